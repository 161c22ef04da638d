"""Long-run drift study: does ReplaySSM decode accumulate error over many flushes?

    python -m bench.drift --out-json bench/results/drift_<date>.json            # full run (GPU)
    python -m bench.drift --smoke --out-json /tmp/drift_smoke.json              # CPU, < 1 min
    python -m bench.drift --steps 8192 --families gdn --dtypes float32,bfloat16  # a subset

Protocol (notes/reliability.md §4):

* Inputs. Synthetic GDN and Mamba2 decode streams of ``--steps`` steps for ``--rows`` batch rows,
  drawn from a counter-based hash of (seed, step, row, element), so any step is reproducible on its
  own. Two regimes per family:
  - ``typical``: GDN g = -exp(U(log 0.05, log 1)), β ~ U(0, 1), v ~ N(0, 1); Mamba2 Δ log-uniform
    in [1e-3, 1e-1], A_h = -1 … -16, x ~ N(0, 1).
  - ``slow``: the adversarial slow-decay regime: GDN g ≈ -1e-3 (log-uniform [5e-4, 2e-3]), β ~
    U(0.9, 1), v ~ 10·N(0, 1); Mamba2 A_h ≈ -1e-3 (so Δ·A ≈ 1e-6 … 1e-4) and x ~ 10·N(0, 1). The
    state then remembers thousands of steps and every rounding error persists.
  q, k (GDN) and B, C (Mamba2) ~ N(0, 1), k L2-normalized; activations float32; Mamba2 takes Δ
  directly (``dt_softplus=False``). Every row starts from a zero state.
* Arms: {replay, conventional} × checkpoint dtype (``--dtypes``) × L (``--buffer-lens``, replay
  only) × GDN fold mode (``--folds``; none given: the library's default, recorded as ``default``).
  The ring dtype is the library default (= checkpoint dtype) unless ``--ring-dtype`` is given. Plus
  a speculative arm per (dtype, L): T = ``--spec-tokens`` tokens per step,
  random accepted counts in [1, T], rejected lanes fed junk inputs, ``--spec-steps`` verify steps.
  Each arm is one ``jax.jit`` of a ``lax.fori_loop`` over the steps (public ops inside), run in
  segments between the sample steps; the speculative arm is a jitted step driven from the host.
* Reference: an independent float64 numpy step loop over the same (float32) inputs — not the
  library's code. It costs ≈ 0.3 ms per step at the default size, ≈ 10 s per 32k-step stream, so
  float64 is used for the full run too (no float32 stand-in).
* Error: relative RMS ``‖x − ref‖ / ‖ref‖`` over all rows and heads, of the step's output and of the
  state after the step (``materialize`` for replay), at log-spaced steps and at flush steps (steps
  ``t`` with ``(t + 1) % lcm(L) == 0``: a flush for every L, i.e. the checkpoint was just written).
* Fit: ordinary least squares of log10(relative error) against the step index over the flush
  samples after the first ``--fit-skip`` (10 %) of the steps (the start-up transient, while the
  state fills from zero, is not drift), with a 95 % confidence interval from Student's t. Why log: errors of different arms sit
  at levels decades apart and scatter multiplicatively (a rounding error is relative), so log makes
  the residuals comparable in size along the run and across arms; a zero slope means the error
  level does not move, a positive slope that it grows (an open-loop accumulator gives a clearly
  positive slope; a random walk of roundings gives a positive, flattening one). The slope is
  reported per 1000 steps and, for replay arms, per 1000 flushes (= per 1000 steps × L), with the
  fitted rise over the run in decades. Caveat: successive errors are autocorrelated, so the
  interval is narrower than a fully honest one; read a "significant" slope together with its rise.
* Model level: greedy tokens of the tiny model (``rs.models``, GatedDeltaNet + Mamba2 layers),
  replay vs conventional decode with the same checkpoint dtype, first divergence index per dtype
  over ``--model-tokens`` tokens (and each run against conventional float32).

The JSON (``--out-json``) is rewritten after every finished series, so an interrupted run keeps
what it finished; ``--max-seconds`` stops starting new arms after that much wall time.
"""
import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import replayssm_jax as rs
from bench import common

f32 = jnp.float32
DTYPES = ("float32", "bfloat16", "float16")
REGIMES = ("typical", "slow")
FAMILIES = ("gdn", "mamba2")
FOLDS = ("u", "exact")


# ----------------------------------------------------------------------------------------------
# Options

@dataclasses.dataclass(frozen=True)
class Options:
  steps: int = 32768
  rows: int = 4
  families: tuple = FAMILIES
  regimes: tuple = REGIMES
  dtypes: tuple = DTYPES
  buffer_lens: tuple = (8, 16, 32)
  folds: tuple = FOLDS
  ring_dtype: str | None = None
  read_copy_dtypes: tuple = ()        # replay arms over float32 checkpoints with a 16-bit read copy
  implementation: str | None = None
  # GDN Hk, Hv, K, V and Mamba2 H, P, G, N.
  gdn_dims: tuple = (2, 4, 64, 64)
  mamba2_dims: tuple = (4, 64, 1, 64)
  log_samples: int = 48
  flush_samples: int = 128
  spec_tokens: int = 4
  spec_steps: int = 4096
  spec_dtypes: tuple | None = None    # None: the --dtypes list
  spec_folds: tuple | None = None     # None: the fold modes; ("default",): the library's default
  spec_buffer_lens: tuple | None = None  # None: the --buffer-lens list
  model_tokens: int = 4096
  model_dtypes: tuple | None = None   # None: the --dtypes list
  model_rows: int = 2
  model_prompt: int = 16
  model_buffer_len: int = 16
  seed: int = 0
  max_seconds: float | None = None
  fit_skip: float = 0.1               # fits leave out the first 10 % of the steps (start-up)


