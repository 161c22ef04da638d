"""GDN decode benchmark: conventional vs ReplaySSM decode, Pallas-Triton vs XLA.

    python -m bench.gdn_decode [--state-dtypes float32] [--buffer-lens 16] [--batches 1,8,...]
                               [--arms ...] [--configs default,bv32w2] [--out-json F] [--markdown] [--plot]
    python -m bench.gdn_decode --smoke          # tiny CPU run (< 1 min); the test suite runs it
    python -m bench.gdn_decode --from-json A.json B.json --markdown --plot   # re-render saved runs

Geometry: one Qwen3.5-4B GDN layer (Hk=16, Hv=32, K=V=128), bf16 activations, g float32, ring in
bf16 (``--ring-dtype``), state float32 and/or bfloat16 (``--state-dtypes``).

Arms (``--arms``): ``conv-pallas`` (rs.gdn.decode, pallas_triton), ``replay-pallas-oo`` /
``replay-pallas-rc`` (rs.gdn.replay_decode, pallas_triton, route output_only / reconstruct),
``conv-xla``, ``replay-xla`` (route output_only); opt-in ``replay-pallas-auto``, ``replay-xla-rc``,
and the Pallas Mosaic GPU arms ``conv-mosaic`` / ``replay-mosaic`` (implementation="pallas_mosaic",
output-only route, flush fold fused; config module defaults) to time Mosaic vs Triton in one run.
XLA arms run only at ``--xla-batches``. ``--configs bv32w2,bv64w4`` adds one row per Pallas launch
config (calls ``replayssm_jax.pallas.gdn_triton`` with keyword overrides; ``default`` = the config
module's choice through the public op).

Method (DESIGN §8, notes/pallas-gpu.md "Calibration", .library/device/METHOD.md):

* Layers. A step runs P layers, each with its own state (and ring) — well over the 60 MB L2:
  P = max(--min-layers, ceil(--target-bytes / state bytes of one layer's pool)), so P·pool ≥ 1 GiB
  and, like a model, at least 8 layers share each step's cursor plan and commit. Layers
  are disjoint slot ranges of one pool array (layer l uses slots l·N + s, N = B slots per layer):
  the same memory traffic as P separate arrays, and one compiled step for any P.
* Steps. One ``jax.jit`` runs ``n`` cycles (a dynamic ``fori_loop``) of ``L`` steps (a static loop;
  conventional arms use ``--conv-cycle`` steps) of P layers (static loop), so dispatch and the
  loop's host round trip are amortized. Buffers, cursor and the last output are the donated carry,
  threaded from call to call. Replay: one ``cursor.plan(slots)`` per step shared by all layers,
  ``cursor.commit(plan)`` after: honest full cycles, every row flushes once per L steps.
* Data. Random, never zeros (a counter-based hash, uniform): checkpoints of std 0.1, rings
  (L2-normalised k, u of unit variance, g ~ -U(0.01, 0.5)) filled at every index; each slot starts at a staggered phase (cursor counts
  spread over [0, L-1], random bases); a bank of ``--bank`` random input sets, layer l of step t
  reads set (t + l) mod bank. Slots are a random permutation. At least one row flushes on the
  first step, so the gate always covers a flush fold.
* Gate, before timing: the arm's first step (layer 0) vs implementation="xla" on the same inputs
  (output and written state/ring rows: max abs and relative L2 error), and the first rows' output
  vs an independent float64 numpy oracle. A row whose gate fails gets no speedup.
* Timing: compile, one untimed call, a calibration call, then ``--reps`` calls of ``n`` cycles
  (≈ ``--rep-seconds`` each) with block_until_ready; ms per layer-step = call time / (n·steps·P):
  median, p20, p80. ``--repeat-arm`` is timed a second time at the end of each (dtype, B) group
  (row ``<arm>#2``): the run-to-run noise. After timing, each replay cursor must be back at its
  starting count and its base advanced by L per cycle (flushes happened), and outputs finite.
* In-place check: the optimized HLO of each timed program is searched for copies as large as a
  donated array (state pool, ring_k, ring_u); any are listed in the row (``big_copies``, ``+copy``
  in the table): such a program pays a full copy per layer-step.
* Copy ceiling, at the start and end of the run: ``bench.common.measure_copy_ceiling``
  (≥ 2 GB in place, bytes read + written / time); the larger median is the ceiling.

Minimal bytes per row and layer-step, averaged over a full cycle (``bytes_model``):
  inputs q, k [Hk·K], v [Hv·V], beta [Hv] in the activation dtype, g [Hv] float32; output o [Hv·V];
  conventional: state read + written: 2·Hv·V·K·s;
  replay: checkpoint read every step (Hv·V·K·s) and written once per L steps (Hv·V·K·s / L);
  ring: the live window read once — on average (L-1)/2 entries — and one entry written, an entry
  being k [Hk·K] (per key head) + u [Hv·V] in the ring dtype + g [Hv] float32.
  Effective bandwidth = B · bytes per row / (ms per layer-step); % of the copy ceiling.
  Not counted: slots/cursor metadata (a few bytes per row), the fold pass re-reading the window.
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
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.gdn.buffers import ReplayBuffers

from bench import common

DEFAULT_BATCHES = (1, 8, 32, 128, 256, 512)
DEFAULT_BUFFER_LENS = (8, 16, 32)


@dataclasses.dataclass(frozen=True)
class Geometry:
  hk: int  # key heads
  hv: int  # value heads
  kd: int  # K
  vd: int  # V

  @property
  def group(self) -> int:
    return self.hv // self.hk


QWEN35_4B = Geometry(hk=16, hv=32, kd=128, vd=128)
SMOKE = Geometry(hk=2, hv=4, kd=16, vd=16)


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  family: str          # "conv" | "replay"
  impl: str            # "pallas_triton" | "pallas_mosaic" | "xla"
  route: str | None = None


ARMS = {a.name: a for a in (
    Arm("conv-pallas", "conv", "pallas_triton"),
    Arm("replay-pallas-oo", "replay", "pallas_triton", "output_only"),
    Arm("replay-pallas-rc", "replay", "pallas_triton", "reconstruct"),
    Arm("conv-xla", "conv", "xla"),
    Arm("replay-xla", "replay", "xla", "output_only"),
    Arm("replay-pallas-auto", "replay", "pallas_triton", "auto"),
    Arm("replay-xla-rc", "replay", "xla", "reconstruct"),
    Arm("conv-mosaic", "conv", "pallas_mosaic"),
    Arm("replay-mosaic", "replay", "pallas_mosaic", "output_only"),
)}
CONV_ARMS = ("conv-pallas", "conv-mosaic")   # "our best conventional kernel" = the faster of these
DEFAULT_ARMS = ("conv-pallas", "replay-pallas-oo", "replay-pallas-rc", "conv-xla", "replay-xla")
_STEP_KNOBS = ("block_v", "num_warps", "num_stages")
_ARM_ORDER = {name: i for i, name in enumerate(ARMS)}


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
  arm: Arm
  cfg: common.LaunchConfig
  setup: Setup

  @property
  def label(self) -> str:
    return self.arm.name + ("" if self.cfg.is_default else f"[{self.cfg.name}]")


# ----------------------------------------------------------------------------------------------
# Byte model

def bytes_model(geo: Geometry, family: str, buffer_len: int | None, state_dtype, ring_dtype,
                act_dtype) -> dict:
  """Minimal bytes per batch row and layer-step, averaged over a full cycle (module doc)."""
  a, s, r = (common.itemsize(d) for d in (act_dtype, state_dtype, ring_dtype))
  inputs = (2 * geo.hk * geo.kd + geo.hv * geo.vd + geo.hv) * a + geo.hv * 4
  output = geo.hv * geo.vd * a
  state = geo.hv * geo.vd * geo.kd * s
  if family == "conv":
    parts = {"inputs": inputs, "output": output, "state_read": state, "state_write": state}
  else:
    L = buffer_len
    entry = geo.hk * geo.kd * r + geo.hv * geo.vd * r + geo.hv * 4
    parts = {"inputs": inputs, "output": output, "checkpoint_read": state,
             "checkpoint_write": state / L, "ring_read": entry * (L - 1) / 2, "ring_write": entry}
  parts["total"] = sum(parts.values())
  return parts


def donated_sizes(setup: "Setup") -> list[int]:
  """Bytes of the large donated arrays (all P layers): state pool; ring_k and ring_u for replay."""
  geo, slots = setup.geo, setup.layers * setup.num_slots
  sizes = [slots * geo.hv * geo.vd * geo.kd * common.itemsize(setup.state_dtype)]
  if setup.family == "replay":
    r = common.itemsize(setup.ring_dtype)
    sizes += [slots * geo.hk * setup.ring_size * geo.kd * r, slots * geo.hv * setup.ring_size * geo.vd * r]
  return sizes


def layers_for(geo: Geometry, batch: int, state_dtype: str, target_bytes: float, max_layers: int,
               min_layers: int = 2) -> int:
  pool = batch * geo.hv * geo.vd * geo.kd * common.itemsize(state_dtype)
  return int(min(max_layers, max(min_layers, 2, math.ceil(target_bytes / pool))))


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
  base = rng.integers(0, setup.ring_size, size=n)
  return slots, count.astype(np.int32), base.astype(np.int32)


def _random(stream: int, shape, lo: float, hi: float):
  """Uniform [lo, hi) float32 from a counter-based integer hash of (stream, flat index).

  A few elementwise integer ops: compiles in milliseconds on every backend (jax.random's threefry
  takes seconds per array on XLA:CPU) and generates gigabytes quickly on the GPU. Statistical
  quality is irrelevant here; what matters is non-zero, non-repeating data.
  """
  n = math.prod(shape)
  if n >= 1 << 32:
    raise ValueError(f"{shape} has {n} elements; the hash generator indexes with uint32 (lower --target-bytes)")
  x = lax.iota(jnp.uint32, n) * jnp.uint32(0x9E3779B1) + jnp.uint32((stream * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF)
  for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
    x = x ^ (x >> shift)
    if mult is not None:
      x = x * jnp.uint32(mult)
  u = (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  return (lo + (hi - lo) * u).reshape(shape)


def _normal(stream: int, shape):
  """Zero-mean, unit-variance (uniform) noise."""
  return _random(stream, shape, -math.sqrt(3.0), math.sqrt(3.0))


def _unit(x, axis=-1):
  return x * lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-12)


def _make_carry(setup: Setup, seed: int, base, count):
  """Device-side random buffers for all P layers, the cursor (replay) and the output slot."""
  geo, P, n = setup.geo, setup.layers, setup.num_slots
  sdt, rdt, adt = (jnp.dtype(d) for d in (setup.state_dtype, setup.ring_dtype, setup.act_dtype))
  ks = [16 * seed + i for i in range(4)]
  state = (_normal(ks[0], (P * n, geo.hv, geo.vd, geo.kd)) * 0.1).astype(sdt)
  o = jnp.zeros((setup.batch, geo.hv, geo.vd), adt)
  t = jnp.zeros((), jnp.int32)
  if setup.family == "conv":
    return state, o, t
  R = setup.ring_size
  ring_k = _unit(_normal(ks[1], (P * n, geo.hk, R, geo.kd))).astype(rdt)
  ring_u = _normal(ks[2], (P * n, geo.hv, R, geo.vd)).astype(rdt)
  ring_g = -_random(ks[3], (P * n, geo.hv, R), 0.01, 0.5)
  bufs = ReplayBuffers(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)
  cursor = ReplayCursor(base=base, count=count, buffer_len=setup.buffer_len, max_draft=0)
  return bufs, cursor, o, t


def _make_bank(setup: Setup, seed: int):
  """``bank`` random input sets: q, k (L2-normalised) [S, B, Hk, K], v [S, B, Hv, V], g (float32,
  ≤ 0) and beta (sigmoid) [S, B, Hv]; activations in the activation dtype."""
  geo, S, B = setup.geo, setup.bank, setup.batch
  adt = jnp.dtype(setup.act_dtype)
  ks = [16 * seed + 8 + i for i in range(5)]
  q = _normal(ks[0], (S, B, geo.hk, geo.kd)).astype(adt)
  k = _unit(_normal(ks[1], (S, B, geo.hk, geo.kd))).astype(adt)
  v = _normal(ks[2], (S, B, geo.hv, geo.vd)).astype(adt)
  g = -_random(ks[3], (S, B, geo.hv), 0.01, 0.5)
  beta = jax.nn.sigmoid(_normal(ks[4], (S, B, geo.hv))).astype(adt)
  return q, k, v, g, beta


def _init(setup: Setup, slots, base, count):
  seed = zlib.crc32(repr((setup.seed, setup.batch, setup.buffer_len, setup.family)).encode()) % (1 << 20)
  return _make_carry(setup, seed, base, count), (_make_bank(setup, seed), slots)


_init_jit = jax.jit(_init, static_argnums=0)


def init_state(setup: Setup):
  """(carry, consts, host layout) on device; random, with staggered cursor phases."""
  slots, count, base = _host_layout(setup)
  carry, consts = _init_jit(setup, jnp.asarray(slots), jnp.asarray(base), jnp.asarray(count))
  return carry, consts, {"slots": slots, "count": count, "base": base}


def abstract_state(setup: Setup):
  slots, count, base = _host_layout(setup)
  return jax.eval_shape(lambda s, b, c: _init(setup, s, b, c), slots, base, count)


# ----------------------------------------------------------------------------------------------
# Programs

def layer_op(arm: Arm, cfg: common.LaunchConfig, scale: float):
  """``op(q, k, v, g, beta, buf, slots_or_plan) -> (o, buf)`` for one layer."""
  if arm.impl == "pallas_triton" and not cfg.is_default:
    from replayssm_jax.pallas import gdn_triton  # noqa: PLC0415
    if arm.family == "conv":
      kw = cfg.kwargs(_STEP_KNOBS)
      return lambda q, k, v, g, b, pool, slots: gdn_triton.decode(q, k, v, g, b, pool, slots,
                                                                  scale=scale, **kw)
    kw = cfg.kwargs()
    return lambda q, k, v, g, b, bufs, plan: gdn_triton.replay_decode(
        q, k, v, g, b, bufs, plan, scale=scale, route=arm.route, **kw)
  if arm.family == "conv":
    return lambda q, k, v, g, b, pool, slots: rs.gdn.decode(q, k, v, g, b, pool, slots, scale=scale,
                                                            implementation=arm.impl)
  return lambda q, k, v, g, b, bufs, plan: rs.gdn.replay_decode(
      q, k, v, g, b, bufs, plan, scale=scale, route=arm.route, implementation=arm.impl)


def make_runner(case: Case):
  """``run(carry, consts, n_cycles) -> carry``: n cycles of ``cycle_steps`` steps of P layers."""
  setup, arm = case.setup, case.arm
  op = layer_op(arm, case.cfg, setup.geo.kd ** -0.5)
  P, n, steps, nb = setup.layers, setup.num_slots, setup.cycle_steps, setup.bank

  def run(carry, consts, n_cycles):
    bank, slots = consts

    def inputs(j):
      return tuple(lax.dynamic_index_in_dim(x, j, 0, keepdims=False) for x in bank)

    if arm.family == "conv":
      def step(_, c):
        pool, o, t = c

        def layer(l, c2):
          pool, o = c2
          o, pool = op(*inputs((t + l) % nb), pool, slots + l * n)
          return pool, o
        pool, o = lax.fori_loop(0, P, layer, (pool, o))
        return pool, o, t + 1
    else:
      def step(_, c):
        bufs, cursor, o, t = c
        plan = cursor.plan(slots)

        def layer(l, c2):
          bufs, o = c2
          o, bufs = op(*inputs((t + l) % nb), bufs, plan.replace(slots=slots + l * n))
          return bufs, o
        bufs, o = lax.fori_loop(0, P, layer, (bufs, o))
        return bufs, cursor.commit(plan), o, t + 1

    def cycle(_, c):
      return lax.fori_loop(0, steps, step, c)
    return lax.fori_loop(0, n_cycles, cycle, carry)
  return run


def make_gate(arm: Arm, cfg: common.LaunchConfig, setup: Setup):
  """``gate(carry, consts) -> (o, rows)``: layer 0's first step (inputs set 0), not donated; rows =
  the written buffers at the batch's slots (state; + ring for replay)."""
  op = layer_op(arm, cfg, setup.geo.kd ** -0.5)

  def gate(carry, consts):
    bank, slots = consts
    inp = tuple(x[0] for x in bank)
    if arm.family == "conv":
      pool = carry[0]
      o, pool = op(*inp, pool, slots)
      return o, (pool[slots],)
    bufs, cursor = carry[0], carry[1]
    o, bufs = op(*inp, bufs, cursor.plan(slots))
    return o, (bufs.state[slots], bufs.ring_k[slots], bufs.ring_u[slots], bufs.ring_g[slots])
  return gate


