"""Mamba2 decode benchmark: conventional vs ReplaySSM decode, Pallas-Triton vs XLA.

    python -m bench.mamba2_decode [--state-dtypes float32] [--buffer-lens 8] [--batches 1,8,...]
                                  [--arms ...] [--configs default,bv16w2] [--heads 4] [--markdown]
    python -m bench.mamba2_decode --smoke       # tiny CPU run (seconds); the test suite runs it
    python -m bench.mamba2_decode --from-json A.json --markdown   # re-render saved runs

Geometry: one Nemotron-3-Super Mamba2 layer (H=128 heads, P=64, N=128, G=8 groups), bf16
activations, ring in bf16 (``--ring-dtype``), state float32 and/or bfloat16 (``--state-dtypes``).
D, z gating, dt_bias and softplus are on, as in the model.

Arms (``--arms``): ``conv-pallas`` (rs.mamba2.decode, pallas_triton), ``replay-pallas-oo`` /
``replay-pallas-rc`` (rs.mamba2.replay_decode, pallas_triton, route output_only / reconstruct),
``conv-xla``, ``replay-xla`` (route output_only). XLA arms run only at ``--xla-batches``.
``--configs`` adds one row per Pallas launch config: tokens ``bv`` (block_p, P rows per program),
``bk`` (block_n, N chunk of the rebuild), ``w`` (warps), ``s`` (stages); ``--heads`` sets the
replay step's heads per program. ``default`` = the config module's choice through the public op.

Method: as bench/gdn_decode.py (whose table, derived numbers, markdown and plot code this module
reuses). P layers with their own state (P·pool ≥ ``--target-bytes``, 1 GiB), many steps inside one
``jax.jit`` with buffers donated, honest full cycles of L steps (one ``cursor.plan`` per step
shared by all layers, ``cursor.commit`` after; rows at staggered phases, every row flushes once
per cycle, the fold fused into the step). Random data everywhere (counter-based hash), a bank of
``--bank`` input sets. Before timing, a gate: the arm's first step (layer 0) vs
implementation="xla" (output and written state/ring rows) and the first rows' output vs an
independent float64 numpy oracle. After timing: replay cursors back at their starting counts with
bases advanced L per cycle. Copy ceiling at start and end (``bench.common``).

Minimal bytes per row and layer-step, averaged over a full cycle (``bytes_model``):
  inputs x, z [H·P], dt [H], B, C [G·N] in the activation dtype; output y [H·P];
  conventional: state read + written, 2·H·P·N·s;
  replay: checkpoint read every step (H·P·N·s) and written once per L steps; the live window read
  once — on average (L-1)/2 entries — and one entry written, an entry being Δx [H·P] and B [G·N]
  in the ring dtype + ΔA [H] float32.
Not counted: slots/cursor metadata, parameters (A, D, dt_bias: 3·H floats).
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import pathlib
import sys
import time
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import replayssm_jax as rs
from bench import common
from bench import gdn_decode as gd
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.mamba2.buffers import ReplayBuffers

DEFAULT_BATCHES = (1, 8, 32, 128, 256, 512)
DEFAULT_BUFFER_LENS = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Geometry:
  h: int  # heads
  g: int  # groups
  p: int  # head dim P
  n: int  # state dim N


NEMOTRON_SUPER = Geometry(h=128, g=8, p=64, n=128)
SMOKE = Geometry(h=4, g=2, p=8, n=16)

ARMS = {name: arm for name, arm in gd.ARMS.items()
        if name in ("conv-pallas", "replay-pallas-oo", "replay-pallas-rc", "conv-xla", "replay-xla")}
DEFAULT_ARMS = tuple(ARMS)
REF_ARM = {"conv": ARMS["conv-xla"], "replay": ARMS["replay-xla"]}
_KNOBS = {"block_v": "block_p", "block_k": "block_n", "num_warps": "num_warps",
          "num_stages": "num_stages"}


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything that fixes the shapes and data of a run (shared by the arms of one family)."""
  geo: Geometry
  family: str
  batch: int
  layers: int          # P
  buffer_len: int      # L (replay); the cycle length (conventional)
  state_dtype: str
  ring_dtype: str
  act_dtype: str
  bank: int
  seed: int

  @property
  def num_slots(self) -> int:  # per layer
    return self.batch

  @property
  def ring_size(self) -> int:
    return rs.ReplayCursor.create(1, self.buffer_len).ring_size

  @property
  def cycle_steps(self) -> int:
    return self.buffer_len


