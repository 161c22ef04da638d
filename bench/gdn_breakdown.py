"""Where a ReplaySSM GDN step spends its time: the step pass, the flush-fold pass, conventional.

Not an honest-cycle benchmark (cursors do not advance; windows are frozen at a staggered spread
of lengths 0..L-1): a breakdown that times each pass of ``replay_decode`` on its own at one shape,
over P rotating layer pools like bench.gdn_decode. With ``--tokens T`` (T ≥ 2) the same for
``replay_verify``: fused and split step kernels with and without flushing rows, the readout
launch, the fold pass at the verify ring size, and the conventional speculative verify. The
decode breakdown also times the read-only floor of any output-only step: each row's checkpoint
read once per step (no ring, no store), as an XLA reduce fusion against q and as Pallas-Triton
streams of [BV, K] tiles at ``--stream-configs`` in two patterns: ``readout`` (one value head per
program, reduced against q) and ``step`` (the replay step's reads: the r value heads of a key head
per program, each tile reduced against q and k), the latter also as a native Triton kernel through
jax_triton at ``--native-stream-configs``. Run on a GPU:

    python -m bench.gdn_breakdown --batch 256 --buffer-len 16 --state-dtype float32
    python -m bench.gdn_breakdown --batch 256 --buffer-len 16 --tokens 4 --config bv32w4
"""
import argparse
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import replayssm_jax as rs
from bench import common, peer_common
from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common as pallas_common
from replayssm_jax.pallas import fold_triton, gdn_triton
from replayssm_jax.pallas import gdn_verify_triton

HK, HV, KD, VD = 16, 32, 128, 128
INTERPRET = pallas_common.interpret_mode()
LAYERS = 1
TIMING = {"reps": 7, "rep_seconds": 0.2}   # set from the command line by main


def _setup(batch, buffer_len, state_dtype, layers, seed=0, tokens=1):
  n = batch * layers
  cursor = rs.ReplayCursor.create(n, buffer_len=buffer_len, max_draft=tokens - 1)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, state_dtype=state_dtype, ring_dtype=jnp.bfloat16)
  key = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  bufs = bufs.replace(
      state=(0.05 * jax.random.normal(next(key), bufs.state.shape)).astype(state_dtype),
      ring_k=jax.random.normal(next(key), bufs.ring_k.shape).astype(jnp.bfloat16) * 0.09,
      ring_u=jax.random.normal(next(key), bufs.ring_u.shape).astype(jnp.bfloat16),
      ring_g=-jax.random.uniform(next(key), bufs.ring_g.shape, minval=0.01, maxval=0.5))
  lead = (batch,) if tokens == 1 else (batch, tokens)   # decode [B, ...]; verify [B, T, ...]
  q = jax.random.normal(next(key), lead + (HK, KD), jnp.bfloat16)
  k = (jax.random.normal(next(key), lead + (HK, KD)) * 0.09).astype(jnp.bfloat16)
  v = jax.random.normal(next(key), lead + (HV, VD), jnp.bfloat16)
  g = -jax.random.uniform(next(key), lead + (HV,), minval=0.01, maxval=0.5)
  beta = jax.nn.sigmoid(jax.random.normal(next(key), lead + (HV,))).astype(jnp.bfloat16)
  count = jnp.arange(batch, dtype=jnp.int32) % buffer_len
  base = (jnp.arange(batch, dtype=jnp.int32) * 7) % cursor.ring_size
  return bufs, cursor, (q, k, v, g, beta), base, count


def per_layer(fn, slots_of):
  """One step over all P layers: ``fn(buffers, slots)`` for each layer's slots in turn."""
  def step(b):
    for slots in slots_of:
      b = fn(b, slots)
    return b
  return step


def _time(fn, carry, label, rows, nbytes=None):
  """Times ``fn`` per layer-step; ``nbytes`` (bytes read per layer-step) adds the bandwidth."""
  call = jax.jit(lambda c, n: lax.fori_loop(0, n, lambda _, c: fn(c), c), donate_argnums=0)
  _, t = common.time_loop(call, carry, **TIMING)
  # One cycle = one step over all P layers: report per layer-step.
  s = t.ms_per(LAYERS)
  rows.append([label, f"{s['median_ms']:.4f}", f"{s['p20_ms']:.4f}-{s['p80_ms']:.4f}",
               "" if nbytes is None else f"{nbytes / s['median_ms'] / 1e6:.0f}"])
  common.log(f"{label}: {s['median_ms']:.4f} ms per layer-step")


