"""GPU-only check of the compiled decode-attention kernel (marker ``gpu``; skipped on CPU).

Interpret mode runs the kernel body in exact float32; this compiles it at Qwen3.5-4B's attention
geometry (B 8, H 16, Hkv 4, Dh 256, S 1040) and checks it against the float64 oracle of
tests/test_attention_kernel.py and against the XLA path (``attend_xla``), for decode and verify,
with and without splits of the rows' blocks, bf16 and f32 pools.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.models.attention import attend_xla
from replayssm_jax.pallas import attention_triton
from tests.test_attention_kernel import _reference

pytestmark = pytest.mark.gpu

H, HKV, DH, S = 16, 4, 256, 1040
SLOTS = np.array([9, 3, -1, 0, 11, 6, 1, 4], np.int32)
TOL = {"float32": 1e-4, "bfloat16": 2e-2}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_compiled_kernel_matches_oracle_and_xla(dtype, t, num_splits):
  rng = np.random.default_rng(t)
  starts = np.array([0, 31, 5, 1023, S - t, 64 - t, 500, 777], np.int32)
  q = rng.normal(size=(len(SLOTS), t, H, DH)).astype(np.float32)
  k, v = (np.asarray(jnp.asarray(rng.normal(size=(12, S, HKV, DH)), dtype).astype(jnp.float32))
          for _ in range(2))
  args = (jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(SLOTS),
          jnp.asarray(starts))
  o = np.asarray(attention_triton.decode_attention(*args, scale=DH ** -0.5, num_splits=num_splits))
  assert np.all(o[SLOTS < 0] == 0)
  live = SLOTS >= 0
  ref = _reference(q, k, v, SLOTS, starts, dtype, DH ** -0.5)
  assert np.abs(o - ref)[live].max() < TOL[jnp.dtype(dtype).name]
  pos = jnp.asarray(starts)[:, None] + jnp.arange(t)[None, :]
  with jax.default_matmul_precision("highest"):   # the XLA path in IEEE f32, not TF32
    xla = np.asarray(attend_xla(*args[:4], pos, scale=DH ** -0.5))
  assert np.abs(o - xla)[live].max() < TOL[jnp.dtype(dtype).name]
