"""Probe 2: the fold deferred to the end of the step over per-layer pools (as in the model):
reordered per-layer folds vs one multi-layer fold launch (fold_triton.fold_flushing_layers)."""
import json, os, sys, time
import jax, jax.numpy as jnp
from jax import lax
import replayssm_jax as rs
from replayssm_jax.pallas import fold_triton, gdn_triton, mamba2_triton
from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common as pc
from bench import common, gdn_breakdown

f32, bf16 = jnp.float32, jnp.bfloat16
OUT = os.environ.get("OUT", "/tmp")
INTERP = pc.interpret_mode()
ROWS = []
orig = {m: m.fold_flushing_rows for m in (gdn_triton, mamba2_triton)}
REPS = dict(reps=5, rep_seconds=0.2)

def timed(label, fn, carry, P):
  jax.clear_caches()
  call = jax.jit(lambda c, n: lax.fori_loop(0, n, lambda _, c: fn(c), c), donate_argnums=0)
  t0 = time.time()
  call = call.lower(carry, 1).compile() if False else call
  carry, t = common.time_loop(call, carry, **REPS)
  s = t.ms_per(P)
  ROWS.append((label, s["median_ms"], t.warmup_s))
  print(f"{label}: {s['median_ms']:.4f} ms per layer-step (warm-up incl. compile {t.warmup_s:.1f} s)", flush=True)
  return carry

def run(tag, P, layer_bufs, step_fn, fold_one, fold_many, keys, mod, group_sizes):
  # correctness: deferred multi-layer fold == per-layer folds
  a = jax.jit(lambda bs: [fold_one(b) for b in bs])(jax.tree.map(jnp.copy, layer_bufs))
  b = jax.jit(fold_many)(jax.tree.map(jnp.copy, layer_bufs))
  err = max(float(jnp.max(jnp.abs(x.state.astype(f32) - y.state.astype(f32)))) for x, y in zip(a, b))
  print(tag, "multi-layer fold vs per-layer folds: max abs diff", err, flush=True)
  assert err == 0.0
  def per_layer(bs):
    return [step_fn(b) for b in bs]
  def steps(bs):
    mod.fold_flushing_rows = lambda b, p, **kw: b
    out = [step_fn(b) for b in bs]
    mod.fold_flushing_rows = orig[mod]
    return out
  c = layer_bufs
  c = timed(f"{tag} step+fold per layer", per_layer, c, P)
  c = timed(f"{tag} steps only", steps, c, P)
  c = timed(f"{tag} steps, then per-layer folds", lambda bs: [fold_one(b) for b in steps(bs)], c, P)
  for g in group_sizes:
    def grouped(bs, g=g):
      bs = steps(bs)
      out = []
      for i in range(0, len(bs), g):
        out += fold_many(bs[i:i + g])
      return out
    c = timed(f"{tag} steps, then multi-layer folds of {g}", grouped, c, P)
  return c

def gdn(B, L, sdt, P, groups):
  bufs, cursor, xs, base, count = gdn_breakdown._setup(B, L, sdt, 1)
  cfg = gdn_triton._replay_cfg("probe", bufs, B, L)
  slots = jnp.arange(B, dtype=jnp.int32)
  plan = rs.ReplayPlan(slots=slots, base=base, count=count, flush=count == L - 1, num_tokens=1,
                       buffer_len=L, ring_size=cursor.ring_size)
  layer_bufs = [jax.tree.map(lambda x, i=i: x + 0 if x.dtype != jnp.int32 else x, bufs) for i in range(P)]
  step_fn = lambda b: gdn_triton._replay_decode(*xs, b, plan, scale=128 ** -0.5, cfg=cfg, interpret=INTERP)[1]
  fold_one = lambda b: orig[gdn_triton](b, plan, cfg=cfg, interpret=INTERP)
  def fold_many(bs):
    states = fold_triton.fold_flushing_layers([(b.state, b.ring_k, b.ring_u, b.ring_g) for b in bs], plan,
        cfg=cfg.fold, row_slots=cfg.fold_rows, interpret=INTERP, name="replayssm_gdn_fold_layers",
        tiles_per_program=cfg.fold_tiles)
    return [b.replace(state=s) for b, s in zip(bs, states)]
  return run(f"gdn {jnp.dtype(sdt).name} B={B} L={L} P={P}", P, layer_bufs, step_fn, fold_one, fold_many,
             None, gdn_triton, groups)

def mamba2(B, L, sdt, P, groups):
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
  fold_one = lambda b: orig[mamba2_triton](b, plan, cfg=cfg, interpret=INTERP)
  def fold_many(bs):
    states = fold_triton.fold_flushing_layers([(b.state, b.ring_B, b.ring_x, b.ring_a) for b in bs], plan,
        cfg=cfg.fold, row_slots=cfg.fold_rows, interpret=INTERP, name="replayssm_mamba2_fold_layers",
        tiles_per_program=cfg.fold_tiles)
    return [b.replace(state=s) for b, s in zip(bs, states)]
  return run(f"mamba2 {jnp.dtype(sdt).name} B={B} L={L} P={P}", P, layer_bufs, step_fn, fold_one,
             fold_many, None, mamba2_triton, groups)

if __name__ == "__main__":
  t0 = time.time()
  gdn(256, 16, f32, 8, (8, 4))
  gdn(256, 16, bf16, 8, (8,))
  mamba2(256, 16, f32, 6, (6,))
  mamba2(256, 8, f32, 6, (6,))
  gdn(256, 16, f32, 24, (24,))
  print(f"\n{time.time() - t0:.0f} s")
  for label, ms, warm in ROWS:
    print(f"{ms:8.4f}  {label}  (warm-up {warm:.0f} s)")
  json.dump(ROWS, open(os.path.join(OUT, "probe_fold2.json"), "w"), indent=1)
