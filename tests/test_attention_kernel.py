"""The slot-indexed decode-attention kernel (``pallas.attention_triton``), CPU interpret mode.

Oracle: float64 numpy, written from the math (gather the slot's row, softmax over positions
0 .. start + t, grouped-query heads), fed with q rounded to the cache dtype as the kernel casts it.
Rows cover permuted slots in a pool larger than the batch, a padding row, start 0, a lane window
ending at and crossing a K/V block edge, and rows whose last block would run past S (the kernel
then re-reads the block ending at S). NaN is planted where the kernel must not read: pool rows of
no batch row, and positions past each row's last block.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.pallas import attention_triton
from tests.helpers import lower_for_h200

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

S, BLOCK = 40, 16          # S not a multiple of the block: the last block is clamped to end at S
SLOTS = np.array([5, 2, -1, 0, 6], np.int32)
NUM_SLOTS = 7
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _starts(t):
  """start 0; the lanes end exactly at a block edge; they cross one; padding; the last S tokens."""
  return np.array([0, BLOCK - t, BLOCK - 1, 3, S - t], np.int32)


def _inputs(rng, t, h, hkv, dh, dtype, starts, slots=SLOTS, num_slots=NUM_SLOTS, seq=S, block=BLOCK):
  q = rng.normal(size=(len(slots), t, h, dh)).astype(np.float32)
  k = rng.normal(size=(num_slots, seq, hkv, dh)).astype(np.float32)
  v = rng.normal(size=(num_slots, seq, hkv, dh)).astype(np.float32)
  k, v = (np.array(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (k, v))   # as stored
  unread = np.ones(num_slots, bool)
  for s, st in zip(slots, starts):
    if s >= 0:
      unread[s] = False
      end = -(-(st + t) // block) * block       # the row's last block ends here (or at S)
      k[s, end:], v[s, end:] = np.nan, np.nan
  k[unread], v[unread] = np.nan, np.nan
  return q, k, v


def _reference(q, k, v, slots, starts, dtype, scale):
  q = np.asarray(jnp.asarray(q).astype(dtype).astype(jnp.float32), np.float64)
  k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
  bsz, t, h, _ = q.shape
  group = h // k.shape[2]
  o = np.zeros(q.shape)
  for b in np.flatnonzero(slots >= 0):
    for i in range(t):
      n = min(starts[b] + i, k.shape[1] - 1) + 1
      for head in range(h):
        keys, values = k[slots[b], :n, head // group], v[slots[b], :n, head // group]
        logits = keys @ q[b, i, head] * scale
        w = np.exp(logits - logits.max())
        o[b, i, head] = (w / w.sum()) @ values
  return o


def _check(t, h, hkv, dh, dtype, seed=0, **knobs):
  rng = np.random.default_rng(seed)
  starts = _starts(t)
  q, k, v = _inputs(rng, t, h, hkv, dh, dtype, starts)
  scale = dh ** -0.5
  o = attention_triton.decode_attention(
      jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(SLOTS),
      jnp.asarray(starts), scale=scale, block_kv=BLOCK, **knobs)
  assert o.shape == q.shape and o.dtype == jnp.float32
  o = np.asarray(o)
  assert np.all(o[SLOTS < 0] == 0)
  err = np.abs(o - _reference(q, k, v, SLOTS, starts, dtype, scale)).max()
  assert err < TOL[jnp.dtype(dtype).name], err


# (T, H, Hkv, Dh, dtype, num_splits): G = H / Hkv in {1, 4}, T in {1, 4}, both pool dtypes, and
# splits of a row's blocks (4 splits: short rows leave some empty).
CASES = [
    (1, 2, 2, 64, jnp.float32, 1),
    (4, 8, 2, 64, jnp.bfloat16, 1),
    (1, 8, 2, 64, jnp.float32, 2),
    (4, 2, 2, 64, jnp.float32, 4),
    (1, 4, 1, 256, jnp.bfloat16, 1),
]


@pytest.mark.parametrize("t,h,hkv,dh,dtype,splits", CASES)
def test_matches_float64_reference(t, h, hkv, dh, dtype, splits):
  _check(t, h, hkv, dh, dtype, num_splits=splits)


def test_default_launch_on_a_short_pool():
  """S below the default block: the block shrinks to the largest power of two that fits."""
  rng = np.random.default_rng(3)
  slots, starts = np.array([1, 0], np.int32), np.array([0, 17], np.int32)
  q, k, v = _inputs(rng, 2, 4, 2, 64, jnp.float32, starts, slots=slots, num_slots=2, seq=20,
                    block=16)
  o = attention_triton.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                        jnp.asarray(slots), jnp.asarray(starts), scale=0.125)
  err = np.abs(np.asarray(o) - _reference(q, k, v, slots, starts, jnp.float32, 0.125)).max()
  assert err < TOL["float32"], err


def _args(b=2, t=1, h=4, hkv=2, dh=64, n=3, seq=32, dtype=jnp.float32):
  return (jnp.zeros((b, t, h, dh), jnp.float32), jnp.zeros((n, seq, hkv, dh), dtype),
          jnp.zeros((n, seq, hkv, dh), dtype), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))


def test_bad_inputs_raise_value_error():
  q, k, v, slots, start = _args()
  call = lambda *a, **kw: attention_triton.decode_attention(*a, scale=1.0, **kw)
  with pytest.raises(ValueError, match=r"q has shape \[2, 4, 64\]"):
    call(q[:, 0], k, v, slots, start)
  with pytest.raises(ValueError, match="k_pool has shape"):
    call(q, k[..., :32], v, slots, start)
  with pytest.raises(ValueError, match="v_pool has shape"):
    call(q, k, v[:, :16], slots, start)
  with pytest.raises(ValueError, match="v_pool has dtype bfloat16"):
    call(q, k, v.astype(jnp.bfloat16), slots, start)
  with pytest.raises(ValueError, match="k_pool has dtype int32"):
    call(q, k.astype(jnp.int32), v, slots, start)
  with pytest.raises(ValueError, match="H=4 query heads is not a multiple of Hkv=3"):
    call(q, *_args(hkv=3)[1:3], slots, start)
  with pytest.raises(ValueError, match="slots has shape"):
    call(q, k, v, slots[:1], start)
  with pytest.raises(ValueError, match="start has dtype"):
    call(q, k, v, slots, start.astype(jnp.float32))
  with pytest.raises(ValueError, match="block_kv=0"):
    call(q, k, v, slots, start, block_kv=0)


def test_valid_inputs_the_kernel_cannot_run_raise_not_implemented():
  call = lambda *a, **kw: attention_triton.decode_attention(*a, scale=1.0, **kw)
  with pytest.raises(NotImplementedError, match="Dh=48"):
    call(*_args(dh=48))
  with pytest.raises(NotImplementedError, match="T=17"):
    call(*_args(t=17))
  with pytest.raises(NotImplementedError, match="S=8"):
    call(*_args(seq=8))
  with pytest.raises(NotImplementedError, match="block_kv=24"):
    call(*_args(), block_kv=24)
  with pytest.raises(NotImplementedError, match="block_kv=64 with S=32"):
    call(*_args(), block_kv=64)


@pytest.mark.parametrize("geometry", ["qwen35_4b", "nemotron_h_8b"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_h200(geometry, dtype):
  """Built for a real GPU (not interpreted) at production shapes, the kernel lowers to one
  Triton launch: no non-power-of-two block, no primitive without a Triton lowering."""
  h, hkv, dh = {"qwen35_4b": (16, 4, 256), "nemotron_h_8b": (32, 8, 128)}[geometry]
  for t, b in ((1, 256), (4, 8)):
    q = jax.ShapeDtypeStruct((b, t, h, dh), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b + 3, 1040, hkv, dh), dtype)
    ints = jax.ShapeDtypeStruct((b,), jnp.int32)
    text = lower_for_h200(lambda *a: attention_triton.decode_attention(*a, scale=dh ** -0.5), (),
                          q, kv, kv, ints, ints)
    assert text.count("__gpu$xla.gpu.triton") == 1