# CPU-sized: every compiled program costs seconds on XLA:CPU, so fewer arms; the model check is
# off (its two compiles alone take ~30 s on 2 cores; `--smoke --model-tokens 32` turns it on).
SMOKE = {"steps": 256, "rows": 2, "gdn_dims": (1, 2, 16, 16), "mamba2_dims": (2, 16, 1, 16),
         "log_samples": 12, "flush_samples": 8, "dtypes": ("float32", "bfloat16"), "buffer_lens": (8,),
         "spec_steps": 32, "spec_dtypes": ("float32",), "spec_folds": ("default",), "model_tokens": 0,
         "model_prompt": 8, "model_dtypes": ("float32",)}


# ----------------------------------------------------------------------------------------------
# Inputs: a counter-based hash, so step t of row b is the same wherever it is generated.

def _bits(seed: int, stream: int, pos, shape):
  """uint32 [rows, *shape] from (seed, stream, row, pos[row], flat index); pos: int32[rows]."""
  rows, n = pos.shape[0], math.prod(shape)
  x = common.mix32(pos.astype(jnp.uint32) * jnp.uint32(0x9E3779B1)
           + jnp.uint32((seed * 0x632BE5AB + stream * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF))
  x = common.mix32(x[:, None] + lax.broadcasted_iota(jnp.uint32, (rows, 1), 0) * jnp.uint32(0xC2B2AE3D))
  x = common.mix32(x + lax.broadcasted_iota(jnp.uint32, (rows, n), 1) * jnp.uint32(0x27D4EB2F))
  return x.reshape((rows,) + tuple(shape))


def _uniform(seed, stream, pos, shape):
  """U(0, 1] float32."""
  return ((_bits(seed, stream, pos, shape) >> 8).astype(f32) + 1.0) * (1.0 / (1 << 24))


def _normal(seed, stream, pos, shape):
  """N(0, 1) float32 (Box–Muller)."""
  u1 = _uniform(seed, 2 * stream, pos, shape)
  u2 = _uniform(seed, 2 * stream + 1, pos, shape)
  return jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(2.0 * math.pi * u2)


def _between(u, lo, hi):
  return lo + (hi - lo) * u


# ----------------------------------------------------------------------------------------------
# Families: inputs, the float64 reference, and the arms' step functions (public ops only).

def fold_modes(opts: Options) -> tuple:
  """GDN fold modes to run: ``opts.folds``, or ("default",) (the library's) if none are given."""
  return tuple(opts.folds) or ("default",)


class _Family:
  """What both families' arms share: the public ops of ``self.ops`` (rs.gdn or rs.mamba2) on a
  state of ``self.state_shape`` per row, called with ``self.op_kwargs``."""
  ops = None
  op_kwargs: dict = {}
  state_shape: tuple = ()

  def ref_init(self):
    return np.zeros((self.rows,) + self.state_shape)

  @staticmethod
  def _update(S, St, mask):
    """S ← St in place (only the rows where ``mask``, if given)."""
    if mask is None:
      S[...] = St
    else:
      S[mask] = St[mask]

  def conv_init(self, dtype):
    return jnp.zeros((self.rows,) + self.state_shape, dtype)

  def conv_step(self, pool, x, slots):
    return self.ops.decode(*x, pool, slots, **self.op_kwargs, implementation=self.impl)

  def conv_read(self, pool, slots):
    return pool.astype(f32)

  def replay_step(self, bufs, x, plan):
    return self.ops.replay_decode(*x, bufs, plan, **self.op_kwargs, implementation=self.impl)

  def verify_step(self, bufs, x, plan):
    return self.ops.replay_verify(*x, bufs, plan, **self.op_kwargs, implementation=self.impl)

  def materialize(self, bufs, cursor, slots):
    return self.ops.materialize(bufs, cursor, slots)


class Gdn(_Family):
  name = "gdn"
  ops = rs.gdn
  shared = ()        # input positions that are per-head parameters, not per-row data
  out_like = 2       # the output has the shape of input 2 (v)

  def __init__(self, opts: Options):
    self.hk, self.hv, self.kd, self.vd = opts.gdn_dims
    self.rows, self.seed, self.impl = opts.rows, opts.seed, opts.implementation
    self.ring_dtype = opts.ring_dtype
    self.scale = self.kd ** -0.5
    self.state_shape = (self.hv, self.vd, self.kd)

  def regime(self, name):
    """[g log-magnitude lo, hi, beta lo, hi, v scale] as a float32 array (traced: one program)."""
    table = {"typical": [math.log(0.05), math.log(1.0), 0.0, 1.0, 1.0],
             "slow": [math.log(5e-4), math.log(2e-3), 0.9, 1.0, 10.0]}
    return np.asarray(table[name], np.float32)

  def inputs(self, prm, pos, seed_offset=0):
    """q, k [rows, Hk, K]; v [rows, Hv, V]; g, beta [rows, Hv] for step pos[row] of each row."""
    s = self.seed + seed_offset
    q = _normal(s, 0, pos, (self.hk, self.kd))
    k = _normal(s, 1, pos, (self.hk, self.kd))
    k = k * lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True))
    v = _normal(s, 2, pos, (self.hv, self.vd)) * prm[4]
    g = -jnp.exp(_between(_uniform(s, 6, pos, (self.hv,)), prm[0], prm[1]))
    beta = _between(_uniform(s, 7, pos, (self.hv,)), prm[2], prm[3])
    return q, k, v, g, beta

  def ref_step(self, S, x, mask=None):
    """One exact step in float64 (in place on S); mask [rows] keeps masked-off rows unchanged."""
    q, k, v, g, beta = x
    r = self.hv // self.hk
    qh, kh = np.repeat(q, r, axis=1) * self.scale, np.repeat(k, r, axis=1)
    St = S * np.exp(g)[..., None, None]
    u = beta[..., None] * (v - np.matmul(St, kh[..., None])[..., 0])
    St += u[..., :, None] * kh[..., None, :]
    self._update(S, St, mask)
    return np.matmul(St, qh[..., None])[..., 0]

  def buffers(self, cursor, dtype, fold, read_copy=None):
    return rs.gdn.ReplayBuffers.create(
        self.rows, cursor, num_k_heads=self.hk, num_v_heads=self.hv, head_k_dim=self.kd,
        head_v_dim=self.vd, state_dtype=dtype, ring_dtype=self.ring_dtype, read_copy_dtype=read_copy,
        **({} if fold in (None, "default") else {"fold": fold}))


