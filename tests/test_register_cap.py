"""bench.register_cap: the Triton register cap reaches the lowered kernels it names, and only them.

Lowered for an abstract H200 on CPU (tests/helpers.lower_for_h200): the Triton module travels as
bytecode inside the custom call, where the attribute name shows as text.
"""
import jax.numpy as jnp
import pytest

from bench import register_cap
from replayssm_jax import gdn
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.gdn import ReplayBuffers
from tests.helpers import lower_for_h200

B, HK, HV, D = 4, 1, 2, 16


def _lowered_replay_step() -> str:
  """StableHLO of one GDN replay decode step: the step kernel, then the fold pass."""
  cursor = ReplayCursor.create(B, buffer_len=4)
  bufs = ReplayBuffers.create(B, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=D, head_v_dim=D,
                              ring_dtype=jnp.bfloat16)
  plan = cursor.plan(jnp.arange(B, dtype=jnp.int32))
  qk = jnp.zeros((B, HK, D), jnp.bfloat16)
  v = jnp.zeros((B, HV, D), jnp.bfloat16)
  g = jnp.zeros((B, HV), jnp.float32)

  def step(q, k, v, g, beta, bufs, plan):
    return gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation="pallas_triton")
  return lower_for_h200(step, (), qk, qk, v, g, g, bufs, plan)


def test_cap_reaches_only_the_named_kernels():
  # Each lowering traces a new jit, so Pallas lowers the kernels afresh (no cache to clear).
  assert register_cap.ATTRIBUTE not in _lowered_replay_step()
  with register_cap.register_caps({"gdn_replay_step": 128}):
    assert _lowered_replay_step().count(register_cap.ATTRIBUTE) == 1
  with register_cap.register_caps({"gdn_replay_step": 128, "gdn_fold": 96}):
    assert _lowered_replay_step().count(register_cap.ATTRIBUTE) == 2
  assert register_cap.ATTRIBUTE not in _lowered_replay_step()   # the wrapper is gone again


def test_parse_caps():
  assert register_cap.parse_caps("gdn_replay_step=128,gdn_fold=96") == {"gdn_replay_step": 128,
                                                                       "gdn_fold": 96}
  for bad in ("gdn_fold", "gdn_fold=0", "=128", "gdn_fold=x"):
    with pytest.raises(ValueError, match="expected NAME=N"):
      register_cap.parse_caps(bad)
