"""Mamba2 references: the step recurrence and the SSD chunked scan (float32, exact).

Per head h (group ``h // (H // G)``), token t, state S ∈ R^{P×N} (P-major):

    Δ_t = softplus(dt_t + dt_bias)   (dt_t + dt_bias if not dt_softplus; dt_bias defaults to 0)
    a_t = exp(Δ_t · A_h)             A_h < 0
    S_t = a_t S_{t-1} + Δ_t x_t B_tᵀ
    y_t = S_t C_t + D_h x_t          then y_t · silu(z_t) if z is given

Shapes: x, z [Bt, T, H, P]; dt [Bt, T, H]; A, D, dt_bias [H]; B, C [Bt, T, G, N]; state
[Bt, H, P, N]. All math is float32 with every dot at ``Precision.HIGHEST``: GPU float32 dots
default to TF32 (~5e-4 relative), far from exact. softplus is ``jax.nn.softplus``
(log(1 + e^x) without overflow); peers return x itself above 20, where the two differ by
< 2e-9, below the float32 rounding of x.
"""
import functools
import numbers

import jax
import jax.numpy as jnp

from replayssm_jax import _checks

HIGHEST = jax.lax.Precision.HIGHEST
f32 = jnp.float32


def _check_inputs(x, dt, A, B, C, D, z, dt_bias, initial_state):
  """Eager shape/dtype checks."""
  optional = (("D", D), ("z", z), ("dt_bias", dt_bias), ("initial_state", initial_state))
  for name, a in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)) + optional:
    if a is not None:
      _checks.expect_float(name, a)
  _checks.expect_shape("x", x, (None,) * 4, "([Bt, T, H, P])")
  b, t, h, p = x.shape
  _checks.expect_shape("dt", dt, (b, t, h), "([Bt, T, H])")
  _checks.expect_shape("A", A, (h,), "([H])")
  _checks.expect_shape("B", B, (b, t, None, None), "([Bt, T, G, N], Bt and T as in x)")
  g, n = B.shape[2:]
  if g == 0 or h % g:
    raise ValueError(f"B has {g} groups and x has {h} heads; expected H a multiple of G "
                     f"(head h reads group h // (H // G))")
  _checks.expect_shape("C", C, (b, t, g, n), "([Bt, T, G, N], like B)")
  expected = {"D": ((h,), "([H])"), "z": ((b, t, h, p), "([Bt, T, H, P], like x)"),
              "dt_bias": ((h,), "([H])"), "initial_state": ((b, h, p, n), "([Bt, H, P, N])")}
  for name, a in optional:
    if a is not None:
      _checks.expect_shape(name, a, *expected[name])


def _prepare(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state):
  """Checks the inputs; returns float32 (x, Δ [Bt, T, H], A, B, C, S_0 [Bt, H, P, N])."""
  _check_inputs(x, dt, A, B, C, D, z, dt_bias, initial_state)
  b, _, h, p = x.shape
  S0 = (jnp.zeros((b, h, p, B.shape[-1]), f32) if initial_state is None
        else jnp.asarray(initial_state, f32))
  delta = _delta(jnp.asarray(dt, f32), None if dt_bias is None else jnp.asarray(dt_bias, f32),
                 softplus=bool(dt_softplus))
  return (jnp.asarray(x, f32), delta, jnp.asarray(A, f32), jnp.asarray(B, f32),
          jnp.asarray(C, f32), S0)


@functools.partial(jax.jit, static_argnames=("softplus",))
def _delta(dt, dt_bias, *, softplus):
  """Δ = softplus(dt + dt_bias) or dt + dt_bias; [Bt, T, H]."""
  if dt_bias is not None:
    dt = dt + dt_bias
  return jax.nn.softplus(dt) if softplus else dt


@functools.partial(jax.jit, static_argnames=("dtype",))
def _skip_and_gate(y, x, D, z, *, dtype):
  """(y + D_h x) · silu(z) in float32 (either term optional), cast to ``dtype``."""
  if D is not None:
    y = y + jnp.asarray(D, f32)[:, None] * x
  if z is not None:
    y = y * jax.nn.silu(jnp.asarray(z, f32))
  return y.astype(dtype)


def recurrent(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
              initial_state=None):
  """Mamba2 by the step recurrence: a ``lax.scan`` over T (the naive oracle).

  Args:
    x: [Bt, T, H, P] inputs; dt: [Bt, T, H] raw step sizes; A: [H] (negative).
    B, C: [Bt, T, G, N] with H a multiple of G; head h reads group h // (H // G).
    D: [H] skip weight, or None. z: [Bt, T, H, P] gate, or None.
    dt_bias: [H] added to dt, or None. dt_softplus: Δ = softplus(dt + dt_bias) if True.
    initial_state: [Bt, H, P, N] S_0, or None for zeros.

  Returns:
    (y [Bt, T, H, P] in x's dtype, S_T [Bt, H, P, N] float32).
  """
  x32, delta, A, B, C, S0 = _prepare(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state)
  y, S = _recurrent(x32, delta, A, B, C, S0)
  return _skip_and_gate(y, x32, D, z, dtype=jnp.result_type(x)), S