class Mamba2(_Family):
  name = "mamba2"
  ops = rs.mamba2
  op_kwargs = {"dt_softplus": False}   # the inputs are Δ itself
  shared = (2,)      # A [H]
  out_like = 0       # y has the shape of x

  def __init__(self, opts: Options):
    self.h, self.p, self.g, self.n = opts.mamba2_dims
    self.rows, self.seed, self.impl = opts.rows, opts.seed, opts.implementation
    self.ring_dtype = opts.ring_dtype
    self.state_shape = (self.h, self.p, self.n)

  def regime(self, name):
    """[Δ log lo, hi, x scale, A_0 … A_{H-1}] as a float32 array."""
    heads = np.linspace(0.0, 1.0, self.h)
    if name == "typical":
      head = [math.log(1e-3), math.log(1e-1), 1.0]
      A = -np.exp(heads * math.log(16.0))                   # -1 … -16
    else:
      head = [math.log(1e-3), math.log(1e-1), 10.0]
      A = -1e-3 * np.exp(heads * math.log(4.0)) / 4.0       # -2.5e-4 … -1e-3
    return np.asarray(head + list(A), np.float32)

  def inputs(self, prm, pos, seed_offset=0):
    """x [rows, H, P]; Δ [rows, H]; A [H]; B, C [rows, G, N]."""
    s = self.seed + 1000 + seed_offset
    x = _normal(s, 0, pos, (self.h, self.p)) * prm[2]
    dt = jnp.exp(_between(_uniform(s, 4, pos, (self.h,)), prm[0], prm[1]))
    B = _normal(s, 5, pos, (self.g, self.n))
    C = _normal(s, 7, pos, (self.g, self.n))
    return x, dt, prm[3:3 + self.h], B, C

  def ref_step(self, S, xs, mask=None):
    x, dt, A, B, C = xs
    r = self.h // self.g
    Bh, Ch = np.repeat(B, r, axis=1), np.repeat(C, r, axis=1)
    St = S * np.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., :, None] * Bh[..., None, :]
    self._update(S, St, mask)
    return np.matmul(St, Ch[..., None])[..., 0]

  def buffers(self, cursor, dtype, fold, read_copy=None):
    return rs.mamba2.ReplayBuffers.create(
        self.rows, cursor, num_heads=self.h, head_dim=self.p, num_groups=self.g, state_dim=self.n,
        state_dtype=dtype, ring_dtype=self.ring_dtype, read_copy_dtype=read_copy)   # one fold


def family(name, opts):
  return {"gdn": Gdn, "mamba2": Mamba2}[name](opts)


# ----------------------------------------------------------------------------------------------
# Sampling and the reference

def sample_steps(steps: int, lcm: int, log_samples: int, flush_samples: int):
  """(sorted sample steps, the flush samples among them): log-spaced steps plus up to
  ``flush_samples`` evenly spaced steps t with (t + 1) % lcm == 0."""
  logs = {round(x) - 1 for x in np.geomspace(1, steps, log_samples)}
  n_flush = steps // lcm
  ms = np.unique(np.linspace(1, n_flush, min(flush_samples, n_flush)).round().astype(int)) if n_flush else []
  flush = {int(m) * lcm - 1 for m in ms}
  return sorted(logs | flush), sorted(flush)


def rel_rms(a, ref):
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  den = math.sqrt(float(np.sum(ref * ref)))
  return math.sqrt(float(np.sum((a - ref) ** 2))) / max(den, 1e-300)


def _input_block(fam, n_rows):
  @functools.partial(jax.jit, static_argnums=2)
  def block(prm, t0, n):
    ts = t0 + jnp.arange(n, dtype=jnp.int32)
    return jax.vmap(lambda t: fam.inputs(prm, jnp.full((n_rows,), t, jnp.int32)))(ts)
  return block


def reference(fam, prm, steps: int, samples, chunk: int = 512):
  """float64 reference outputs and states at the sample steps: {t: (o, S)}."""
  block = _input_block(fam, fam.rows)
  want, out = set(samples), {}
  S = fam.ref_init()
  for t0 in range(0, steps, chunk):
    n = min(chunk, steps - t0)
    xs = [np.asarray(a, np.float64) for a in block(prm, np.int32(t0), chunk)]
    for i in range(n):
      t = t0 + i
      o = fam.ref_step(S, [a[i] for a in xs])
      if t in want:
        out[t] = (o, S.copy())
  return out