@dataclasses.dataclass(frozen=True)
class Case:
  arm: gd.Arm
  cfg: common.LaunchConfig
  setup: Setup
  heads: int | None = None

  @property
  def label(self) -> str:
    return self.arm.name + ("" if self.cfg.is_default else f"[{self.cfg.name}]")


# ----------------------------------------------------------------------------------------------
# Byte model

def bytes_model(geo: Geometry, family: str, buffer_len: int | None, state_dtype, ring_dtype,
                act_dtype) -> dict:
  """Minimal bytes per batch row and layer-step, averaged over a full cycle (module doc)."""
  a, s, r = (common.itemsize(d) for d in (act_dtype, state_dtype, ring_dtype))
  inputs = (2 * geo.h * geo.p + geo.h + 2 * geo.g * geo.n) * a
  output = geo.h * geo.p * a
  state = geo.h * geo.p * geo.n * s
  if family == "conv":
    parts = {"inputs": inputs, "output": output, "state_read": state, "state_write": state}
  else:
    L = buffer_len
    entry = (geo.h * geo.p + geo.g * geo.n) * r + geo.h * 4
    parts = {"inputs": inputs, "output": output, "checkpoint_read": state,
             "checkpoint_write": state / L, "ring_read": entry * (L - 1) / 2, "ring_write": entry}
  parts["total"] = sum(parts.values())
  return parts


def _pool_bytes(setup: Setup) -> int:
  geo = setup.geo
  return setup.layers * setup.num_slots * geo.h * geo.p * geo.n * common.itemsize(setup.state_dtype)


def layers_for(geo: Geometry, batch: int, state_dtype: str, target_bytes: float, max_layers: int) -> int:
  pool = batch * geo.h * geo.p * geo.n * common.itemsize(state_dtype)
  return int(min(max_layers, max(2, math.ceil(target_bytes / pool))))


# ----------------------------------------------------------------------------------------------
# Data

def _make_carry(setup: Setup, seed: int, base, count):
  """Device-side random buffers for all P layers, the cursor (replay) and the output slot."""
  geo, P, n = setup.geo, setup.layers, setup.num_slots
  sdt, rdt, adt = (jnp.dtype(d) for d in (setup.state_dtype, setup.ring_dtype, setup.act_dtype))
  ks = [16 * seed + i for i in range(4)]
  state = (gd._normal(ks[0], (P * n, geo.h, geo.p, geo.n)) * 0.1).astype(sdt)
  y = jnp.zeros((setup.batch, geo.h, geo.p), adt)
  t = jnp.zeros((), jnp.int32)
  if setup.family == "conv":
    return state, y, t
  R = setup.ring_size
  ring_x = (gd._normal(ks[1], (P * n, geo.h, R, geo.p)) * 0.05).astype(rdt)   # Δ·x, Δ ≈ 0.05
  ring_B = gd._normal(ks[2], (P * n, geo.g, R, geo.n)).astype(rdt)
  ring_a = -gd._random(ks[3], (P * n, geo.h, R), 0.01, 0.5)
  bufs = ReplayBuffers(state=state, ring_x=ring_x, ring_B=ring_B, ring_a=ring_a)
  cursor = ReplayCursor(base=base, count=count, buffer_len=setup.buffer_len, max_draft=0)
  return bufs, cursor, y, t


