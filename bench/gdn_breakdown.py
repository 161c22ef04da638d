"""Where a ReplaySSM GDN step spends its time: the step pass, the flush-fold pass, conventional.

Not an honest-cycle benchmark (cursors do not advance; windows are frozen at a staggered spread
of lengths 0..L-1): a breakdown that times each pass of ``replay_decode`` on its own at one shape,
over P rotating layer pools like bench.gdn_decode. Run on a GPU:

    python -m bench.gdn_breakdown --batch 256 --buffer-len 16 --state-dtype float32
"""
import argparse

import jax
import jax.numpy as jnp
from jax import lax

import replayssm_jax as rs
from bench import common
from replayssm_jax.pallas import common as pallas_common
from replayssm_jax.pallas import gdn_triton

HK, HV, KD, VD = 16, 32, 128, 128
INTERPRET = pallas_common.interpret_mode()
LAYERS = 1


def _setup(batch, buffer_len, state_dtype, layers, seed=0):
  n = batch * layers
  cursor = rs.ReplayCursor.create(n, buffer_len=buffer_len)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, state_dtype=state_dtype, ring_dtype=jnp.bfloat16)
  key = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
  bufs = bufs.replace(
      state=(0.05 * jax.random.normal(next(key), bufs.state.shape)).astype(state_dtype),
      ring_k=jax.random.normal(next(key), bufs.ring_k.shape).astype(jnp.bfloat16) * 0.09,
      ring_u=jax.random.normal(next(key), bufs.ring_u.shape).astype(jnp.bfloat16),
      ring_g=-jax.random.uniform(next(key), bufs.ring_g.shape, minval=0.01, maxval=0.5))
  q = jax.random.normal(next(key), (batch, HK, KD), jnp.bfloat16)
  k = (jax.random.normal(next(key), (batch, HK, KD)) * 0.09).astype(jnp.bfloat16)
  v = jax.random.normal(next(key), (batch, HV, VD), jnp.bfloat16)
  g = -jax.random.uniform(next(key), (batch, HV), minval=0.01, maxval=0.5)
  beta = jax.nn.sigmoid(jax.random.normal(next(key), (batch, HV))).astype(jnp.bfloat16)
  count = jnp.arange(batch, dtype=jnp.int32) % buffer_len
  base = (jnp.arange(batch, dtype=jnp.int32) * 7) % cursor.ring_size
  return bufs, cursor, (q, k, v, g, beta), base, count


def _time(fn, carry, label, rows):
  call = jax.jit(lambda c, n: lax.fori_loop(0, n, lambda _, c: fn(c), c), donate_argnums=0)
  _, t = common.time_loop(call, carry, reps=7, rep_seconds=0.2)
  # One cycle = one step over all P layers: report per layer-step.
  med, p20, p80 = (x / LAYERS for x in common.quantiles(t.per_cycle()))
  rows.append([label, f"{med * 1e3:.4f}", f"{p20 * 1e3:.4f}-{p80 * 1e3:.4f}"])
  common.log(f"{label}: {med * 1e3:.4f} ms per layer-step")


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.gdn_breakdown")
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--buffer-len", type=int, default=16)
  p.add_argument("--state-dtype", default="float32")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--config", default="default", help="step launch config, e.g. bv64w2bk64")
  args = p.parse_args(argv)
  global LAYERS
  B, L, P, sdt = args.batch, args.buffer_len, args.layers, jnp.dtype(args.state_dtype)
  LAYERS = P
  bufs, cursor, xs, base, count = _setup(B, L, sdt, P)
  kw = common.parse_config(args.config).kwargs()
  cfg = gdn_triton._replay_cfg("breakdown", bufs, B, L, **kw)
  scale = KD ** -0.5
  slots_of = [jnp.arange(B, dtype=jnp.int32) + l * B for l in range(P)]
  rows = []

  def per_layer(fn):
    def step(b):
      for l in range(P):
        b = fn(b, slots_of[l])
      return b
    return step

  def replay(flush_every):
    def fn(b, slots):
      flush = (count == L - 1) if flush_every else jnp.zeros_like(count, bool)
      plan = rs.ReplayPlan(slots=slots, base=base, count=count, flush=flush, num_tokens=1,
                           buffer_len=L, ring_size=cursor.ring_size)
      return gdn_triton._replay_decode(*xs, b, plan, scale=scale, route=cfg.route, cfg=cfg,
                                       interpret=INTERPRET)[1]
    return fn

  def fold(active):
    def fn(b, slots):
      flush = (count == L - 1) if active else jnp.zeros_like(count, bool)
      rows = jnp.nonzero(flush, size=B, fill_value=0)[0].astype(jnp.int32)
      return b.replace(state=gdn_triton._fold(
          b, slots, base, jnp.where(flush, L, 0), rows, jnp.sum(flush), cfg=cfg.fold,
          row_slots=cfg.fold_rows, interpret=INTERPRET, into_checkpoint=True))
    return fn

  def conventional(b, slots):
    return b.replace(state=rs.gdn.decode(*xs, b.state, slots, scale=scale,
                                         implementation="pallas_triton")[1])

  for label, fn in ((f"replay step+fold, 1/{L} rows flush", replay(True)),
                    ("replay step+fold, no row flushes", replay(False)),
                    (f"fold pass only, 1/{L} rows fold {L} entries", fold(True)),
                    ("fold pass only, no active row", fold(False)),
                    ("conventional decode", conventional)):
    _time(lambda c, fn=fn: per_layer(fn)(c), jax.tree.map(jnp.copy, bufs), label, rows)
  print(f"\nB={B} L={L} state={sdt} P={P} step config {cfg.step} fold {cfg.fold} route {cfg.route}")
  print(common.render_table(["pass", "ms/layer-step", "p20-p80"], rows))


if __name__ == "__main__":
  main()
