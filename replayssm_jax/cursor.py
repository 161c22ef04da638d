"""The cursor model: which ring entries are live, and when a row flushes.

Per pool slot the cursor keeps ``base`` (ring index of the oldest unfolded entry) and ``count``
(committed entries not yet folded into the checkpoint). Invariant after every commit::

    checkpoint ⊕ ring[base : base + count (mod R)]  ==  exact state after all accepted tokens
    0 <= count <= buffer_len - 1,   0 <= base < R

One step (``plan`` → kernels → ``commit``) handles ``T = num_tokens`` tokens per row. Token ``i``
of a row is written to ring index ``base + count + i (mod R)`` on every row. A *flushing* row
additionally folds its committed window plus token 0 (``count + 1`` entries) into the checkpoint;
tokens ``1..T-1`` (drafts) stay in the ring past the new base. Token 0 is the token the model
already emitted, so it always commits (``1 <= num_accepted <= T``); rejected drafts are simply
never counted — ``commit`` is the whole rollback.

A row flushes naturally when the committed window could overflow (``count + T > buffer_len - 1``)
or when ``force_flush`` asks (e.g. a prefix-cache block boundary). Flush is per-row runtime data:
one compiled step serves rows at any phase.

Ring size ``R = next_pow2(buffer_len + max_draft)``: the writes of one step
(``[base + count, base + count + T)``) never alias the live window ``[base, base + count)`` that the
same launch reads, because ``count + T <= buffer_len - 1 + max_draft + 1 <= R``.
"""
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import _checks


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def ring_size_for(buffer_len: int, max_draft: int) -> int:
  """Physical ring length R for a buffer length L and a maximum number of drafts per step."""
  return _next_pow2(buffer_len + max_draft)


def _safe_index(slots: jax.Array, num_slots: int) -> jax.Array:
  """Scatter index: live rows keep their slot, padding rows point past the end (dropped)."""
  return jnp.where(slots >= 0, slots, num_slots)


@flax.struct.dataclass
class ReplayPlan:
  """Per-step metadata for a batch, shared by all layers of a model.

  Attributes:
    slots: int32[B] pool slot per row; negative = padding row (inert).
    base: int32[B] ring index of the row's oldest unfolded entry (0 on padding rows).
    count: int32[B] committed entries in the row's window (0 on padding rows).
    flush: bool[B] the row folds ``count + 1`` entries (window and token 0) into its checkpoint.
    flush_all: static; every live row flushes (``plan(flush_all=True)``, the small-batch policy),
      so kernels may fold and step each row in one pass, like conventional decode.
  """
  slots: jax.Array
  base: jax.Array
  count: jax.Array
  flush: jax.Array
  num_tokens: int = flax.struct.field(pytree_node=False, default=1)
  flush_all: bool = flax.struct.field(pytree_node=False, default=False)
  buffer_len: int = flax.struct.field(pytree_node=False, default=16)
  ring_size: int = flax.struct.field(pytree_node=False, default=16)

  @property
  def batch_size(self) -> int:
    return self.slots.shape[0]

  @property
  def valid(self) -> jax.Array:
    return self.slots >= 0

  def write_index(self, token: int | jax.Array = 0) -> jax.Array:
    """int32[B] ring index that token ``token`` of each row is written to."""
    return (self.base + self.count + token) % self.ring_size

  def fold_length(self) -> jax.Array:
    """int32[B] entries the flush pass folds: ``count + 1`` on flushing rows, else 0."""
    return jnp.where(self.flush, self.count + 1, 0)