def _make_bank(setup: Setup, seed: int):
  """``bank`` input sets x, z [S, B, H, P], dt [S, B, H], B, C [S, B, G, N] (activation dtype)
  and the parameters A (negative), D, dt_bias [H] float32 (dt + dt_bias ≈ -4: Δ ≈ 0.02)."""
  geo, S, Bt = setup.geo, setup.bank, setup.batch
  adt = jnp.dtype(setup.act_dtype)
  ks = [16 * seed + 8 + i for i in range(8)]
  bank = (gd._normal(ks[0], (S, Bt, geo.h, geo.p)).astype(adt),
          gd._normal(ks[1], (S, Bt, geo.h)).astype(adt),
          gd._normal(ks[2], (S, Bt, geo.g, geo.n)).astype(adt),
          gd._normal(ks[3], (S, Bt, geo.g, geo.n)).astype(adt),
          gd._normal(ks[4], (S, Bt, geo.h, geo.p)).astype(adt))
  params = {"A": -gd._random(ks[5], (geo.h,), 1.0, 2.0), "D": gd._normal(ks[6], (geo.h,)),
            "dt_bias": gd._random(ks[7], (geo.h,), -4.0, -3.0)}
  return bank, params


def _init(setup: Setup, slots, base, count):
  seed = zlib.crc32(repr((setup.seed, setup.batch, setup.buffer_len, setup.family)).encode()) % (1 << 20)
  bank, params = _make_bank(setup, seed)
  return _make_carry(setup, seed, base, count), (bank, params, slots)


_init_jit = jax.jit(_init, static_argnums=0)


def init_state(setup: Setup):
  """(carry, consts, host layout) on device; random, with staggered cursor phases."""
  slots, count, base = gd._host_layout(setup)
  carry, consts = _init_jit(setup, jnp.asarray(slots), jnp.asarray(base), jnp.asarray(count))
  return carry, consts, {"slots": slots, "count": count, "base": base}


def abstract_state(setup: Setup):
  slots, count, base = gd._host_layout(setup)
  return jax.eval_shape(lambda s, b, c: _init(setup, s, b, c), slots, base, count)


# ----------------------------------------------------------------------------------------------
# Programs

def layer_op(case: Case):
  """``op(x, dt, B, C, z, params, buf, slots_or_plan) -> (y, buf)`` for one layer."""
  arm, cfg = case.arm, case.cfg
  if arm.impl == "pallas_triton" and not (cfg.is_default and case.heads is None):
    from replayssm_jax.pallas import mamba2_triton
    kw = {_KNOBS[k]: v for k, v in cfg.kwargs(_KNOBS).items()}
    if arm.family == "conv":
      kw.pop("block_n", None)
      return lambda x, dt, B, C, z, pr, pool, slots: mamba2_triton.decode(
          x, dt, pr["A"], B, C, pool, slots, D=pr["D"], z=z, dt_bias=pr["dt_bias"],
          dt_softplus=True, **kw)
    return lambda x, dt, B, C, z, pr, bufs, plan: mamba2_triton.replay_decode(
        x, dt, pr["A"], B, C, bufs, plan, D=pr["D"], z=z, dt_bias=pr["dt_bias"], dt_softplus=True,
        route=arm.route, heads=case.heads, **kw)
  if arm.family == "conv":
    return lambda x, dt, B, C, z, pr, pool, slots: rs.mamba2.decode(
        x, dt, pr["A"], B, C, pool, slots, D=pr["D"], z=z, dt_bias=pr["dt_bias"],
        implementation=arm.impl)
  return lambda x, dt, B, C, z, pr, bufs, plan: rs.mamba2.replay_decode(
      x, dt, pr["A"], B, C, bufs, plan, D=pr["D"], z=z, dt_bias=pr["dt_bias"], route=arm.route,
      implementation=arm.impl)