# ----------------------------------------------------------------------------------------------
# Arms

def _segment_program(fam, kind: str):
  """jit(carry, o, t0, n, prm) → (carry, o, state): n steps from step t0, then the state."""
  slots = jnp.arange(fam.rows, dtype=jnp.int32)

  def seg(carry, o, t0, n, prm):
    def body(i, c):
      carry, o = c
      x = fam.inputs(prm, jnp.full((fam.rows,), t0 + i, jnp.int32))
      if kind == "conv":
        o, carry = fam.conv_step(carry, x, slots)
      else:
        bufs, cursor = carry
        plan = cursor.plan(slots)
        o, bufs = fam.replay_step(bufs, x, plan)
        carry = (bufs, cursor.commit(plan))
      return carry, o.astype(f32)
    carry, o = lax.fori_loop(0, n, body, (carry, o))
    if kind == "conv":
      S = fam.conv_read(carry, slots)
    else:
      S = fam.materialize(carry[0], carry[1], slots)
    return carry, o, S
  return jax.jit(seg, donate_argnums=(0,))


def _out_zeros(fam, prm):
  shape = jax.eval_shape(lambda: fam.inputs(prm, jnp.zeros((fam.rows,), jnp.int32)))[fam.out_like].shape
  return jnp.zeros(shape, f32)


def run_arm(fam, kind, dtype, L, fold, prm, ref, samples, program_cache, read_copy=None):
  """Errors of one arm at the sample steps (a dict of lists); ``read_copy``: the replay buffers'
  read copy dtype."""
  if kind not in program_cache:
    program_cache[kind] = _segment_program(fam, kind)
  prog = program_cache[kind]
  if kind == "conv":
    carry = fam.conv_init(dtype)
  else:
    cursor = rs.ReplayCursor.create(fam.rows, buffer_len=L)
    carry = (fam.buffers(cursor, dtype, fold, read_copy), cursor)
  o = _out_zeros(fam, prm)
  t, series = 0, {"step": [], "o_err": [], "state_err": []}
  t_start = time.perf_counter()
  for s in samples:
    carry, o, S = prog(carry, o, np.int32(t), np.int32(s + 1 - t), prm)
    t = s + 1
    o_ref, S_ref = ref[s]
    series["step"].append(s)
    series["o_err"].append(rel_rms(o, o_ref))
    series["state_err"].append(rel_rms(S, S_ref))
  series["wall_s"] = time.perf_counter() - t_start
  return series


def _spec_programs(fam, T: int):
  """(step, true_inputs, materialize) jitted once per family; prm is an argument."""
  rows = fam.rows
  slots = jnp.arange(rows, dtype=jnp.int32)

  def gen(prm, pos, junk):
    """Inputs [rows, T, ...] at positions pos[row] + i; lanes with junk[row, i] get other data."""
    lanes = [fam.inputs(prm, pos + i) for i in range(T)]
    other = [fam.inputs(prm, pos + i, seed_offset=7919) for i in range(T)]
    out = []
    for j in range(len(lanes[0])):
      if j in fam.shared:  # per-head parameters (Mamba2 A) pass through
        out.append(lanes[0][j])
        continue
      stack = jnp.stack([ln[j] for ln in lanes], axis=1)
      alt = jnp.stack([ot[j] for ot in other], axis=1)
      m = junk.reshape(junk.shape + (1,) * (stack.ndim - 2))
      out.append(jnp.where(m, alt, stack))
    return tuple(out)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(bufs, cursor, prm, pos, accepted):
    junk = jnp.arange(T)[None, :] >= accepted[:, None]
    plan = cursor.plan(slots, num_tokens=T)
    o, bufs = fam.verify_step(bufs, gen(prm, pos, junk), plan)
    return o.astype(f32), bufs, cursor.commit(plan, accepted), plan.flush

  true_inputs = jax.jit(lambda prm, pos: [fam.inputs(prm, pos + i) for i in range(T)])
  materialize = jax.jit(lambda b, c: fam.materialize(b, c, slots))
  return step, true_inputs, materialize


def run_spec_arm(fam, dtype, L, fold, prm, opts: Options, rng, program_cache):
  """Speculative arm: T tokens per verify step, random accepts, float64 reference in lockstep."""
  T, rows = opts.spec_tokens, fam.rows
  if ("spec", T) not in program_cache:
    program_cache[("spec", T)] = _spec_programs(fam, T)
  step, true_inputs, materialize = program_cache[("spec", T)]
  cursor = rs.ReplayCursor.create(rows, buffer_len=max(L, T + 1), max_draft=T - 1)
  bufs = fam.buffers(cursor, dtype, fold)
  S_ref = fam.ref_init()
  pos = np.zeros(rows, np.int32)
  flushes = np.zeros(rows, np.int64)
  n = opts.spec_steps
  sample_at = {round(x) - 1 for x in np.geomspace(1, n, opts.log_samples)}
  sample_at |= set(np.linspace(0, n - 1, opts.flush_samples).round().astype(int).tolist())
  series = {"step": [], "tokens": [], "flushes": [], "o_err": [], "state_err": []}
  t_start = time.perf_counter()
  for s in range(n):
    accepted = rng.integers(1, T + 1, size=rows).astype(np.int32)
    o, bufs, cursor, flush = step(bufs, cursor, prm, jnp.asarray(pos), jnp.asarray(accepted))
    xs = [[np.asarray(a, np.float64) for a in lane] for lane in true_inputs(prm, jnp.asarray(pos))]
    o_ref = [fam.ref_step(S_ref, xs[i], mask=i < accepted) for i in range(T)]
    flushes += np.asarray(flush)
    pos = pos + accepted
    if s in sample_at:
      lanes = np.arange(T)[None, :] < accepted[:, None]        # accepted lanes only
      o_ref = np.stack(o_ref, axis=1)
      series["step"].append(s)
      series["tokens"].append(float(pos.mean()))
      series["flushes"].append(float(flushes.mean()))
      series["o_err"].append(rel_rms(np.asarray(o)[lanes], o_ref[lanes]))
      series["state_err"].append(rel_rms(materialize(bufs, cursor), S_ref))
  series["wall_s"] = time.perf_counter() - t_start
  return series


