"""The decode benchmark harness shared by bench/gdn_decode.py and bench/mamba2_decode.py.

A layer module describes what differs per layer family in a ``LayerBench`` (geometry, byte model,
random buffers and inputs, the layer op, the float64 oracle, CLI defaults) and calls
``main(bench, argv)``. Everything else lives here, once: the arms, ``Setup``/``Case``, the layer
count P, the timed program (``make_runner``) and the gate (``make_gate``), one case
(``run_case``), planning (``plan_groups``), one (state dtype, batch) group of programs compiled
together (``run_group``), derived numbers, the table, markdown, plot and the CLI. The method is
described in bench/gdn_decode.py's docstring.

Peer arms (``Arm.peer``, bench/peer_common.py) are other projects' kernels called through
jax_triton in the same programs: their inputs are put in the peer's calling convention once per
timed call (``layer_op``'s ``prepare``), and a peer that keeps replay buffers its own way gets its
own ``Setup.layout`` (the same data converted; cursors at ring base 0), its gate reading the
buffers back in our layout.
"""
import argparse
import dataclasses
import gc
import importlib
import json
import math
import os
import pathlib
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import replayssm_jax as rs
from replayssm_jax.cursor import ReplayCursor

from bench import common
from bench import peer_common


# ----------------------------------------------------------------------------------------------
# Arms

@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  family: str          # "conv" | "replay"
  impl: str            # "pallas_triton" | "pallas_mosaic" | "xla" | "peer"
  route: str | None = None
  flush_all: bool = False   # every step flushes every row (the small-batch policy's plan)
  peer: Any = None          # a bench.peer_common.Peer: another project's kernel (impl "peer")
  read_copy: bool = False   # buffers with a 16-bit read copy of the checkpoint (--read-copy-dtype)


ARMS = {a.name: a for a in (
    Arm("conv-pallas", "conv", "pallas_triton"),
    Arm("replay-pallas-oo", "replay", "pallas_triton", "output_only"),
    Arm("replay-pallas-rc", "replay", "pallas_triton", "reconstruct"),
    Arm("conv-xla", "conv", "xla"),
    Arm("replay-xla", "replay", "xla", "output_only"),
    Arm("replay-xla-rc", "replay", "xla", "reconstruct"),
    Arm("conv-mosaic", "conv", "pallas_mosaic"),
    Arm("replay-mosaic", "replay", "pallas_mosaic", "output_only"),
    Arm("replay-mosaic-rc", "replay", "pallas_mosaic", "reconstruct"),
    # The small-batch policy: cursor.plan(flush_all=True), one fold-and-step pass per layer (its
    # %-of-ceiling column uses the replay byte model; the speed-up column is what it is for).
    Arm("replay-pallas-flushall", "replay", "pallas_triton", "output_only", flush_all=True),
    # The opt-in read copy (ReplayBuffers.create(read_copy_dtype=...)): steps read the 16-bit copy.
    Arm("replay-pallas-copy", "replay", "pallas_triton", "output_only", read_copy=True),
    Arm("replay-xla-copy", "replay", "xla", "output_only", read_copy=True),
)}
STANDARD_ARMS = ("conv-pallas", "replay-pallas-oo", "replay-pallas-rc", "conv-xla", "replay-xla")
CONV_ARMS = ("conv-pallas", "conv-mosaic")   # "our best conventional kernel" = the faster of these
REF_ARM = {"conv": ARMS["conv-xla"], "replay": ARMS["replay-xla"]}


def _ref_arm(arm: Arm) -> Arm:
  """The XLA arm an arm's gate compares with: same family, plan policy (flush_all) and buffers."""
  return dataclasses.replace(REF_ARM[arm.family], flush_all=arm.flush_all, read_copy=arm.read_copy)


def _ref_key(case) -> tuple:
  return ("ref", case.setup, case.arm.flush_all)
# Launch knobs of the conventional (step-only) kernels: block (V or P rows), warps, stages.
STEP_KNOBS = ("block_v", "num_warps", "num_stages")
# Knobs only the Mosaic kernels take (batch rows per program).
MOSAIC_ONLY_KNOBS = ("rows",)
_ARM_ORDER = {name: i for i, name in enumerate(ARMS)}
_DEFAULT = common.LaunchConfig("default")


# ----------------------------------------------------------------------------------------------
# What a layer module provides

@dataclasses.dataclass(frozen=True, eq=False)
class LayerBench:
  """One layer family's part of the benchmark (hashed by identity: a static jit argument).

  Geometries are frozen dataclasses with ``state_shape`` (one slot's state) and ``out_shape`` (one
  row's output). Callables:

  * ``bytes_model(geo, family, buffer_len, state_dtype, ring_dtype, act_dtype, read_copy_dtype)
    -> dict``: minimal bytes per batch row and layer-step, with a ``total``.
  * ``donated_sizes(setup) -> [bytes]``: the large donated arrays; a copy of one of them in the
    timed program is reported (``big_copies``).
  * ``make_rings(setup, state, streams) -> buffers``: the replay buffers around ``state`` (all P
    layers), random rings drawn from the three hash ``streams``.
  * ``make_bank(setup, streams) -> (bank, params)``: ``bank`` random input sets (a tuple of arrays
    with a leading set axis) from eight hash ``streams``; ``params`` are passed to every layer call.
  * ``layer(case) -> op``, ``op(inputs, params, buf, slots_or_plan) -> (out, buf)`` for one layer
    and one input set.
  * ``oracle_output(setup, carry, consts, host, rows)``: the float64 output of layer 0's first step
    for the first ``rows`` batch rows.
  * ``summary(meta, ceilings) -> str``: the line under the markdown section's heading.
  """
  name: str                  # "gdn_decode": module bench.<name>, files <name>_<date>.json / .png
  title: str                 # "GDN decode": markdown heading and plot title
  description: str           # the CLI's description
  geometry: Any
  smoke_geometry: Any
  arms: tuple                # names in ARMS this family has
  default_arms: tuple        # names in ``arms`` or ``peer_arms``
  default_buffer_lens: tuple
  plot_L: int                # the L whose replay rows the bandwidth plot shows
  smoke_help: str
  configs_help: str
  pallas_module: str         # the Pallas-Triton kernels; if it does not import, their arms are skipped
  mosaic_knobs: tuple        # --configs knobs the family's Mosaic kernels take (e.g. rows)
  bytes_model: Callable
  bytes_model_doc: dict      # the result file's "bytes_model"
  donated_sizes: Callable
  make_rings: Callable
  make_bank: Callable
  layer: Callable
  oracle_output: Callable
  summary: Callable
  heads_option: bool = False  # the replay kernel takes heads per program: --heads, row field "heads"
  peer_arms: tuple = ()       # Arms of other projects' kernels (bench.peer_*), opt-in by name

  @property
  def arm_names(self) -> tuple:
    return self.arms + tuple(a.name for a in self.peer_arms)

  def arm(self, name: str) -> Arm:
    return next((a for a in self.peer_arms if a.name == name), None) or ARMS[name]

  def with_peers(self, name: str, default_arms: tuple) -> "LayerBench":
    """This bench run as ``python -m bench.<name>`` with other default arms (a bench.peer_* module)."""
    return dataclasses.replace(self, name=name, default_arms=default_arms, title=f"{self.title} with peers")

  def pallas_available(self) -> str | None:
    """None if the Pallas-Triton kernels import, else why not."""
    try:
      importlib.import_module(self.pallas_module)
    except Exception as e:  # noqa: BLE001
      return f"{self.pallas_module} not importable: {type(e).__name__}: {e}"
    return None


