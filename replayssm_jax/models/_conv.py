"""What the mixers share: prompt validation and the mask of real positions, the causal depthwise
conv1d with its rolling per-slot state (prefill, one-token step, T-token verify + commit), and the
stand-in cursor a layer's ``prefill`` hands to ``write_state``.

Shapes: x [B, T, C] (prefill, verify) or [B, C] (decode); weight [W, C]; bias [C] or None;
conv_state [N, W-1, C] per pool slot, oldest input first; a verify window [B, W-1+T, C].
"""
import jax.numpy as jnp

from replayssm_jax import _checks, _dispatch, _slots
from replayssm_jax.cursor import ReplayCursor, ReplayPlan

f32 = jnp.float32


def real_positions(x, slots, lengths):
  """Validates a prefill's ``slots``/``lengths`` for x [B, T, D]; returns bool[B, T], True at
  real positions (t < lengths[b] on live rows; padding rows, slot < 0, are all padding)."""
  bsz, t = x.shape[:2]
  _checks.expect_slots("slots", slots, bsz)
  _checks.expect_dtype("lengths", lengths, (jnp.int32,))
  _checks.expect_shape("lengths", lengths, (bsz,), "(int32[B], real tokens per row)")
  return (jnp.arange(t)[None, :] < lengths[:, None]) & (slots >= 0)[:, None]


def plan_slots(plan, batch: int):
  """Validates a decode / verify ``plan`` for a batch of ``batch`` rows; returns ``plan.slots``."""
  if not isinstance(plan, ReplayPlan):
    raise ValueError(f"plan must be a ReplayPlan from cursor.plan(slots); got {type(plan).__name__}")
  _checks.expect_shape("plan.slots", plan.slots, (batch,), "(one slot per row of x)")
  return plan.slots


def _taps(window, weight, bias, t):
  """out_t = Σ_{i<W} w_i · window_{t+i} (+ bias) for t < T: window [B, W-1+T, C] → [B, T, C] f32.

  Written as W elementwise multiply-adds, not a dot: a contraction over W = 4 with C as a batch
  dimension let XLA pick channel-major layouts for the window, and the gather, concatenate and
  scatter of the conv state around it ran several times slower than their bytes (bench.model_trace).
  """
  wt = weight.astype(f32)
  out = sum(wt[i] * window[:, i:i + t].astype(f32) for i in range(weight.shape[0]))
  return out if bias is None else out + bias.astype(f32)


def prefill(x, weight, bias, conv_state, slots, lengths, *, resume=False):
  """Causal conv over right-padded prompts: out_t = Σ_{i<W} w_i · x_{t−(W−1)+i} (+ bias), zeros
  before the prompt start (``resume=False``) or the slot's stored W-1 inputs (``resume=True``:
  the prompt continues the slot's sequence). Returns (pre-activation [B, T, C] float32,
  conv_state) with each live slot's state = its last W-1 inputs (padding only follows them, so
  it never leaks back)."""
  w, t = weight.shape[0], x.shape[1]
  if resume:
    live = (slots >= 0)[:, None, None]
    hist = jnp.where(live, conv_state[jnp.where(slots >= 0, slots, 0)], 0).astype(x.dtype)
    padded = jnp.concatenate([hist, x], axis=1)                          # [B, W-1+T, C]
  else:
    padded = jnp.pad(x, ((0, 0), (w - 1, 0), (0, 0)))                     # [B, T+W-1, C]
  out = _taps(padded, weight, bias, t)
  # The W-1 inputs before position lengths[b]: padded rows lengths[b] .. lengths[b] + W-2.
  tail = jnp.take_along_axis(padded, (lengths[:, None] + jnp.arange(w - 1)[None, :])[:, :, None],
                             axis=1)
  return out, _slots.scatter_rows(conv_state, slots, tail)


def step(x, weight, bias, conv_state, slots, *, implementation=None):
  """One token per row: window = [W-1 stored inputs, x]; out = Σ_i w_i · window_i (+ bias).
  Returns (pre-activation [B, C] float32, conv_state); padding rows (slot < 0) change nothing.

  ``implementation``: "xla" (gather, taps, scatter), "pallas_triton" (``pallas.conv_triton``: the
  slots' states read and written in place, one launch) or None (the kernel on a GPU, measured
  faster inside the models: bench/RESULTS.md "The conv-step kernel"; XLA elsewhere)."""
  def run_xla():
    hist = _slots.gather(conv_state, slots)                              # [B, W-1, C]
    window = jnp.concatenate([hist, x[:, None, :].astype(hist.dtype)], axis=1)
    out = _taps(window, weight, bias, 1)[:, 0]
    return out, _slots.scatter_rows(conv_state, slots, window[:, 1:])

  def run_triton():
    from replayssm_jax.pallas import conv_triton
    return conv_triton.conv_step(x, weight, bias, conv_state, slots)

  return _dispatch.run("conv.step", implementation, {"xla": run_xla, "pallas_triton": run_triton})


def verify(x, weight, bias, conv_state, slots):
  """T tokens per row (speculative verify): window = [W-1 stored inputs, x_0 .. x_{T-1}];
  out_t = Σ_i w_i · window_{t+i} (+ bias), the same sum as ``step`` for each token.

  The conv state is *not* written: which inputs it must end with depends on how many tokens the
  step accepts, so the caller keeps the window and ``commit`` writes the state afterwards.

  Returns:
    (pre-activation [B, T, C] float32, window [B, W-1+T, C] in the conv state's dtype).
  """
  hist = _slots.gather(conv_state, slots)                                # [B, W-1, C]
  window = jnp.concatenate([hist, x.astype(hist.dtype)], axis=1)         # [B, W-1+T, C]
  return _taps(window, weight, bias, x.shape[1]), window


def commit(conv_state, window, slots, num_accepted):
  """Rolls each live slot's conv state forward by its accepted tokens only (the rollback).

  After accepting a = ``num_accepted[b]`` of the T verified tokens, the last W-1 inputs are
  window rows a .. a+W-2 (the stored inputs, then x_0 .. x_{a-1}); rejected drafts x_a .. never
  reach the state. Padding rows (slot < 0) change nothing.

  Args:
    conv_state: [N, W-1, C].
    window: [B, W-1+T, C] from ``verify``.
    slots: int32[B].
    num_accepted: int32[B] in [1, T] on live rows.
  """
  keep = conv_state.shape[1]
  rows = num_accepted[:, None] + jnp.arange(keep)[None, :]                # [B, W-1]
  tail = jnp.take_along_axis(window, rows[:, :, None], axis=1)
  return _slots.scatter_rows(conv_state, slots, tail)


def stand_in_cursor(bufs) -> ReplayCursor:
  """A cursor with the pool and ring size of ``bufs`` for ``write_state`` inside a layer's
  prefill; the model's shared cursor is reset once for all layers by the caller (LM.prefill).
  R is a power of two, so buffer_len = R gives ring size R."""
  return ReplayCursor.create(bufs.num_slots, buffer_len=bufs.ring_size)
