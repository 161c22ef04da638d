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


READ_COPY_DTYPES = (jnp.bfloat16, jnp.float16)


def check_read_copy(read_copy_dtype, state_dtype):
  """Validates ``ReplayBuffers.create(read_copy_dtype=...)``: None or a 16-bit float narrower than a
  float32 checkpoint; returns the dtype (or None)."""
  if read_copy_dtype is None:
    return None
  dtype = jnp.dtype(read_copy_dtype)
  if dtype not in [jnp.dtype(d) for d in READ_COPY_DTYPES]:
    raise ValueError(f"read_copy_dtype={dtype}; expected None, bfloat16 or float16")
  if jnp.dtype(state_dtype) != jnp.dtype(jnp.float32):
    raise ValueError(f"read_copy_dtype={dtype} with state_dtype={jnp.dtype(state_dtype)}: a read copy "
                     f"serves a float32 checkpoint (a 16-bit checkpoint is already read at 16 bits)")
  return dtype


def refresh_read_copy(bufs, slots):
  """``bufs`` with the read copy of ``slots`` (negative: skipped) rounded from their stored
  checkpoint; no-op without a read copy. Reading the stored rows back, rather than rounding the
  values that were scattered into them, keeps copy == round(checkpoint) exact even where XLA
  computes the scattered values twice, in two fusions that round differently (seen on the CPU)."""
  if bufs.read_copy is None:
    return bufs
  return bufs.replace(read_copy=scatter_rows(bufs.read_copy, slots, gather(bufs.state, slots)))


def readout_window(bufs, slots, window):
  """``window`` (``replay.gather_window``'s tuple, checkpoint rows first) with the checkpoint rows
  taken from the read copy when there is one: what the readouts replay from. The folds replay from
  ``window`` itself (the float32 checkpoint)."""
  if bufs.read_copy is None:
    return window
  return (gather(bufs.read_copy, slots).astype(jnp.float32),) + tuple(window[1:])


def without_read_copy(op: str, bufs) -> None:
  """Ops that write the checkpoint in a kernel of their own do not keep a read copy in step."""
  if bufs.read_copy is not None:
    raise NotImplementedError(f"{op}: buffers with a read copy (ReplayBuffers.create(read_copy_dtype="
                              f"...)) are not supported here; create them without one")


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
  """Scatter index: live rows keep their slot, padding row b points past the end, to num_slots + b.

  Live slots are unique by contract and padding rows each get their own out-of-range position, so
  the index is unique: scatter with ``mode="drop", unique_indices=True`` (``scatter_rows``).
  """
  return jnp.where(slots >= 0, slots, num_slots + jnp.arange(slots.shape[0], dtype=slots.dtype))


def scatter_rows(pool, slots, rows):
  """pool[slots[b]] = rows[b] on live rows; padding rows (slot < 0) write nothing.

  Declared unique: with indices that may repeat, XLA's scatter into a bf16 pool was more than twice
  as slow on the H200 (the [256, 3, 8192] conv-state step: 77 → 35 µs per call in
  ``python -m bench.model_parts``, 2026-11-29; git show 60b2ea2:bench/results/model_parts_2026-11-29_s7.json).
  """
  return pool.at[scatter_index(slots, pool.shape[0])].set(rows.astype(pool.dtype), mode="drop",
                                                          unique_indices=True)


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
  bufs = bufs.replace(state=scatter_rows(bufs.state, slots, S))
  return refresh_read_copy(bufs, slots), cursor.reset(slots)


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


def check_lengths(lengths, batch: int, num_tokens: int, slots):
  """Real tokens per row of a verify step: int32[B] in [1, T] on live rows; None = all T real."""
  if lengths is None:
    return jnp.full((batch,), num_tokens, jnp.int32)
  _checks.expect_dtype("lengths", lengths, (jnp.int32,))
  _checks.expect_shape("lengths", lengths, (batch,), f"(int32[B], real tokens per row in [1, T={num_tokens}])")
  _checks.check_host(
      lambda n, s: bool(np.all((n[s >= 0] >= 1) & (n[s >= 0] <= num_tokens))),
      lambda n, s: f"lengths must lie in [1, {num_tokens}] on live rows; got {n[s >= 0].tolist()}",
      lengths, slots)
  return lengths


def check_stack(stack, read_index, slots, batch: int, num_tokens: int, what: str):
  """A conventional-verify state stack [N, T_max, ...] with T_max >= T and its read index int32[B]."""
  _checks.expect_dtype("stack", stack, BUFFER_DTYPES)
  _checks.expect_shape("stack", stack, (None,) * 5, what)
  if stack.shape[1] < num_tokens:
    raise ValueError(f"stack has shape {list(stack.shape)}: {stack.shape[1]} states per slot; expected "
                     f"at least T={num_tokens} (one per token) {what}")
  _checks.expect_slots("slots", slots, batch)
  _checks.check_slots("slots", slots, stack.shape[0])
  _checks.expect_dtype("read_index", read_index, (jnp.int32,))
  _checks.expect_shape("read_index", read_index, (batch,), "(int32[B]: the stack entry holding each row's state)")
  t_max = stack.shape[1]
  _checks.check_host(
      lambda r, s: bool(np.all((r[s >= 0] >= 0) & (r[s >= 0] < t_max))),
      lambda r, s: f"read_index must lie in [0, {t_max}) on live rows; got {r[s >= 0].tolist()}",
      read_index, slots)


def check_num_tokens(name: str, x, num_tokens: int, what: str) -> None:
  """``x.shape[1]`` (the token axis of a verify input) must be the plan's T."""
  if x.shape[1] != num_tokens:
    raise ValueError(f"{name} has shape {list(x.shape)}: {x.shape[1]} tokens per row; expected "
                     f"T={num_tokens} {what}")
