"""Mamba2 decode in plain XLA (jnp, float32 math at HIGHEST precision).

The fallback on every device and the readable statement of what the Pallas kernels compute.
Shapes: x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]; pool [N, H, P, N];
slots int32[B]. Head h reads group ``h // (H // G)``. Verify ops (speculative, T tokens per row)
put T after B: x, z [B, T, H, P]; dt [B, T, H]; B, C [B, T, G, N].

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
  pool = _slots.scatter_rows(pool, slots, S_new)
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
    # The readout from the read copy when there is one (the fold from the checkpoint).
    y = (jnp.exp(dA)[..., None] * replay.read(*_slots.readout_window(bufs, slots, win), Ch)
         + jnp.sum(Bh * Ch, axis=-1, keepdims=True) * dx)

  # Token 0 goes to ring index base + count on every live row (flushing rows fold it right away).
  idx = _slots.scatter_index(slots, bufs.num_slots)
  pos = plan.write_index(0)
  ring_x = bufs.ring_x.at[idx, :, pos].set(dx.astype(bufs.ring_x.dtype), mode="drop")
  ring_B = bufs.ring_B.at[idx, :, pos].set(B.astype(bufs.ring_B.dtype), mode="drop")
  ring_a = bufs.ring_a.at[idx, :, pos].set(dA, mode="drop")

  # Flushing rows: checkpoint = S_t (window and token 0 folded).
  flushing = jnp.where(plan.flush, slots, -1)
  bufs = bufs.replace(state=_slots.scatter_rows(bufs.state, flushing, S_new), ring_x=ring_x,
                      ring_B=ring_B, ring_a=ring_a)
  return _finish(y, x32, D, z, slots, x.dtype), _slots.refresh_read_copy(bufs, flushing)


def materialize(bufs: ReplayBuffers, slots, base, length):
  S = replay.rebuild(*_window(bufs, slots, base, length))
  return jnp.where((slots >= 0)[:, None, None, None], S, 0.0)


# ------------------------------------------------------------------------------------------------
# Speculative verify: T tokens per row, x, z [B, T, H, P]; dt [B, T, H]; B, C [B, T, G, N];
# lengths int32[B] real tokens per row (lanes t >= lengths are padding).


def _verify_inputs(x, dt, A, B, C, dt_bias, dt_softplus, lanes):
  """``_inputs`` over the B·T tokens, padded lanes zeroed (Δx = 0, ΔA = 0: no decay, no write).

  Returns float32 (x, Δx [B, T, H, P], ΔA [B, T, H], B and C per head [B, T, H, N]); a select, so
  NaN inputs in padded lanes cannot leak.
  """
  b, t = x.shape[:2]
  flat = lambda a: a.reshape((b * t,) + a.shape[2:])
  outs = _inputs(flat(x), flat(dt), A, flat(B), flat(C), dt_bias, dt_softplus)

  def clean(a):
    a = a.reshape((b, t) + a.shape[1:])
    return jnp.where(lanes.reshape(lanes.shape + (1,) * (a.ndim - 2)), a, 0.0)

  return tuple(map(clean, outs))


def _lanes(slots, lengths, t):
  """bool[B, T]: real tokens of live rows."""
  return (slots >= 0)[:, None] & (jnp.arange(t)[None, :] < lengths[:, None])


def _finish_tokens(y, x, D, z, lanes, dtype):
  """(y + D x) · silu(z) per token of [B, T, H, P], zeros on padded lanes, in ``dtype``."""
  y = _skip_and_gate(y, x, D, z, dtype=f32)
  return jnp.where(lanes[..., None, None], y, 0.0).astype(dtype)


def replay_verify(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, D, z, dt_bias,
                  dt_softplus):
  """Mamba2 Alg. 4: T tokens replayed from S_h = checkpoint ⊕ committed window under a causal mask.

  With L_s = Σ_{i≤s} Δ_i A over the tokens, S_s = e^{L_s} S_h + Σ_{s'≤s} e^{L_s−L_{s'}} Δx_{s'} B_{s'}ᵀ, so

      y_s = e^{L_s} (S_h C_s) + Σ_{s'≤s} e^{L_s−L_{s'}} (B_{s'}·C_s) Δx_{s'}      (then D skip, gate).

  Every token is appended at ``plan.write_index(i)``; flushing rows fold the committed window and
  token 0 only: checkpoint = e^{Δ_0 A} S_h + Δx_0 B_0ᵀ. A read copy is not read (verify replays
  from the float32 checkpoint, as without one); flushing rows write it with the checkpoint.
  """
  t = plan.num_tokens
  slots = plan.slots
  lanes = _lanes(slots, lengths, t)
  x32, dx, dA, Bh, Ch = _verify_inputs(x, dt, A, B, C, dt_bias, dt_softplus, lanes)
  heads_first = lambda a: jnp.moveaxis(a, 1, 2)                            # [B, T, H, ..] → [B, H, T, ..]
  dxh, dAh, Bhh, Chh = map(heads_first, (dx, dA, Bh, Ch))
  win = _window(bufs, slots, plan.base, plan.count)
  S_h = replay.rebuild(*win)
  Lc = jnp.cumsum(dAh, axis=-1)                                            # [B, H, T]
  causal = jnp.tril(jnp.ones((t, t), bool))
  # Mask the exponent, not the result: e^{L_s − L_s'} for s < s' may overflow.
  decay = jnp.exp(jnp.where(causal, Lc[..., :, None] - Lc[..., None, :], -jnp.inf))
  CB = jnp.einsum("bhsn,bhtn->bhst", Chh, Bhh, precision=HIGHEST)
  y = (jnp.exp(Lc)[..., None] * jnp.einsum("bhpn,bhtn->bhtp", S_h, Chh, precision=HIGHEST)
       + jnp.einsum("bhst,bhtp->bhsp", decay * CB, dxh, precision=HIGHEST))
  y = _finish_tokens(jnp.moveaxis(y, 2, 1), x32, D, z, lanes, x.dtype)

  idx = jnp.where(lanes, slots[:, None], bufs.num_slots)                   # [B, T], N = dropped
  pos = (plan.write_index(0)[:, None] + jnp.arange(t, dtype=jnp.int32)) % plan.ring_size
  put = lambda ring, a: ring.at[idx, :, pos].set(a.astype(ring.dtype), mode="drop")
  S_fold = _update(S_h, dAh[..., 0], dxh[..., 0, :], Bhh[..., 0, :])
  flushing = jnp.where(plan.flush, slots, -1)
  bufs = bufs.replace(state=_slots.scatter_rows(bufs.state, flushing, S_fold), ring_x=put(bufs.ring_x, dx),
                      ring_B=put(bufs.ring_B, B), ring_a=put(bufs.ring_a, dA))
  return y, _slots.refresh_read_copy(bufs, flushing)


def verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths, *, D, z, dt_bias, dt_softplus):
  """Conventional speculative verify: step each row's state token by token, keep every state.

  stack [N, T_max, H, P, N]: row b reads ``stack[slots[b], read_index[b]]`` and writes the state
  after token i to ``stack[slots[b], i]`` (real lanes only).
  """
  t = x.shape[1]
  lanes = _lanes(slots, lengths, t)
  x32, dx, dA, Bh, Ch = _verify_inputs(x, dt, A, B, C, dt_bias, dt_softplus, lanes)
  valid = slots >= 0
  S = stack[jnp.where(valid, slots, 0), jnp.where(valid, read_index, 0)].astype(f32)
  ys, states = [], []
  for i in range(t):  # T <= 8: unrolled
    S = _update(S, dA[:, i], dx[:, i], Bh[:, i])
    ys.append(jnp.einsum("bhpn,bhn->bhp", S, Ch[:, i], precision=HIGHEST))
    states.append(S)
  y = _finish_tokens(jnp.stack(ys, axis=1), x32, D, z, lanes, x.dtype)
  idx = jnp.where(lanes, slots[:, None], stack.shape[0])
  stack = stack.at[idx, jnp.arange(t)[None, :]].set(jnp.stack(states, axis=1).astype(stack.dtype),
                                                    mode="drop")
  return y, stack