@dataclasses.dataclass(frozen=True)
class Setup:
  """Everything that fixes the shapes and data of a run (shared by the arms of one family)."""
  geo: Any             # the layer module's Geometry
  family: str
  batch: int
  layers: int          # P
  buffer_len: int      # L (replay); the cycle length (conventional)
  state_dtype: str
  ring_dtype: str
  act_dtype: str
  bank: int
  seed: int
  layout: Any = None   # a peer's RingLayout (bench.peer_common): buffers in its form, cursors at base 0
  read_copy_dtype: str | None = None   # replay buffers with a read copy of the checkpoint

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
  arm: Arm
  cfg: common.LaunchConfig
  setup: Setup
  heads: int | None = None  # replay step's heads per program (``--heads``), None: the config's

  @property
  def label(self) -> str:
    return self.arm.name + ("" if self.cfg.is_default else f"[{self.cfg.name}]")


def pool_bytes(setup: Setup) -> int:
  """Bytes of the state pool of all P layers."""
  return (setup.layers * setup.num_slots * math.prod(setup.geo.state_shape)
          * common.itemsize(setup.state_dtype))


def read_copy_bytes(setup: Setup) -> list[int]:
  """[bytes of the read copy of all P layers' pools], or [] without one."""
  if setup.read_copy_dtype is None:
    return []
  return [pool_bytes(setup) // common.itemsize(setup.state_dtype) * common.itemsize(setup.read_copy_dtype)]


def cycle_bytes(family: str, buffer_len: int | None, *, inputs: float, output: float, state: float,
                entry: float, read_copy: float | None = None) -> dict:
  """Minimal bytes per batch row and layer-step, averaged over a full cycle, from one row's
  ``inputs``, ``output``, ``state`` and ring ``entry`` bytes: conventional, the state read and
  written; replay, the checkpoint read every step and written once per L steps, the live window read
  once ((L-1)/2 entries on average) and one entry written. With a ``read_copy`` (its bytes): the
  copy read every step; once per L steps the checkpoint read and written and the copy written."""
  if family == "conv":
    parts = {"inputs": inputs, "output": output, "state_read": state, "state_write": state}
  elif read_copy is not None:
    L = buffer_len
    parts = {"inputs": inputs, "output": output, "read_copy_read": read_copy,
             "checkpoint_fold": 2 * state / L, "read_copy_write": read_copy / L,
             "ring_read": entry * (L - 1) / 2, "ring_write": entry}
  else:
    L = buffer_len
    parts = {"inputs": inputs, "output": output, "checkpoint_read": state,
             "checkpoint_write": state / L, "ring_read": entry * (L - 1) / 2, "ring_write": entry}
  parts["total"] = sum(parts.values())
  return parts


def layers_for(geo, batch: int, state_dtype: str, target_bytes: float, max_layers: int,
               min_layers: int = 2) -> int:
  """P = max(min_layers, 2, ceil(target_bytes / one layer's state pool)), at most ``max_layers``,
  at most ``common.MAX_UNROLLED_LAYERS`` (the layers are unrolled in the compiled step)."""
  pool = batch * math.prod(geo.state_shape) * common.itemsize(state_dtype)
  return int(min(max_layers, common.MAX_UNROLLED_LAYERS,
                 max(min_layers, 2, math.ceil(target_bytes / pool))))


# ----------------------------------------------------------------------------------------------
# Data

def _host_layout(setup: Setup):
  """Slots (a random permutation) and staggered cursor phases, from a seeded numpy generator."""
  rng = np.random.default_rng([setup.seed, setup.batch, setup.buffer_len])
  n, L = setup.num_slots, setup.buffer_len
  slots = rng.permutation(n).astype(np.int32)[: setup.batch]
  if n >= L:
    count = rng.permutation(np.arange(n) % L)
  else:
    count = rng.choice(L, size=n, replace=False)
    if L - 1 not in count:  # the gate's step must include a flushing row
      count[rng.integers(n)] = L - 1
  base = rng.integers(0, setup.ring_size, size=n) * (setup.layout is None)
  return slots, count.astype(np.int32), base.astype(np.int32)


def _make_carry(bench: LayerBench, setup: Setup, seed: int, base, count, params):
  """Device-side random buffers for all P layers (in ``setup.layout``), the cursor (replay) and the
  output slot."""
  geo, P, n = setup.geo, setup.layers, setup.num_slots
  ks = [16 * seed + i for i in range(4)]
  state = (common.hash_normal(ks[0], (P * n,) + geo.state_shape) * 0.1).astype(setup.state_dtype)
  o = jnp.zeros((setup.batch,) + geo.out_shape, setup.act_dtype)
  if setup.family == "conv":
    return state, o
  bufs = bench.make_rings(setup, state, ks[1:])
  if setup.layout is not None:
    bufs = setup.layout.from_ours(bufs, params)
  cursor = ReplayCursor(base=base, count=count, buffer_len=setup.buffer_len, max_draft=0)
  return bufs, cursor, o


def _init(bench: LayerBench, setup: Setup, slots, base, count):
  seed = zlib.crc32(repr((setup.seed, setup.batch, setup.buffer_len, setup.family)).encode()) % (1 << 20)
  bank, params = bench.make_bank(setup, [16 * seed + 8 + i for i in range(8)])
  return _make_carry(bench, setup, seed, base, count, params), (bank, params, slots)


_init_jit = jax.jit(_init, static_argnums=(0, 1))


def init_state(bench: LayerBench, setup: Setup):
  """(carry, consts, host layout) on device; random, with staggered cursor phases.

  carry: (pool, o) conventional, (buffers, cursor, o) replay; consts: (bank, params, slots).
  """
  slots, count, base = _host_layout(setup)
  carry, consts = _init_jit(bench, setup, jnp.asarray(slots), jnp.asarray(base), jnp.asarray(count))
  return carry, consts, {"slots": slots, "count": count, "base": base}


def abstract_state(bench: LayerBench, setup: Setup):
  slots, count, base = _host_layout(setup)
  return jax.eval_shape(lambda s, b, c: _init(bench, setup, s, b, c), slots, base, count)


def ours(setup: Setup, bufs, params):
  """Replay buffers of ``setup`` in our layout (as they are, unless a peer's layout holds them)."""
  return bufs if setup.layout is None else setup.layout.to_ours(bufs, params)


def layer_op(bench: LayerBench, case: Case):
  """``(prepare, step)``: ``prepare(inputs, params)`` puts one input set in the arm's calling
  convention, once per call outside the loops (identity for our arms); ``step(prepared, params,
  buf, slots_or_plan) -> (out, buf)`` is one layer-step."""
  peer = case.arm.peer
  if peer is None:
    return (lambda inputs, params: inputs), bench.layer(case)
  kernels = peer.kernels()
  return (lambda inputs, params: peer.prepare(kernels, case, inputs, params),
          lambda inputs, params, buf, index: peer.step(kernels, case, inputs, params, buf, index))


# ----------------------------------------------------------------------------------------------
# Programs

def make_runner(bench: LayerBench, case: Case):
  """``run(carry, consts, n_cycles) -> carry``: n cycles of ``cycle_steps`` steps of P layers."""
  setup, arm = case.setup, case.arm
  prepare, op = layer_op(bench, case)
  P, n, steps, nb = setup.layers, setup.num_slots, setup.cycle_steps, setup.bank

  def run(carry, consts, n_cycles):
    bank, params, slots = consts
    # Every layer's operands are made once per call, outside the loops, and the layers are
    # unrolled: a layer-step is then its kernels alone, as in a model. (A lax.fori_loop over the
    # layers, with the slot offsets and input set computed per layer, cost ~7.5 µs per layer-step
    # on the H200: 3x the whole B = 1 kernel.)
    sets = [prepare(tuple(x[j] for x in bank), params) for j in range(min(nb, P))]
    layer_slots = [slots + l * n for l in range(P)]

    if arm.family == "conv":
      def step(_, c):
        pool, o = c
        for l in range(P):
          o, pool = op(sets[l % nb], params, pool, layer_slots[l])
        return pool, o
    else:
      def step(_, c):
        bufs, cursor, o = c
        plan = cursor.plan(slots, flush_all=arm.flush_all)
        for l in range(P):
          o, bufs = op(sets[l % nb], params, bufs, plan.replace(slots=layer_slots[l]))
        return bufs, cursor.commit(plan), o

    def cycle(_, c):
      return lax.fori_loop(0, steps, step, c)
    return lax.fori_loop(0, n_cycles, cycle, carry)
  return run


def _live_ring_entries(bufs, cursor, slots):
  """Every ``ring_*`` buffer at the batch's slots, with the entries outside each row's committed
  window zeroed: those are dead (never read again), so implementations may leave them stale."""
  ring_size = cursor.ring_size
  offset = (jnp.arange(ring_size)[None, :] - cursor.base[slots][:, None]) % ring_size
  live = offset < cursor.count[slots][:, None]                                 # [B, R]
  rings = [getattr(bufs, f.name) for f in dataclasses.fields(bufs) if f.name.startswith("ring_")]
  return tuple(jnp.where(live.reshape(live.shape[:1] + (1,) + live.shape[1:] + (1,) * (r.ndim - 3)),
                         r[slots], 0) for r in rings if r is not None)


def make_gate(bench: LayerBench, case: Case):
  """``gate(carry, consts) -> (o, rows)``: layer 0's first step (input set 0), not donated; rows =
  the written buffers at the batch's slots (state; + the live entries of every ring for replay), in
  our layout whatever layout the setup's buffers have."""
  prepare, op = layer_op(bench, case)

  def gate(carry, consts):
    bank, params, slots = consts
    inp = prepare(tuple(x[0] for x in bank), params)
    if case.arm.family == "conv":
      o, pool = op(inp, params, carry[0], slots)
      return o, (pool[slots],)
    bufs, cursor = carry[0], carry[1]
    native = case.arm.peer is not None   # a peer arm runs on its own layout, ours on ours
    if not native:
      bufs = ours(case.setup, bufs, params)
    plan = cursor.plan(slots, flush_all=case.arm.flush_all)
    o, bufs = op(inp, params, bufs, plan)
    if native:
      bufs = ours(case.setup, bufs, params)
    return o, (bufs.state[slots],) + _live_ring_entries(bufs, cursor.commit(plan), slots)
  return gate


@jax.jit
def _compare(a, b):
  """(max |a-b|, ‖a-b‖/‖b‖) over a pytree, in float32."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  diff2 = sum(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32))) for x, y in zip(la, lb))
  ref2 = sum(jnp.sum(jnp.square(y.astype(jnp.float32))) for y in lb)
  mx = jnp.max(jnp.stack([jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))
                          for x, y in zip(la, lb)]))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x.astype(jnp.float32))) for x in la]))
  return mx, jnp.sqrt(diff2 / jnp.maximum(ref2, 1e-30)), finite


def f64(x):
  """A device array as a float64 numpy array (through float32)."""
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


ORACLE_ROWS = 4   # batch rows the gate checks against the float64 oracle


def gate_tolerance(setup: Setup) -> float:
  """Relative L2 tolerance set by the coarsest dtype involved (bf16 ≈ 4e-3 per rounding): far below
  what a wrong index, phase or missed write gives (O(1)), above TF32 (≈ 5e-4)."""
  worst = {"float32": 2e-3, "float16": 5e-3, "bfloat16": 1e-2}
  dts = [setup.act_dtype, setup.state_dtype] + ([setup.ring_dtype] if setup.family == "replay" else [])
  dts += [setup.read_copy_dtype] if setup.read_copy_dtype else []
  return max(worst[jnp.dtype(d).name] for d in dts)


# ----------------------------------------------------------------------------------------------
# Running one case

def _post_checks(case: Case, carry, host, cycles_run: int) -> dict:
  out = {"finite": bool(jnp.all(jnp.isfinite(carry[-1].astype(jnp.float32))))}
  if case.arm.family == "replay":
    cursor = carry[1]
    L, R = case.setup.buffer_len, case.setup.ring_size
    if case.arm.flush_all:
      # Every step flushes: the first folds the pending window, then one entry per step.
      want_count = np.zeros_like(host["count"])
      want_base = (host["base"].astype(np.int64) + host["count"] + L * cycles_run) % R
    else:
      # Full cycles of L steps: every row flushed once per cycle and is back at its phase.
      want_count = host["count"]
      want_base = (host["base"].astype(np.int64) + L * cycles_run) % R
    out["cursor_count_back"] = bool(np.array_equal(np.asarray(cursor.count), want_count))
    out["cursor_base_advanced"] = bool(np.array_equal(np.asarray(cursor.base), want_base))
  return out


def run_case(bench: LayerBench, case: Case, runner, gate_fn, ref_gate_fn, args, *, tol: float) -> dict:
  """Gate, then time one compiled case on fresh random buffers: its result row."""
  setup = case.setup
  row = _row_skeleton(bench, case)
  t0 = time.perf_counter()
  carry, consts, host = init_state(bench, setup)
  jax.block_until_ready(carry)
  row["init_s"] = time.perf_counter() - t0

  # Gate: arm vs XLA on layer 0's first step, and the first rows vs the float64 oracle.
  t0 = time.perf_counter()
  ref_o, ref_rows = ref_gate_fn(carry, consts)
  if gate_fn is ref_gate_fn:
    o, rows = ref_o, ref_rows
  else:
    o, rows = gate_fn(carry, consts)
  o_abs, o_rel, o_fin = (float(x) for x in _compare(o, ref_o))
  s_abs, s_rel, s_fin = (float(x) for x in _compare(rows, ref_rows))
  m = min(setup.batch, ORACLE_ROWS)
  view = carry if setup.family == "conv" else (ours(setup, carry[0], consts[1]),) + carry[1:]
  want = bench.oracle_output(setup, view, consts, host, m)
  del view
  norm = max(np.linalg.norm(want), 1e-30)
  oracle_rel = float(np.linalg.norm(f64(o[:m]) - want) / norm)
  ref_oracle_rel = float(np.linalg.norm(f64(ref_o[:m]) - want) / norm)
  del o, rows, ref_o, ref_rows
  passed = bool(o_fin and s_fin and max(o_rel, s_rel, oracle_rel) <= tol and ref_oracle_rel <= tol)
  row["gate"] = {"passed": passed, "tol_rel": tol, "o_max_abs": o_abs, "o_rel": o_rel,
                 "state_max_abs": s_abs, "state_rel": s_rel, "oracle_rows": m,
                 "oracle_o_rel": oracle_rel, "xla_oracle_o_rel": ref_oracle_rel,
                 "vs": "implementation='xla', same inputs; oracle: float64 numpy"}
  row["gate_s"] = time.perf_counter() - t0

  t0 = time.perf_counter()
  call = lambda c, n, consts=consts: runner(c, consts, np.int32(n))   # bound: consts is deleted below
  carry, timing = common.time_loop(call, carry, reps=args.reps, rep_seconds=args.rep_seconds)
  row["run_s"] = time.perf_counter() - t0
  row["checks"] = _post_checks(case, carry, host, timing.cycles_run)
  del carry, consts
  units = setup.cycle_steps * setup.layers  # layer-steps per cycle
  summary = timing.ms_per(units)
  row.update(ms_per_layer_step=summary.pop("ms"), **summary, layer_steps_per_call=timing.n_cycles * units,
             warmup_s=timing.warmup_s, calib_s=timing.calib_s)
  ok_checks = all(row["checks"].values())
  row["status"] = "ok" if (passed and ok_checks) else ("gate-failed" if not passed else "check-failed")
  return row


def _row_skeleton(bench: LayerBench, case: Case) -> dict:
  s = case.setup
  bm = bench.bytes_model(s.geo, case.arm.family, s.buffer_len, s.state_dtype, s.ring_dtype, s.act_dtype,
                         s.read_copy_dtype)
  replay = case.arm.family == "replay"
  return {
      "arm": case.arm.name, "label": case.label, "config": case.cfg.name,
      "config_overrides": dict(case.cfg.overrides),
      **({"heads": case.heads} if bench.heads_option else {}),
      "impl": case.arm.impl, "family": case.arm.family, "route": case.arm.route,
      "peer": case.arm.peer.name if case.arm.peer else None,
      "ring_layout": s.layout.name if s.layout else None,
      "state_dtype": s.state_dtype, "ring_dtype": s.ring_dtype if replay else None,
      "read_copy_dtype": s.read_copy_dtype,
      "act_dtype": s.act_dtype, "batch": s.batch, "buffer_len": s.buffer_len if replay else None,
      "layers": s.layers, "slots_per_layer": s.num_slots, "cycle_steps": s.cycle_steps,
      "bytes_per_row": bm, "bytes_per_layer_step": bm["total"] * s.batch,
      "pool_bytes_all_layers": pool_bytes(s),
      "repeat": False, "status": "pending", "error": None,
  }


# ----------------------------------------------------------------------------------------------
# Planning

def _step_config(cfg: common.LaunchConfig) -> common.LaunchConfig:
  """The part of a launch config a conventional (step-only) kernel takes, named by its tokens."""
  kw = cfg.kwargs(STEP_KNOBS)
  if not kw:
    return _DEFAULT
  name = "".join(f"{t}{kw[k]}" for t, k in (("bv", "block_v"), ("w", "num_warps"), ("s", "num_stages"))
                 if k in kw)
  return common.LaunchConfig(name, tuple(sorted(kw.items())))


def _arm_configs(bench: LayerBench, arm: Arm, configs) -> list:
  """The ``--configs`` an arm runs: a Triton arm those without a Mosaic-only knob, a Mosaic arm
  those made of ``bench.mosaic_knobs`` only, an XLA or peer arm the default. A config that no arm
  of the run takes is refused by ``main``."""
  if arm.impl == "pallas_triton":
    return [c for c in configs if not set(c.kwargs()) & set(MOSAIC_ONLY_KNOBS)]
  if arm.impl == "pallas_mosaic":
    return [c for c in configs if set(c.kwargs()) <= set(bench.mosaic_knobs)]
  return [_DEFAULT]


def _unavailable(bench: LayerBench, arm: Arm, pallas_error: str | None) -> str | None:
  """Why an arm cannot run in this process (None if it can)."""
  if arm.peer is not None:
    return arm.peer.available()
  return pallas_error if arm.impl == "pallas_triton" else None


def plan_groups(bench: LayerBench, args, geo, pallas_error: str | None):
  """[(state_dtype, batch, [Case...], [skipped rows])], in run order."""
  groups = []
  arms = [bench.arm(name) for name in args.arms]
  layouts = [None] + list(dict.fromkeys(a.peer.layout for a in arms if a.peer and a.peer.layout))
  for sdt in args.state_dtypes:
    for B in args.batches:
      P = layers_for(geo, B, sdt, args.target_bytes, args.max_layers, args.min_layers)
      mk = lambda family, L, layout=None, copy=None: Setup(
          geo=geo, family=family, batch=B, layers=P, buffer_len=L, state_dtype=sdt, ring_dtype=args.ring_dtype,
          act_dtype=args.act_dtype, bank=args.bank, seed=args.seed, layout=layout, read_copy_dtype=copy)
      cases, skipped, seen = [], [], set()
      setups = [mk("conv", args.conv_cycle)] + [mk("replay", L, lay) for lay in layouts for L in args.buffer_lens]
      if any(a.read_copy for a in arms) and sdt == "float32":   # a read copy serves f32 checkpoints
        setups += [mk("replay", L, copy=args.read_copy_dtype) for L in args.buffer_lens]
      for setup in setups:
        for arm in arms:
          layout = arm.peer.layout if arm.peer and arm.family == "replay" else None
          if (arm.family != setup.family or layout is not setup.layout
              or arm.read_copy != (setup.read_copy_dtype is not None)
              or (arm.impl == "xla" and B not in args.xla_batches)):
            continue
          heads = args.heads if bench.heads_option and arm.impl == "pallas_triton" and arm.family == "replay" else None
          for cfg in _arm_configs(bench, arm, args.configs):
            if arm.family == "conv" and arm.impl == "pallas_triton" and not cfg.is_default:
              cfg = _step_config(cfg)
            case = Case(arm, cfg, setup, heads)
            if (case.label, setup) in seen:
              continue
            seen.add((case.label, setup))
            why = _unavailable(bench, arm, pallas_error)
            if why:
              row = _row_skeleton(bench, case)
              row.update(status="skipped", error=why)
              skipped.append(row)
            else:
              cases.append(case)
      groups.append((sdt, B, cases, skipped))
  return groups


def _error_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) < 2000 else text[:2000] + " …"


def run_group(bench: LayerBench, sdt, B, cases, args) -> list[dict]:
  """Lowers and compiles every program of one (state dtype, batch) group, then runs its cases."""
  rows = []
  lowered, errors = {}, {}
  abstract = {}
  t0 = time.perf_counter()
  n_abs = jax.ShapeDtypeStruct((), jnp.int32)
  for case in cases:
    s, ref = case.setup, _ref_key(case)
    if s not in abstract:
      try:
        abstract[s] = abstract_state(bench, s)
      except Exception as e:  # noqa: BLE001  (e.g. buffers too large: recorded per arm, the run goes on)
        abstract[s] = e
    if isinstance(abstract[s], Exception):
      errors[("run", case)] = abstract[s]
      continue
    if ref not in lowered and ref not in errors:
      try:
        lowered[ref] = jax.jit(make_gate(bench, Case(_ref_arm(case.arm), _DEFAULT, s))).lower(*abstract[s])
      except Exception as e:  # noqa: BLE001
        errors[ref] = e
    try:
      lowered[("run", case)] = jax.jit(make_runner(bench, case), donate_argnums=(0,)).lower(*abstract[s], n_abs)
      if case.arm != _ref_arm(case.arm):
        lowered[("gate", case)] = jax.jit(make_gate(bench, case)).lower(*abstract[s])
    except Exception as e:  # noqa: BLE001
      errors[("run", case)] = e
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = common.compile_all(lowered, args.compile_workers)
  compile_wall = time.perf_counter() - t0
  common.log(f"state={sdt} B={B}: {len(cases)} arms, lowered {len(lowered)} programs in {lower_s:.1f}s, "
             f"compiled in {compile_wall:.1f}s ({args.compile_workers} workers)")

  def get(key, compiled=compiled):   # bound: the group's programs are deleted after its cases ran
    if key in errors:
      return errors[key], 0.0
    return compiled.get(key, (None, 0.0))

  tol = lambda case: gate_tolerance(case.setup)
  runners = {}
  for case in cases:
    row = _row_skeleton(bench, case)
    runner, run_cs = get(("run", case))
    gate_key = ("gate", case) if ("gate", case) in lowered or ("gate", case) in errors else _ref_key(case)
    gate_fn, gate_cs = get(gate_key)
    ref_fn, _ = get(_ref_key(case))
    row["compile_s"] = run_cs + (gate_cs if gate_key[0] == "gate" else 0.0)
    if runner is not None and not isinstance(runner, Exception):
      # A copy as large as a donated pool array (all layers' state or a ring) in the timed
      # program means it is not updated in place: the time would include the copy.
      row["big_copies"] = common.big_copies(runner, 0.9 * min(bench.donated_sizes(case.setup)))
    problem = next((x for x in (runner, gate_fn, ref_fn) if isinstance(x, Exception)), None)
    if problem is not None:
      row.update(status="error", error=_error_text(problem))
    else:
      try:
        row.update(run_case(bench, case, runner, gate_fn, ref_fn, args, tol=tol(case)))
        runners[case.label] = (case, runner, gate_fn, ref_fn, row)
      except Exception as e:  # noqa: BLE001
        row.update(status="error", error=_error_text(e))
    gc.collect()
    rows.append(row)
    _log_row(row)

  # The same arm once more, at the end of the group: run-to-run noise.
  rep = runners.get(args.repeat_arm)
  if rep is not None:
    case, runner, gate_fn, ref_fn, first = rep
    try:
      row = run_case(bench, case, runner, gate_fn, ref_fn, args, tol=tol(case))
      row.update(repeat=True, label=case.label + "#2", compile_s=0.0, big_copies=first.get("big_copies"))
    except Exception as e:  # noqa: BLE001
      row = _row_skeleton(bench, case)
      row.update(repeat=True, label=case.label + "#2", status="error", error=_error_text(e))
    rows.append(row)
    _log_row(row)
  del compiled, lowered, runners
  gc.collect()
  return rows


def _log_row(row: dict) -> None:
  where = f"{row['label']:<22} {row['state_dtype']:<8} B={row['batch']:<4}" + (
      f" L={row['buffer_len']:<3}" if row["buffer_len"] else " L=-  ") + f" P={row['layers']:<4}"
  if row["status"] in ("error", "skipped"):
    common.log(f"{where} {row['status'].upper()}: {str(row['error'])[:300]}")
    return
  g = row["gate"]
  common.log(f"{where} gate {'ok' if g['passed'] else 'FAILED'} vs xla: o max|d| {g['o_max_abs']:.1e} "
             f"rel {g['o_rel']:.1e}, state max|d| {g['state_max_abs']:.1e} rel {g['state_rel']:.1e}; "
             f"vs f64 rel {g['oracle_o_rel']:.1e} | "
             f"{row['median_ms']:.4f} ms/layer-step [{row['p20_ms']:.4f}, {row['p80_ms']:.4f}] "
             f"compile {row.get('compile_s', 0):.1f}s run {row['run_s']:.1f}s"
             + ("" if row["status"] == "ok" else f" STATUS {row['status']} {row['checks']}")
             + (f" WARNING: large copies in the timed program {row['big_copies'][:4]}"
                if row.get("big_copies") else ""))


# ----------------------------------------------------------------------------------------------
# Derived numbers, table, files

def derive(rows: list[dict], ceiling_gbps: float | None) -> None:
  """Effective bandwidth, % of ceiling and speedups (only between rows whose gates passed)."""
  ok = [r for r in rows if r["status"] == "ok" and not r["repeat"]]

  def best(pred):
    cands = [r for r in ok if pred(r)]
    return min(cands, key=lambda r: r["median_ms"]) if cands else None

  for r in rows:
    r.update(eff_gbps=None, pct_ceiling=None, speedup_vs_conv=None, speedup_vs_conv_basis=None,
             speedup_vs_xla=None, speedup_vs_xla_basis=None, speedup_vs_peer=None, speedup_vs_peer_basis=None)
    if r.get("median_ms") is None:
      continue
    r["eff_gbps"] = r["bytes_per_layer_step"] / (r["median_ms"] * 1e-3) / 1e9
    if ceiling_gbps:
      r["pct_ceiling"] = 100.0 * r["eff_gbps"] / ceiling_gbps
    if r["status"] != "ok":
      continue
    same = lambda o, r=r: o["state_dtype"] == r["state_dtype"] and o["batch"] == r["batch"]
    conv = best(lambda o: same(o) and o["arm"] in CONV_ARMS)
    if r["family"] == "replay":
      xla = best(lambda o: same(o) and o["arm"] == "replay-xla" and o["buffer_len"] == r["buffer_len"])
    elif r["arm"] in CONV_ARMS:
      xla = best(lambda o: same(o) and o["arm"] == "conv-xla")
    else:
      xla = None
    if conv is not None and r["family"] == "replay":
      r["speedup_vs_conv"] = conv["median_ms"] / r["median_ms"]
      r["speedup_vs_conv_basis"] = conv["label"]
    if xla is not None and r["impl"] not in ("xla", "peer"):
      r["speedup_vs_xla"] = xla["median_ms"] / r["median_ms"]
      r["speedup_vs_xla_basis"] = xla["label"]
    # The fastest peer kernel of the same family (and L), same state dtype and batch.
    peer = best(lambda o: same(o) and o["impl"] == "peer" and o["family"] == r["family"]
                and o["buffer_len"] == r["buffer_len"])
    if peer is not None and r["impl"] != "peer":
      r["speedup_vs_peer"] = peer["median_ms"] / r["median_ms"]
      r["speedup_vs_peer_basis"] = peer["label"]


_DTYPE_ORDER = {"float32": 0, "bfloat16": 1, "float16": 2}


def _sort_key(r):
  """Result-row order: state dtype, batch, L, arm, label (a ``#2`` repeat after its arm)."""
  return (_DTYPE_ORDER.get(r["state_dtype"], 9), r["batch"], r["buffer_len"] or 0, _ARM_ORDER.get(r["arm"], 99),
          r["label"].replace("#2", "~"))


TABLE_HEADERS = ["arm", "state", "B", "L", "P", "ms/step", "p20-p80", "GB/s", "%ceil", "x conv",
                 "x xla", "x peer", "gate (rel err)"]
_RIGHT = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11}


def table_rows(rows: list[dict]) -> list[list[str]]:
  out = []
  f = common.fmt_float
  for r in sorted(rows, key=_sort_key):
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["state_dtype"], r["state_dtype"])
    head = [r["label"], short, str(r["batch"]), str(r["buffer_len"] or "-"), str(r["layers"])]
    if r.get("median_ms") is None:
      out.append(head + ["-"] * 7 + [f"{r['status'].upper()}: {str(r['error'])[:60]}"])
      continue
    g = r["gate"]
    gate = ("ok " if g["passed"] else "FAIL ") + f"{max(g['o_rel'], g['state_rel'], g['oracle_o_rel']):.1e}"
    if r["status"] == "check-failed":
      gate += " CHECK-FAILED"
    if r.get("big_copies"):
      gate += " +copy"  # the timed program copies a whole donated array (see JSON big_copies)
    out.append(head + [f(r["median_ms"], ".4f"), f"{r['p20_ms']:.4f}-{r['p80_ms']:.4f}",
                       f(r["eff_gbps"], ".0f"), f(r["pct_ceiling"], ".0f"),
                       f(r["speedup_vs_conv"], ".2f"), f(r["speedup_vs_xla"], ".2f"),
                       f(r.get("speedup_vs_peer"), ".2f"), gate])
  return out


