"""Probe 3: the flush fold on a second CUDA stream (compute_on("gpu_stream:1"), XLA flag
--xla_gpu_experimental_stream_annotation), overlapping the next layer's work."""
import json, os, sys, time
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on
import replayssm_jax as rs
from replayssm_jax.pallas import fold_triton, gdn_triton, mamba2_triton
from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common as pc
from bench import common, gdn_breakdown

f32, bf16 = jnp.float32, jnp.bfloat16
OUT = os.environ.get("OUT", "/tmp")
INTERP = pc.interpret_mode()
ROWS = []
FOLD_ARGS = []
UNROLL = int(os.environ.get("UNROLL", "0"))
REPS = dict(reps=5, rep_seconds=0.2)
orig = {m: m.fold_flushing_rows for m in (gdn_triton, mamba2_triton)}

def timed(label, fn, carry, P):
  jax.clear_caches()
  if UNROLL:
    one = jax.jit(lambda c: [c := fn(c) for _ in range(UNROLL)][-1], donate_argnums=0)
    def call(c, n):
      for _ in range(n):
        c = one(c)
      return c
    P = P * UNROLL
  else:
    call = jax.jit(lambda c, n: lax.fori_loop(0, n, lambda _, c: fn(c), c), donate_argnums=0)
  carry, t = common.time_loop(call, carry, **REPS)
  s = t.ms_per(P)
  ROWS.append((label, s["median_ms"]))
  print(f"{label}: {s['median_ms']:.4f} ms per layer-step", flush=True)
  return carry