# ----------------------------------------------------------------------------------------------
# Fits

def t_quantile_975(dof: int) -> float:
  """Student's t 0.975 quantile (Cornish–Fisher expansion; < 0.1 % off for dof >= 3)."""
  z = 1.959963984540054
  if dof <= 0:
    return float("nan")
  v = float(dof)
  return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
          + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3))


def ols(x, y) -> dict | None:
  """Slope of y on x with its 95 % confidence interval (OLS, Student's t)."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  ok = np.isfinite(x) & np.isfinite(y)
  x, y = x[ok], y[ok]
  if len(x) < 4 or np.ptp(x) == 0:
    return None
  xm, ym = x.mean(), y.mean()
  sxx = float(np.sum((x - xm) ** 2))
  slope = float(np.sum((x - xm) * (y - ym)) / sxx)
  resid = y - ym - slope * (x - xm)
  se = math.sqrt(float(np.sum(resid ** 2)) / (len(x) - 2) / sxx)
  h = t_quantile_975(len(x) - 2) * se
  return {"slope": slope, "ci95": [slope - h, slope + h], "se": se, "n": len(x),
          "intercept": float(ym - slope * xm)}


def fit_series(series: dict, L: int | None, flush_steps, min_step: int = 0) -> dict:
  """Fits of log10(error) against steps (per 1000 steps) and flushes (per 1000 flushes), over the
  samples at steps >= ``min_step`` (the start-up transient is left out)."""
  out = {}
  steps_all = np.asarray(series["step"])
  if "tokens" in series:  # speculative arm: x = mean flushes per row, at every sample
    idx = np.nonzero(steps_all >= min_step)[0]
    x_flush = np.asarray(series["flushes"], np.float64)[idx]
  else:
    want = set(flush_steps)
    idx = np.array([i for i, s in enumerate(series["step"]) if s in want and s >= min_step], int)
    x_flush = None
  for what in ("state_err", "o_err"):
    err = np.asarray(series[what], np.float64)[idx] if len(idx) else np.zeros(0)
    y = np.log10(np.maximum(err, 1e-30))
    if x_flush is None:
      steps = np.asarray(series["step"], np.float64)[idx] + 1
      f = ols(steps / 1000.0, y)
      if f is None:
        out[what] = None
        continue
      res = {"per_kstep": f["slope"], "per_kstep_ci95": f["ci95"], "n": f["n"],
             "rise_decades": f["slope"] * (steps.max() - steps.min()) / 1000.0,
             "mean_log10": float(y.mean())}
      if L:
        res["per_kflush"] = f["slope"] * L
        res["per_kflush_ci95"] = [c * L for c in f["ci95"]]
      ci = f["ci95"]
    else:
      f = ols(x_flush / 1000.0, y)
      if f is None:
        out[what] = None
        continue
      res = {"per_kflush": f["slope"], "per_kflush_ci95": f["ci95"], "n": f["n"],
             "rise_decades": f["slope"] * (x_flush.max() - x_flush.min()) / 1000.0,
             "mean_log10": float(y.mean())}
      ci = f["ci95"]
    res["verdict"] = "flat" if ci[0] <= 0.0 <= ci[1] else ("grows" if ci[0] > 0 else "shrinks")
    out[what] = res
  return out


def excess_over_conventional(result: dict) -> None:
  """Adds ``fit[what]["excess"]`` to every replay series (T = 1): the OLS slope, per 1000 steps, of
  log10(error of replay / error of conventional decode) with the same family, regime and checkpoint
  dtype, over the fit samples both have. It is the drift replay adds on top of what the same-precision
  conventional recurrence does on the same inputs: where every arm's error rises with the regime
  (a slowly decaying, growing state), this is the number that says whether replay is to blame."""
  min_step = int(result["options"]["fit_skip"] * result["options"]["steps"])
  conv = {(s["family"], s["regime"], s["state_dtype"]): s for s in result["series"]
          if s.get("status") == "ok" and s["arm"] == "conventional"}
  flush_steps = set(result["samples"]["flush_steps"])
  for s in result["series"]:
    c = conv.get((s["family"], s["regime"], s["state_dtype"]))
    if s.get("status") != "ok" or s["arm"] not in ("replay", "replay-read-copy") or c is None:
      continue
    at_c = {t: i for i, t in enumerate(c["step"])}
    pairs = [(i, at_c[t]) for i, t in enumerate(s["step"]) if t in flush_steps and t >= min_step and t in at_c]
    for what in ("state_err", "o_err"):
      if s["fit"].get(what) is None or len(pairs) < 4:
        continue
      x = np.array([s["step"][i] + 1 for i, _ in pairs], np.float64) / 1000.0
      ratio = [max(s[what][i], 1e-30) / max(c[what][j], 1e-30) for i, j in pairs]
      f = ols(x, np.log10(ratio))
      if f is None:
        continue
      lo, hi = f["ci95"]
      s["fit"][what]["excess"] = {"per_kstep": f["slope"], "per_kstep_ci95": f["ci95"], "n": f["n"],
                                  "verdict": "flat" if lo <= 0.0 <= hi else ("grows" if lo > 0 else "shrinks")}


# ----------------------------------------------------------------------------------------------
# Model-level check

def model_check(opts: Options, dtypes) -> dict:
  """Greedy tokens of the tiny model: replay vs conventional decode, per checkpoint dtype."""
  from flax import nnx

  cfg = rs.models.LMConfig.tiny_hybrid()
  model = rs.models.make_model(cfg, opts.seed)
  graphdef, params = nnx.split(model)
  rows, n = opts.model_rows, opts.model_tokens
  rng = np.random.default_rng(opts.seed)
  prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows, opts.model_prompt)), jnp.int32)
  lengths = jnp.full((rows,), opts.model_prompt, jnp.int32)
  slots = jnp.arange(rows, dtype=jnp.int32)

  @functools.partial(jax.jit, static_argnames=("replay",))
  def run(params, cache, replay):
    m = nnx.merge(graphdef, params)
    logits, cache = m.prefill(prompts, cache, slots, lengths)
    tok = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def body(c, _):
      tok, cache = c
      logits, cache = m.decode(tok, cache, slots, replay=replay, implementation=opts.implementation)
      new = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return (new, cache), new
    _, toks = lax.scan(body, (tok, cache), None, length=n - 1)
    return jnp.concatenate([tok[:, None], toks.T], axis=1)

  tokens, wall = {}, {}
  for dt in dtypes:
    for replay in (True, False):
      t0 = time.perf_counter()
      cache = model.init_cache(rows, buffer_len=opts.model_buffer_len, state_dtype=jnp.dtype(dt))
      tokens[(dt, replay)] = np.asarray(run(params, cache, replay))
      wall[(dt, replay)] = time.perf_counter() - t0

  def first_divergence(a, b):
    """Per row: index of the first differing token, or None (= equal over all n tokens)."""
    out = []
    for ra, rb in zip(a, b):
      diff = np.nonzero(ra != rb)[0]
      out.append(int(diff[0]) if diff.size else None)
    return out

  base = tokens.get(("float32", False))
  results = []
  for dt in dtypes:
    r, c = tokens[(dt, True)], tokens[(dt, False)]
    results.append({
        "state_dtype": dt,
        "replay_vs_conventional": first_divergence(r, c),
        "replay_vs_conventional_f32": first_divergence(r, base) if base is not None else None,
        "conventional_vs_conventional_f32": first_divergence(c, base) if base is not None else None,
        "wall_s": wall[(dt, True)] + wall[(dt, False)],
    })
  return {"config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"},
          "tokens": n, "rows": rows, "prompt_len": opts.model_prompt, "buffer_len": opts.model_buffer_len,
          "prompt_seed": opts.seed, "decode": "greedy argmax; prefill then lax.scan of LM.decode",
          "results": results}


# ----------------------------------------------------------------------------------------------
# The study

def study(opts: Options, *, out_json=None, meta=None, log=common.log) -> dict:
  t_begin = time.perf_counter()
  lcm = math.lcm(*opts.buffer_lens) if opts.buffer_lens else 1
  samples, flush_samples = sample_steps(opts.steps, lcm, opts.log_samples, opts.flush_samples)
  folds = fold_modes(opts)
  result = {
      "meta": dict(meta or {}),
      "options": dataclasses.asdict(opts),
      "reference": "float64 numpy step loop over the same float32 inputs (independent of the library)",
      "error": "relative RMS ||x - ref|| / ||ref|| over all rows and heads; output of the step and "
               "state after it (materialize for replay)",
      "fit": "OLS of log10(relative error) on steps (and flushes) over the flush samples after the "
             "first fit_skip of the steps; 95 % CI "
             "from Student's t; per 1000 steps / per 1000 flushes (= per 1000 steps x L); "
             "verdict 'flat' when the interval contains 0",
      "fold_modes": list(folds),
      "spec": {"tokens": opts.spec_tokens, "steps": opts.spec_steps},
      "samples": {"steps": samples, "flush_steps": flush_samples, "lcm_buffer_len": lcm},
      "series": [],
      "skipped": [],
      "model": None,
  }

  def save():
    result["elapsed_s"] = time.perf_counter() - t_begin
    if out_json:
      common.write_json(out_json, result)

  def out_of_time():
    return opts.max_seconds is not None and time.perf_counter() - t_begin > opts.max_seconds

  rng = np.random.default_rng(opts.seed)
  for fname in opts.families:
    fam = family(fname, opts)
    programs = {}
    for regime in opts.regimes:
      prm = jnp.asarray(fam.regime(regime))
      if out_of_time():
        result["skipped"].append({"family": fname, "regime": regime, "why": "max_seconds"})
        continue
      t0 = time.perf_counter()
      ref = reference(fam, prm, opts.steps, samples)
      log(f"{fname}/{regime}: float64 reference over {opts.steps} steps in {time.perf_counter() - t0:.1f}s")
      arms = [("conv", dt, None, None, None) for dt in opts.dtypes]
      arms += [("replay", dt, L, fold, None) for fold in (folds if fname == "gdn" else ("default",))
               for dt in opts.dtypes for L in opts.buffer_lens]
      arms += [("replay", "float32", L, "default", copy) for copy in opts.read_copy_dtypes
               for L in opts.buffer_lens]
      for kind, dt, L, fold, copy in arms:
        name = "conventional" if kind == "conv" else ("replay" if copy is None else "replay-read-copy")
        where = {"family": fname, "regime": regime, "arm": name, "state_dtype": dt, "buffer_len": L,
                 "fold": fold, **({"read_copy_dtype": copy} if copy else {})}
        if out_of_time():
          result["skipped"].append({**where, "why": "max_seconds"})
          continue
        try:
          s = run_arm(fam, kind, dt, L, fold, prm, ref, samples, programs, read_copy=copy)
          s.update(where)
          s["ring_dtype"] = (opts.ring_dtype or dt) if kind == "replay" else None
          s["flushes"] = [(t + 1) // L for t in s["step"]] if L else None
          s["fit"] = fit_series(s, L, flush_samples, int(opts.fit_skip * opts.steps))
          s["status"] = "ok"
        except Exception as e:  # noqa: BLE001  (recorded; the study goes on)
          s = {**where, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
        result["series"].append(s)
        _log_series(log, s)
        save()
      if opts.spec_steps > 0:
        spec_folds = (opts.spec_folds or folds) if fname == "gdn" else ("default",)
        for fold in spec_folds:
          for dt in opts.spec_dtypes or opts.dtypes:
            for L in opts.spec_buffer_lens or opts.buffer_lens:
              where = {"family": fname, "regime": regime, "arm": "replay-spec", "state_dtype": dt,
                       "buffer_len": max(L, opts.spec_tokens + 1), "fold": fold,
                       "spec_tokens": opts.spec_tokens}
              if out_of_time():
                result["skipped"].append({**where, "why": "max_seconds"})
                continue
              try:
                s = run_spec_arm(fam, dt, L, fold, prm, opts, rng, programs)
                s.update(where)
                s["fit"] = fit_series(s, where["buffer_len"], [], int(opts.fit_skip * opts.spec_steps))
                s["status"] = "ok"
              except Exception as e:  # noqa: BLE001
                s = {**where, "status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
              result["series"].append(s)
              _log_series(log, s)
              save()
  if opts.model_tokens > 0 and not out_of_time():
    t0 = time.perf_counter()
    try:
      result["model"] = model_check(opts, opts.model_dtypes or opts.dtypes)
    except Exception as e:  # noqa: BLE001
      result["model"] = {"status": "error", "error": f"{type(e).__name__}: {e}"[:2000]}
    log(f"model check ({opts.model_tokens} tokens) in {time.perf_counter() - t0:.1f}s: "
        + "; ".join(f"{r['state_dtype']}: first divergence {r['replay_vs_conventional']}"
                    for r in (result["model"] or {}).get("results", [])))
  elif opts.model_tokens > 0:
    result["skipped"].append({"model": True, "why": "max_seconds"})
  excess_over_conventional(result)
  save()
  return result


def _log_series(log, s):
  head = (f"{s['family']}/{s['regime']} {s['arm']:<12} {s['state_dtype']:<8} L={s['buffer_len'] or '-':<3} "
          f"fold={s['fold'] or '-'}")
  if s["status"] != "ok":
    log(f"{head} ERROR {s['error'][:300]}")
    return
  fs = s["fit"].get("state_err") or {}
  slope = fs.get("per_kflush", fs.get("per_kstep"))
  ci = fs.get("per_kflush_ci95", fs.get("per_kstep_ci95"))
  unit = "kflush" if "per_kflush" in fs else "kstep"
  log(f"{head} state err last {s['state_err'][-1]:.2e}, out err last {s['o_err'][-1]:.2e}; "
      + (f"slope {slope:+.3f} log10/{unit} [{ci[0]:+.3f}, {ci[1]:+.3f}] {fs['verdict']}" if fs else "no fit")
      + f" ({s['wall_s']:.1f}s)")


# ----------------------------------------------------------------------------------------------
# Summary table (for bench/RESULTS.md)

def summary_rows(result: dict) -> list[list[str]]:
  excess_over_conventional(result)   # derived from the series: also for JSON written before it existed
  rows = []
  for s in result["series"]:
    if s.get("status") != "ok":
      continue
    fs = s["fit"].get("state_err") or {}
    fo = s["fit"].get("o_err") or {}

    def slope(f):
      if not f:
        return "-", "-"
      key = "per_kflush" if "per_kflush" in f else "per_kstep"
      lo, hi = f[key + "_ci95"]
      return f"{f[key]:+.4f}", f"[{lo:+.4f}, {hi:+.4f}]"
    ss, sci = slope(fs)
    so, _ = slope(fo)
    ex = fs.get("excess")
    excess = (f"{ex['per_kstep']:+.4f} [{ex['per_kstep_ci95'][0]:+.4f}, {ex['per_kstep_ci95'][1]:+.4f}] "
              f"{ex['verdict']}" if ex else "-")
    state = s["state_dtype"] + (f" + {s['read_copy_dtype']} copy" if s.get("read_copy_dtype") else "")
    rows.append([s["family"], s["regime"], s["arm"], state, str(s["buffer_len"] or "-"),
                 str(s["fold"] or "-"), f"{s['state_err'][-1]:.2e}", f"{max(s['state_err']):.2e}",
                 f"{s['o_err'][-1]:.2e}", ss, sci, fs.get("verdict", "-"),
                 f"{fs['rise_decades']:+.3f}" if fs else "-", so, excess])
  return rows


SUMMARY_HEADERS = ["family", "regime", "arm", "state", "L", "fold", "state err (last)", "state err (max)",
                   "out err (last)", "slope state (log10/kflush; conv /kstep)", "95% CI", "verdict",
                   "fitted rise (decades)", "slope out", "excess over conventional (log10/kstep, 95% CI)"]


def render(result: dict, *, markdown=False) -> str:
  return common.render_table(SUMMARY_HEADERS, summary_rows(result), markdown=markdown,
                             align_right={4, 6, 7, 8, 9, 12, 13})


# ----------------------------------------------------------------------------------------------
# CLI

def _csv(kind):
  return lambda text: tuple(kind(x) for x in text.split(",") if x)


def parse_args(argv):
  d = Options()
  p = argparse.ArgumentParser(prog="python -m bench.drift", description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="CPU-sized run (< 1 min): " + str(SMOKE))
  p.add_argument("--steps", type=int, default=None, help=f"decode steps per stream (default {d.steps})")
  p.add_argument("--rows", type=int, default=None)
  p.add_argument("--families", type=_csv(str), default=None, help="gdn,mamba2")
  p.add_argument("--regimes", type=_csv(str), default=None, help="typical,slow")
  p.add_argument("--dtypes", type=_csv(str), default=None, help="checkpoint dtypes: float32,bfloat16,float16")
  p.add_argument("--buffer-lens", type=_csv(int), default=None, help="L values (default 8,16,32)")
  p.add_argument("--folds", type=_csv(str), default=None, help="GDN fold modes, if the library has them")
  p.add_argument("--ring-dtype", default=None, help="ring dtype (default: the library's, = checkpoint dtype)")
  p.add_argument("--read-copy-dtypes", type=_csv(str), default=None,
                 help="replay arms over float32 checkpoints with a read copy of these dtypes (bfloat16,float16)")
  p.add_argument("--implementation", default=None, help="None (auto), xla, pallas_triton, ...")
  p.add_argument("--gdn-dims", type=_csv(int), default=None, help="Hk,Hv,K,V (default 2,4,64,64)")
  p.add_argument("--mamba2-dims", type=_csv(int), default=None, help="H,P,G,N (default 4,64,1,64)")
  p.add_argument("--log-samples", type=int, default=None)
  p.add_argument("--flush-samples", type=int, default=None)
  p.add_argument("--spec-tokens", type=int, default=None)
  p.add_argument("--spec-steps", type=int, default=None, help="verify steps of the speculative arm (0: off)")
  p.add_argument("--spec-dtypes", type=_csv(str), default=None, help="checkpoint dtypes of the speculative arm")
  p.add_argument("--spec-buffer-lens", type=_csv(int), default=None, help="L values of the speculative arm")
  p.add_argument("--spec-folds", type=_csv(str), default=None,
                 help="GDN fold modes of the speculative arm ('default': the library's)")
  p.add_argument("--model-tokens", type=int, default=None, help="tokens of the model-level check (0: off)")
  p.add_argument("--model-dtypes", type=_csv(str), default=None, help="checkpoint dtypes of the model check")
  p.add_argument("--seed", type=int, default=None)
  p.add_argument("--fit-skip", type=float, default=None, help="fraction of steps left out of the fits")
  p.add_argument("--max-seconds", type=float, default=None,
                 help="start no new arm after this much wall time (the JSON says what was skipped)")
  p.add_argument("--out-json", type=pathlib.Path, default=None,
                 help="default bench/results/drift_<date>.json (smoke: no file unless given)")
  p.add_argument("--markdown", action="store_true", help="print the summary table as markdown")
  p.add_argument("--git-commit", default=None)
  p.add_argument("--summarize", type=pathlib.Path, default=None,
                 help="print the summary table of an existing result JSON (excess slopes derived) and exit")
  args = p.parse_args(argv)
  fields = dict(SMOKE) if args.smoke else {}
  for f in dataclasses.fields(Options):
    v = getattr(args, f.name, None)
    if v is not None:
      fields[f.name] = v
  opts = Options(**fields)
  for name, allowed in (("families", FAMILIES), ("regimes", REGIMES), ("dtypes", DTYPES),
                        ("model_dtypes", DTYPES), ("spec_dtypes", DTYPES),
                        ("read_copy_dtypes", ("bfloat16", "float16"))):
    bad = [x for x in (getattr(opts, name) or ()) if x not in allowed]
    if bad:
      p.error(f"--{name} {bad}: expected some of {allowed}")
  if opts.steps < 1 or opts.rows < 1:
    p.error("--steps and --rows must be >= 1")
  return args, opts


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args, opts = parse_args(argv)
  if args.summarize:
    result = json.loads(args.summarize.read_text())
    print(render(result, markdown=args.markdown))
    return result
  rs.set_checks(False)
  meta = common.run_metadata(argv, "bench.drift", git_commit_override=args.git_commit)
  common.log(f"{meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}; "
             f"{opts.steps} steps, rows {opts.rows}, folds {fold_modes(opts)}")
  out = args.out_json
  if out is None and not args.smoke:
    out = common.BENCH_DIR / "results" / f"drift_{common.timestamp()}.json"
  result = study(opts, out_json=out, meta=meta)
  if out:
    print(f"json: {out}")
  print(render(result, markdown=args.markdown))
  return result


if __name__ == "__main__":
  main()