REF_ARM = {"conv": ARMS["conv-xla"], "replay": ARMS["replay-xla"]}


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


# float64 oracle (numpy; independent of the library's jnp code) -----------------------------------

def _f64(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def oracle_step(S, q, k, v, g, beta, scale, group):
  """One exact GDN step from S [m, Hv, V, K]: the output o [m, Hv, V]."""
  qh = np.repeat(q, group, axis=1) * scale
  kh = np.repeat(k, group, axis=1)
  alpha = np.exp(g)[..., None, None]
  St = alpha * S
  u = beta[..., None] * (v - np.einsum("bhvk,bhk->bhv", St, kh))
  Sn = St + u[..., :, None] * kh[..., None, :]
  return np.einsum("bhvk,bhk->bhv", Sn, qh)


def oracle_rebuild(Sc, rk, ru, rg, base, count, group):
  """S = e^{Σg} S_c + Σ_j e^{Σ_{i>j} g_i} u_j k_jᵀ over each row's window (DESIGN §2)."""
  S = np.array(Sc)
  R = rg.shape[-1]
  for b in range(S.shape[0]):
    idx = (int(base[b]) + np.arange(int(count[b]))) % R
    if idx.size == 0:
      continue
    G = rg[b][:, idx]                                  # [Hv, n]
    total = G.sum(-1)
    suffix = total[:, None] - np.cumsum(G, axis=-1)    # Σ_{i>j} g_i
    kk = np.repeat(rk[b][:, idx], group, axis=0)       # [Hv, n, K]
    S[b] = (np.exp(total)[:, None, None] * Sc[b]
            + np.einsum("hj,hjv,hjk->hvk", np.exp(suffix), ru[b][:, idx], kk))
  return S


def oracle_output(setup: Setup, carry, consts, host, rows: int):
  """float64 output of the first step for the first ``rows`` batch rows (layer 0)."""
  bank, _ = consts
  sl = host["slots"][:rows]
  q, k, v, g, beta = (_f64(x[0][:rows]) for x in bank)
  geo = setup.geo
  if setup.family == "conv":
    S = _f64(carry[0][sl])
  else:
    bufs = carry[0]
    S = oracle_rebuild(_f64(bufs.state[sl]), _f64(bufs.ring_k[sl]), _f64(bufs.ring_u[sl]),
                       _f64(bufs.ring_g[sl]), host["base"][sl], host["count"][sl], geo.group)
  return oracle_step(S, q, k, v, g, beta, geo.kd ** -0.5, geo.group)


def gate_tolerance(setup: Setup) -> float:
  """Relative L2 tolerance set by the coarsest dtype involved (bf16 ≈ 4e-3 per rounding): far below
  what a wrong index, phase or missed write gives (O(1)), above TF32 (≈ 5e-4)."""
  worst = {"float32": 2e-3, "float16": 5e-3, "bfloat16": 1e-2}
  dts = [setup.act_dtype, setup.state_dtype] + ([setup.ring_dtype] if setup.family == "replay" else [])
  return max(worst[jnp.dtype(d).name] for d in dts)


# ----------------------------------------------------------------------------------------------
# Running one case

def _post_checks(case: Case, carry, host, cycles_run: int) -> dict:
  out = {"finite": bool(jnp.all(jnp.isfinite(carry[-2].astype(jnp.float32))))}
  if case.arm.family == "replay":
    cursor = carry[1]
    L, R = case.setup.buffer_len, case.setup.ring_size
    want_base = (host["base"].astype(np.int64) + L * cycles_run) % R
    out["cursor_count_back"] = bool(np.array_equal(np.asarray(cursor.count), host["count"]))
    out["cursor_base_advanced"] = bool(np.array_equal(np.asarray(cursor.base), want_base))
  return out


def run_case(case: Case, runner, gate_fn, ref_gate_fn, args, *, tol: float) -> dict:
  setup = case.setup
  row = _row_skeleton(case)
  t0 = time.perf_counter()
  carry, consts, host = init_state(setup)
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
  m = min(setup.batch, args.oracle_rows)
  want = oracle_output(setup, carry, consts, host, m)
  norm = max(np.linalg.norm(want), 1e-30)
  oracle_rel = float(np.linalg.norm(_f64(o[:m]) - want) / norm)
  ref_oracle_rel = float(np.linalg.norm(_f64(ref_o[:m]) - want) / norm)
  del o, rows, ref_o, ref_rows
  passed = bool(o_fin and s_fin and max(o_rel, s_rel, oracle_rel) <= tol and ref_oracle_rel <= tol)
  row["gate"] = {"passed": passed, "tol_rel": tol, "o_max_abs": o_abs, "o_rel": o_rel,
                 "state_max_abs": s_abs, "state_rel": s_rel, "oracle_rows": m,
                 "oracle_o_rel": oracle_rel, "xla_oracle_o_rel": ref_oracle_rel,
                 "vs": "implementation='xla', same inputs; oracle: float64 numpy"}
  row["gate_s"] = time.perf_counter() - t0

  t0 = time.perf_counter()
  call = lambda c, n: runner(c, consts, np.int32(n))
  carry, timing = common.time_loop(call, carry, reps=args.reps, rep_seconds=args.rep_seconds)
  row["run_s"] = time.perf_counter() - t0
  row["checks"] = _post_checks(case, carry, host, timing.cycles_run)
  del carry, consts
  units = setup.cycle_steps * setup.layers  # layer-steps per cycle
  ms = [t / units * 1e3 for t in timing.per_cycle()]
  med, p20, p80 = common.quantiles(ms)
  row.update(ms_per_layer_step=ms, median_ms=med, p20_ms=p20, p80_ms=p80, n_cycles=timing.n_cycles,
             layer_steps_per_call=timing.n_cycles * units, warmup_s=timing.warmup_s,
             calib_s=timing.calib_s)
  ok_checks = all(row["checks"].values())
  row["status"] = "ok" if (passed and ok_checks) else ("gate-failed" if not passed else "check-failed")
  return row


def _row_skeleton(case: Case) -> dict:
  s = case.setup
  bm = bytes_model(s.geo, case.arm.family, s.buffer_len, s.state_dtype, s.ring_dtype, s.act_dtype)
  return {
      "arm": case.arm.name, "label": case.label, "config": case.cfg.name,
      "config_overrides": dict(case.cfg.overrides), "impl": case.arm.impl,
      "family": case.arm.family, "route": case.arm.route, "state_dtype": s.state_dtype,
      "ring_dtype": s.ring_dtype if case.arm.family == "replay" else None,
      "act_dtype": s.act_dtype, "batch": s.batch,
      "buffer_len": s.buffer_len if case.arm.family == "replay" else None,
      "layers": s.layers, "slots_per_layer": s.num_slots, "cycle_steps": s.cycle_steps,
      "bytes_per_row": bm, "bytes_per_layer_step": bm["total"] * s.batch,
      "pool_bytes_all_layers": s.layers * s.num_slots * s.geo.hv * s.geo.vd * s.geo.kd
      * common.itemsize(s.state_dtype),
      "repeat": False, "status": "pending", "error": None,
  }


# ----------------------------------------------------------------------------------------------
# Planning

def plan_groups(args, geo: Geometry, pallas_error: str | None):
  """[(state_dtype, batch, [Case...], [skipped rows])], in run order."""
  groups = []
  for sdt in args.state_dtypes:
    for B in args.batches:
      P = layers_for(geo, B, sdt, args.target_bytes, args.max_layers, args.min_layers)
      mk = lambda family, L: Setup(geo=geo, family=family, batch=B, layers=P, buffer_len=L,
                                   state_dtype=sdt, ring_dtype=args.ring_dtype, act_dtype=args.act_dtype,
                                   bank=args.bank, seed=args.seed)
      cases, skipped, seen = [], [], set()
      setups = [mk("conv", args.conv_cycle)] + [mk("replay", L) for L in args.buffer_lens]
      for setup in setups:
        for name in args.arms:
          arm = ARMS[name]
          if arm.family != setup.family or (arm.impl == "xla" and B not in args.xla_batches):
            continue
          for cfg in (args.configs if arm.impl == "pallas_triton" else [common.LaunchConfig("default")]):
            if arm.family == "conv" and not cfg.is_default:
              kw = cfg.kwargs(_STEP_KNOBS)
              cfg = (common.LaunchConfig("default") if not kw else common.LaunchConfig(
                  "".join(f"{t}{kw[k]}" for t, k in (("bv", "block_v"), ("w", "num_warps"),
                                                      ("s", "num_stages")) if k in kw),
                  tuple(sorted(kw.items()))))
            case = Case(arm, cfg, setup)
            if (case.label, setup) in seen:
              continue
            seen.add((case.label, setup))
            if arm.impl == "pallas_triton" and pallas_error:
              row = _row_skeleton(case)
              row.update(status="skipped", error=pallas_error)
              skipped.append(row)
            else:
              cases.append(case)
      groups.append((sdt, B, cases, skipped))
  return groups


def pallas_available() -> str | None:
  """None if the Pallas-Triton GDN kernels import, else why not."""
  try:
    from replayssm_jax.pallas import gdn_triton  # noqa: F401, PLC0415
  except Exception as e:  # noqa: BLE001
    return f"replayssm_jax.pallas.gdn_triton not importable: {type(e).__name__}: {e}"
  return None


def _error_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  return text if len(text) < 2000 else text[:2000] + " …"


def run_group(sdt, B, cases, args, bar) -> list[dict]:
  """Lowers and compiles every program of one (state dtype, batch) group, then runs its cases."""
  rows = []
  lowered, errors = {}, {}
  abstract = {}
  t0 = time.perf_counter()
  n_abs = jax.ShapeDtypeStruct((), jnp.int32)
  for case in cases:
    s = case.setup
    if s not in abstract:
      abstract[s] = abstract_state(s)
      ref = REF_ARM[s.family]
      try:
        lowered[("ref", s)] = jax.jit(make_gate(ref, common.LaunchConfig("default"), s)).lower(*abstract[s])
      except Exception as e:  # noqa: BLE001
        errors[("ref", s)] = e
    try:
      lowered[("run", case)] = jax.jit(make_runner(case), donate_argnums=(0,)).lower(*abstract[s], n_abs)
      if not (case.arm.impl == "xla" and case.arm.route == REF_ARM[s.family].route):
        lowered[("gate", case)] = jax.jit(make_gate(case.arm, case.cfg, s)).lower(*abstract[s])
    except Exception as e:  # noqa: BLE001
      errors[("run", case)] = e
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = common.compile_all(lowered, args.compile_workers)
  compile_wall = time.perf_counter() - t0
  common.log(f"state={sdt} B={B}: {len(cases)} arms, lowered {len(lowered)} programs in {lower_s:.1f}s, "
             f"compiled in {compile_wall:.1f}s ({args.compile_workers} workers)")

  def get(key):
    if key in errors:
      return errors[key], 0.0
    return compiled.get(key, (None, 0.0))

  runners = {}
  for case in cases:
    bar.set_description_str(f"{case.label} {sdt} B={B}" + (f" L={case.setup.buffer_len}"
                                                           if case.arm.family == "replay" else ""))
    row = _row_skeleton(case)
    runner, run_cs = get(("run", case))
    gate_key = ("gate", case) if ("gate", case) in lowered or ("gate", case) in errors else ("ref", case.setup)
    gate_fn, gate_cs = get(gate_key)
    ref_fn, _ = get(("ref", case.setup))
    row["compile_s"] = run_cs + (gate_cs if gate_key[0] == "gate" else 0.0)
    if runner is not None and not isinstance(runner, Exception):
      # A copy as large as a donated pool array (all layers' state, ring_k or ring_u) in the timed
      # program means it is not updated in place: the time would include the copy.
      row["big_copies"] = common.big_copies(runner, 0.9 * min(donated_sizes(case.setup)))
    problem = next((x for x in (runner, gate_fn, ref_fn) if isinstance(x, Exception)), None)
    if problem is not None:
      row.update(status="error", error=_error_text(problem))
    else:
      try:
        row.update({k: v for k, v in run_case(case, runner, gate_fn, ref_fn, args,
                                              tol=args.gate_tol or gate_tolerance(case.setup)).items()
                    if k not in ("compile_s",)})
        runners[case.label] = (case, runner, gate_fn, ref_fn, row)
      except Exception as e:  # noqa: BLE001
        row.update(status="error", error=_error_text(e))
    gc.collect()
    rows.append(row)
    _log_row(row)
    bar.update(1)

  # The same arm once more, at the end of the group: run-to-run noise.
  rep = next((v for k, v in runners.items() if k == args.repeat_arm), None)
  if rep is not None:
    case, runner, gate_fn, ref_fn, first = rep
    try:
      row = run_case(case, runner, gate_fn, ref_fn, args, tol=args.gate_tol or gate_tolerance(case.setup))
      row.update(repeat=True, label=case.label + "#2", compile_s=0.0, big_copies=first.get("big_copies"))
    except Exception as e:  # noqa: BLE001
      row = _row_skeleton(case)
      row.update(repeat=True, label=case.label + "#2", status="error", error=_error_text(e))
    rows.append(row)
    _log_row(row)
    bar.update(1)
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
             speedup_vs_xla=None, speedup_vs_xla_basis=None)
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
    if xla is not None and r["impl"] != "xla":
      r["speedup_vs_xla"] = xla["median_ms"] / r["median_ms"]
      r["speedup_vs_xla_basis"] = xla["label"]


