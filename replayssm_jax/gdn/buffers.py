"""Gated DeltaNet replay buffers: the checkpoint pool and the input ring of one layer."""
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

from replayssm_jax import _slots
from replayssm_jax.cursor import ReplayCursor


FOLDS = ("u", "exact")


@flax.struct.dataclass
class ReplayBuffers:
  """Per-layer GDN buffers over a pool of N slots (ring size R from the cursor).

  Attributes:
    state: [N, Hv, V, K] checkpoint per slot (float32, bfloat16 or float16).
    ring_k: [N, Hk, R, K] keys, stored once per key head (ring dtype).
    ring_u: [N, Hv, R, V] corrected values ``u = β(v − α S k)`` (ring dtype).
    ring_g: [N, Hv, R] float32 log decays.
    ring_v: [N, Hv, R, V] raw values (ring dtype); ``fold="exact"`` only, else None.
    ring_beta: [N, Hv, R] float32 raw write strengths β; ``fold="exact"`` only, else None.
    read_copy: [N, Hv, V, K] the float32 checkpoint rounded to bfloat16 / float16, or None
      (``create(read_copy_dtype=...)``). Decode steps read it instead of the checkpoint (half the
      bytes of every step); every write of the checkpoint writes it too, so it always equals
      ``state.astype(read_copy.dtype)``. Outputs and the corrected values u of decode steps see
      one rounding of S_c to 16 bits per step (S·q, S·k); the checkpoint and the fold stay
      float32. Speculative verify reads the float32 checkpoint and writes the copy with it:
      reading the copy would force verify onto its output-only route, 2.4x slower than the
      reconstruct kernels on an H100 (bench/NOTES.md, "Read copy").
    fold: how a flush folds the window into the checkpoint (static):
      "u": from the cached corrected values, ``S = e^{Σg} S_c + Σ_j e^{Σ_{i>j} g_i} u_j k_jᵀ``. The
        u's were computed from a replayed state, so their rounding (storage dtype, the verify
        triangular solve) is folded open-loop into the checkpoint.
      "exact": by the delta-rule recurrence itself over the raw (k, v, g, β) of the window, in the
        step order of ``gdn.recurrent`` (closed loop: the checkpoint is the conventional decode's
        state up to the ring dtype of v and k). Outputs still use the u's (one-shot, never folded).
  """
  state: jax.Array
  ring_k: jax.Array
  ring_u: jax.Array
  ring_g: jax.Array
  ring_v: jax.Array | None = None
  ring_beta: jax.Array | None = None
  read_copy: jax.Array | None = None
  fold: str = flax.struct.field(pytree_node=False, default="u")

  @classmethod
  def create(cls, num_slots: int, cursor: ReplayCursor, *, num_k_heads: int, num_v_heads: int,
             head_k_dim: int, head_v_dim: int, state_dtype=jnp.float32, ring_dtype=None,
             fold: Literal["u", "exact"] = "u", read_copy_dtype=None) -> "ReplayBuffers":
    """Zeroed buffers. ``ring_dtype=None`` stores the ring in the state dtype.

    ``fold="exact"`` adds ``ring_v`` and ``ring_beta`` (raw inputs) to the ring;
    ``read_copy_dtype`` (bfloat16 / float16, float32 state only) adds ``read_copy``; see the class
    doc.
    """
    state_dtype, ring_dtype = _slots.check_create(
        num_slots, cursor, {"num_k_heads": num_k_heads, "num_v_heads": num_v_heads,
                            "head_k_dim": head_k_dim, "head_v_dim": head_v_dim},
        state_dtype, ring_dtype)
    if num_v_heads % num_k_heads:
      raise ValueError(f"num_v_heads={num_v_heads} is not a multiple of num_k_heads={num_k_heads} "
                       f"(GQA needs Hv = r·Hk)")
    if fold not in FOLDS:
      raise ValueError(f"fold={fold!r}; expected one of {FOLDS}")
    copy_dtype = _slots.check_read_copy(read_copy_dtype, state_dtype)
    r = cursor.ring_size
    exact = fold == "exact"
    return cls(
        state=jnp.zeros((num_slots, num_v_heads, head_v_dim, head_k_dim), state_dtype),
        ring_k=jnp.zeros((num_slots, num_k_heads, r, head_k_dim), ring_dtype),
        ring_u=jnp.zeros((num_slots, num_v_heads, r, head_v_dim), ring_dtype),
        ring_g=jnp.zeros((num_slots, num_v_heads, r), jnp.float32),
        ring_v=jnp.zeros((num_slots, num_v_heads, r, head_v_dim), ring_dtype) if exact else None,
        ring_beta=jnp.zeros((num_slots, num_v_heads, r), jnp.float32) if exact else None,
        read_copy=(None if copy_dtype is None else
                   jnp.zeros((num_slots, num_v_heads, head_v_dim, head_k_dim), copy_dtype)),
        fold=fold,
    )

  @property
  def num_slots(self) -> int:
    return self.state.shape[0]

  @property
  def num_k_heads(self) -> int:
    return self.ring_k.shape[1]

  @property
  def num_v_heads(self) -> int:
    return self.state.shape[1]

  @property
  def head_v_dim(self) -> int:
    return self.state.shape[2]

  @property
  def head_k_dim(self) -> int:
    return self.state.shape[3]

  @property
  def ring_size(self) -> int:
    return self.ring_g.shape[2]
