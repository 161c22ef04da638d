"""The conv decode-step kernel (``pallas.conv_triton``), CPU interpret mode.

Oracle: float64 numpy from the math (the slot's W-1 stored inputs then x rounded to the state
dtype; taps summed; the state shifted by one, x last). Rows cover permuted slots in a pool larger
than the batch and a padding row; pool slots of no batch row hold NaN and must stay NaN (never
written), as must every state of a padding row's slot 0 when no live row uses it.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.models import _conv
from replayssm_jax.pallas import conv_triton
from tests.helpers import lower_for_h200

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

SLOTS = np.array([5, 2, -1, 6, 3], np.int32)
NUM_SLOTS = 7
TOL = 1e-6   # relative: f32 taps over the same stored values, either state dtype


def _inputs(rng, channels, width, dtype, bias):
  x = jnp.asarray(rng.normal(size=(len(SLOTS), channels)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(width, channels)), jnp.bfloat16)
  b = jnp.asarray(rng.normal(size=(channels,)), jnp.bfloat16) if bias else None
  state = rng.normal(size=(NUM_SLOTS, width - 1, channels)).astype(np.float32)
  state[[s for s in range(NUM_SLOTS) if s not in SLOTS]] = np.nan   # no batch row reads these
  return x, weight, b, jnp.asarray(state, dtype)


def _reference(x, weight, bias, state, slots):
  f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
  x_stored = f64(jnp.asarray(x).astype(state.dtype))
  st = f64(state)
  out = np.zeros(x.shape)
  new = st.copy()
  for b, s in enumerate(slots):
    if s < 0:
      continue
    window = np.concatenate([st[s], x_stored[b][None]], axis=0)     # [W, C]
    out[b] = (f64(weight) * window).sum(axis=0) + (0 if bias is None else f64(bias))
    new[s] = window[1:]
  return out, new


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("channels,width,bias", [(96, 4, False), (64, 4, True), (256, 2, True)])
def test_matches_float64_reference_and_the_xla_step(dtype, channels, width, bias):
  rng = np.random.default_rng(channels + width)
  x, weight, b, state = _inputs(rng, channels, width, dtype, bias)
  slots = jnp.asarray(SLOTS)
  out, new = conv_triton.conv_step(x, weight, b, state, slots)
  ref_out, ref_new = _reference(x, weight, b, state, SLOTS)
  live = SLOTS >= 0
  assert out.dtype == jnp.float32 and new.dtype == state.dtype
  assert np.abs(np.asarray(out)[live] - ref_out[live]).max() < TOL * np.abs(ref_out).max()
  # The new state is stored values moved, exactly; untouched slots (NaN included) stay as they were.
  np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)), ref_new.astype(np.float32))
  xla_out, xla_new = _conv.step(x, weight, b, state, slots, implementation="xla")
  np.testing.assert_allclose(np.asarray(out)[live], np.asarray(xla_out)[live], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)),
                                np.asarray(xla_new.astype(jnp.float32)))


def test_the_model_step_dispatches_to_it():
  """``_conv.step(implementation="pallas_triton")`` is this kernel: same outputs, same state."""
  rng = np.random.default_rng(0)
  x, weight, b, state = _inputs(rng, 64, 4, "bfloat16", True)
  slots = jnp.asarray(SLOTS)
  direct = conv_triton.conv_step(x, weight, b, state, slots)
  via = _conv.step(x, weight, b, state, slots, implementation="pallas_triton")
  for a, c in zip(direct, via):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(c.astype(jnp.float32)))


def test_block_override_tiles_channels_alike():
  rng = np.random.default_rng(1)
  x, weight, b, state = _inputs(rng, 128, 4, "float32", False)
  slots = jnp.asarray(SLOTS)
  one = conv_triton.conv_step(x, weight, b, state, slots)
  four = conv_triton.conv_step(x, weight, b, state, slots, block_c=32, num_warps=1)
  for a, c in zip(one, four):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_bad_inputs_raise_value_error():
  rng = np.random.default_rng(2)
  x, weight, b, state = _inputs(rng, 64, 4, "bfloat16", True)
  slots = jnp.asarray(SLOTS)
  cases = [
      ((x[:, :32], weight, b, state, slots), {}, "weight has shape"),
      ((x, weight[:1], b, state[:, :0], slots), {}, "W >= 2"),
      ((x, weight, b[:8], state, slots), {}, "bias has shape"),
      ((x, weight, b, state[:, :2], slots), {}, "conv_state has shape"),
      ((x, weight, b, state, slots[:3]), {}, "slots has shape"),
      ((x, weight, b, state, slots.astype(jnp.float32)), {}, "slots has dtype"),
      ((x, weight, b, state, slots), {"block_c": 48}, "block_c=48"),
  ]
  for args, kw, match in cases:
    with pytest.raises(ValueError, match=match):
      conv_triton.conv_step(*args, **kw)


def test_channels_without_a_power_of_two_block_are_not_implemented():
  rng = np.random.default_rng(3)
  x, weight, b, state = _inputs(rng, 72, 4, "bfloat16", False)    # largest power-of-two divisor: 8
  with pytest.raises(NotImplementedError, match="C=72"):
    conv_triton.conv_step(x, weight, b, state, jnp.asarray(SLOTS))
  # implementation=None falls back to XLA for it.
  out, _ = _conv.step(x, weight, b, state, jnp.asarray(SLOTS))
  assert out.shape == (len(SLOTS), 72)


@pytest.mark.parametrize("channels,bias", [(8192, False), (10240, True)])   # Qwen3.5-4B, Nemotron-H-8B
def test_lowers_for_h200_in_place(channels, bias):
  """Built for a real GPU at production shapes: one Triton launch, the state pool aliased."""
  b = 256
  x = jax.ShapeDtypeStruct((b, channels), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, channels), jnp.bfloat16)
  state = jax.ShapeDtypeStruct((b + 8, 3, channels), jnp.bfloat16)
  slots = jax.ShapeDtypeStruct((b,), jnp.int32)
  args = (x, w) + ((jax.ShapeDtypeStruct((channels,), jnp.bfloat16),) if bias else ()) + (state, slots)

  def fn(x, w, *rest):
    return conv_triton.conv_step(x, w, rest[0] if bias else None, *rest[-2:])
  text = lower_for_h200(fn, (len(args) - 2,), *args)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert text.count("tf.aliasing_output") == 1