_DTYPE_ORDER = {"float32": 0, "bfloat16": 1, "float16": 2}


def _sort_key(r):
  return (_DTYPE_ORDER.get(r["state_dtype"], 9), r["batch"], r["buffer_len"] or 0, _ARM_ORDER.get(r["arm"], 99),
          r["label"].replace("#2", "~"))


TABLE_HEADERS = ["arm", "state", "B", "L", "P", "ms/step", "p20-p80", "GB/s", "%ceil", "x conv",
                 "x xla", "gate (rel err)"]
_RIGHT = {2, 3, 4, 5, 6, 7, 8, 9, 10}


def table_rows(rows: list[dict]) -> list[list[str]]:
  out = []
  f = common.fmt_float
  for r in sorted(rows, key=_sort_key):
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["state_dtype"], r["state_dtype"])
    head = [r["label"], short, str(r["batch"]), str(r["buffer_len"] or "-"), str(r["layers"])]
    if r.get("median_ms") is None:
      out.append(head + ["-"] * 6 + [f"{r['status'].upper()}: {str(r['error'])[:60]}"])
      continue
    g = r["gate"]
    gate = ("ok " if g["passed"] else "FAIL ") + f"{max(g['o_rel'], g['state_rel'], g['oracle_o_rel']):.1e}"
    if r["status"] == "check-failed":
      gate += " CHECK-FAILED"
    if r.get("big_copies"):
      gate += " +copy"  # the timed program copies a whole donated array (see JSON big_copies)
    out.append(head + [f(r["median_ms"], ".4f"), f"{r['p20_ms']:.4f}-{r['p80_ms']:.4f}",
                       f(r["eff_gbps"], ".0f"), f(r["pct_ceiling"], ".0f"),
                       f(r["speedup_vs_conv"], ".2f"), f(r["speedup_vs_xla"], ".2f"), gate])
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
  (replay-xla at the same L for replay arms, conv-xla for conv-pallas / conv-mosaic) / this arm's time. Speedups only between rows whose gates passed.