def render(rows, *, markdown=False) -> str:
  return common.render_table(TABLE_HEADERS, table_rows(rows), markdown=markdown, align_right=_RIGHT)


RESULTS_HEADER = """# replayssm_jax benchmark results

Sections are appended by `python -m bench.gdn_decode --markdown` (or `--from-json F.json --markdown`).

Definitions (bench/gdn_decode.py docstring has the full method):
- **ms/step**: median milliseconds per layer-step (one decode step of one GDN layer for the whole batch);
  p20-p80 over the timed repetitions. Each step of the timed loop runs P layers, each with its own state
  (P·pool ≥ 1 GiB, far past the L2); many steps run inside one `jax.jit`, buffers donated; replay arms
  run whole cycles of L steps (every row flushes once per cycle, rows at staggered phases).
- **GB/s**: effective bandwidth on the minimal bytes of a layer-step averaged over a cycle: inputs
  (q, k, v, g, beta) and the output; conventional: state read + written; replay: checkpoint read every step
  and written once per L steps, the live ring window read once ((L-1)/2 entries on average; k per key head,
  u per value head, g) and one ring entry written. **%ceil**: of the device-to-device copy ceiling
  (in-place `x + z` over ≥ 2 GB, bytes read + written) measured in the same run.
- **x conv**: conventional Pallas time / this arm's time (same state dtype and batch, same run; the best
  conventional arm and launch config, Triton or Mosaic). **x xla**: XLA time of the same algorithm
  (replay-xla at the same L for replay arms, conv-xla for conv-pallas / conv-mosaic) / this arm's time.
  **x peer**: the fastest peer kernel of the same kind (`peer-*` rows: another project's kernel called
  through jax_triton in the same harness, same data, same gate) / this arm's time. Speedups only between
  rows whose gates passed.
- **gate**: first step vs `implementation="xla"` (output and written state/ring rows) and vs a float64
  oracle on the first rows; the largest relative L2 error is shown. `#2` rows re-time an arm at the end
  of its group: the run-to-run noise. `+copy`: the compiled timed program copies a whole donated array
  (state pool or ring) each layer, i.e. an update is not in place (JSON `big_copies`).
"""


