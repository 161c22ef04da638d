"""Pallas-Triton addresses a ref with int32 element offsets up to 2**32 bytes and int64 above
(jax/_src/pallas/triton/lowering.py). So the kernels take pools past 2**31 elements of 2- and
4-byte dtypes, and refuse only 1-byte arrays of 2**31 to 2**32 elements, whose int32 offsets
would wrap and address the wrong rows silently (NotImplementedError; ``implementation=None`` falls
back to XLA).

Everything here is abstract: pools past 2**31 elements are never allocated on CPU
(tests/test_large_pools_gpu.py runs such pools on a GPU).
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import lowering as triton_lowering

import replayssm_jax as rs
from replayssm_jax.pallas import attention_triton, common
from tests.helpers import lower_for_h200

PER_SLOT = 16 * 16                                    # Hk = Hv = 1 (GDN), H = G = 1 (Mamba2), 16 × 16
PAST_INT32 = common.INT32_OFFSET_ELEMENTS // PER_SLOT + 1   # one slot past 2**31 elements
B = 2
sd = jax.ShapeDtypeStruct


def _gdn_inputs(tokens=None):
  lead = (B,) if tokens is None else (B, tokens)
  return (sd((*lead, 1, 16), jnp.float32), sd((*lead, 1, 16), jnp.float32),
          sd((*lead, 1, 16), jnp.float32), sd((*lead, 1), jnp.float32), sd((*lead, 1), jnp.float32))


def _mamba2_inputs():
  return (sd((B, 1, 16), jnp.float32), sd((B, 1), jnp.float32), sd((1,), jnp.float32),
          sd((B, 1, 16), jnp.float32), sd((B, 1, 16), jnp.float32))


def _gdn_decode(num_slots, implementation, dtype=jnp.float32):
  pool, slots = sd((num_slots, 1, 16, 16), dtype), sd((B,), jnp.int32)
  return jax.eval_shape(lambda *a: rs.gdn.decode(*a, implementation=implementation),
                        *_gdn_inputs(), pool, slots)


def _mamba2_decode(num_slots, implementation, dtype=jnp.float32):
  pool, slots = sd((num_slots, 1, 16, 16), dtype), sd((B,), jnp.int32)
  return jax.eval_shape(lambda *a: rs.mamba2.decode(*a, implementation=implementation),
                        *_mamba2_inputs(), pool, slots)


def _replay(family, num_slots, implementation, dtype=jnp.float32):
  """replay_decode over abstract buffers of ``num_slots`` slots (buffer_len 4)."""
  def run(*xs):
    cursor = rs.ReplayCursor.create(num_slots, buffer_len=4)
    plan = cursor.plan(jnp.arange(B, dtype=jnp.int32))
    if family == "gdn":
      bufs = rs.gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=1, num_v_heads=1,
                                         head_k_dim=16, head_v_dim=16, state_dtype=dtype)
      return rs.gdn.replay_decode(*xs, bufs, plan, implementation=implementation)
    bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=1, head_dim=16,
                                          num_groups=1, state_dim=16, state_dtype=dtype)
    return rs.mamba2.replay_decode(*xs, bufs, plan, implementation=implementation)
  return jax.eval_shape(run, *(_gdn_inputs() if family == "gdn" else _mamba2_inputs()))


def _attention(num_slots, implementation, dtype=jnp.float32):
  """Decode attention over KV pools of ``num_slots`` slots of 16 positions (Hkv 1, Dh 16)."""
  assert implementation == "pallas_triton"
  pool = sd((num_slots, 16, 1, 16), dtype)
  return jax.eval_shape(lambda q, k, v, s, p: attention_triton.decode_attention(
      q, k, v, s, p, scale=0.25), sd((B, 1, 1, 16), jnp.float32), pool, pool,
      sd((B,), jnp.int32), sd((B,), jnp.int32))


CASES = {"gdn.decode": _gdn_decode, "mamba2.decode": _mamba2_decode,
         "gdn.replay_decode": functools.partial(_replay, "gdn"),
         "mamba2.replay_decode": functools.partial(_replay, "mamba2"),
         "attention": _attention}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("op", sorted(CASES))
def test_triton_takes_pools_past_2_31_elements(op, dtype):
  CASES[op](PAST_INT32, "pallas_triton", dtype)


def test_the_lowering_switches_to_int64_offsets_past_2_32_bytes(monkeypatch):
  """The premise of ``triton_addressable``, read off the offsets the lowering builds for the state
  pool of a conventional GDN decode (i32 at exactly 2**32 bytes, i64 one slot later)."""
  seen = {}
  build = triton_lowering._compute_offsets_from_indices

  def spy(block_info, nd_indexer):
    built = build(block_info, nd_indexer)
    offsets = built[0] if isinstance(built, tuple) else built   # jax 0.12: (offsets, bounds mask)
    seen[block_info.full_shape_dtype.shape] = str(offsets.type)
    return built

  monkeypatch.setattr(triton_lowering, "_compute_offsets_from_indices", spy)
  for slots, width in ((common.INT32_OFFSET_ELEMENTS // PER_SLOT // 2, "i32"),
                       (common.INT32_OFFSET_ELEMENTS // PER_SLOT // 2 + 1, "i64")):
    pool = sd((slots, 1, 16, 16), jnp.float32)
    lower_for_h200(lambda pool, s, *x: rs.gdn.decode(*x, pool, s, implementation="pallas_triton"),
                   (0,), pool, sd((B,), jnp.int32), *_gdn_inputs())
    assert seen[pool.shape].endswith(f"{width}>"), (pool.shape, seen[pool.shape])


@pytest.mark.parametrize("shape,dtype,ok", [
    ((2**31,), jnp.int8, True), ((2**31 + 1,), jnp.int8, False), ((2**32,), jnp.int8, False),
    ((2**32 + 1,), jnp.int8, True), ((2**31 + 1,), jnp.bfloat16, True),
    ((2**33,), jnp.float32, True)])
def test_triton_addressable(shape, dtype, ok):
  assert common.triton_addressable(shape, dtype) is ok


def test_message_names_the_operand_and_its_shape():
  with pytest.raises(NotImplementedError, match="int32 element offsets") as e:
    common.require_triton_addressable("op", pool=sd((2**31 + 1,), jnp.float8_e4m3fn),
                                      slots=sd((B,), jnp.int32))
  assert f"pool float8_e4m3fn[{2**31 + 1}]" in str(e.value) and "slots" not in str(e.value)
