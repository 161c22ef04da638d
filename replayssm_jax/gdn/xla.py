"""Gated DeltaNet decode in plain XLA (jnp, float32 math at HIGHEST precision).

The fallback on every device and the readable statement of what the Pallas kernels compute.
Shapes: q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv]; pool [N, Hv, V, K]; slots int32[B].
Verify ops (speculative, T tokens per row) put T after B: q, k [B, T, Hk, K], v [B, T, Hv, V], ...
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _slots
from replayssm_jax import replay
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.gdn.buffers import ReplayBuffers
from replayssm_jax.gdn.reference import _unit_lower_solve

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _per_v_head(x, num_v_heads):
  """[B, Hk, ...] → [B, Hv, ...]: value head h reads key head h // (Hv // Hk)."""
  return jnp.repeat(x, num_v_heads // x.shape[1], axis=1)


_gather = _slots.gather


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
  pool = _slots.scatter_rows(pool, slots, S_new)
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
  else:   # the readouts come from the read copy when there is one (the fold from the checkpoint)
    read = _slots.readout_window(bufs, slots, (Sc, rk, ru, w, total))
    Sk = _read(*read, kh)
    Sq = _read(*read, qh)
  u = beta_[..., None] * (v - alpha * Sk)
  o = alpha * Sq + u * jnp.sum(kh * qh, axis=-1, keepdims=True)
  valid = slots >= 0
  o = jnp.where(valid[:, None, None], o, 0.0)

  # Token 0 goes to ring index base + count on every live row (flushing rows fold it right away).
  # Flushing rows, fold="u": checkpoint = α S_{t-1} + u kᵀ.
  if bufs.fold == "u" and S_prev is None:
    S_prev = _rebuild(Sc, rk, ru, w, total)
  S_fold = alpha[..., None] * S_prev + u[..., :, None] * kh[..., None, :] if bufs.fold == "u" else None
  expand = lambda x: x[:, None]
  bufs = _append_and_fold(bufs, plan, valid[:, None], *map(expand, (k, u, g, v, beta_)), S_fold,
                          fold=bufs.fold)
  return o.astype(out_dtype), bufs


def _append_and_fold(bufs: ReplayBuffers, plan: ReplayPlan, lanes, k, u, g, v, beta, S_fold, *, fold):
  """Writes a step's T tokens to the ring and folds flushing rows into their checkpoint.

  Token i of row b goes to ring index ``plan.write_index(i)``; lanes that are False (padding rows,
  padded draft lanes) write nothing. Buffers with the exact layout also store raw v and β.
  Flushing rows then fold ``plan.fold_length()`` entries (committed window + token 0): with
  fold="u" the caller's ``S_fold`` [B, Hv, V, K]; with fold="exact" the recurrence over the raw
  ring entries (token 0 included, just written).

  Args:
    lanes: bool[B, T]; k [B, T, Hk, K]; u, v [B, T, Hv, V]; g, beta [B, T, Hv] (float32).
  """
  t = lanes.shape[1]
  idx = jnp.where(lanes, plan.slots[:, None], bufs.num_slots)                # [B, T], N = dropped
  pos = (plan.write_index(0)[:, None] + jnp.arange(t, dtype=jnp.int32)) % plan.ring_size  # [B, T]
  put = lambda ring, x: ring.at[idx, :, pos].set(x.astype(ring.dtype), mode="drop")
  new = dict(ring_k=put(bufs.ring_k, k), ring_u=put(bufs.ring_u, u), ring_g=put(bufs.ring_g, g))
  if bufs.fold == "exact":
    new.update(ring_v=put(bufs.ring_v, v), ring_beta=put(bufs.ring_beta, beta))
  bufs = bufs.replace(**new)
  if fold == "exact":
    S_fold = _exact_replay(bufs, plan.slots, plan.base, plan.fold_length())
  flushing = jnp.where(plan.flush, plan.slots, -1)
  bufs = bufs.replace(state=_slots.scatter_rows(bufs.state, flushing, S_fold))
  return _slots.refresh_read_copy(bufs, flushing)


def _exact_replay(bufs: ReplayBuffers, slots, base, length):
  """Checkpoint ⊕ window by the delta-rule recurrence over the raw ring (fold="exact").

  Steps the window's ``length`` entries from ``base`` in order, with ``gdn.recurrent``'s op order:
  S̃ = α S, u = β(v − S̃ k), S = S̃ + u kᵀ. Rows past their length keep their state (a select, so
  stale or NaN ring cells outside the window cannot leak). Returns float32 [B, Hv, V, K].
  """
  hv, ring_size = bufs.num_v_heads, bufs.ring_size
  S = _gather(bufs.state, slots).astype(f32)
  rk = _per_v_head(_gather(bufs.ring_k, slots).astype(f32), hv)            # [B, Hv, R, K]
  rv = _gather(bufs.ring_v, slots).astype(f32)                            # [B, Hv, R, V]
  rg, rb = _gather(bufs.ring_g, slots), _gather(bufs.ring_beta, slots)    # [B, Hv, R]

  def entry(ring, pos):
    """ring[b, :, pos[b]] for every row b."""
    return jnp.take_along_axis(ring, pos.reshape((-1,) + (1,) * (ring.ndim - 1)), axis=2)[:, :, 0]

  def step(j, S):
    pos = (base + j) % ring_size
    k, v, g, beta = entry(rk, pos), entry(rv, pos), entry(rg, pos), entry(rb, pos)
    S_t = jnp.exp(g)[..., None, None] * S                                  # S̃ = α S
    u = beta[..., None] * (v - jnp.einsum("bhvk,bhk->bhv", S_t, k, precision=HIGHEST))
    S_t = S_t + u[..., :, None] * k[..., None, :]
    return jnp.where((j < length)[:, None, None, None], S_t, S)

  return jax.lax.fori_loop(0, jnp.max(length, initial=0), step, S)


def materialize(bufs: ReplayBuffers, slots, base, length):
  if bufs.fold == "exact":
    S = _exact_replay(bufs, slots, base, length)
  else:
    S = _rebuild(*_window(bufs, slots, base, length))
  return jnp.where((slots >= 0)[:, None, None, None], S, 0.0)


# ------------------------------------------------------------------------------------------------
# Speculative verify: T tokens per row, q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv];
# lengths int32[B] real tokens per row (lanes t >= lengths are padding).


def _lanes(slots, lengths, t):
  """bool[B, T]: real tokens of live rows."""
  return (slots >= 0)[:, None] & (jnp.arange(t)[None, :] < lengths[:, None])


def _verify_inputs(q, k, v, g, beta, lanes, num_v_heads, scale):
  """float32 per value head, token axis after the heads, padded lanes zeroed.

  Returns (scale·q, k [B, Hv, T, K], v [B, Hv, T, V], g, beta [B, Hv, T]). Padded lanes become
  q = k = v = 0, g = 0, β = 0 (no decay, no write): inert, and a select, so NaN cannot leak.
  """
  def clean(x):
    mask = lanes.reshape(lanes.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, x.astype(f32), 0.0)

  heads_first = lambda x: jnp.moveaxis(x, 1, 2)                            # [B, T, H, ..] → [B, H, T, ..]
  per_head = lambda x: jnp.repeat(heads_first(clean(x)), num_v_heads // x.shape[2], axis=1)
  return (per_head(q) * scale, per_head(k), heads_first(clean(v)), heads_first(clean(g)),
          heads_first(clean(beta)))


def replay_verify(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, scale, fold):
  """GDN Alg. 8 (UT transform): T tokens replayed from S_h = checkpoint ⊕ committed window.

  With G_s = Σ_{i≤s} g_i over the drafts and hq_s = S_h q_s, hk_s = S_h k_s, the recurrence
  unrolls to S_s = e^{G_s} S_h + Σ_{s'≤s} e^{G_s−G_{s'}} u_{s'} k_{s'}ᵀ, so the corrected values
  solve one unit lower-triangular T×T system

      (I + A) U = R,   A_{ss'} = β_s e^{G_s−G_{s'}} (k_s·k_{s'}) (s' < s),   R_s = β_s (v_s − e^{G_s} hk_s)
      o_s = e^{G_s} hq_s + Σ_{s'≤s} e^{G_s−G_{s'}} (k_{s'}·q_s) U_{s'}.

  Every token is appended at ``plan.write_index(i)``; flushing rows fold the committed window and
  token 0 only (fold="u": S_0 = e^{g_0} S_h + U_0 k_0ᵀ; fold="exact": the raw recurrence). A read
  copy is not read (verify replays from the float32 checkpoint, as without one); flushing rows
  write it with the checkpoint.
  """
  t = plan.num_tokens
  hv = bufs.num_v_heads
  lanes = _lanes(plan.slots, lengths, t)
  qh, kh, vh, gh, bh = _verify_inputs(q, k, v, g, beta, lanes, hv, scale)
  win = _window(bufs, plan.slots, plan.base, plan.count)
  S_h = _rebuild(*win)
  hq = jnp.einsum("bhvk,bhtk->bhtv", S_h, qh, precision=HIGHEST)
  hk = jnp.einsum("bhvk,bhtk->bhtv", S_h, kh, precision=HIGHEST)
  G = jnp.cumsum(gh, axis=-1)                                              # [B, Hv, T]
  causal = jnp.tril(jnp.ones((t, t), bool))
  # Mask the exponent, not the result: e^{G_s − G_s'} for s < s' may overflow.
  decay = jnp.exp(jnp.where(causal, G[..., :, None] - G[..., None, :], -jnp.inf))
  kk = jnp.einsum("bhsk,bhtk->bhst", kh, kh, precision=HIGHEST)
  A = jnp.where(jnp.tril(causal, -1), bh[..., :, None] * decay * kk, 0.0)
  R = bh[..., None] * (vh - jnp.exp(G)[..., None] * hk)
  U = _unit_lower_solve(A, R)                                              # [B, Hv, T, V]
  qk = jnp.einsum("bhsk,bhtk->bhst", qh, kh, precision=HIGHEST)
  o = jnp.exp(G)[..., None] * hq + jnp.einsum("bhst,bhtv->bhsv", decay * qk, U, precision=HIGHEST)
  o = jnp.where(lanes[..., None, None], jnp.moveaxis(o, 2, 1), 0.0)        # [B, T, Hv, V]

  S_fold = None
  if fold == "u":  # S_0 = e^{g_0} S_h + U_0 k_0ᵀ
    S_fold = jnp.exp(gh[..., 0])[..., None, None] * S_h + U[..., 0, :, None] * kh[..., 0, None, :]
  tokens_first = lambda x: jnp.moveaxis(x, 2, 1)
  bufs = _append_and_fold(bufs, plan, lanes, k, tokens_first(U), g.astype(f32), tokens_first(vh),
                          beta.astype(f32), S_fold, fold=fold)
  return o.astype(v.dtype), bufs


def verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths, *, scale):
  """Conventional speculative verify: step each row's state token by token, keep every state.

  stack [N, T_max, Hv, V, K]: row b reads ``stack[slots[b], read_index[b]]`` and writes the state
  after token i to ``stack[slots[b], i]`` (real lanes only).
  """
  t, hv = q.shape[1], stack.shape[2]
  lanes = _lanes(slots, lengths, t)
  qh, kh, vh, gh, bh = _verify_inputs(q, k, v, g, beta, lanes, hv, scale)
  valid = slots >= 0
  S = stack[jnp.where(valid, slots, 0), jnp.where(valid, read_index, 0)].astype(f32)
  outs, states = [], []
  for i in range(t):  # T <= 8: unrolled
    o, _, S = _delta_step(S, qh[:, :, i], kh[:, :, i], vh[:, :, i], gh[:, :, i], bh[:, :, i], 1.0)
    outs.append(o)
    states.append(S)
  o = jnp.where(lanes[..., None, None], jnp.stack(outs, axis=1), 0.0)
  idx = jnp.where(lanes, slots[:, None], stack.shape[0])
  stack = stack.at[idx, jnp.arange(t)[None, :]].set(jnp.stack(states, axis=1).astype(stack.dtype),
                                                    mode="drop")
  return o.astype(v.dtype), stack
