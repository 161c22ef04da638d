"""Probe (stacked pool of P layers): is the flush fold's cost per launch (one fold over all P layers) and does a one-product bf16
window (opt-in precision) buy speed?  Frozen windows as bench.gdn_breakdown."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp
from jax import lax
import replayssm_jax as rs
from replayssm_jax.pallas import fold_triton, gdn_triton, mamba2_triton
from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common as pc
from bench import common, gdn_breakdown

f32, bf16 = jnp.float32, jnp.bfloat16
OUT = os.environ.get("OUT", "/tmp")
ROWS = []
INTERP = pc.interpret_mode()
orig_product = fold_triton._window_product
orig_gdn_ffr, orig_m2_ffr = gdn_triton.fold_flushing_rows, mamba2_triton.fold_flushing_rows

def one_product(A, K, key_dtype):
  if jnp.dtype(key_dtype) != jnp.dtype(bf16) or min(*A.shape, K.shape[1]) < 16:
    return jnp.dot(A, K, precision=lax.Precision.HIGHEST)
  return jnp.dot(A.astype(bf16), K.astype(bf16), preferred_element_type=f32)

def timed(label, fn, carry, P):
  jax.clear_caches()
  call = jax.jit(lambda c, n: lax.fori_loop(0, n, lambda _, c: fn(c), c), donate_argnums=0)
  carry, t = common.time_loop(call, carry, reps=5, rep_seconds=0.2)
  s = t.ms_per(P)
  ROWS.append((label, s["median_ms"]))
  print(f"{label}: {s['median_ms']:.4f} ms per layer-step", flush=True)
  return carry

def gdn(B, L, sdt, P):
  bufs, cursor, xs, base, count = gdn_breakdown._setup(B, L, sdt, P)
  cfg = gdn_triton._replay_cfg("probe", bufs, B, L)
  slots_of = [jnp.arange(B, dtype=jnp.int32) + l * B for l in range(P)]
  flush = count == L - 1
  def plan(slots):
    return rs.ReplayPlan(slots=slots, base=base, count=count, flush=flush, num_tokens=1,
                         buffer_len=L, ring_size=cursor.ring_size)
  def steps(b):
    for s in slots_of:
      b = gdn_triton._replay_decode(*xs, b, plan(s), scale=128 ** -0.5, cfg=cfg, interpret=INTERP)[1]
    return b
  allslots = jnp.arange(B * P, dtype=jnp.int32)
  fl = jnp.tile(flush, P); bs = jnp.tile(base, P); ln = jnp.where(fl, L, 0)
  def merged(b):
    rows = jnp.nonzero(fl, size=B * P, fill_value=0)[0].astype(jnp.int32)
    return b.replace(state=fold_triton.fold(b.state, b.ring_k, b.ring_u, b.ring_g, allslots, bs, ln,
        rows, jnp.sum(fl), cfg=cfg.fold, row_slots=cfg.fold_rows * P, interpret=INTERP,
        into_checkpoint=True, name="probe_fold_merged", tiles_per_program=cfg.fold_tiles))
  def per_layer_fold(b):
    for s in slots_of:
      b = orig_gdn_ffr(b, plan(s), cfg=cfg, interpret=INTERP)
    return b
  ca = jax.jit(per_layer_fold)(jax.tree.map(jnp.copy, bufs)).state
  cb = jax.jit(merged)(jax.tree.map(jnp.copy, bufs)).state
  err = float(jnp.max(jnp.abs(ca.astype(f32) - cb.astype(f32))))
  print("merged fold vs per-layer folds: max abs diff", err, flush=True)
  assert err == 0.0, err
  tag = f"gdn {jnp.dtype(sdt).name} B={B} L={L} P={P}"
  print(tag, cfg.fold, cfg.fold_rows, cfg.fold_tiles, flush=True)
  c = jax.tree.map(jnp.copy, bufs)
  for prod_name, prod in (("3xbf16", orig_product), ("1xbf16", one_product)):
    fold_triton._window_product = prod
    gdn_triton.fold_flushing_rows = orig_gdn_ffr
    c = timed(f"{tag} {prod_name} step+fold per layer", steps, c, P)
    c = timed(f"{tag} {prod_name} fold per layer only", per_layer_fold, c, P)
    c = timed(f"{tag} {prod_name} fold merged only", merged, c, P)
    gdn_triton.fold_flushing_rows = lambda b, p, **kw: b
    c = timed(f"{tag} {prod_name} steps, then one merged fold", lambda b: merged(steps(b)), c, P)
    if prod_name == "3xbf16":
      c = timed(f"{tag} steps only (no fold)", steps, c, P)
  fold_triton._window_product = orig_product
  gdn_triton.fold_flushing_rows = orig_gdn_ffr

def mamba2(B, L, sdt, P):
  H, G, Pd, N = (128, 8, 64, 128) if not INTERP else (8, 2, 16, 32)
  n = B * P
  cursor = rs.ReplayCursor.create(n, buffer_len=L)
  bufs = rs.mamba2.ReplayBuffers.create(n, cursor, num_heads=H, head_dim=Pd, num_groups=G,
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
  flush = count == L - 1
  cfg = config_lib.mamba2_replay_config(device_kind=pc.device_kind(), state_dtype=bufs.state.dtype,
      head_dim=Pd, state_dim=N, num_heads=H, num_groups=G, batch=B, buffer_len=L,
      ring_size=bufs.ring_size, route="output_only")
  slots_of = [jnp.arange(B, dtype=jnp.int32) + l * B for l in range(P)]
  def plan(slots):
    return rs.ReplayPlan(slots=slots, base=base, count=count, flush=flush, num_tokens=1,
                         buffer_len=L, ring_size=cursor.ring_size)
  def steps(b):
    for s in slots_of:
      b = mamba2_triton._replay_decode(x, dt, A, Bm, Cm, b, plan(s), D, z, dt_bias,
                                       dt_softplus=True, cfg=cfg, interpret=INTERP)[1]
    return b
  allslots = jnp.arange(n, dtype=jnp.int32)
  fl = jnp.tile(flush, P); bs = jnp.tile(base, P); ln = jnp.where(fl, L, 0)
  def merged(b):
    rows = jnp.nonzero(fl, size=n, fill_value=0)[0].astype(jnp.int32)
    return b.replace(state=fold_triton.fold(b.state, b.ring_B, b.ring_x, b.ring_a, allslots, bs, ln,
        rows, jnp.sum(fl), cfg=cfg.fold, row_slots=cfg.fold_rows * P, interpret=INTERP,
        into_checkpoint=True, name="probe_m2_fold_merged", tiles_per_program=cfg.fold_tiles))
  def per_layer_fold(b):
    for s in slots_of:
      b = orig_m2_ffr(b, plan(s), cfg=cfg, interpret=INTERP)
    return b
  ca = jax.jit(per_layer_fold)(jax.tree.map(jnp.copy, bufs)).state
  cb = jax.jit(merged)(jax.tree.map(jnp.copy, bufs)).state
  err = float(jnp.max(jnp.abs(ca.astype(f32) - cb.astype(f32))))
  print("merged fold vs per-layer folds: max abs diff", err, flush=True)
  assert err == 0.0, err
  tag = f"mamba2 {jnp.dtype(sdt).name} B={B} L={L} P={P}"
  print(tag, cfg.fold, cfg.fold_rows, cfg.fold_tiles, flush=True)
  c = bufs
  prods = (("3xbf16", orig_product), ("1xbf16", one_product)) if L >= 16 else (("rank1", orig_product),)
  for prod_name, prod in prods:
    fold_triton._window_product = prod
    mamba2_triton.fold_flushing_rows = orig_m2_ffr
    c = timed(f"{tag} {prod_name} step+fold per layer", steps, c, P)
    c = timed(f"{tag} {prod_name} fold per layer only", per_layer_fold, c, P)
    c = timed(f"{tag} {prod_name} fold merged only", merged, c, P)
    mamba2_triton.fold_flushing_rows = lambda b, p, **kw: b
    c = timed(f"{tag} {prod_name} steps, then one merged fold", lambda b: merged(steps(b)), c, P)
    if prod_name != "1xbf16":
      c = timed(f"{tag} steps only (no fold)", steps, c, P)
  fold_triton._window_product = orig_product
  mamba2_triton.fold_flushing_rows = orig_m2_ffr

if __name__ == "__main__":
  which = sys.argv[1:] or ["gdn", "mamba2"]
  t0 = time.time()
  if "gdn" in which:
    gdn(256, 16, f32, 8)
    gdn(256, 16, bf16, 8)
  if "mamba2" in which:
    mamba2(256, 16, f32, 6)
    mamba2(256, 8, f32, 6)
  if "gdn24" in which:
    gdn(256, 16, f32, 24)
  print(f"\n{time.time() - t0:.0f} s")
  for label, ms in ROWS:
    print(f"{ms:8.4f}  {label}")
  json.dump(ROWS, open(os.path.join(OUT, "probe_fold.json"), "w"), indent=1)
