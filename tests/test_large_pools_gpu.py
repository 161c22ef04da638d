"""GPU-only: the compiled Pallas-Triton kernels address arrays past 2**31 elements (marker ``gpu``).

Pallas-Triton switches a ref's element offsets to int64 above 2**32 bytes
(tests/test_triton_offsets.py pins that in the lowering); here the compiled kernels read and write
the far end of such pools, where int32 offsets would wrap below the array. Each case puts the
rows it runs at the last slots of a pool of just over 2**31 elements and compares them with the XLA
implementation on a small pool holding the same rows.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax.models.attention import attend_xla
from replayssm_jax.pallas import attention_triton, common
from tests.helpers import make_gdn_step, max_err

pytestmark = pytest.mark.gpu


def test_gdn_decode_at_the_end_of_a_pool_past_2_31_elements():
  kd = vd = 128
  per_slot = kd * vd                                       # Hk = Hv = 1
  n = common.INT32_OFFSET_ELEMENTS // per_slot + 4         # 2**31 + 4 slots' worth: 8.6 GB f32
  rng = np.random.default_rng(0)
  slots = np.array([n - 1, n - 3, -1], np.int32)
  rows = jnp.asarray(0.1 * rng.normal(size=(2, 1, vd, kd)), jnp.float32)
  pool = jnp.zeros((n, 1, vd, kd), jnp.float32).at[slots[:2]].set(rows)
  args = make_gdn_step(rng, len(slots), 1, 1, kd, vd).as_jax()
  decode = jax.jit(lambda pool, *a: rs.gdn.decode(*a, pool, jnp.asarray(slots),
                                                  implementation="pallas_triton"),
                   donate_argnums=0)
  o, pool = decode(pool, *args)
  small = jnp.zeros((3, 1, vd, kd), jnp.float32).at[:2].set(rows)
  o_ref, small = rs.gdn.decode(*args, small, jnp.asarray([0, 1, -1], jnp.int32),
                               implementation="xla")
  assert max_err(np.asarray(o), np.asarray(o_ref)) < 1e-5
  assert max_err(np.asarray(pool[slots[:2]]), np.asarray(small[:2])) < 1e-5
  # The slots int32 offsets would have wrapped to, and the neighbours, are untouched.
  assert not np.any(np.asarray(pool[n - 2])) and not np.any(np.asarray(pool[:4]))


def test_decode_attention_at_the_end_of_a_pool_past_2_31_elements():
  h, hkv, dh, s = 4, 1, 128, 16384
  n = common.INT32_OFFSET_ELEMENTS // (s * hkv * dh) + 2   # 2**31 + 2**22 elements: 4.3 GB bf16
  rng = np.random.default_rng(1)
  rows = [jnp.asarray(rng.normal(size=(1, s, hkv, dh)), jnp.bfloat16) for _ in range(2)]
  k_pool, v_pool = (jnp.zeros((n, s, hkv, dh), jnp.bfloat16).at[n - 1:].set(r) for r in rows)
  q = jnp.asarray(rng.normal(size=(2, 1, h, dh)), jnp.float32)
  start = jnp.asarray([s - 1, 4000], jnp.int32)
  o = attention_triton.decode_attention(q, k_pool, v_pool, jnp.asarray([n - 1, n - 1], jnp.int32),
                                        start, scale=dh ** -0.5)
  del k_pool, v_pool
  pos = start[:, None]
  with jax.default_matmul_precision("highest"):
    ref = attend_xla(q, rows[0], rows[1], jnp.zeros((2,), jnp.int32), pos, scale=dh ** -0.5)
  assert max_err(np.asarray(o), np.asarray(ref)) < 2e-2