def markdown_section(bench: LayerBench, meta: dict, ceilings: list, rows: list[dict]) -> str:
  ceil = ", ".join(f"{c:.0f}" for c in ceilings if c)
  return "\n".join([
      f"## {bench.title} — {meta.get('date', '?')} — {meta.get('device_kind', '?')}", "",
      bench.summary(meta, ceil), "",
      "```", meta.get("command", ""), "```", "",
      render(rows, markdown=True), ""])


def append_markdown(path: pathlib.Path, section: str) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists():
    path.write_text(RESULTS_HEADER)
  with path.open("a") as f:
    f.write("\n" + section)


def plot(rows: list[dict], ceilings: list, path: pathlib.Path, title: str, plot_L: int = 16) -> bool:
  """Left: replay speedup (Pallas arms) over conventional Pallas vs batch, per L. Right: effective
  bandwidth vs batch (conventional arms and replay arms at ``plot_L``), with the copy ceiling."""
  try:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    common.log("matplotlib not installed: no plot")
    return False
  good = [r for r in rows if r.get("median_ms") is not None and not r["repeat"]]
  Ls = sorted({r["buffer_len"] for r in good if r["buffer_len"]})
  if plot_L not in Ls and Ls:
    plot_L = Ls[len(Ls) // 2]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
  styles = ["-", "--", ":", "-."]
  series = {}
  for r in good:
    if r["family"] == "replay" and r["impl"].startswith("pallas") and r["speedup_vs_conv"]:
      series.setdefault((r["label"], r["state_dtype"], r["buffer_len"]), []).append(
          (r["batch"], r["speedup_vs_conv"]))
  for i, ((label, sdt, L), pts) in enumerate(sorted(series.items())):
    pts.sort()
    ax1.plot(*zip(*pts), marker="o", linestyle=styles[Ls.index(L) % 4] if L in Ls else "-",
             label=f"{label} {sdt} L={L}")
  ax1.axhline(1.0, color="gray", lw=0.8)
  ax1.set(xlabel="batch B", ylabel="speedup vs conventional Pallas",
          title="ReplaySSM speedup (same run, same state dtype)")
  bw = {}
  for r in good:
    if r["eff_gbps"] and (r["family"] == "conv" or r["buffer_len"] == plot_L):
      key = (r["label"], r["state_dtype"], r["buffer_len"])
      bw.setdefault(key, []).append((r["batch"], r["eff_gbps"]))
  for (label, sdt, L), pts in sorted(bw.items()):
    pts.sort()
    ax2.plot(*zip(*pts), marker="o", linestyle="-" if sdt == "float32" else "--",
             label=f"{label} {sdt}" + (f" L={L}" if L else ""))
  for c in {round(c) for c in ceilings if c}:
    ax2.axhline(c, color="black", lw=1.0, linestyle=":")
    ax2.annotate(f"copy ceiling {c} GB/s", (0.01, c), xycoords=("axes fraction", "data"),
                 va="bottom", fontsize=8)
  ax2.set(xlabel="batch B", ylabel="effective GB/s (minimal bytes)",
          title=f"effective bandwidth (replay at L={plot_L})")
  batches = sorted({r["batch"] for r in good})
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    if batches:
      ax.set_xticks(batches, [str(b) for b in batches])
      ax.minorticks_off()
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


# ----------------------------------------------------------------------------------------------
# CLI

def _csv(cast):
  return lambda s: [cast(x) for x in s.split(",") if x.strip()]


def _dtype_name(s: str) -> str:
  aliases = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
  name = jnp.dtype(aliases.get(s, s)).name
  if name not in ("float32", "bfloat16", "float16"):
    raise argparse.ArgumentTypeError(f"dtype {s!r}; expected float32, bfloat16 or float16")
  return name


def parse_args(bench: LayerBench, argv):
  p = argparse.ArgumentParser(prog=f"python -m bench.{bench.name}", description=bench.description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help=bench.smoke_help)
  p.add_argument("--state-dtypes", type=_csv(_dtype_name), default=["float32", "bfloat16"])
  p.add_argument("--ring-dtype", type=_dtype_name, default="bfloat16")
  p.add_argument("--read-copy-dtype", type=_dtype_name, default="bfloat16",
                 help="dtype of the checkpoint's read copy in the *-copy arms (float32 state only)")
  p.add_argument("--act-dtype", type=_dtype_name, default="bfloat16")
  p.add_argument("--batches", type=_csv(int), default=[1, 8, 32, 128, 256, 512])
  p.add_argument("--buffer-lens", type=_csv(int), default=list(bench.default_buffer_lens))
  p.add_argument("--arms", type=_csv(str), default=list(bench.default_arms),
                 help=f"comma list of {', '.join(bench.arm_names)}")
  p.add_argument("--configs", type=_csv(common.parse_config), default=[_DEFAULT], help=bench.configs_help)
  if bench.heads_option:
    p.add_argument("--heads", type=int, default=None, help="replay step: heads per program")
  p.add_argument("--xla-batches", type=_csv(int), default=None,
                 help="batches at which the XLA arms run (default: all of --batches)")
  p.add_argument("--repeat-arm", default="conv-pallas",
                 help="arm label timed a second time per (dtype, B) group for noise; 'none' disables")
  p.add_argument("--reps", type=int, default=7, help="timed repetitions (>= 5)")
  p.add_argument("--rep-seconds", type=float, default=0.1, help="target seconds per timed call")
  p.add_argument("--target-bytes", type=float, default=float(1 << 30),
                 help="P·(one layer's state pool) >= this (P >= 2)")
  p.add_argument("--max-layers", type=int, default=4096)
  p.add_argument("--min-layers", type=int, default=8,
                 help="P >= this: layers sharing one plan/commit per step, as in a model (Qwen3.5-4B "
                      "has 24 GDN layers); the per-step cursor work is spread over them")
  p.add_argument("--bank", type=int, default=8, help="random input sets cycled through")
  p.add_argument("--conv-cycle", type=int, default=16, help="steps per cycle of the conventional arms")
  p.add_argument("--copy-bytes", type=float, default=float(2 << 30), help="copy-ceiling buffer bytes")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="parallel XLA compilations (default 8 on GPU, min(4, CPUs) elsewhere)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-json", type=pathlib.Path, default=None,
                 help=f"default bench/results/{bench.name}_<date>.json; rewritten after every group")
  p.add_argument("--markdown", action="store_true", help="append a section to --results-md")
  p.add_argument("--results-md", type=pathlib.Path, default=common.BENCH_DIR / "RESULTS.md")
  p.add_argument("--plot", nargs="?", const="auto", default=None, type=str,
                 help=f"write a PNG (default path bench/{bench.name}_<date>.png)")
  p.add_argument("--from-json", type=pathlib.Path, nargs="+", default=None,
                 help="re-render table/markdown/plot from saved result files (no device work)")
  p.add_argument("--git-commit", default=None, help="commit to record where the checkout has no .git")
  p.add_argument("--peer-dir", type=pathlib.Path, action="append", default=[],
                 help="a directory holding a peer's source tree (e.g. sglang/, vllm/, mamba_ssm/), searched "
                      "before the installed packages by the peer-* arms; repeatable")
  p.add_argument("--dry-run", action="store_true", help="print the planned arms, P and memory, then exit")
  args = p.parse_args(argv)
  if args.smoke:
    defaults = p.parse_args([])
    smoke = dict(batches=[2], buffer_lens=[4], state_dtypes=["float32"], reps=5, rep_seconds=0.005,
                 target_bytes=0.0, copy_bytes=float(8 << 20), bank=2, conv_cycle=4, max_layers=2,
                 min_layers=2)
    for k, v in smoke.items():  # smoke sizes unless given explicitly
      if getattr(args, k) == getattr(defaults, k):
        setattr(args, k, v)
  bad = [a for a in args.arms if a not in bench.arm_names]
  if bad:
    p.error(f"unknown arm(s) {bad}; choose from {list(bench.arm_names)}")
  bad = [d for d in args.peer_dir if not d.is_dir()]
  if bad:
    p.error(f"--peer-dir {[str(d) for d in bad]}: not a directory")
  unused = [c.name for c in args.configs if not c.is_default
            and not any(c in _arm_configs(bench, bench.arm(a), [c]) for a in args.arms)]
  if unused:
    p.error(f"--configs {unused}: no arm of {args.arms} takes these knobs (Triton arms take all but "
            f"{list(MOSAIC_ONLY_KNOBS)}; this family's Mosaic arms take {list(bench.mosaic_knobs)})")
  if args.reps < 5:
    p.error("--reps must be >= 5")
  if args.xla_batches is None:
    args.xla_batches = list(args.batches)
  if args.repeat_arm in ("", "none"):
    args.repeat_arm = None
  if args.compile_workers is None:
    args.compile_workers = 8 if jax.default_backend() == "gpu" else min(4, os.cpu_count() or 1)
  return args


