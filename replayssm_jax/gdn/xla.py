"""Gated DeltaNet decode in plain XLA (jnp, float32 math at HIGHEST precision).

The fallback on every device and the readable statement of what the Pallas kernels compute.
Shapes: q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv]; pool [N, Hv, V, K]; slots int32[B].
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _slots
from replayssm_jax import replay
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.gdn.buffers import ReplayBuffers

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _per_v_head(x, num_v_heads):
  """[B, Hk, ...] → [B, Hv, ...]: value head h reads key head h // (Hv // Hk)."""
  return jnp.repeat(x, num_v_heads // x.shape[1], axis=1)


_gather = _slots.gather
_scatter_index = _slots.scatter_index


def _delta_step(S, q, k, v, g, beta, scale):
  """One exact GDN step from S = S_{t-1}: returns (o_t, u_t, S_t). All float32, [B, Hv, ...]."""
  alpha = jnp.exp(g)[..., None]
  Sk = jnp.einsum("bhvk,bhk->bhv", S, k, precision=HIGHEST)
  u = beta[..., None] * (v - alpha * Sk)
  S_new = alpha[..., None] * S + u[..., :, None] * k[..., None, :]
  o = jnp.einsum("bhvk,bhk->bhv", S_new, q * scale, precision=HIGHEST)
  return o, u, S_new


def decode(q, k, v, g, beta, pool, slots, *, scale):
  hv = pool.shape[1]
  S = _gather(pool, slots).astype(f32)
  qh, kh = _per_v_head(q.astype(f32), hv), _per_v_head(k.astype(f32), hv)
  o, _, S_new = _delta_step(S, qh, kh, v.astype(f32), g.astype(f32), beta.astype(f32), scale)
  idx = _scatter_index(slots, pool.shape[0])
  pool = pool.at[idx].set(S_new.astype(pool.dtype), mode="drop")
  o = jnp.where((slots >= 0)[:, None, None], o, 0.0)
  return o.astype(v.dtype), pool


def _window(bufs: ReplayBuffers, slots, base, length):
  """Gathered window of each row: (S_c, keys per value head, u, weights, total log decay)."""
  return replay.gather_window(bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g, slots, base, length)


_rebuild = replay.rebuild
_read = replay.read


def replay_decode(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, *, scale, route):
  hv = bufs.num_v_heads
  slots = plan.slots
  out_dtype = v.dtype
  qh = _per_v_head(q.astype(f32), hv) * scale
  kh = _per_v_head(k.astype(f32), hv)
  v, g, beta_ = v.astype(f32), g.astype(f32), beta.astype(f32)
  Sc, rk, ru, w, total = _window(bufs, slots, plan.base, plan.count)
  alpha = jnp.exp(g)[..., None]
  S_prev = _rebuild(Sc, rk, ru, w, total) if route == "reconstruct" else None
  if route == "reconstruct":
    Sk = jnp.einsum("bhvk,bhk->bhv", S_prev, kh, precision=HIGHEST)
    Sq = jnp.einsum("bhvk,bhk->bhv", S_prev, qh, precision=HIGHEST)
  else:
    Sk = _read(Sc, rk, ru, w, total, kh)
    Sq = _read(Sc, rk, ru, w, total, qh)
  u = beta_[..., None] * (v - alpha * Sk)
  o = alpha * Sq + u * jnp.sum(kh * qh, axis=-1, keepdims=True)
  valid = slots >= 0
  o = jnp.where(valid[:, None, None], o, 0.0)

  # Token 0 goes to ring index base + count on every live row (flushing rows fold it right away).
  idx = _scatter_index(slots, bufs.num_slots)
  pos = plan.write_index(0)
  ring_k = bufs.ring_k.at[idx, :, pos].set(k.astype(bufs.ring_k.dtype), mode="drop")
  ring_u = bufs.ring_u.at[idx, :, pos].set(u.astype(bufs.ring_u.dtype), mode="drop")
  ring_g = bufs.ring_g.at[idx, :, pos].set(g, mode="drop")

  # Flushing rows: checkpoint = α S_{t-1} + u kᵀ.
  if S_prev is None:
    S_prev = _rebuild(Sc, rk, ru, w, total)
  S_new = alpha[..., None] * S_prev + u[..., :, None] * kh[..., None, :]
  flush_idx = _scatter_index(jnp.where(plan.flush, slots, -1), bufs.num_slots)
  state = bufs.state.at[flush_idx].set(S_new.astype(bufs.state.dtype), mode="drop")
  return o.astype(out_dtype), bufs.replace(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)


def materialize(bufs: ReplayBuffers, slots, base, length):
  Sc, rk, ru, w, total = _window(bufs, slots, base, length)
  S = _rebuild(Sc, rk, ru, w, total)
  return jnp.where((slots >= 0)[:, None, None, None], S, 0.0)