- **gate**: first step vs `implementation="xla"` (output and written state/ring rows) and vs a float64
  oracle on the first rows; the largest relative L2 error is shown. `#2` rows re-time an arm at the end
  of its group: the run-to-run noise. `+copy`: the compiled timed program copies a whole donated array
  (state pool or ring) each layer, i.e. an update is not in place (JSON `big_copies`).
"""


def markdown_section(meta: dict, ceilings: list, rows: list[dict]) -> str:
  ceil = ", ".join(f"{c:.0f}" for c in ceilings if c)
  lines = [
      f"## GDN decode — {meta.get('date', '?')} — {meta.get('device_kind', '?')}",
      "",
      f"jax {meta.get('jax_version')} / jaxlib {meta.get('jaxlib_version')}, commit "
      f"`{(meta.get('git_commit') or 'unknown')[:12]}`, source digest `{meta.get('source_digest')}`; "
      f"copy ceiling {ceil} GB/s.",
      "",
      "```",
      meta.get("command", ""),
      "```",
      "",
      render(rows, markdown=True),
      "",
  ]
  return "\n".join(lines)


def append_markdown(path: pathlib.Path, section: str) -> None:
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  if not path.exists():
    path.write_text(RESULTS_HEADER)
  with path.open("a") as f:
    f.write("\n" + section)


def plot(rows: list[dict], ceilings: list, path: pathlib.Path, title: str, plot_L: int = 16) -> bool:
  """Left: replay-pallas speedup over conventional Pallas vs batch, per L. Right: effective
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
    if r["family"] == "replay" and r["impl"] == "pallas_triton" and r["speedup_vs_conv"]:
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


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m bench.gdn_decode", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true",
                 help="tiny CPU-sized run (Hk=2, Hv=4, K=V=16, B=2, L=4, float32 state unless "
                      "--state-dtypes is given): checks the harness end to end")
  p.add_argument("--state-dtypes", type=_csv(_dtype_name), default=["float32", "bfloat16"])
  p.add_argument("--ring-dtype", type=_dtype_name, default="bfloat16")
  p.add_argument("--act-dtype", type=_dtype_name, default="bfloat16")
  p.add_argument("--batches", type=_csv(int), default=list(DEFAULT_BATCHES))
  p.add_argument("--buffer-lens", type=_csv(int), default=list(DEFAULT_BUFFER_LENS))
  p.add_argument("--arms", type=_csv(str), default=list(DEFAULT_ARMS),
                 help=f"comma list of {', '.join(ARMS)}")
  p.add_argument("--configs", type=_csv(common.parse_config), default=[common.LaunchConfig("default")],
                 help="Pallas launch configs, e.g. default,bv32w2,bv64w4s2,bv32w2fbv64fw4")
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
  p.add_argument("--oracle-rows", type=int, default=4, help="rows checked against the float64 oracle")
  p.add_argument("--gate-tol", type=float, default=None, help="relative tolerance (default by dtype)")
  p.add_argument("--copy-bytes", type=float, default=float(2 << 30), help="copy-ceiling buffer bytes")
  p.add_argument("--compile-workers", type=int, default=None,
                 help="parallel XLA compilations (default 8 on GPU, min(4, CPUs) elsewhere)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-json", type=pathlib.Path, default=None,
                 help="default bench/results/gdn_decode_<date>.json")
  p.add_argument("--markdown", action="store_true", help="append a section to --results-md")
  p.add_argument("--results-md", type=pathlib.Path, default=common.BENCH_DIR / "RESULTS.md")
  p.add_argument("--plot", nargs="?", const="auto", default=None, type=str,
                 help="write a PNG (default path bench/gdn_decode_<date>.png)")
  p.add_argument("--plot-L", type=int, default=16)
  p.add_argument("--from-json", type=pathlib.Path, nargs="+", default=None,
                 help="re-render table/markdown/plot from saved result files (no device work)")
  p.add_argument("--git-commit", default=None, help="commit to record where the checkout has no .git")
  p.add_argument("--progress", action="store_true", help="show the progress bar even without a terminal")
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