@jax.jit
def _recurrent(x, delta, A, B, C, S):
  """S_t C_t for every t (no D, no gate): (y [Bt, T, H, P], S_T)."""
  r = x.shape[2] // B.shape[2]
  B, C = (jnp.repeat(a, r, axis=2) for a in (B, C))                 # [Bt, T, H, N]

  def step(S, inp):
    x_t, d_t, B_t, C_t = inp                                        # [Bt, H, P|N] and [Bt, H]
    dx = d_t[..., None] * x_t
    S = (jnp.exp(d_t * A)[..., None, None] * S                      # a_t S_{t-1} + Δ_t x_t B_tᵀ
         + jnp.einsum("bhp,bhn->bhpn", dx, B_t, precision=HIGHEST))
    return S, jnp.einsum("bhpn,bhn->bhp", S, C_t, precision=HIGHEST)

  S, y = jax.lax.scan(step, S, tuple(jnp.moveaxis(a, 1, 0) for a in (x, delta, B, C)))
  return jnp.moveaxis(y, 0, 1), S


def chunked(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
            initial_state=None, chunk_size=64):
  """Mamba2 by the SSD chunked scan: exact within each chunk, a ``lax.scan`` over chunks.

  Within a chunk of c tokens starting from state S_0, with L_i = Σ_{s≤i} Δ_s A_h (cumulative
  log decay) and the segment-sum mask M_ij = e^{L_i−L_j} for i ≥ j (else 0), the recurrence
  unrolls to

      y_i = Σ_{j≤i} M_ij (C_i·B_j) Δ_j x_j  +  e^{L_i} S_0 C_i      (intra + inter chunk)
      S_c = e^{L_c} S_0 + Σ_j e^{L_c−L_j} Δ_j x_j B_jᵀ,

  so the chunk-local terms are batched over all chunks and only S_0 → S_c is a scan. Only
  differences L_i − L_j with i ≥ j (≤ 0 for A < 0) are exponentiated, the exponent masked
  before exp, so strong decay underflows to 0 instead of overflowing. The last chunk is
  padded after Δ is computed, with Δ = 0 (a = 1, no update) and zero x, B, C, so the padding
  cannot change the state; the padded outputs are sliced off.

  Args:
    x: [Bt, T, H, P] inputs; dt: [Bt, T, H] raw step sizes; A: [H] (negative).
    B, C: [Bt, T, G, N] with H a multiple of G; head h reads group h // (H // G).
    D: [H] skip weight, or None. z: [Bt, T, H, P] gate, or None.
    dt_bias: [H] added to dt, or None. dt_softplus: Δ = softplus(dt + dt_bias) if True.
    initial_state: [Bt, H, P, N] S_0, or None for zeros.
    chunk_size: c ≥ 1; any T (the last chunk is padded).

  Returns:
    (y [Bt, T, H, P] in x's dtype, S_T [Bt, H, P, N] float32).
  """
  if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r}; expected an integer >= 1")
  x32, delta, A, B, C, S0 = _prepare(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_state)
  t, c = x.shape[1], int(chunk_size)
  # Padding here, outside the jit, lets every T with the same number of chunks share one
  # compilation.
  pad = lambda a: jnp.pad(a, [(0, 0), (0, -t % c)] + [(0, 0)] * (a.ndim - 2))
  y, S = _chunked(pad(x32), pad(delta), A, pad(B), pad(C), S0, chunk_size=c)
  return _skip_and_gate(y[:, :t], x32, D, z, dtype=jnp.result_type(x)), S


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def _chunked(x, delta, A, B, C, S, *, chunk_size):
  """The SSD scan on whole chunks, T = Nc·c, no D, no gate: (y [Bt, T, H, P], S float32)."""
  b, t, h, p = x.shape
  g, n = B.shape[2:]
  c, r = chunk_size, h // g
  nc = t // c
  # Heads h = g·R + r share group g = h // R; chunk-major layout [Nc, Bt, G, (R,) c, ...].
  x = x.reshape(b, nc, c, g, r, p).transpose(1, 0, 3, 4, 2, 5)       # [Nc, Bt, G, R, c, P]
  delta = delta.reshape(b, nc, c, g, r).transpose(1, 0, 3, 4, 2)      # [Nc, Bt, G, R, c]
  B, C = (a.reshape(b, nc, c, g, n).transpose(1, 0, 3, 2, 4) for a in (B, C))  # [Nc, Bt, G, c, N]
  L = jnp.cumsum(delta * A.reshape(g, r, 1), axis=-1)                 # L_i
  i_ge_j = jnp.tril(jnp.ones((c, c), bool))
  # Mask the exponent, not the result: e^{L_i − L_j} for i < j may be inf (inf·0 = NaN, and
  # where() over an inf branch gives NaN gradients).
  M = jnp.exp(jnp.where(i_ge_j, L[..., :, None] - L[..., None, :], -jnp.inf))
  CB = jnp.einsum("...in,...jn->...ij", C, B, precision=HIGHEST)      # [Nc, Bt, G, c, c]
  y_in = jnp.einsum("...ij,...jp->...ip", M * CB[..., None, :, :] * delta[..., None, :], x,
                    precision=HIGHEST)
  w = jnp.exp(L[..., -1:] - L) * delta                                # e^{L_c − L_j} Δ_j
  S_in = jnp.einsum("...grjp,...gjn->...grpn", w[..., None] * x, B, precision=HIGHEST)

  def step(S, inp):
    S_in, a_c = inp                                                   # chunk update, e^{L_c}
    return a_c[..., None, None] * S + S_in, S

  S, S_prev = jax.lax.scan(step, S.reshape(b, g, r, p, n), (S_in, jnp.exp(L[..., -1])))
  y = y_in + jnp.exp(L)[..., None] * jnp.einsum("...grpn,...gin->...grip", S_prev, C,
                                                 precision=HIGHEST)
  return y.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, p), S.reshape(b, h, p, n)
