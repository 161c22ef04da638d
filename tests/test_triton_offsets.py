"""Pallas-Triton computes element offsets in int32: an operand of more than 2**31 elements would be
addressed modulo 2**32 (wrong slots read and written, silently). The Triton wrappers refuse such
operands with NotImplementedError, and ``implementation=None`` falls through to XLA.

Everything here is abstract (``jax.eval_shape``): pools of 2**31 elements are never allocated.
"""
import jax
import jax.numpy as jnp
import pytest

import replayssm_jax as rs
from replayssm_jax import _dispatch
from replayssm_jax.pallas import common

PER_SLOT = 16 * 16                                   # Hk = Hv = 1 (GDN), H = G = 1 (Mamba2), 16 × 16
FITS = common.TRITON_MAX_ELEMENTS // PER_SLOT        # a pool of exactly 2**31 elements
TOO_MANY = FITS + 1
B = 2
sd = jax.ShapeDtypeStruct


def _gdn_inputs(tokens=None):
  lead = (B,) if tokens is None else (B, tokens)
  return (sd((*lead, 1, 16), jnp.float32), sd((*lead, 1, 16), jnp.float32),
          sd((*lead, 1, 16), jnp.float32), sd((*lead, 1), jnp.float32), sd((*lead, 1), jnp.float32))


def _mamba2_inputs():
  return (sd((B, 1, 16), jnp.float32), sd((B, 1), jnp.float32), sd((1,), jnp.float32),
          sd((B, 1, 16), jnp.float32), sd((B, 1, 16), jnp.float32))


def _gdn_decode(num_slots, implementation):
  pool, slots = sd((num_slots, 1, 16, 16), jnp.float32), sd((B,), jnp.int32)
  return jax.eval_shape(lambda *a: rs.gdn.decode(*a, implementation=implementation),
                        *_gdn_inputs(), pool, slots)


def _mamba2_decode(num_slots, implementation):
  pool, slots = sd((num_slots, 1, 16, 16), jnp.float32), sd((B,), jnp.int32)
  return jax.eval_shape(lambda *a: rs.mamba2.decode(*a, implementation=implementation),
                        *_mamba2_inputs(), pool, slots)


def _replay(family, num_slots, implementation):
  """replay_decode over abstract buffers of ``num_slots`` slots (buffer_len 4)."""
  def run(*xs):
    cursor = rs.ReplayCursor.create(num_slots, buffer_len=4)
    plan = cursor.plan(jnp.arange(B, dtype=jnp.int32))
    if family == "gdn":
      bufs = rs.gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=1, num_v_heads=1,
                                         head_k_dim=16, head_v_dim=16)
      return rs.gdn.replay_decode(*xs, bufs, plan, implementation=implementation)
    bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=1, head_dim=16,
                                          num_groups=1, state_dim=16)
    return rs.mamba2.replay_decode(*xs, bufs, plan, implementation=implementation)
  return jax.eval_shape(run, *(_gdn_inputs() if family == "gdn" else _mamba2_inputs()))


CASES = {"gdn.decode": _gdn_decode, "mamba2.decode": _mamba2_decode,
         "gdn.replay_decode": lambda n, impl: _replay("gdn", n, impl),
         "mamba2.replay_decode": lambda n, impl: _replay("mamba2", n, impl)}


@pytest.mark.parametrize("op", sorted(CASES))
def test_triton_refuses_a_pool_past_int32_offsets(op):
  with pytest.raises(NotImplementedError, match=r"int32 element offsets.*\b(pool|state)\b"):
    CASES[op](TOO_MANY, "pallas_triton")


@pytest.mark.parametrize("op", sorted(CASES))
def test_a_pool_of_exactly_2_31_elements_is_accepted(op):
  CASES[op](FITS, "pallas_triton")


@pytest.mark.parametrize("op", sorted(CASES))
def test_none_falls_back_to_xla_on_a_gpu(op, monkeypatch):
  monkeypatch.setattr(_dispatch, "_auto_order", lambda: ("pallas_triton", "xla"))
  CASES[op](TOO_MANY, None)


def test_message_names_the_operand_and_its_shape():
  with pytest.raises(NotImplementedError) as e:
    common.require_int32_offsets("op", pool=sd((TOO_MANY, 1, 16, 16), jnp.float32),
                                 slots=sd((B,), jnp.int32))
  assert f"pool ({TOO_MANY}, 1, 16, 16)" in str(e.value) and "slots" not in str(e.value)