def make_runner(case: Case):
  """``run(carry, consts, n_cycles) -> carry``: n cycles of ``cycle_steps`` steps of P layers."""
  setup, arm = case.setup, case.arm
  op = layer_op(case)
  P, n, steps, nb = setup.layers, setup.num_slots, setup.cycle_steps, setup.bank

  def run(carry, consts, n_cycles):
    bank, params, slots = consts

    def inputs(j):
      return tuple(lax.dynamic_index_in_dim(x, j, 0, keepdims=False) for x in bank)

    if arm.family == "conv":
      def step(_, c):
        pool, y, t = c

        def layer(l, c2):
          pool, y = c2
          y, pool = op(*inputs((t + l) % nb), params, pool, slots + l * n)
          return pool, y
        pool, y = lax.fori_loop(0, P, layer, (pool, y))
        return pool, y, t + 1
    else:
      def step(_, c):
        bufs, cursor, y, t = c
        plan = cursor.plan(slots)

        def layer(l, c2):
          bufs, y = c2
          y, bufs = op(*inputs((t + l) % nb), params, bufs, plan.replace(slots=slots + l * n))
          return bufs, y
        bufs, y = lax.fori_loop(0, P, layer, (bufs, y))
        return bufs, cursor.commit(plan), y, t + 1

    def cycle(_, c):
      return lax.fori_loop(0, steps, step, c)
    return lax.fori_loop(0, n_cycles, cycle, carry)
  return run


def make_gate(case: Case):
  """``gate(carry, consts) -> (y, rows)``: layer 0's first step (input set 0), not donated; rows =
  the written buffers at the batch's slots (state; + rings for replay)."""
  op = layer_op(case)

  def gate(carry, consts):
    bank, params, slots = consts
    inp = tuple(x[0] for x in bank)
    if case.arm.family == "conv":
      y, pool = op(*inp, params, carry[0], slots)
      return y, (pool[slots],)
    bufs, cursor = carry[0], carry[1]
    y, bufs = op(*inp, params, bufs, cursor.plan(slots))
    return y, (bufs.state[slots], bufs.ring_x[slots], bufs.ring_B[slots], bufs.ring_a[slots])
  return gate


# float64 oracle (numpy; independent of the library's jnp code) -----------------------------------

def oracle_output(setup: Setup, carry, consts, host, rows: int):
  """float64 output of the first step for the first ``rows`` batch rows (layer 0)."""
  (x, dt, B, C, z), params, _ = consts
  sl = host["slots"][:rows]
  f = gd._f64
  x, dt, B, C, z = (f(a[0][:rows]) for a in (x, dt, B, C, z))
  A, D, bias = (f(params[k]) for k in ("A", "D", "dt_bias"))
  group = np.arange(setup.geo.h) // (setup.geo.h // setup.geo.g)
  if setup.family == "conv":
    S = f(carry[0][sl])
  else:   # S = e^{Σa} S_c + Σ_j e^{Σ_{i>j} a_i} Δx_j B_jᵀ over each row's window
    bufs = carry[0]
    S = f(bufs.state[sl])
    rx, rB, ra = f(bufs.ring_x[sl]), f(bufs.ring_B[sl]), f(bufs.ring_a[sl])
    for b in range(rows):
      idx = (int(host["base"][sl[b]]) + np.arange(int(host["count"][sl[b]]))) % setup.ring_size
      if idx.size:
        a = ra[b][:, idx]                                        # [H, n]
        total = a.sum(-1)
        suffix = total[:, None] - np.cumsum(a, axis=-1)
        S[b] = (np.exp(total)[:, None, None] * S[b]
                + np.einsum("hj,hjp,hjn->hpn", np.exp(suffix), rx[b][:, idx], rB[b][group][:, idx]))
  delta = np.logaddexp(0.0, dt + bias)
  S = (np.exp(delta * A)[..., None, None] * S
       + (delta[..., None] * x)[..., :, None] * B[:, group][:, :, None, :])
  y = np.einsum("bhpn,bhn->bhp", S, C[:, group]) + D[:, None] * x
  return y * z / (1.0 + np.exp(-z))


# ----------------------------------------------------------------------------------------------
# Running one case / one group

