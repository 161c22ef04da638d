"""Replay math shared by every family and backend: decay weights of a circular ring window.

Both families keep a ring of "log decay + rank-one update" entries — (u, k, g) for Gated DeltaNet,
(Δx, B, ΔA) for Mamba2. A window of ``n`` entries starting at ring index ``base`` replays as::

    S = exp(Σ_j g_j) · S_c + Σ_j exp(Σ_{i>j} g_i) · u_j k_jᵀ          (j, i over the window)

``window_decays`` returns the per-position weights ``exp(Σ_{i>j} g_i)`` (zero outside the window)
and the total log decay ``Σ_j g_j``. It uses only broadcasts and reductions over a ``[R, R]``
comparison, so the same function runs in XLA (batched) and inside Pallas kernels (one row).
"""
import jax
import jax.numpy as jnp
from jax import lax


def window_offsets(shape, base, length, ring_size: int):
  """(offset, inside) for ring positions of ``shape[-1] == R``: each entry's place in the window."""
  pos = lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
  base = jnp.asarray(base, jnp.int32)[..., None]
  length = jnp.asarray(length, jnp.int32)[..., None]
  offset = (pos - base + ring_size) % ring_size
  return offset, offset < length


def window_decays(g: jax.Array, base, length, ring_size: int):
  """Decay weights of a circular window.

  Args:
    g: float32[..., R] per-entry log decays (values outside the window are ignored, NaN included).
    base: int32 broadcastable to ``g.shape[:-1]``: ring index of the window's first entry.
    length: int32 broadcastable to ``g.shape[:-1]``: entries in the window (0..R).
    ring_size: R.

  Returns:
    weights: float32[..., R], ``exp(Σ_{i after j in window} g_i)`` at window positions j, else 0.
    total: float32[...], ``Σ_{j in window} g_j``.
  """
  offset, inside = window_offsets(g.shape, base, length, ring_size)
  g_in = jnp.where(inside, g.astype(jnp.float32), 0.0)
  # later[j, i]: entry i comes after entry j in the window.
  later = offset[..., None, :] > offset[..., :, None]
  suffix = jnp.sum(jnp.where(later, g_in[..., None, :], 0.0), axis=-1)
  weights = jnp.where(inside, jnp.exp(suffix), 0.0)
  return weights, jnp.sum(g_in, axis=-1)