@flax.struct.dataclass
class ReplayCursor:
  """Ring cursors of every pool slot. A pytree; all layers of a model share one cursor.

  Attributes:
    base: int32[N] ring index of the oldest unfolded entry per slot.
    count: int32[N] committed, unfolded entries per slot (``<= buffer_len - 1``).
  """
  base: jax.Array
  count: jax.Array
  buffer_len: int = flax.struct.field(pytree_node=False, default=16)
  max_draft: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def ring_size(self) -> int:
    return ring_size_for(self.buffer_len, self.max_draft)

  @property
  def num_slots(self) -> int:
    return self.base.shape[0]

  @classmethod
  def create(cls, num_slots: int, buffer_len: int = 16, max_draft: int = 0) -> "ReplayCursor":
    """Empty cursors for ``num_slots`` slots.

    Args:
      num_slots: pool size N.
      buffer_len: L; the checkpoint is written once every L tokens (L = 1: every step, i.e.
        conventional decode). The live window holds at most L - 1 entries.
      max_draft: drafts per verify step beyond the emitted token (``num_tokens <= max_draft + 1``).
    """
    for name, value, lo in (("num_slots", num_slots, 1), ("buffer_len", buffer_len, 1),
                            ("max_draft", max_draft, 0)):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}={value!r}; expected an int >= {lo}")
    if buffer_len < max_draft + 1:
      raise ValueError(f"buffer_len={buffer_len} with max_draft={max_draft}; expected buffer_len >= "
                       f"max_draft + 1 so that a flushed row's drafts fit the live window")
    # Two distinct arrays: a cursor donated to a jitted step must not hold one buffer twice.
    return cls(base=jnp.zeros((int(num_slots),), jnp.int32),
               count=jnp.zeros((int(num_slots),), jnp.int32),
               buffer_len=int(buffer_len), max_draft=int(max_draft))

  def _check_values(self) -> None:
    _checks.check_host(
        lambda b, c: bool(np.all((b >= 0) & (b < self.ring_size) & (c >= 0) & (c <= self.buffer_len - 1))),
        lambda b, c: (f"cursor out of range: base must lie in [0, {self.ring_size}) and count in "
                      f"[0, {self.buffer_len - 1}]; got base in [{b.min()}, {b.max()}], count in "
                      f"[{c.min()}, {c.max()}]"),
        self.base, self.count)

  def plan(self, slots: jax.Array, num_tokens: int = 1, force_flush: Any = None,
           flush_all: bool = False) -> ReplayPlan:
    """Gathers the batch rows' cursors and decides per row whether this step flushes.

    Args:
      slots: int32[B] pool slot per row, negative = padding row.
      num_tokens: T tokens per row this step (1 = standard decode; up to ``max_draft + 1``).
      force_flush: optional bool[B]; True forces a flush on that row (ignored on padding rows).
      flush_all: every live row flushes this step (static). The small-batch policy: below the
        batch where replay beats conventional decode, windows stay empty and each step costs one
        conventional pass over the state (``config.replay_min_batch``). T = 1 only.
    """
    if not isinstance(flush_all, bool):
      raise ValueError(f"flush_all={flush_all!r}; expected a Python bool (it is static)")
    if flush_all and num_tokens != 1:
      raise ValueError(f"flush_all=True with num_tokens={num_tokens}: the flush-every-step policy is "
                       f"for one-token decode (verify steps keep their drafts in the ring)")
    _checks.expect_slots("slots", slots)
    if (not isinstance(num_tokens, (int, np.integer)) or isinstance(num_tokens, bool)
        or not 1 <= num_tokens <= self.max_draft + 1):
      raise ValueError(f"num_tokens={num_tokens!r}; expected an int in [1, max_draft + 1 = "
                       f"{self.max_draft + 1}] (create the cursor with a larger max_draft)")
    batch = slots.shape[0]
    if force_flush is not None:
      _checks.expect_shape("force_flush", force_flush, (batch,), "(bool[B])")
      _checks.expect_dtype("force_flush", force_flush, (jnp.bool_,))
    _checks.check_slots("slots", slots, self.num_slots)
    self._check_values()
    valid = slots >= 0
    safe = jnp.where(valid, slots, 0)
    base = jnp.where(valid, self.base[safe], 0)
    count = jnp.where(valid, self.count[safe], 0)
    natural = count + num_tokens > self.buffer_len - 1
    forced = jnp.zeros_like(valid) if force_flush is None else force_flush
    return ReplayPlan(slots=slots, base=base, count=count, flush=valid & (natural | forced | flush_all),
                      num_tokens=int(num_tokens), buffer_len=self.buffer_len, ring_size=self.ring_size,
                      flush_all=flush_all)

  def commit(self, plan: ReplayPlan, num_accepted: jax.Array | None = None) -> "ReplayCursor":
    """Advances the planned rows by their accepted token counts (the whole rollback).

    Args:
      plan: the plan of the step being committed.
      num_accepted: optional int32[B] in [1, T]; None = all T tokens accepted. Ignored on padding.
    """
    if (plan.ring_size, plan.buffer_len) != (self.ring_size, self.buffer_len):
      raise ValueError(f"plan was made for buffer_len={plan.buffer_len}, ring_size={plan.ring_size}; "
                       f"this cursor has buffer_len={self.buffer_len}, ring_size={self.ring_size}")
    t = plan.num_tokens
    if num_accepted is None:
      accepted = jnp.full(plan.slots.shape, t, jnp.int32)
    else:
      _checks.expect_dtype("num_accepted", num_accepted, (jnp.int32,))
      _checks.expect_shape("num_accepted", num_accepted, (plan.batch_size,), "(int32[B], in [1, T])")
      accepted = num_accepted
      _checks.check_host(
          lambda a, s: bool(np.all((a[s >= 0] >= 1) & (a[s >= 0] <= t))),
          lambda a, s: f"num_accepted must lie in [1, {t}] on live rows; got {a[s >= 0].tolist()}",
          accepted, plan.slots)
    new_base = jnp.where(plan.flush, (plan.base + plan.count + 1) % self.ring_size, plan.base)
    new_count = jnp.where(plan.flush, accepted - 1, plan.count + accepted)
    idx = _safe_index(plan.slots, self.num_slots)
    return self.replace(base=self.base.at[idx].set(new_base, mode="drop"),
                        count=self.count.at[idx].set(new_count, mode="drop"))

  def reset(self, slots: jax.Array) -> "ReplayCursor":
    """Empties the windows of ``slots`` (negative entries ignored): the checkpoint alone is the state."""
    _checks.expect_slots("slots", slots)
    _checks.check_slots("slots", slots, self.num_slots)
    idx = _safe_index(slots, self.num_slots)
    zeros = jnp.zeros(slots.shape, jnp.int32)
    return self.replace(base=self.base.at[idx].set(zeros, mode="drop"),
                        count=self.count.at[idx].set(zeros, mode="drop"))


