"""Gated DeltaNet references: the step recurrence and the chunked WY form (float32, exact).

Per value head h (key head ``h // (Hv // Hk)``), token t, state S ∈ R^{V×K} (V-major):

    α_t = exp(g_t)                 g_t ≤ 0 is the log decay
    S̃   = α_t · S_{t-1}
    u_t = β_t · (v_t − S̃ k_t)
    S_t = S̃ + u_t k_tᵀ
    o_t = S_t (scale · q_t)        scale defaults to K^-0.5

Shapes: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; state [B, Hv, V, K];
output [B, T, Hv, V]. All math is float32 with every dot at ``Precision.HIGHEST``: GPU float32
dots default to TF32 (~5e-4 relative), far from exact.
"""
import functools
import numbers

import jax
import jax.numpy as jnp

from replayssm_jax import _checks

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _check_inputs(q, k, v, g, beta, initial_state):
  """Eager shape/dtype checks; returns (B, Hv, K, V)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    _checks.expect_float(name, x)
  _checks.expect_shape("q", q, (None,) * 4, "([B, T, Hk, K])")
  b, t, hk, kd = q.shape
  _checks.expect_shape("k", k, (b, t, hk, kd), "([B, T, Hk, K], like q)")
  _checks.expect_shape("v", v, (b, t, None, None), "([B, T, Hv, V], B and T as in q)")
  hv, vd = v.shape[2:]
  if hk == 0 or hv % hk:
    raise ValueError(f"q has {hk} key heads and v has {hv} value heads; expected Hv a multiple "
                     f"of Hk (GQA: value head h reads key head h // (Hv // Hk))")
  _checks.expect_shape("g", g, (b, t, hv), "([B, T, Hv])")
  _checks.expect_shape("beta", beta, (b, t, hv), "([B, T, Hv])")
  if initial_state is not None:
    _checks.expect_float("initial_state", initial_state)
    _checks.expect_shape("initial_state", initial_state, (b, hv, vd, kd), "([B, Hv, V, K])")
  return b, hv, kd, vd


def _prepare(q, k, v, g, beta, initial_state, scale):
  """float32 inputs per value head: (scale·q, k [B, T, Hv, K], v, g, beta, S_0 [B, Hv, V, K])."""
  b, hv, kd, vd = _check_inputs(q, k, v, g, beta, initial_state)
  scale = kd ** -0.5 if scale is None else float(scale)
  r = hv // q.shape[2]
  q = jnp.repeat(scale * jnp.asarray(q, f32), r, axis=2)
  k = jnp.repeat(jnp.asarray(k, f32), r, axis=2)
  S0 = jnp.zeros((b, hv, vd, kd), f32) if initial_state is None else jnp.asarray(initial_state, f32)
  return q, k, jnp.asarray(v, f32), jnp.asarray(g, f32), jnp.asarray(beta, f32), S0


def recurrent(q, k, v, g, beta, *, scale=None, initial_state=None):
  """GDN by the step recurrence: a ``lax.scan`` over T (the naive oracle).

  Args:
    q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv a multiple of Hk.
    g: [B, T, Hv] log decay (≤ 0); beta: [B, T, Hv] write strength.
    scale: query scale, default K^-0.5.
    initial_state: [B, Hv, V, K] S_0, or None for zeros.

  Returns:
    (o [B, T, Hv, V] in v's dtype, S_T [B, Hv, V, K] float32).
  """
  args = _prepare(q, k, v, g, beta, initial_state, scale)
  o, S = _recurrent(*args)
  return o.astype(jnp.result_type(v)), S


@jax.jit
def _recurrent(q, k, v, g, beta, S):
  def step(S, x):
    q_t, k_t, v_t, g_t, b_t = x                                # [B, Hv, K|V] and [B, Hv]
    S = jnp.exp(g_t)[..., None, None] * S                      # S̃ = α_t S_{t-1}
    u = b_t[..., None] * (v_t - jnp.einsum("bhvk,bhk->bhv", S, k_t, precision=HIGHEST))
    S = S + u[..., :, None] * k_t[..., None, :]                # S_t = S̃ + u_t k_tᵀ
    return S, jnp.einsum("bhvk,bhk->bhv", S, q_t, precision=HIGHEST)

  S, o = jax.lax.scan(step, S, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
  return jnp.moveaxis(o, 0, 1), S


def chunked(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64):
  """GDN in the chunked WY form: exact within each chunk, a ``lax.scan`` over chunks.

  Within a chunk of C tokens starting from state S_0, with G_i = Σ_{s≤i} g_s (cumulative log
  decay) and D_ij = e^{G_i−G_j} for i ≥ j (else 0), the recurrence unrolls to

      S_i = e^{G_i} S_0 + Σ_{j≤i} D_ij u_j k_jᵀ,

  so the delta-rule correction couples the u's through a unit lower-triangular system

      u_i + Σ_{j<i} β_i D_ij (k_i·k_j) u_j = β_i v_i − β_i e^{G_i} S_0 k_i,
      i.e. (I + A) U = βV − (β e^G K) S_0ᵀ,   A = strictly-lower(β_i D_ij k_i·k_j).

  Solving once for both right-hand sides (the WY/UT form) gives U = Ũ − W S_0ᵀ with
  Ũ = (I + A)⁻¹ βV and W = (I + A)⁻¹ (β e^G K), both independent of S_0. Then

      O   = e^G ⊙ (Q̃ S_0ᵀ) + (D ⊙ Q̃ Kᵀ) U          (Q̃ = scale·Q)
      S_C = e^{G_C} S_0 + Uᵀ (e^{G_C − G} ⊙ K).

  Only differences G_i − G_j with i ≥ j (≤ 0 for g ≤ 0) are exponentiated, so strong decay
  underflows to 0 instead of overflowing. The last chunk is padded with g = 0, β = 0 and zero
  q, k, v, which leaves U, O and S unchanged; the padded outputs are sliced off.

  Args:
    q, k: [B, T, Hk, K]; v: [B, T, Hv, V] with Hv a multiple of Hk.
    g: [B, T, Hv] log decay (≤ 0); beta: [B, T, Hv] write strength.
    scale: query scale, default K^-0.5.
    initial_state: [B, Hv, V, K] S_0, or None for zeros.
    chunk_size: C ≥ 1; any T (the last chunk is padded).

  Returns:
    (o [B, T, Hv, V] in v's dtype, S_T [B, Hv, V, K] float32).
  """
  if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r}; expected an integer >= 1")
  out_dtype = jnp.result_type(v)
  q, k, v, g, beta, S0 = _prepare(q, k, v, g, beta, initial_state, scale)
  t, c = v.shape[1], int(chunk_size)
  # Zero padding is inert: g = 0 (no decay), β = 0 (u = 0), q = 0 (o = 0). Padding here, outside
  # the jit, lets every T with the same number of chunks share one compilation.
  pad = lambda x: jnp.pad(x, [(0, 0), (0, -t % c)] + [(0, 0)] * (x.ndim - 2))
  o, S = _chunked(*map(pad, (q, k, v, g, beta)), S0, chunk_size=c)
  return o[:, :t].astype(out_dtype), S


def _unit_lower_solve(A, R):
  """X with (I + A) X = R; A [..., C, C] strictly lower triangular, R [..., C, F].

  Forward substitution X_i = R_i − Σ_{j<i} A_ij X_j. Rows ≥ i of X still hold R (finite) and
  A_ij = 0 for j ≥ i, so the full-row dot is exactly the sum over j < i.
  """
  def row(i, X):
    x_i = R[..., i, :] - jnp.einsum("...j,...jf->...f", A[..., i, :], X, precision=HIGHEST)
    return X.at[..., i, :].set(x_i)

  return jax.lax.fori_loop(1, A.shape[-1], row, R)


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _chunked(q, k, v, g, beta, S, *, chunk_size):
  """The chunked form on whole chunks: T = N·C. Returns (o [B, T, Hv, V], S float32)."""
  b, t, hv, vd = v.shape
  c = chunk_size
  n = t // c

  def chunks(x):
    """[B, N·C, Hv, ...] → [N, B, Hv, C, ...]."""
    return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), (1, 3), (0, 2))

  q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
  G = jnp.cumsum(g, axis=-1)                                            # [N, B, Hv, C]
  i_ge_j = jnp.tril(jnp.ones((c, c), bool))
  # Mask the exponent, not the result: e^{G_i − G_j} for i < j may be inf, and inf·0 = NaN.
  D = jnp.exp(jnp.where(i_ge_j, G[..., :, None] - G[..., None, :], -jnp.inf))
  kk = jnp.einsum("...ik,...jk->...ij", k, k, precision=HIGHEST)
  A = jnp.where(jnp.tril(i_ge_j, -1), beta[..., :, None] * D * kk, 0.0)
  rhs = jnp.concatenate([beta[..., None] * v, (beta * jnp.exp(G))[..., None] * k], axis=-1)
  X = _unit_lower_solve(A, rhs)
  U0, W = X[..., :vd], X[..., vd:]                                     # Ũ [.., C, V], W [.., C, K]
  P = D * jnp.einsum("...ik,...jk->...ij", q, k, precision=HIGHEST)     # D ⊙ Q̃Kᵀ
  e_in = jnp.exp(G)[..., None]                                          # e^{G_i}
  e_out = jnp.exp(G[..., -1:] - G)[..., None]                           # e^{G_C − G_j}
  e_all = jnp.exp(G[..., -1])[..., None, None]                          # e^{G_C}

  def step(S, x):
    U0, W, P, q, k, e_in, e_out, e_all = x
    U = U0 - jnp.einsum("bhck,bhvk->bhcv", W, S, precision=HIGHEST)    # U = Ũ − W S_0ᵀ
    o = (e_in * jnp.einsum("bhck,bhvk->bhcv", q, S, precision=HIGHEST)
         + jnp.einsum("bhij,bhjv->bhiv", P, U, precision=HIGHEST))
    S = e_all * S + jnp.einsum("bhcv,bhck->bhvk", U, e_out * k, precision=HIGHEST)
    return S, o

  S, o = jax.lax.scan(step, S, (U0, W, P, q, k, e_in, e_out, e_all))
  return jnp.moveaxis(o, (0, 2), (1, 3)).reshape(b, t, hv, vd), S
