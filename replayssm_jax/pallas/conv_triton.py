"""The mixers' causal depthwise conv1d decode step in Pallas with the Triton lowering.

One token per row: row b reads the W-1 inputs its slot keeps, ``conv_state[slots[b]]``, in
place, and writes the slot's new state (the window shifted by one, x last) back in place:

    out[b, c] = Σ_{i<W-1} w[i, c] · state[s, i, c] + w[W-1, c] · x[b, c]  (+ bias[c]),  s = slots[b]

The XLA step (models/_conv.py) gathers every row's state into a copy, sums the taps from it and
scatters the shifted window back: the state crosses HBM four times. Here it is read once and
written once, in one launch. Numerics as the XLA step: x rounded to the state dtype (the window
is stored in it), taps summed in float32 in window order. Padding rows (slot < 0) read slot 0
(their output is the caller's to mask, as the XLA step's) and write nothing.

Grid (B, C/BC). Shapes: x [B, C]; weight [W, C]; bias [C] or None; conv_state [N, W-1, C];
slots int32[B]; out float32 [B, C].
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import _checks, config
from replayssm_jax.pallas import common

f32 = jnp.float32
OP = "conv.step[pallas_triton]"
MIN_BLOCK_C = 16       # below this a channel count's largest power-of-two divisor is not worth a launch


def _kernel(slots_ref, x_ref, w_ref, *refs, width, block_c, has_bias):
  bias_ref, refs = (refs[0], refs[1:]) if has_bias else (None, refs)
  state_ref, out_ref, state_out_ref = refs
  b, ct = pl.program_id(0), pl.program_id(1)
  s = slots_ref[b]
  cols = pl.ds(ct * block_c, block_c)
  src = jnp.maximum(s, 0)
  window = [state_ref[src, i, cols] for i in range(width - 1)]
  window.append(x_ref[b, cols].astype(state_ref.dtype))
  out = w_ref[0, cols].astype(f32) * window[0].astype(f32)
  for i in range(1, width):
    out = out + w_ref[i, cols].astype(f32) * window[i].astype(f32)
  if has_bias:
    out = out + bias_ref[cols].astype(f32)
  out_ref[b, cols] = out

  @pl.when(s >= 0)
  def _():
    for i in range(width - 1):
      state_out_ref[s, i, cols] = window[i + 1]


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _step(x, weight, bias, conv_state, slots, *, cfg, interpret):
  bsz, channels = x.shape
  has_bias = bias is not None
  args = (slots, x, weight) + ((bias,) if has_bias else ()) + (conv_state,)
  kernel = functools.partial(_kernel, width=weight.shape[0], block_c=cfg.block_c,
                             has_bias=has_bias)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      kernel, grid=(bsz, channels // cfg.block_c),
      in_specs=[any_spec] * len(args), out_specs=[any_spec] * 2,
      out_shape=[jax.ShapeDtypeStruct((bsz, channels), f32),
                 jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)],
      input_output_aliases={len(args) - 1: 1}, name="replayssm_conv_step", interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
  )(*args)


def conv_step(x, weight, bias, conv_state, slots, *, block_c=None, num_warps=None):
  """One causal-conv decode token per row, the slots' states updated in place.

  Args:
    x: [B, C] this token's pre-conv inputs.
    weight: [W, C] taps, oldest input first; bias: [C] or None.
    conv_state: [N, W-1, C] the last W-1 inputs per pool slot, oldest first (donate it: it is
      updated in place).
    slots: int32[B] pool slots; negative = padding row (writes nothing).
    block_c, num_warps: launch overrides (``block_c`` a power of two dividing C).

  Returns:
    (out float32 [B, C] pre-activation, conv_state).

  Raises:
    ValueError: bad shapes. NotImplementedError: C without a power-of-two divisor of at least 16,
    or arrays past Triton's int32 element offsets.
  """
  _checks.expect_shape("x", x, (None, None), "([B, C])")
  bsz, channels = x.shape
  _checks.expect_shape("weight", weight, (None, channels), f"([W, C] with C={channels} as x)")
  width = weight.shape[0]
  if width < 2:
    raise ValueError(f"weight has shape {list(weight.shape)}; expected W >= 2 taps")
  if bias is not None:
    _checks.expect_shape("bias", bias, (channels,), f"([C] with C={channels})")
  _checks.expect_shape("conv_state", conv_state, (None, width - 1, channels),
                       f"([N, W-1, C] with W={width}, C={channels})")
  _checks.expect_slots("slots", slots, bsz)
  cfg = config.conv_step_config(channels=channels)
  if block_c is not None:
    if not common.is_pow2(block_c) or channels % block_c:
      raise ValueError(f"block_c={block_c}; expected a power of two dividing C={channels}")
    cfg = dataclasses.replace(cfg, block_c=int(block_c))
  if num_warps is not None:
    cfg = dataclasses.replace(cfg, num_warps=int(num_warps))
  if cfg.block_c < MIN_BLOCK_C:
    raise NotImplementedError(f"{OP}: C={channels} has no power-of-two divisor >= {MIN_BLOCK_C}")
  common.require_triton_addressable(OP, x=x, conv_state=conv_state)
  return _step(x, weight, bias, conv_state, slots, cfg=cfg, interpret=common.interpret_mode())