def _write_reports(bench: LayerBench, args, meta: dict, ceilings: list, rows: list[dict]) -> None:
  """The markdown section (``--markdown``) and the plot (``--plot``)."""
  if args.markdown:
    append_markdown(args.results_md, markdown_section(bench, meta, ceilings, rows))
    print(f"markdown: appended to {args.results_md}")
  if args.plot:
    path = (common.BENCH_DIR / f"{bench.name}_{common.timestamp()}.png") if args.plot == "auto" else args.plot
    if plot(rows, ceilings, path, f"{bench.title}, {meta.get('device_kind')}, {meta.get('date')}", bench.plot_L):
      print(f"plot: {path}")


def _report_only(bench: LayerBench, args) -> dict:
  rows, metas, ceilings = [], [], []
  for path in args.from_json:
    data = json.loads(pathlib.Path(path).read_text())
    for r in data["rows"]:
      r["source"] = pathlib.Path(path).stem
    rows += data["rows"]
    metas.append(data["meta"])
    ceilings.append(data.get("ceiling", {}).get("gbps"))
  key = lambda r: (r["label"], r["state_dtype"], r["batch"], r["buffer_len"])
  seen = {}
  for r in rows:
    seen[key(r)] = seen.get(key(r), 0) + 1
  for r in rows:  # the same arm from several files: say which file each row came from
    if seen[key(r)] > 1:
      r["label"] = f"{r['label']}@{r['source']}"
  meta = dict(metas[0])
  meta["command"] = "\n".join(m.get("command", "") for m in metas)
  _write_reports(bench, args, meta, ceilings, rows)
  print(render(rows))
  return {"meta": meta, "rows": rows}


