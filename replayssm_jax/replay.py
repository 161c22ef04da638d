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


# ------------------------------------------------------------------------------------------------
# Batched XLA statement of the replay, shared by the families' XLA paths. Ring naming follows the
# "(u, k, g)" form above: GDN (u, k, g), Mamba2 (Δx, B, ΔA). Keys are stored per key head / group
# and repeated to the state's heads (head h reads key head h // (H // Hk)). float32 math throughout.

HIGHEST = lax.Precision.HIGHEST


def gather_window(state, ring_k, ring_u, ring_g, slots, base, length):
  """Gathers each row's checkpoint and window from ``[N, ...]`` buffers.

  Args:
    state: [N, H, V, K] checkpoints; ring_k: [N, Hk, R, K]; ring_u: [N, H, R, V]; ring_g: [N, H, R].
    slots: int32[B] (negative = padding: reads slot 0, the caller masks); base, length: int32[B].

  Returns:
    (S_c [B, H, V, K], k [B, H, R, K], u [B, H, R, V], weights [B, H, R], total log decay [B, H]),
    float32; k and u are zero outside the window (selected away, so stale NaN cannot leak).
  """
  safe = jnp.where(slots >= 0, slots, 0)
  heads = state.shape[1]
  Sc = state[safe].astype(jnp.float32)
  rk = jnp.repeat(ring_k[safe].astype(jnp.float32), heads // ring_k.shape[1], axis=1)
  ru = ring_u[safe].astype(jnp.float32)
  rg = ring_g[safe]
  w, total = window_decays(rg, base[:, None], length[:, None], ring_g.shape[-1])
  _, inside = window_offsets(rg.shape, base[:, None], length[:, None], ring_g.shape[-1])
  rk = jnp.where(inside[..., None], rk, 0.0)
  ru = jnp.where(inside[..., None], ru, 0.0)
  return Sc, rk, ru, w, total


def rebuild(Sc, rk, ru, w, total):
  """S = exp(total) S_c + Σ_j w_j u_j k_jᵀ  ([B, H, V, K])."""
  return (jnp.exp(total)[..., None, None] * Sc
          + jnp.einsum("bhr,bhrv,bhrk->bhvk", w, ru, rk, precision=HIGHEST))


def read(Sc, rk, ru, w, total, x):
  """S x without building S: exp(total)(S_c x) + Σ_j w_j (k_j·x) u_j  ([B, H, V])."""
  kx = jnp.einsum("bhrk,bhk->bhr", rk, x, precision=HIGHEST)
  return (jnp.exp(total)[..., None] * jnp.einsum("bhvk,bhk->bhv", Sc, x, precision=HIGHEST)
          + jnp.einsum("bhr,bhrv->bhv", w * kx, ru, precision=HIGHEST))