def _row_skeleton(case: Case) -> dict:
  s = case.setup
  bm = bytes_model(s.geo, case.arm.family, s.buffer_len, s.state_dtype, s.ring_dtype, s.act_dtype)
  replay = case.arm.family == "replay"
  return {
      "arm": case.arm.name, "label": case.label, "config": case.cfg.name,
      "config_overrides": dict(case.cfg.overrides), "heads": case.heads, "impl": case.arm.impl,
      "family": case.arm.family, "route": case.arm.route, "state_dtype": s.state_dtype,
      "ring_dtype": s.ring_dtype if replay else None, "act_dtype": s.act_dtype, "batch": s.batch,
      "buffer_len": s.buffer_len if replay else None, "layers": s.layers,
      "slots_per_layer": s.num_slots, "cycle_steps": s.cycle_steps, "bytes_per_row": bm,
      "bytes_per_layer_step": bm["total"] * s.batch, "pool_bytes_all_layers": _pool_bytes(s),
      "repeat": False, "status": "pending", "error": None,
  }


def run_case(case: Case, runner, gate_fn, ref_gate_fn, args, *, tol: float) -> dict:
  setup = case.setup
  row = _row_skeleton(case)
  carry, consts, host = init_state(setup)
  jax.block_until_ready(carry)
  ref_y, ref_rows = ref_gate_fn(carry, consts)
  y, rows = (ref_y, ref_rows) if gate_fn is ref_gate_fn else gate_fn(carry, consts)
  y_abs, y_rel, y_fin = (float(v) for v in gd._compare(y, ref_y))
  s_abs, s_rel, s_fin = (float(v) for v in gd._compare(rows, ref_rows))
  m = min(setup.batch, args.oracle_rows)
  want = oracle_output(setup, carry, consts, host, m)
  norm = max(np.linalg.norm(want), 1e-30)
  oracle_rel = float(np.linalg.norm(gd._f64(y[:m]) - want) / norm)
  ref_oracle_rel = float(np.linalg.norm(gd._f64(ref_y[:m]) - want) / norm)
  del y, rows, ref_y, ref_rows
  passed = bool(y_fin and s_fin and max(y_rel, s_rel, oracle_rel) <= tol and ref_oracle_rel <= tol)
  row["gate"] = {"passed": passed, "tol_rel": tol, "o_max_abs": y_abs, "o_rel": y_rel,
                 "state_max_abs": s_abs, "state_rel": s_rel, "oracle_rows": m,
                 "oracle_o_rel": oracle_rel, "xla_oracle_o_rel": ref_oracle_rel,
                 "vs": "implementation='xla', same inputs; oracle: float64 numpy"}
  t0 = time.perf_counter()
  call = lambda c, n: runner(c, consts, np.int32(n))
  carry, timing = common.time_loop(call, carry, reps=args.reps, rep_seconds=args.rep_seconds)
  row["run_s"] = time.perf_counter() - t0
  row["checks"] = gd._post_checks(case, carry, host, timing.cycles_run)
  del carry
  ms = [t / (setup.cycle_steps * setup.layers) * 1e3 for t in timing.per_cycle()]
  med, p20, p80 = common.quantiles(ms)
  row.update(ms_per_layer_step=ms, median_ms=med, p20_ms=p20, p80_ms=p80, n_cycles=timing.n_cycles)
  ok_checks = all(row["checks"].values())
  row["status"] = "ok" if (passed and ok_checks) else ("gate-failed" if not passed else "check-failed")
  return row


def plan_groups(args, geo: Geometry):
  """[(state_dtype, batch, [Case...])], in run order."""
  groups = []
  for sdt in args.state_dtypes:
    for B in args.batches:
      P = layers_for(geo, B, sdt, args.target_bytes, args.max_layers)
      mk = lambda family, L: Setup(geo=geo, family=family, batch=B, layers=P, buffer_len=L,
                                   state_dtype=sdt, ring_dtype=args.ring_dtype,
                                   act_dtype=args.act_dtype, bank=args.bank, seed=args.seed)
      cases = []
      for setup in [mk("conv", args.conv_cycle)] + [mk("replay", L) for L in args.buffer_lens]:
        for name in args.arms:
          arm = ARMS[name]
          if arm.family != setup.family or (arm.impl == "xla" and B not in args.xla_batches):
            continue
          for cfg in (args.configs if arm.impl == "pallas_triton" else [common.LaunchConfig("default")]):
            heads = args.heads if arm.impl == "pallas_triton" and arm.family == "replay" else None
            case = Case(arm, cfg, setup, heads)
            if case not in cases:
              cases.append(case)
      groups.append((sdt, B, cases))
  return groups


