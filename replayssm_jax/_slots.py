"""Slot-pool plumbing shared by every family: gathers/scatters by slot, and the pure data-movement
ops ``write_state`` / ``copy_slots`` (validation + one jitted scatter each).

A family's buffers are a pytree whose leaves all have the pool axis N first and a ``state`` field
``[N, H, ...]`` (the checkpoint); ``num_slots`` and ``ring_size`` are properties. Negative slots are
padding rows: gathers read slot 0 (the caller masks the result), scatters drop them.
"""
import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _checks
from replayssm_jax import _dispatch
from replayssm_jax.cursor import ReplayCursor, ReplayPlan

BUFFER_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def check_create(num_slots, cursor, dims: dict, state_dtype, ring_dtype):
  """Validates a family's ``ReplayBuffers.create`` arguments; returns (state dtype, ring dtype).

  ``dims`` maps argument names to their values (each an int >= 1); ``ring_dtype=None`` means the
  state dtype.
  """
  for name, value in {"num_slots": num_slots, **dims}.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name}={value!r}; expected an int >= 1")
  if not isinstance(cursor, ReplayCursor):
    raise ValueError(f"cursor must be a ReplayCursor; got {type(cursor).__name__}")
  if cursor.num_slots != num_slots:
    raise ValueError(f"cursor has {cursor.num_slots} slots but num_slots={num_slots}")
  state_dtype = jnp.dtype(state_dtype)
  ring_dtype = state_dtype if ring_dtype is None else jnp.dtype(ring_dtype)
  allowed = [jnp.dtype(d) for d in BUFFER_DTYPES]
  for name, dtype in (("state_dtype", state_dtype), ("ring_dtype", ring_dtype)):
    if dtype not in allowed:
      raise ValueError(f"{name}={dtype}; expected float32, bfloat16 or float16")
  return state_dtype, ring_dtype


def check_plan(plan, bufs, batch: int, rows_of: str) -> None:
  """A plan from the cursor these buffers were made with, one slot per row of ``rows_of``."""
  if not isinstance(plan, ReplayPlan):
    raise ValueError(f"plan must be a ReplayPlan from cursor.plan(...); got {type(plan).__name__}")
  if plan.ring_size != bufs.ring_size:
    raise ValueError(f"plan has ring_size={plan.ring_size} but bufs were created with ring size "
                     f"{bufs.ring_size} (use the cursor the buffers were created with)")
  _checks.expect_shape("plan.slots", plan.slots, (batch,), f"(one slot per row of {rows_of})")
  _checks.check_slots("plan.slots", plan.slots, bufs.num_slots)


def gather(pool, slots):
  """pool[slots] with padding rows reading slot 0 (mask the result)."""
  return pool[jnp.where(slots >= 0, slots, 0)]


def scatter_index(slots, num_slots):
  """Scatter index: live rows keep their slot, padding rows point past the end (use mode="drop")."""
  return jnp.where(slots >= 0, slots, num_slots)


def check_cursor(cursor, bufs) -> None:
  if not isinstance(cursor, ReplayCursor):
    raise ValueError(f"cursor must be a ReplayCursor; got {type(cursor).__name__}")
  if cursor.num_slots != bufs.num_slots or cursor.ring_size != bufs.ring_size:
    raise ValueError(f"cursor has {cursor.num_slots} slots and ring size {cursor.ring_size}; bufs have "
                     f"{bufs.num_slots} slots and ring size {bufs.ring_size}")


def window_of(cursor, slots):
  """(base, count) int32[B] of each row's live window; zeros on padding rows."""
  valid = slots >= 0
  safe = jnp.where(valid, slots, 0)
  return jnp.where(valid, cursor.base[safe], 0), jnp.where(valid, cursor.count[safe], 0)


@jax.jit
def _write_state(bufs, cursor, slots, S):
  idx = scatter_index(slots, bufs.num_slots)
  state = bufs.state.at[idx].set(S.astype(bufs.state.dtype), mode="drop")
  return bufs.replace(state=state), cursor.reset(slots)


def write_state(op: str, bufs, cursor, slots, S, implementation, what: str):
  """Checkpoint of ``slots`` = S, windows emptied (``bufs`` already type-checked by the caller)."""
  check_cursor(cursor, bufs)
  _checks.expect_slots("slots", slots)
  _checks.expect_float("S", S)
  _checks.expect_shape("S", S, (slots.shape[0],) + bufs.state.shape[1:], what)
  _checks.check_slots("slots", slots, bufs.num_slots)
  _dispatch.resolve(op, implementation)
  return _write_state(bufs, cursor, slots, S)


@jax.jit
def _copy_slots(bufs, cursor, src, dst):
  n = bufs.num_slots
  live = (src >= 0) & (dst >= 0)
  take = jnp.where(live, src, 0)
  put = jnp.where(live, dst, n)
  copied = jax.tree.map(lambda x: x.at[put].set(x[take], mode="drop"), bufs)
  cursor = cursor.replace(base=cursor.base.at[put].set(cursor.base[take], mode="drop"),
                          count=cursor.count.at[put].set(cursor.count[take], mode="drop"))
  return copied, cursor


def copy_slots(op: str, bufs, cursor, src, dst, implementation):
  """Checkpoint, ring and cursor of ``src[i]`` → ``dst[i]`` (``bufs`` already type-checked)."""
  check_cursor(cursor, bufs)
  _checks.expect_slots("src", src)
  _checks.expect_slots("dst", dst, src.shape[0])
  _checks.check_slots("dst", dst, bufs.num_slots)
  _checks.check_host(lambda s: bool(np.all(s < bufs.num_slots)),
                     lambda s: f"src holds slot {int(s.max())} but the pool has {bufs.num_slots} slots", src)
  _checks.check_host(
      lambda s, d: not (set(s[(s >= 0) & (d >= 0)].tolist()) & set(d[(s >= 0) & (d >= 0)].tolist())),
      lambda s, d: f"copy_slots: src {s.tolist()} and dst {d.tolist()} overlap", src, dst)
  _dispatch.resolve(op, implementation)
  return _copy_slots(bufs, cursor, src, dst)