def _report_only(args) -> dict:
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
  if args.markdown:
    append_markdown(args.results_md, markdown_section(meta, ceilings, rows))
  if args.plot:
    path = (common.BENCH_DIR / f"gdn_decode_{common.timestamp()}.png") if args.plot == "auto" else args.plot
    if plot(rows, ceilings, path, f"GDN decode, {meta.get('device_kind')}, {meta.get('date')}", args.plot_L):
      print(f"plot: {path}")
  print(render(rows))
  return {"meta": meta, "rows": rows}


def _dry_run(args, geo: Geometry) -> dict:
  groups = plan_groups(args, geo, pallas_available())
  lines = []
  for sdt, B, cases, skipped in groups:
    for c in cases:
      s = c.setup
      mem = sum(donated_sizes(s)) / 2**30
      lines.append([c.label, sdt, str(B), str(s.buffer_len if s.family == "replay" else "-"), str(s.layers),
                    f"{mem:.2f}", f"{bytes_model(geo, s.family, s.buffer_len, sdt, s.ring_dtype, s.act_dtype)['total'] * B / 1e6:.1f}"])
    for r in skipped:
      lines.append([r["label"], sdt, str(B), str(r["buffer_len"] or "-"), str(r["layers"]), "-", "skipped"])
  n_prog = sum(len(c) for _, _, c, _ in groups)
  print(common.render_table(["arm", "state", "B", "L", "P", "GiB donated", "MB/layer-step"], lines,
                            align_right={2, 3, 4, 5, 6}))
  print(f"{n_prog} timed arms in {len(groups)} groups; about {2 * n_prog} programs to compile")
  return {"plan": lines}


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.from_json:
    return _report_only(args)
  rs.set_checks(False)
  warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
  geo = SMOKE if args.smoke else QWEN35_4B
  if args.dry_run:
    return _dry_run(args, geo)
  meta = common.run_metadata(argv, "bench.gdn_decode", git_commit_override=args.git_commit)
  meta["geometry"] = dataclasses.asdict(geo)
  meta["options"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                     if k != "configs"}
  meta["options"]["configs"] = [c.name for c in args.configs]
  common.log(f"{meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, "
             f"commit {(meta['git_commit'] or '?')[:12]}, source {meta['source_digest']}")
  pallas_error = pallas_available()
  if pallas_error:
    common.log(f"Pallas arms skipped: {pallas_error}")

  ceil_runs = [common.measure_copy_ceiling(int(args.copy_bytes), reps=args.reps,
                                           rep_seconds=max(args.rep_seconds, 0.005))]
  common.log(f"copy ceiling: {ceil_runs[0]['gbps']:.0f} GB/s (p20-p80 {ceil_runs[0]['gbps_p20']:.0f}-"
             f"{ceil_runs[0]['gbps_p80']:.0f}) over {ceil_runs[0]['bytes_total'] / 1e9:.2f} GB")

  groups = plan_groups(args, geo, pallas_error)
  total = sum(len(c) for _, _, c, _ in groups) + sum(
      1 for _, _, c, _ in groups if any(x.label == args.repeat_arm for x in c))
  common.log(f"{total} timed rows in {len(groups)} groups (state dtype x batch)")
  rows = []
  bar = common.progress(total, "arms", force=True if args.progress else None)
  try:
    for sdt, B, cases, skipped in groups:
      rows += skipped
      for r in skipped:
        _log_row(r)
      if cases:
        rows += run_group(sdt, B, cases, args, bar)
  finally:
    bar.close()

  ceil_runs.append(common.measure_copy_ceiling(int(args.copy_bytes), reps=args.reps,
                                               rep_seconds=max(args.rep_seconds, 0.005), seed=1))
  ceiling = max(c["gbps"] for c in ceil_runs)
  common.log(f"copy ceiling at the end: {ceil_runs[1]['gbps']:.0f} GB/s; using {ceiling:.0f} GB/s")
  derive(rows, ceiling)
  meta["elapsed_s"] = common.elapsed()
  result = {
      "meta": meta,
      "ceiling": {"gbps": ceiling, "runs": ceil_runs},
      "bytes_model": {
          "unit": "bytes per batch row and layer-step, averaged over a full cycle",
          "conv": "inputs (q,k,v,beta act dtype; g f32) + output + state read + state write",
          "replay": "inputs + output + checkpoint read + checkpoint write / L + ring window read "
                    "((L-1)/2 entries) + one ring entry written; entry = k[Hk,K] + u[Hv,V] (ring dtype) "
                    "+ g[Hv] f32",
          "not_counted": "slot/cursor metadata; the fold pass re-reading the window on flush rows",
      },
      "rows": sorted(rows, key=_sort_key),
  }
  out = args.out_json or (common.BENCH_DIR / "results" / f"gdn_decode_{common.timestamp()}.json")
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(common.to_jsonable(result), indent=1))
  print(f"json: {out}")
  if args.markdown:
    append_markdown(args.results_md, markdown_section(meta, [ceiling], rows))
    print(f"markdown: appended to {args.results_md}")
  if args.plot:
    path = (common.BENCH_DIR / f"gdn_decode_{common.timestamp()}.png") if args.plot == "auto" else args.plot
    if plot(rows, [ceiling], path, f"GDN decode, {meta['device_kind']}, {meta['date']}", args.plot_L):
      print(f"plot: {path}")
  n_fail = sum(r["status"] not in ("ok", "skipped") for r in rows)
  print(f"done in {common.elapsed():.0f}s; copy ceiling {ceiling:.0f} GB/s; "
        f"{n_fail} row(s) not ok" + (" (see 'gate' column / JSON 'error')" if n_fail else ""))
  print(render(rows))
  return result


if __name__ == "__main__":
  main()
