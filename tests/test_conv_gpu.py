"""GPU-only check of the compiled conv decode-step kernel (marker ``gpu``; skipped on CPU).

Interpret mode runs the kernel body on the CPU; this compiles it at Qwen3.5-4B's GDN conv
(C = 8192, no bias) and Nemotron-H-8B's Mamba2 conv (C = 10240, bias), B = 256 rows on permuted
slots of a larger pool with padding rows, and checks it against the float64 oracle of
tests/test_conv_kernel.py and the XLA step: outputs to float32 rounding, the state exactly.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.models import _conv
from replayssm_jax.pallas import conv_triton
from tests.test_conv_kernel import _reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("channels,bias", [(8192, False), (10240, True)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_kernel_matches_oracle_and_xla(channels, bias, dtype):
  rng = np.random.default_rng(channels)
  num_slots, bsz = 300, 256
  slots = rng.permutation(num_slots)[:bsz].astype(np.int32)
  slots[[3, 100]] = -1
  x = jnp.asarray(rng.normal(size=(bsz, channels)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(4, channels)), jnp.bfloat16)
  b = jnp.asarray(rng.normal(size=(channels,)), jnp.bfloat16) if bias else None
  state = jnp.asarray(rng.normal(size=(num_slots, 3, channels)), dtype)
  out, new = conv_triton.conv_step(x, w, b, state, jnp.asarray(slots))
  ref_out, ref_new = _reference(x, w, b, state, slots)
  live = slots >= 0
  assert np.abs(np.asarray(out)[live] - ref_out[live]).max() < 1e-6 * np.abs(ref_out).max()
  np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)), ref_new.astype(np.float32))
  xla_out, xla_new = _conv.step(x, w, b, state, jnp.asarray(slots), implementation="xla")
  np.testing.assert_allclose(np.asarray(out)[live], np.asarray(xla_out)[live], rtol=1e-6, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)),
                                np.asarray(xla_new.astype(jnp.float32)))
