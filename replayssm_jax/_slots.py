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
from replayssm_jax.cursor import ReplayCursor


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
