"""The shared fold kernel (pallas/fold_triton.py) against a float64 step loop, CPU interpret mode.

Checks the window product's two forms at f32 accuracy: the IEEE-f32 dot (f32 key ring) and the
three-term bf16 split (bf16 key ring), on windows that wrap the ring and rings poisoned with NaN
outside every window.
"""
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.config import KernelConfig
from replayssm_jax.pallas import fold_triton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

NUM_SLOTS, H, HK, V, K, R = 3, 2, 1, 32, 32, 16
SLOTS, BASE, LENGTH = [2, -1, 0], [5, 0, 12], [16, 3, 7]   # row 1 is padding; rows 0, 2 wrap


def _oracle(state, ring_k, ring_u, ring_g):
  """S ← e^{g_j} S + u_j k_jᵀ over each row's window, in float64."""
  out = np.zeros((len(SLOTS), H, V, K))
  for b, (s, base, length) in enumerate(zip(SLOTS, BASE, LENGTH)):
    if s < 0:
      continue
    for h in range(H):
      S = state[s, h].astype(np.float64)
      for j in range(length):
        at = (base + j) % R
        S = (np.exp(np.float64(ring_g[s, h, at])) * S
             + np.outer(ring_u[s, h, at].astype(np.float64), ring_k[s, h // (H // HK), at]))
      out[b, h] = S
  return out


@pytest.mark.parametrize("ring_dtype", ["float32", "bfloat16"])
def test_fold_matches_float64_step_loop(ring_dtype):
  rng = np.random.default_rng(0)
  state = rng.normal(size=(NUM_SLOTS, H, V, K)).astype(np.float32)
  ring_k = rng.normal(size=(NUM_SLOTS, HK, R, K)).astype(np.float32)
  ring_u = rng.normal(size=(NUM_SLOTS, H, R, V)).astype(np.float32)
  ring_g = -0.2 * rng.random(size=(NUM_SLOTS, H, R)).astype(np.float32)
  # Exactly the values the kernel sees (rounded to the ring dtype), NaN outside every window.
  ring_k, ring_u = (np.array(jnp.asarray(x, ring_dtype).astype(jnp.float32)) for x in (ring_k, ring_u))
  for s, base, length in zip(SLOTS, BASE, LENGTH):
    if s >= 0:
      dead = [(base + j) % R for j in range(length, R)]
      ring_k[s, :, dead], ring_u[s, :, dead], ring_g[s, :, dead] = np.nan, np.nan, np.nan
  want = _oracle(state, ring_k, ring_u, ring_g)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  got = fold_triton.fold(
      jnp.asarray(state), jnp.asarray(ring_k, ring_dtype), jnp.asarray(ring_u, ring_dtype),
      jnp.asarray(ring_g), i32(SLOTS), i32(BASE), i32(LENGTH), i32(range(len(SLOTS))), len(SLOTS),
      cfg=KernelConfig(block_v=16, block_k=32, num_warps=4), row_slots=len(SLOTS), interpret=True,
      into_checkpoint=False, name="fold_test")
  got = np.asarray(got)
  assert np.all(got[1] == 0.0)                                   # padding row: zeros
  rel = np.max(np.abs(got - want)) / np.max(np.abs(want))
  assert rel < 1e-6, rel                                         # f32 accuracy, not TF32 / bf16


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_compact_rows_lists_flagged_rows_in_order(batch):
  """compact_rows == jnp.nonzero(size=B, fill_value=0): the fold grid's row list."""
  rng = np.random.default_rng(batch)
  for p in (0.0, 0.1, 0.5, 1.0):
    flags = rng.random(batch) < p
    want = np.flatnonzero(flags)
    got = np.asarray(fold_triton.compact_rows(jnp.asarray(flags)))
    np.testing.assert_array_equal(got, np.concatenate([want, np.zeros(batch - len(want), np.int64)]))