def _stream_kernel(slots_ref, q_ref, k_ref, state_ref, o_ref, *, group, block_v, pattern):
  """The checkpoint bytes alone. ``readout``: grid (V/BV, Hv, B), o[b, h, tile] = S_c[slot, h,
  tile, :] · q[b, h // group]. ``step``: the replay step's read pattern, grid (V/BV, Hk, B), the
  ``group`` value heads of a key head per program, each tile reduced against q and k (two
  readouts, o = S·q + S·k/2 so neither is dead)."""
  vt, hp, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  tile = pl.ds(vt * block_v, block_v)
  heads = [hp] if pattern == "readout" else [hp * group + i for i in range(group)]
  for h in heads:
    S = state_ref[slots_ref[b], h, tile, :].astype(jnp.float32)
    o = jnp.sum(S * q_ref[b, h // group, :].astype(jnp.float32)[None, :], axis=1)
    if pattern == "step":
      o = o + 0.5 * jnp.sum(S * k_ref[b, h // group, :].astype(jnp.float32)[None, :], axis=1)
    o_ref[b, h, tile] = o


def stream_readout(q, k, state, slots, *, block_v, num_warps, pattern="readout"):
  """o [B, Hv, V] = S_c[slots] · q per value head (f32; ``pattern="step"`` adds S_c·k / 2), by a
  read-only Pallas-Triton stream."""
  kernel = functools.partial(_stream_kernel, group=HV // HK, block_v=block_v, pattern=pattern)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(kernel, grid=(VD // block_v, HV if pattern == "readout" else HK,
                                      slots.shape[0]), in_specs=[any_spec] * 4,
                        out_specs=any_spec, interpret=INTERPRET,
                        out_shape=jax.ShapeDtypeStruct((slots.shape[0], HV, VD), jnp.float32),
                        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
                        )(slots, q, k, state)


def stream_pass(q, k, *, block_v, num_warps, pattern):
  """The read-only stream as a pass ``fn(bufs, slots)``; o is fed back into one state element
  (neither dead code nor loop-invariant)."""
  def fn(b, slots):
    o = stream_readout(q, k, b.state, slots, block_v=block_v, num_warps=num_warps, pattern=pattern)
    return b.replace(state=b.state.at[0, 0, 0, 0].set(o[-1, -1, -1].astype(b.state.dtype)))
  return fn


@functools.cache
def _native_step_stream():
  """The ``step`` read pattern as a native Triton kernel (ours), for jax_triton: pointer arguments
  (slots, q, k, state, o), grid (V/BV, Hk, B)."""
  import triton  # noqa: PLC0415
  import triton.language as tl  # noqa: PLC0415

  @triton.jit
  def kernel(slots_ptr, q_ptr, k_ptr, s_ptr, o_ptr, HV: tl.constexpr, HK: tl.constexpr,
             V: tl.constexpr, K: tl.constexpr, BV: tl.constexpr):
    vt, hk, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = tl.load(slots_ptr + b).to(tl.int64)
    rv, rk = vt * BV + tl.arange(0, BV), tl.arange(0, K)
    q = tl.load(q_ptr + (b * HK + hk) * K + rk).to(tl.float32)
    k = tl.load(k_ptr + (b * HK + hk) * K + rk).to(tl.float32)
    for i in tl.static_range(HV // HK):
      h = hk * (HV // HK) + i
      S = tl.load(s_ptr + ((s * HV + h) * V + rv[:, None]) * K + rk[None, :])
      tl.store(o_ptr + (b * HV + h) * V + rv,
               tl.sum(S * q[None, :], axis=1) + 0.5 * tl.sum(S * k[None, :], axis=1))
  return kernel


def native_stream_pass(q, k, *, block_v, num_warps):
  """The ``step`` pattern in native Triton through jax_triton, as a pass ``fn(bufs, slots)``
  (raises peer_common.PeerUnavailable where jax_triton cannot run)."""
  jt = peer_common.import_jax_triton()
  kernel = _native_step_stream()

  def readout(state, slots):
    return jt.triton_call(slots, q, k, state, kernel=kernel,
                          out_shape=jax.ShapeDtypeStruct((slots.shape[0], HV, VD), jnp.float32),
                          grid=(VD // block_v, HK, slots.shape[0]), num_warps=num_warps,
                          num_stages=1, HV=HV, HK=HK, V=VD, K=KD, BV=block_v)

  def fn(b, slots):
    o = readout(b.state, slots)
    return b.replace(state=b.state.at[0, 0, 0, 0].set(o[-1, -1, -1].astype(b.state.dtype)))
  fn.readout = readout
  return fn


def xla_stream_pass(q, batch):
  """The same read-only reduction as one XLA reduce fusion over a contiguous slice of the pool."""
  qv = jnp.repeat(q.astype(jnp.float32), HV // HK, axis=1)                 # [B, Hv, K]

  def fn(b, slots):
    S = lax.dynamic_slice_in_dim(b.state, slots[0], batch, axis=0)
    o = jnp.sum(S.astype(jnp.float32) * qv[:, :, None, :], axis=-1)
    return b.replace(state=b.state.at[0, 0, 0, 0].set(o[-1, -1, -1].astype(b.state.dtype)))
  return fn


def verify_breakdown(B, L, T, P, sdt, knobs):
  """Each launch of ``replay_verify`` (T tokens per row) timed on its own, plus the baseline."""
  bufs, cursor, xs, base, count = _setup(B, L, sdt, P, tokens=T)
  count = jnp.minimum(count, L - 1)
  lengths = jnp.full((B,), T, jnp.int32)
  scale = KD ** -0.5
  slots_of = [jnp.arange(B, dtype=jnp.int32) + l * B for l in range(P)]
  natural = count + T > L - 1                      # the cursor's flush rule at T tokens
  plan_of = lambda slots, flush: rs.ReplayPlan(slots=slots, base=base, count=count, flush=flush,
                                               num_tokens=T, buffer_len=L, ring_size=cursor.ring_size)
  cfg = gdn_verify_triton.verify_cfg("breakdown", bufs, plan_of(slots_of[0], natural), B, **knobs)
  rows = []

  def verify(split, flushing):
    c = config_lib.VerifyConfig(step=cfg.step, readout=cfg.readout, split=split, fold=cfg.fold,
                                fold_rows=cfg.fold_rows)

    def fn(b, slots):
      plan = plan_of(slots, natural if flushing else jnp.zeros_like(natural))
      return gdn_verify_triton._replay_verify(*xs, b, plan, lengths, scale=scale, cfg=c,
                                              interpret=INTERPRET)[1]
    return fn

  def readout(b, slots):
    r = gdn_verify_triton._readout(xs[0], xs[1], b.state, slots, lengths, scale=scale,
                                   cfg=cfg.readout, interpret=INTERPRET)
    # One element fed back into the state: the launch is neither dead code nor loop-invariant
    # (XLA would hoist it out of the timing loop).
    return b.replace(state=b.state.at[0, 0, 0, 0].set(r[-1, -1, -1, -1].astype(b.state.dtype)))

  def fold(b, slots):
    return gdn_triton.fold_flushing_rows(b, plan_of(slots, natural), cfg=cfg, interpret=INTERPRET)

  stack = jnp.zeros((B * P, T, HV, VD, KD), sdt)
  read_index = jnp.zeros((B,), jnp.int32)

  def conventional(st):
    for l in range(P):
      st = gdn_verify_triton.verify_conventional(*xs, st, slots_of[l], read_index, lengths,
                                                 scale=scale)[1]
    return st

  flushing = int(jnp.sum(natural))
  for label, fn in ((f"verify fused, {flushing} flushing rows", verify(False, True)),
                    ("verify fused, no flushing row", verify(False, False)),
                    (f"verify split, {flushing} flushing rows", verify(True, True)),
                    ("verify split, no flushing row", verify(True, False)),
                    ("readout launch only", readout),
                    (f"fold pass only, {flushing} rows", fold)):
    _time(lambda c, fn=fn: per_layer(fn, slots_of)(c), jax.tree.map(jnp.copy, bufs), label, rows)
  _time(conventional, stack, "conventional speculative verify", rows)
  print(f"\nB={B} L={L} T={T} R={cursor.ring_size} state={sdt} P={P}\nstep {cfg.step}\n"
        f"readout {cfg.readout}\nfold {cfg.fold} fold_rows {cfg.fold_rows}")
  print(common.render_table(["pass", "ms/layer-step", "p20-p80", "GB/s read"], rows))


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.gdn_breakdown")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--buffer-len", type=int, default=16)
  p.add_argument("--tokens", type=int, default=1, help="T >= 2: break down replay_verify")
  p.add_argument("--state-dtype", default="float32")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--config", default="default", help="step launch config, e.g. bv64w2bk64")
  p.add_argument("--stream-configs", default="bv8w1,bv16w1,bv32w2,bv64w2,bv64w4",
                 help="[BV, K] tiles / warps of the read-only checkpoint stream ('' for none)")
  p.add_argument("--native-stream-configs", default="",
                 help="tiles / warps of the step pattern in native Triton through jax_triton, "
                      "e.g. bv8w1,bv64w8 ('' for none; skipped where jax_triton cannot run)")
  p.add_argument("--reps", type=int, default=7, help="timed calls per pass")
  p.add_argument("--rep-seconds", type=float, default=0.2, help="target seconds per timed call")
  args = p.parse_args(argv)
  global LAYERS
  TIMING.update(reps=args.reps, rep_seconds=args.rep_seconds)
  B, L, P, sdt = args.batch, args.buffer_len, args.layers, jnp.dtype(args.state_dtype)
  LAYERS = P
  if args.tokens > 1:
    return verify_breakdown(B, L, args.tokens, P, sdt, common.parse_config(args.config).kwargs())
  bufs, cursor, xs, base, count = _setup(B, L, sdt, P)
  kw = common.parse_config(args.config).kwargs()
  cfg = gdn_triton._replay_cfg("breakdown", bufs, B, L, **kw)
  scale = KD ** -0.5
  slots_of = [jnp.arange(B, dtype=jnp.int32) + l * B for l in range(P)]
  rows = []

  def replay(flush_every):
    def fn(b, slots):
      flush = (count == L - 1) if flush_every else jnp.zeros_like(count, bool)
      plan = rs.ReplayPlan(slots=slots, base=base, count=count, flush=flush, num_tokens=1,
                           buffer_len=L, ring_size=cursor.ring_size)
      return gdn_triton._replay_decode(*xs, b, plan, scale=scale, cfg=cfg,
                                       interpret=INTERPRET)[1]
    return fn

  def fold(active):
    def fn(b, slots):
      flush = (count == L - 1) if active else jnp.zeros_like(count, bool)
      rows = jnp.nonzero(flush, size=B, fill_value=0)[0].astype(jnp.int32)
      return b.replace(state=fold_triton.fold(
          b.state, b.ring_k, b.ring_u, b.ring_g, slots, base, jnp.where(flush, L, 0), rows,
          jnp.sum(flush), cfg=cfg.fold, row_slots=cfg.fold_rows, interpret=INTERPRET,
          into_checkpoint=True, name="replayssm_gdn_fold", tiles_per_program=cfg.fold_tiles))
    return fn

  def conventional(b, slots):
    return b.replace(state=rs.gdn.decode(*xs, b.state, slots, scale=scale,
                                         implementation="pallas_triton")[1])

  checkpoint_bytes = B * HV * VD * KD * sdt.itemsize     # what each read-only stream reads
  passes = [(f"replay step+fold, 1/{L} rows flush", replay(True), None),
            ("replay step+fold, no row flushes", replay(False), None),
            (f"fold pass only, 1/{L} rows fold {L} entries", fold(True), None),
            ("fold pass only, no active row", fold(False), None),
            ("conventional decode", conventional, None),
            ("checkpoint read only, XLA reduce", xla_stream_pass(xs[0], B), checkpoint_bytes)]
  for pattern in ("readout", "step"):
    for name in filter(None, args.stream_configs.split(",")):
      knobs = common.parse_config(name).kwargs()
      passes.append((f"checkpoint read only, Triton {name}, {pattern} pattern",
                     stream_pass(xs[0], xs[1], block_v=knobs.get("block_v", 16),
                                 num_warps=knobs.get("num_warps", 1), pattern=pattern),
                     checkpoint_bytes))
  for name in filter(None, args.native_stream_configs.split(",")):
    knobs = common.parse_config(name).kwargs()
    try:
      fn = native_stream_pass(xs[0], xs[1], block_v=knobs.get("block_v", 16),
                              num_warps=knobs.get("num_warps", 1))
    except peer_common.PeerUnavailable as e:
      common.log(f"native stream {name} skipped: {e}")
      continue
    # Gate: the native kernel computes what the Pallas step-pattern stream computes.
    want = stream_readout(xs[0], xs[1], bufs.state, slots_of[0], block_v=16, num_warps=1,
                          pattern="step")
    err = float(jnp.max(jnp.abs(fn.readout(bufs.state, slots_of[0]) - want)) / jnp.max(jnp.abs(want)))
    if not err < 1e-5:
      raise AssertionError(f"native stream {name}: relative error {err:.1e} against Pallas")
    passes.append((f"checkpoint read only, native Triton {name}, step pattern", fn,
                   checkpoint_bytes))
  for label, fn, nbytes in passes:
    _time(lambda c, fn=fn: per_layer(fn, slots_of)(c), jax.tree.map(jnp.copy, bufs), label, rows,
          nbytes)
  ceiling = common.measure_copy_ceiling(2 * 2**30 if not INTERPRET else 2**20)["gbps"]
  print(f"\ncopy ceiling {ceiling:.0f} GB/s (read + written)")
  print(f"B={B} L={L} state={sdt} P={P} step config {cfg.step} fold {cfg.fold} "
        f"({cfg.fold_tiles} tiles per program) route {cfg.route}")
  print(common.render_table(["pass", "ms/layer-step", "p20-p80", "GB/s read"], rows))
  return rows


if __name__ == "__main__":
  main()