def run_group(sdt, B, cases, args) -> list[dict]:
  """Lowers and compiles every program of one (state dtype, batch) group, then runs its cases."""
  lowered, errors, abstract = {}, {}, {}
  n_abs = jax.ShapeDtypeStruct((), jnp.int32)
  ref_case = lambda s: Case(REF_ARM[s.family], common.LaunchConfig("default"), s)
  for case in cases:
    s = case.setup
    try:
      if s not in abstract:
        abstract[s] = abstract_state(s)
        lowered[("ref", s)] = jax.jit(make_gate(ref_case(s))).lower(*abstract[s])
      lowered[("run", case)] = jax.jit(make_runner(case), donate_argnums=(0,)).lower(*abstract[s], n_abs)
      if case != ref_case(s):
        lowered[("gate", case)] = jax.jit(make_gate(case)).lower(*abstract[s])
    except Exception as e:  # noqa: BLE001  (recorded per arm; the run goes on)
      errors[case] = e
  t0 = time.perf_counter()
  compiled = common.compile_all(lowered, args.compile_workers)
  common.log(f"state={sdt} B={B}: {len(cases)} arms, {len(lowered)} programs compiled in "
             f"{time.perf_counter() - t0:.1f}s")
  rows, done = [], {}
  for case in cases:
    row = _row_skeleton(case)
    got = {k: compiled.get((k, case if k != "ref" else case.setup), (None, 0.0))[0]
           for k in ("run", "gate", "ref")}
    gate_fn = got["gate"] if got["gate"] is not None else got["ref"]
    problem = errors.get(case) or next((v for v in got.values() if isinstance(v, Exception)), None)
    if problem is not None:
      row.update(status="error", error=gd._error_text(problem))
    else:
      # A copy as large as the state pool in the timed program: the update is not in place.
      row["big_copies"] = common.big_copies(got["run"], 0.9 * _pool_bytes(case.setup))
      try:
        row.update(run_case(case, got["run"], gate_fn, got["ref"], args,
                            tol=args.gate_tol or gd.gate_tolerance(case.setup)))
        done[case.label] = (case, got, gate_fn)
      except Exception as e:  # noqa: BLE001
        row.update(status="error", error=gd._error_text(e))
    gc.collect()
    rows.append(row)
    gd._log_row(row)
  if args.repeat_arm in done:  # the same arm once more, at the end of the group: run-to-run noise
    case, got, gate_fn = done[args.repeat_arm]
    row = run_case(case, got["run"], gate_fn, got["ref"], args,
                   tol=args.gate_tol or gd.gate_tolerance(case.setup))
    row.update(repeat=True, label=case.label + "#2")
    rows.append(row)
    gd._log_row(row)
  del compiled, lowered
  gc.collect()
  return rows


# ----------------------------------------------------------------------------------------------
# Report and CLI