def count_accepted(accepted: jax.Array, slots: jax.Array | None = None) -> jax.Array:
  """Accepted counts for ``commit`` from a per-token acceptance mask of linear draft chains.

  A verify step replays one contiguous chain per row, so token i can only be accepted together with
  every token before it, and token 0 (the emitted token) always is. A mask that is not such a
  prefix — tree / EAGLE top-k drafts whose accepted path skips a sibling — is refused: ValueError
  on concrete arrays (always) and inside ``jax.jit`` in checked mode. Without checked mode inside
  jit the length of the leading accepted run is returned, so a bad mask never commits a gap.

  Args:
    accepted: bool[B, T], True where the token was accepted.
    slots: optional int32[B]; rows with a negative slot (padding) are not checked.

  Returns:
    int32[B] in [1, T] (``num_accepted`` for ``cursor.commit``).
  """
  _checks.expect_dtype("accepted", accepted, (jnp.bool_,))
  _checks.expect_shape("accepted", accepted, (None, None), "(bool[B, T] acceptance mask)")
  if slots is not None:
    _checks.expect_slots("slots", slots, accepted.shape[0])

  def problems(a, s):
    rows = np.ones(a.shape[0], bool) if s is None else s >= 0
    a = a[rows]
    if not np.all(a[:, 0]):
      return f"accepted[:, 0] must be True on live rows (token 0 always commits); got {a.astype(int).tolist()}"
    gap = np.any(a[:, 1:] & ~a[:, :-1], axis=1)
    if np.any(gap):
      return (f"accepted must be a prefix on every live row (linear draft chains; tree drafts are not "
              f"supported); rows {np.flatnonzero(rows)[gap].tolist()} accept a token after a rejected one: "
              f"{a[gap].astype(int).tolist()}")
    return None

  def host(a, *s):
    msg = problems(np.asarray(a), np.asarray(s[0]) if s else None)
    if msg:
      raise ValueError(msg)

  arrays = (accepted,) if slots is None else (accepted, slots)
  if _checks._is_concrete(*arrays):
    host(*arrays)
  elif _checks.checks_enabled():
    jax.debug.callback(host, *arrays)
  # Length of the leading run of accepted tokens (at least token 0).
  run = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
  return jnp.maximum(run, 1).astype(jnp.int32)
