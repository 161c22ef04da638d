"""Mamba2 decode in plain XLA (jnp, float32 math at HIGHEST precision).

The fallback on every device and the readable statement of what the Pallas kernels compute.
Shapes: x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]; pool [N, H, P, N];
slots int32[B]. Head h reads group ``h // (H // G)``.

The ring holds (Δ·x, B, Δ·A), the Mamba2 form of the shared "(u, k, g)" replay ring, so the
window replay (``replay.gather_window`` / ``rebuild`` / ``read``) is the one GDN uses.
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _slots
from replayssm_jax import replay
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.mamba2.buffers import ReplayBuffers
from replayssm_jax.mamba2.reference import _delta, _skip_and_gate

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _inputs(x, dt, A, B, C, dt_bias, dt_softplus):
  """float32 (x, Δ·x [B, H, P], Δ·A [B, H], B and C per head [B, H, N])."""
  heads = x.shape[1]
  x = x.astype(f32)
  delta = _delta(dt.astype(f32), None if dt_bias is None else dt_bias.astype(f32), softplus=dt_softplus)
  per_head = lambda a: jnp.repeat(a.astype(f32), heads // a.shape[1], axis=1)
  return x, delta[..., None] * x, delta * A.astype(f32), per_head(B), per_head(C)


def _finish(y, x, D, z, slots, dtype):
  """(y + D x) · silu(z), zeros on padding rows, in ``dtype``."""
  y = _skip_and_gate(y, x, D, z, dtype=f32)
  return jnp.where((slots >= 0)[:, None, None], y, 0.0).astype(dtype)


def _update(S, dA, dx, Bh):
  """a S + Δx Bᵀ with a = exp(ΔA)."""
  return jnp.exp(dA)[..., None, None] * S + dx[..., :, None] * Bh[..., None, :]


def decode(x, dt, A, B, C, pool, slots, *, D, z, dt_bias, dt_softplus):
  x32, dx, dA, Bh, Ch = _inputs(x, dt, A, B, C, dt_bias, dt_softplus)
  S_new = _update(_slots.gather(pool, slots).astype(f32), dA, dx, Bh)
  y = jnp.einsum("bhpn,bhn->bhp", S_new, Ch, precision=HIGHEST)
  pool = pool.at[_slots.scatter_index(slots, pool.shape[0])].set(S_new.astype(pool.dtype), mode="drop")
  return _finish(y, x32, D, z, slots, x.dtype), pool


def _window(bufs: ReplayBuffers, slots, base, length):
  """(S_c, B per head, Δx, weights, total log decay) of each row's window."""
  return replay.gather_window(bufs.state, bufs.ring_B, bufs.ring_x, bufs.ring_a, slots, base, length)


def replay_decode(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, *, D, z, dt_bias, dt_softplus,
                  route):
  slots = plan.slots
  x32, dx, dA, Bh, Ch = _inputs(x, dt, A, B, C, dt_bias, dt_softplus)
  win = _window(bufs, slots, plan.base, plan.count)
  S_prev = replay.rebuild(*win)
  S_new = _update(S_prev, dA, dx, Bh)
  if route == "reconstruct":
    y = jnp.einsum("bhpn,bhn->bhp", S_new, Ch, precision=HIGHEST)
  else:  # S_t C = a (S_{t-1} C) + (B_t·C) Δx_t, with S_{t-1} C read from checkpoint and ring
    y = (jnp.exp(dA)[..., None] * replay.read(*win, Ch)
         + jnp.sum(Bh * Ch, axis=-1, keepdims=True) * dx)

  # Token 0 goes to ring index base + count on every live row (flushing rows fold it right away).
  idx = _slots.scatter_index(slots, bufs.num_slots)
  pos = plan.write_index(0)
  ring_x = bufs.ring_x.at[idx, :, pos].set(dx.astype(bufs.ring_x.dtype), mode="drop")
  ring_B = bufs.ring_B.at[idx, :, pos].set(B.astype(bufs.ring_B.dtype), mode="drop")
  ring_a = bufs.ring_a.at[idx, :, pos].set(dA, mode="drop")

  # Flushing rows: checkpoint = S_t (window and token 0 folded).
  flush_idx = _slots.scatter_index(jnp.where(plan.flush, slots, -1), bufs.num_slots)
  state = bufs.state.at[flush_idx].set(S_new.astype(bufs.state.dtype), mode="drop")
  return (_finish(y, x32, D, z, slots, x.dtype),
          bufs.replace(state=state, ring_x=ring_x, ring_B=ring_B, ring_a=ring_a))


def materialize(bufs: ReplayBuffers, slots, base, length):
  S = replay.rebuild(*_window(bufs, slots, base, length))
  return jnp.where((slots >= 0)[:, None, None, None], S, 0.0)