def markdown_section(meta: dict, ceilings: list, rows: list[dict]) -> str:
  ceil = ", ".join(f"{c:.0f}" for c in ceilings if c)
  geo = meta.get("geometry", {})
  return "\n".join([
      f"## Mamba2 decode — {meta.get('date', '?')} — {meta.get('device_kind', '?')}", "",
      f"Geometry H={geo.get('h')} P={geo.get('p')} N={geo.get('n')} G={geo.get('g')}; jax "
      f"{meta.get('jax_version')}, commit `{(meta.get('git_commit') or 'unknown')[:12]}`, source "
      f"digest `{meta.get('source_digest')}`; copy ceiling {ceil} GB/s. Bytes and method: "
      f"bench/mamba2_decode.py docstring.", "",
      "```", meta.get("command", ""), "```", "",
      gd.render(rows, markdown=True), ""])


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m bench.mamba2_decode", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true",
                 help="tiny CPU-sized run (H=4, G=2, P=8, N=16, B=2, L=4, float32 state)")
  p.add_argument("--state-dtypes", type=gd._csv(gd._dtype_name), default=["float32", "bfloat16"])
  p.add_argument("--ring-dtype", type=gd._dtype_name, default="bfloat16")
  p.add_argument("--act-dtype", type=gd._dtype_name, default="bfloat16")
  p.add_argument("--batches", type=gd._csv(int), default=list(DEFAULT_BATCHES))
  p.add_argument("--buffer-lens", type=gd._csv(int), default=list(DEFAULT_BUFFER_LENS))
  p.add_argument("--arms", type=gd._csv(str), default=list(DEFAULT_ARMS),
                 help=f"comma list of {', '.join(ARMS)}")
  p.add_argument("--configs", type=gd._csv(common.parse_config), default=[common.LaunchConfig("default")],
                 help="Pallas launch configs: bv (block_p) bk (block_n) w s tokens, e.g. default,bv16w2")
  p.add_argument("--heads", type=int, default=None, help="replay step: heads per program")
  p.add_argument("--xla-batches", type=gd._csv(int), default=None,
                 help="batches at which the XLA arms run (default: all of --batches)")
  p.add_argument("--repeat-arm", default="conv-pallas",
                 help="arm label timed a second time per (dtype, B) group for noise; 'none' disables")
  p.add_argument("--reps", type=int, default=7, help="timed repetitions (>= 5)")
  p.add_argument("--rep-seconds", type=float, default=0.1, help="target seconds per timed call")
  p.add_argument("--target-bytes", type=float, default=float(1 << 30),
                 help="P·(one layer's state pool) >= this (P >= 2)")
  p.add_argument("--max-layers", type=int, default=4096)
  p.add_argument("--bank", type=int, default=8, help="random input sets cycled through")
  p.add_argument("--conv-cycle", type=int, default=16, help="steps per cycle of the conventional arms")
  p.add_argument("--oracle-rows", type=int, default=4, help="rows checked against the float64 oracle")
  p.add_argument("--gate-tol", type=float, default=None, help="relative tolerance (default by dtype)")
  p.add_argument("--copy-bytes", type=float, default=float(2 << 30), help="copy-ceiling buffer bytes")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="parallel XLA compilations (default 8 on GPU, min(4, CPUs) elsewhere)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-json", type=pathlib.Path, default=None,
                 help="default bench/results/mamba2_decode_<date>.json")
  p.add_argument("--markdown", action="store_true", help="append a section to --results-md")
  p.add_argument("--results-md", type=pathlib.Path, default=common.BENCH_DIR / "RESULTS.md")
  p.add_argument("--plot", nargs="?", const="auto", default=None, type=str,
                 help="write a PNG (default path bench/mamba2_decode_<date>.png)")
  p.add_argument("--plot-L", type=int, default=8)
  p.add_argument("--from-json", type=pathlib.Path, nargs="+", default=None,
                 help="re-render table/markdown from saved result files (no device work)")
  p.add_argument("--git-commit", default=None, help="commit to record where the checkout has no .git")
  args = p.parse_args(argv)
  if args.smoke:
    defaults = p.parse_args([])
    smoke = dict(batches=[2], buffer_lens=[4], state_dtypes=["float32"], reps=5, rep_seconds=0.005,
                 target_bytes=0.0, copy_bytes=float(8 << 20), bank=2, conv_cycle=4, max_layers=2)
    for k, v in smoke.items():  # smoke sizes unless given explicitly
      if getattr(args, k) == getattr(defaults, k):
        setattr(args, k, v)
  bad = [a for a in args.arms if a not in ARMS]
  if bad:
    p.error(f"unknown arm(s) {bad}; choose from {list(ARMS)}")
  if args.reps < 5:
    p.error("--reps must be >= 5")
  if args.xla_batches is None:
    args.xla_batches = list(args.batches)
  if args.repeat_arm in ("", "none"):
    args.repeat_arm = None
  if args.compile_workers is None:
    args.compile_workers = 8 if jax.default_backend() == "gpu" else min(4, os.cpu_count() or 1)
  return args


