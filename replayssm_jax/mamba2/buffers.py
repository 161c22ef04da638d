"""Mamba2 replay buffers: the checkpoint pool and the input ring of one layer."""
import flax.struct
import jax
import jax.numpy as jnp

from replayssm_jax import _slots
from replayssm_jax.cursor import ReplayCursor


@flax.struct.dataclass
class ReplayBuffers:
  """Per-layer Mamba2 buffers over a pool of N slots (ring size R from the cursor).

  Ring entries are self-contained (Δ·x, B, Δ·A): materializing a state needs no parameters.

  Attributes:
    state: [N, H, P, N_state] checkpoint per slot (float32, bfloat16 or float16).
    ring_x: [N, H, R, P] Δ·x per head (ring dtype).
    ring_B: [N, G, R, N_state] B, stored once per group (ring dtype).
    ring_a: [N, H, R] float32 log decays Δ·A.
    read_copy: [N, H, P, N_state] the float32 checkpoint rounded to bfloat16 / float16, or None
      (``create(read_copy_dtype=...)``). Decode steps read it instead of the checkpoint (half the
      bytes of every step); every write of the checkpoint writes it too, so it always equals
      ``state.astype(read_copy.dtype)``. Mamba2's update does not read the state, so only decode
      outputs see the rounding (of S_c in S·C); the checkpoint is the float32 one, bit for bit.
      Speculative verify reads the float32 checkpoint.
  """
  state: jax.Array
  ring_x: jax.Array
  ring_B: jax.Array
  ring_a: jax.Array
  read_copy: jax.Array | None = None

  @classmethod
  def create(cls, num_slots: int, cursor: ReplayCursor, *, num_heads: int, head_dim: int,
             num_groups: int, state_dim: int, state_dtype=jnp.float32, ring_dtype=None,
             read_copy_dtype=None) -> "ReplayBuffers":
    """Zeroed buffers. ``ring_dtype=None`` stores the ring in the state dtype; ``read_copy_dtype``
    (bfloat16 / float16, float32 state only) adds ``read_copy`` (see the class doc)."""
    state_dtype, ring_dtype = _slots.check_create(
        num_slots, cursor, {"num_heads": num_heads, "head_dim": head_dim, "num_groups": num_groups,
                            "state_dim": state_dim}, state_dtype, ring_dtype)
    if num_heads % num_groups:
      raise ValueError(f"num_heads={num_heads} is not a multiple of num_groups={num_groups} "
                       f"(head h reads group h // (H // G))")
    copy_dtype = _slots.check_read_copy(read_copy_dtype, state_dtype)
    r = cursor.ring_size
    return cls(
        state=jnp.zeros((num_slots, num_heads, head_dim, state_dim), state_dtype),
        ring_x=jnp.zeros((num_slots, num_heads, r, head_dim), ring_dtype),
        ring_B=jnp.zeros((num_slots, num_groups, r, state_dim), ring_dtype),
        ring_a=jnp.zeros((num_slots, num_heads, r), jnp.float32),
        read_copy=(None if copy_dtype is None else
                   jnp.zeros((num_slots, num_heads, head_dim, state_dim), copy_dtype)),
    )

  @property
  def num_slots(self) -> int:
    return self.state.shape[0]

  @property
  def num_heads(self) -> int:
    return self.state.shape[1]

  @property
  def head_dim(self) -> int:
    return self.state.shape[2]

  @property
  def state_dim(self) -> int:
    return self.state.shape[3]

  @property
  def num_groups(self) -> int:
    return self.ring_B.shape[1]

  @property
  def ring_size(self) -> int:
    return self.ring_a.shape[2]