def _dry_run(bench: LayerBench, args, geo) -> dict:
  groups = plan_groups(bench, args, geo, bench.pallas_available())
  lines = []
  for sdt, B, cases, skipped in groups:
    for c in cases:
      s = c.setup
      mem = sum(bench.donated_sizes(s)) / 2**30
      mb = bench.bytes_model(geo, s.family, s.buffer_len, sdt, s.ring_dtype, s.act_dtype,
                             s.read_copy_dtype)["total"] * B / 1e6
      lines.append([c.label, sdt, str(B), str(s.buffer_len if s.family == "replay" else "-"), str(s.layers),
                    f"{mem:.2f}", f"{mb:.1f}"])
    for r in skipped:
      lines.append([r["label"], sdt, str(B), str(r["buffer_len"] or "-"), str(r["layers"]), "-", "skipped"])
  n_prog = sum(len(c) for _, _, c, _ in groups)
  print(common.render_table(["arm", "state", "B", "L", "P", "GiB donated", "MB/layer-step"], lines,
                            align_right={2, 3, 4, 5, 6}))
  print(f"{n_prog} timed arms in {len(groups)} groups; about {2 * n_prog} programs to compile")
  return {"plan": lines}


def main(bench: LayerBench, argv=None) -> dict:
  """The CLI of ``python -m bench.<bench.name>``: runs, records and reports; returns the result."""
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(bench, argv)
  if args.from_json:
    return _report_only(bench, args)
  rs.set_checks(False)
  warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
  geo = bench.smoke_geometry if args.smoke else bench.geometry
  peer_common.set_peer_dirs(args.peer_dir)
  if args.dry_run:
    return _dry_run(bench, args, geo)
  meta = common.run_metadata(argv, f"bench.{bench.name}", git_commit_override=args.git_commit)
  meta["geometry"] = dataclasses.asdict(geo)
  meta["options"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                     if k != "configs"}
  meta["options"]["configs"] = [c.name for c in args.configs]
  common.log(f"{meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, "
             f"commit {(meta['git_commit'] or '?')[:12]}, source {meta['source_digest']}")
  pallas_error = bench.pallas_available()
  if pallas_error:
    common.log(f"Pallas arms skipped: {pallas_error}")
  peers = {bench.arm(a).peer.name: bench.arm(a).peer.available() for a in args.arms if bench.arm(a).peer}
  if peers:
    meta["peers"] = {"status": peers, "peer_dirs": [str(d) for d in args.peer_dir],
                     **{d: peer_common.version(d) for d in ("jax-triton", "triton", "sglang", "vllm", "mamba-ssm")}}

  measure = lambda seed: common.measure_copy_ceiling(int(args.copy_bytes), reps=args.reps, seed=seed,
                                                     rep_seconds=max(args.rep_seconds, 0.005))
  ceil_runs = [measure(0)]
  common.log(f"copy ceiling: {ceil_runs[0]['gbps']:.0f} GB/s (p20-p80 {ceil_runs[0]['gbps_p20']:.0f}-"
             f"{ceil_runs[0]['gbps_p80']:.0f}) over {ceil_runs[0]['bytes_total'] / 1e9:.2f} GB")

  groups = plan_groups(bench, args, geo, pallas_error)
  total = sum(len(c) for _, _, c, _ in groups) + sum(
      1 for _, _, c, _ in groups if any(x.label == args.repeat_arm for x in c))
  common.log(f"{total} timed rows in {len(groups)} groups (state dtype x batch)")
  out = pathlib.Path(args.out_json or (common.BENCH_DIR / "results" / f"{bench.name}_{common.timestamp()}.json"))

  def save(rows, ceiling):
    """The result file, rewritten after every group: a run cut short keeps what it measured."""
    derive(rows, ceiling)
    meta["elapsed_s"] = common.elapsed()
    result = {"meta": meta, "ceiling": {"gbps": ceiling, "runs": ceil_runs},
              "bytes_model": bench.bytes_model_doc, "rows": sorted(rows, key=_sort_key)}
    common.write_json(out, result)
    return result

  rows = []
  for sdt, B, cases, skipped in groups:
    rows += skipped
    for r in skipped:
      _log_row(r)
    if cases:
      rows += run_group(bench, sdt, B, cases, args)
    save(rows, ceil_runs[0]["gbps"])

  ceil_runs.append(measure(1))
  ceiling = max(c["gbps"] for c in ceil_runs)
  common.log(f"copy ceiling at the end: {ceil_runs[1]['gbps']:.0f} GB/s; using {ceiling:.0f} GB/s")
  result = save(rows, ceiling)
  print(f"json: {out}")
  _write_reports(bench, args, meta, [ceiling], rows)
  n_fail = sum(r["status"] not in ("ok", "skipped") for r in rows)
  print(f"done in {common.elapsed():.0f}s; copy ceiling {ceiling:.0f} GB/s; "
        f"{n_fail} row(s) not ok" + (" (see 'gate' column / JSON 'error')" if n_fail else ""))
  print(render(rows))
  return result
