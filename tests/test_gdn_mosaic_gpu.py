"""GPU-only checks of the compiled Pallas Mosaic GPU kernels (marker ``gpu``; skipped on CPU).

Mirrors test_gdn_gpu.py for ``implementation="pallas_mosaic"``: Qwen3.5-4B geometry (Hk 16,
Hv 32, K = V = 128) against the independent float64 oracle across flushes (an f32 wgmma would
show TF32 errors near 1e-3), agreement with the Triton kernels, and a donated step that compiles
without copying the state pool (written Refs alias in place).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import GEOMETRIES, gdn_step_f64, make_gdn_step, max_err

pytestmark = pytest.mark.gpu

HK, HV, KD, VD = GEOMETRIES["qwen35_4b"]
SLOTS = np.array([5, -1, 2, 7], np.int32)   # a padding row in the middle
IMPL = "pallas_mosaic"


def _run(state_dtype, buffer_len, steps, seed=0):
  rng = np.random.default_rng(seed)
  n = 8
  cursor = rs.ReplayCursor.create(n, buffer_len=buffer_len)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, state_dtype=state_dtype, ring_dtype=jnp.float32)
  live = SLOTS >= 0
  S = rng.normal(size=(len(SLOTS), HV, VD, KD)) * 0.05
  S = np.asarray(jnp.asarray(S, state_dtype).astype(jnp.float32), np.float64)   # as stored
  slots = jnp.asarray(SLOTS)
  bufs, cursor = rs.gdn.write_state(bufs, cursor, slots, jnp.asarray(S, jnp.float32))
  pool = bufs.state
  errs = {"replay": 0.0, "state": 0.0, "conv": 0.0, "vs_triton": 0.0}
  flushes = 0
  for _ in range(steps):
    step = make_gdn_step(rng, len(SLOTS), HK, HV, KD, VD)
    plan = cursor.plan(slots)
    flushes += int(np.sum(np.asarray(plan.flush)))
    o_tri, _ = rs.gdn.replay_decode(*step.as_jax(), bufs, plan, implementation="pallas_triton")
    o, bufs = rs.gdn.replay_decode(*step.as_jax(), bufs, plan, implementation=IMPL)
    cursor = cursor.commit(plan)
    oc, pool = rs.gdn.decode(*step.as_jax(), pool, slots, implementation=IMPL)
    o_ref, S = gdn_step_f64(S, step.rounded())
    errs["replay"] = max(errs["replay"], max_err(np.asarray(o)[live], o_ref[live]))
    errs["conv"] = max(errs["conv"], max_err(np.asarray(oc)[live], o_ref[live]))
    errs["vs_triton"] = max(errs["vs_triton"], max_err(o, o_tri))
    assert np.all(np.asarray(o)[~live] == 0) and np.all(np.asarray(oc)[~live] == 0)
    state = rs.gdn.materialize(bufs, cursor, slots, implementation=IMPL)
    errs["state"] = max(errs["state"], max_err(np.asarray(state)[live], S[live]))
  assert flushes > 0
  return errs


def test_compiled_f32_matches_float64_oracle():
  errs = _run(jnp.float32, buffer_len=4, steps=9)
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5 and errs["conv"] < 5e-5, errs
  assert errs["vs_triton"] < 5e-5, errs


def test_compiled_bf16_state():
  errs = _run(jnp.bfloat16, buffer_len=8, steps=17)
  assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


def test_donated_step_does_not_copy_the_pool():
  n, b = 16, 8
  cursor = rs.ReplayCursor.create(n, buffer_len=16)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, ring_dtype=jnp.bfloat16)
  step = make_gdn_step(np.random.default_rng(0), b, HK, HV, KD, VD)
  slots = jnp.arange(b, dtype=jnp.int32)

  def replay(bufs, cursor, q, k, v, g, beta):
    plan = cursor.plan(slots)
    o, bufs = rs.gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation=IMPL)
    return o, bufs, cursor.commit(plan)

  def conventional(pool, q, k, v, g, beta):
    return rs.gdn.decode(q, k, v, g, beta, pool, slots, implementation=IMPL)

  for fn, args in ((replay, (bufs, cursor)), (conventional, (bufs.state,))):
    text = jax.jit(fn, donate_argnums=tuple(range(len(args)))).lower(
        *args, *step.as_jax("bfloat16")).compile().as_text()
    state_shape = f"f32[{n},{HV},{VD},{KD}]"
    copies = [line for line in text.splitlines() if " copy(" in line and state_shape in line]
    assert not copies, copies