def _finish(args, meta, ceilings, rows) -> None:
  if args.markdown:
    gd.append_markdown(args.results_md, markdown_section(meta, ceilings, rows))
    print(f"markdown: appended to {args.results_md}")
  if args.plot:
    path = (common.BENCH_DIR / f"mamba2_decode_{common.timestamp()}.png") if args.plot == "auto" else args.plot
    if gd.plot(rows, ceilings, path, f"Mamba2 decode, {meta.get('device_kind')}, {meta.get('date')}",
               args.plot_L):
      print(f"plot: {path}")
  print(gd.render(rows))


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.from_json:
    data = [json.loads(pathlib.Path(f).read_text()) for f in args.from_json]
    rows = [r for d in data for r in d["rows"]]
    meta = dict(data[0]["meta"], command="\n".join(d["meta"].get("command", "") for d in data))
    _finish(args, meta, [d.get("ceiling", {}).get("gbps") for d in data], rows)
    return {"meta": meta, "rows": rows}
  rs.set_checks(False)
  warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
  geo = SMOKE if args.smoke else NEMOTRON_SUPER
  meta = common.run_metadata(argv, "bench.mamba2_decode", git_commit_override=args.git_commit)
  meta["geometry"] = dataclasses.asdict(geo)
  meta["options"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                     if k != "configs"}
  meta["options"]["configs"] = [c.name for c in args.configs]
  common.log(f"{meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, "
             f"commit {(meta['git_commit'] or '?')[:12]}, source {meta['source_digest']}")
  measure = lambda seed: common.measure_copy_ceiling(int(args.copy_bytes), reps=args.reps, seed=seed,
                                                     rep_seconds=max(args.rep_seconds, 0.005))
  ceil_runs = [measure(0)]
  common.log(f"copy ceiling: {ceil_runs[0]['gbps']:.0f} GB/s")
  rows = []
  for sdt, B, cases in plan_groups(args, geo):
    rows += run_group(sdt, B, cases, args)
  ceil_runs.append(measure(1))
  ceiling = max(c["gbps"] for c in ceil_runs)
  common.log(f"copy ceiling at the end: {ceil_runs[1]['gbps']:.0f} GB/s; using {ceiling:.0f} GB/s")
  gd.derive(rows, ceiling)
  meta["elapsed_s"] = common.elapsed()
  result = {
      "meta": meta, "ceiling": {"gbps": ceiling, "runs": ceil_runs},
      "bytes_model": {
          "unit": "bytes per batch row and layer-step, averaged over a full cycle",
          "conv": "inputs (x, z, dt, B, C; act dtype) + output y + state read + state write",
          "replay": "inputs + output + checkpoint read + checkpoint write / L + ring window read "
                    "((L-1)/2 entries) + one entry written; entry = Δx[H,P] + B[G,N] (ring dtype) + "
                    "ΔA[H] f32",
          "not_counted": "slot/cursor metadata; parameters A, D, dt_bias",
      },
      "rows": sorted(rows, key=gd._sort_key),
  }
  out = pathlib.Path(args.out_json or (common.BENCH_DIR / "results" / f"mamba2_decode_{common.timestamp()}.json"))
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(common.to_jsonable(result), indent=1))
  print(f"json: {out}")
  _finish(args, meta, [ceiling], rows)
  n_fail = sum(r["status"] != "ok" for r in rows)
  print(f"done in {common.elapsed():.0f}s; copy ceiling {ceiling:.0f} GB/s; {n_fail} row(s) not ok")
  return result


if __name__ == "__main__":
  main()