def run(tag, P, layer_bufs, step_fn, fold_state, mod, names, D):
  key = jax.random.PRNGKey(1)
  W = (jax.random.normal(key, (D, 4 * D)) * 0.02).astype(bf16)
  X = jax.random.normal(key, (256, D), bf16)
  def stepped(bs, *, stream, gemm, fold=True):
    out = []
    h = X
    mod.fold_flushing_rows = lambda b, p, **kw: b
    for b in bs:
      if gemm:   # stand-in for the layer's projections / MLP (compute on the main stream)
        h = (jnp.dot(h, W, preferred_element_type=f32)[:, :D] * 1e-3).astype(bf16)
      b = step_fn(b)
      if fold:
        parts = tuple(getattr(b, n) for n in names)
        f = (compute_on(fold_state, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)
             if stream else fold_state)
        b = b.replace(state=f(*parts, *FOLD_ARGS))
      out.append(b)
    mod.fold_flushing_rows = orig[mod]
    if gemm:   # keep the GEMM chain live
      out[0] = out[0].replace(state=out[0].state.at[0, 0, 0, 0].add(h[0, 0].astype(out[0].state.dtype) * 0))
    return out
  # correctness: three steps on the main stream vs with the fold on stream 1, bit for bit
  ref = layer_bufs
  a = jax.jit(lambda bs: stepped(stepped(stepped(bs, stream=False, gemm=True), stream=False, gemm=True), stream=False, gemm=True))(jax.tree.map(jnp.copy, ref))
  b = jax.jit(lambda bs: stepped(stepped(stepped(bs, stream=True, gemm=True), stream=True, gemm=True), stream=True, gemm=True))(jax.tree.map(jnp.copy, ref))
  err = max(float(jnp.max(jnp.abs(x.astype(f32) - y.astype(f32)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  print(tag, "fold on stream 1 vs main stream, 3 steps: max abs diff", err, flush=True)
  hlo = jax.jit(lambda bs: stepped(bs, stream=True, gemm=False)).lower(ref).compile().as_text()
  print(tag, "compiled HLO: call-start", hlo.count("call-start"), "async-start", hlo.count("async-start"),
        "annotations", hlo.count("_xla_stream_annotation"), flush=True)
  open(os.path.join(OUT, "hlo_stream.txt"), "w").write(hlo)
  c = layer_bufs
  for gemm in (False, True):
    g = " +GEMM" if gemm else ""
    c = timed(f"{tag}{g} step+fold, one stream", lambda bs: stepped(bs, stream=False, gemm=gemm), c, P)
    c = timed(f"{tag}{g} step, fold on stream 1", lambda bs: stepped(bs, stream=True, gemm=gemm), c, P)
    c = timed(f"{tag}{g} step only", lambda bs: stepped(bs, stream=False, gemm=gemm, fold=False), c, P)
  return c

def gdn(B, L, sdt, P):
  bufs, cursor, xs, base, count = gdn_breakdown._setup(B, L, sdt, 1)
  cfg = gdn_triton._replay_cfg("probe", bufs, B, L)
  plan = rs.ReplayPlan(slots=jnp.arange(B, dtype=jnp.int32), base=base, count=count,
                       flush=count == L - 1, num_tokens=1, buffer_len=L, ring_size=cursor.ring_size)
  layer_bufs = [jax.tree.map(lambda x: x + 0 if x.dtype != jnp.int32 else x, bufs) for _ in range(P)]
  step_fn = lambda b: gdn_triton._replay_decode(*xs, b, plan, scale=128 ** -0.5, cfg=cfg, interpret=INTERP)[1]
  def fold_state(state, rk, ru, rg, slots, base, length, rows, num_rows):
    return fold_triton.fold(state, rk, ru, rg, slots, base, length, rows, num_rows, cfg=cfg.fold,
        row_slots=cfg.fold_rows, interpret=INTERP, into_checkpoint=True, name="replayssm_gdn_fold",
        tiles_per_program=cfg.fold_tiles)
  FOLD_ARGS[:] = [plan.slots, plan.base, plan.fold_length(), fold_triton.compact_rows(plan.flush),
                  jnp.reshape(jnp.sum(plan.flush), (1,)).astype(jnp.int32)]
  return run(f"gdn {jnp.dtype(sdt).name} B={B} L={L} P={P}", P, layer_bufs, step_fn, fold_state, gdn_triton,
             ("state", "ring_k", "ring_u", "ring_g"), 2560)

def mamba2(B, L, sdt, P):
  H, G, Pd, N = (128, 8, 64, 128) if not INTERP else (8, 2, 16, 32)
  cursor = rs.ReplayCursor.create(B, buffer_len=L)
  bufs = rs.mamba2.ReplayBuffers.create(B, cursor, num_heads=H, head_dim=Pd, num_groups=G,
                                        state_dim=N, state_dtype=sdt, ring_dtype=bf16)
  key = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  bufs = bufs.replace(state=(0.05 * jax.random.normal(next(key), bufs.state.shape)).astype(sdt),
                      ring_x=jax.random.normal(next(key), bufs.ring_x.shape).astype(bf16),
                      ring_B=jax.random.normal(next(key), bufs.ring_B.shape).astype(bf16) * 0.09,
                      ring_a=-jax.random.uniform(next(key), bufs.ring_a.shape, minval=0.01, maxval=0.5))
  x = jax.random.normal(next(key), (B, H, Pd), bf16)
  dt = jax.random.normal(next(key), (B, H), bf16)
  A = -jnp.exp(jax.random.uniform(next(key), (H,), minval=0.0, maxval=2.0))
  Bm = (jax.random.normal(next(key), (B, G, N)) * 0.09).astype(bf16)
  Cm = jax.random.normal(next(key), (B, G, N), bf16)
  D = jnp.ones((H,), f32); z = jax.random.normal(next(key), (B, H, Pd), bf16)
  dt_bias = jnp.zeros((H,), f32)
  count = jnp.arange(B, dtype=jnp.int32) % L
  base = (jnp.arange(B, dtype=jnp.int32) * 7) % cursor.ring_size
  plan = rs.ReplayPlan(slots=jnp.arange(B, dtype=jnp.int32), base=base, count=count, flush=count == L - 1,
                       num_tokens=1, buffer_len=L, ring_size=cursor.ring_size)
  cfg = config_lib.mamba2_replay_config(device_kind=pc.device_kind(), state_dtype=bufs.state.dtype,
      head_dim=Pd, state_dim=N, num_heads=H, num_groups=G, batch=B, buffer_len=L,
      ring_size=bufs.ring_size, route="output_only")
  layer_bufs = [jax.tree.map(lambda x: x + 0 if x.dtype != jnp.int32 else x, bufs) for _ in range(P)]
  step_fn = lambda b: mamba2_triton._replay_decode(x, dt, A, Bm, Cm, b, plan, D, z, dt_bias,
                                                   dt_softplus=True, cfg=cfg, interpret=INTERP)[1]
  def fold_state(state, rB, rx, ra, slots, base, length, rows, num_rows):
    return fold_triton.fold(state, rB, rx, ra, slots, base, length, rows, num_rows, cfg=cfg.fold,
        row_slots=cfg.fold_rows, interpret=INTERP, into_checkpoint=True, name="replayssm_mamba2_fold",
        tiles_per_program=cfg.fold_tiles)
  FOLD_ARGS[:] = [plan.slots, plan.base, plan.fold_length(), fold_triton.compact_rows(plan.flush),
                  jnp.reshape(jnp.sum(plan.flush), (1,)).astype(jnp.int32)]
  return run(f"mamba2 {jnp.dtype(sdt).name} B={B} L={L} P={P}", P, layer_bufs, step_fn, fold_state,
             mamba2_triton, ("state", "ring_B", "ring_x", "ring_a"), 4096)

if __name__ == "__main__":
  print("XLA_FLAGS", os.environ.get("XLA_FLAGS"))
  t0 = time.time()
  which = sys.argv[1:] or ["gdn", "mamba2"]
  if "gdn" in which:
    gdn(256, 16, f32, 8)
  if "mamba2" in which:
    mamba2(256, 16, f32, 6)
  print(f"\n{time.time() - t0:.0f} s")
  for label, ms in ROWS:
    print(f"{ms:8.4f}  {label}")
  json.dump(ROWS, open(os.path.join(OUT, "probe_stream.json"), "w"), indent=1)
