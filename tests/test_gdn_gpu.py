"""GPU-only checks of the compiled Pallas kernels, Triton and Mosaic GPU (marker ``gpu``; skipped
on CPU).

Interpret mode hides what only the compiled kernels show: TF32 dots (or an f32 wgmma), lowering
of masked loads, register-level layouts. These tests run the real kernels at production geometry
(Qwen3.5-4B: Hk 16, Hv 32, K = V = 128) against the independent float64 oracle across flushes
(the Mosaic kernels also against the Triton ones), and check that a donated step compiles
without copying the state pool (Mosaic: written Refs alias in place).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import GEOMETRIES, gdn_step_f64, make_gdn_step, max_err, set_mosaic_rows

pytestmark = pytest.mark.gpu

HK, HV, KD, VD = GEOMETRIES["qwen35_4b"]
SLOTS = np.array([5, -1, 2, 7], np.int32)   # a padding row in the middle


IMPLS = ("pallas_triton", "pallas_mosaic")


def _run(route, state_dtype, buffer_len, steps, seed=0, flush_all_at=(), impl="pallas_triton"):
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
    plan = cursor.plan(slots, flush_all=_ in flush_all_at)
    flushes += int(np.sum(np.asarray(plan.flush)))
    o, after = rs.gdn.replay_decode(*step.as_jax(), bufs, plan, route=route, implementation=impl)
    if impl != "pallas_triton":   # the same step through the Triton kernels
      o_tri, _ = rs.gdn.replay_decode(*step.as_jax(), bufs, plan, route=route, implementation="pallas_triton")
      errs["vs_triton"] = max(errs["vs_triton"], max_err(o, o_tri))
    bufs, cursor = after, cursor.commit(plan)
    oc, pool = rs.gdn.decode(*step.as_jax(), pool, slots, implementation=impl)
    o_ref, S = gdn_step_f64(S, step.rounded())
    errs["replay"] = max(errs["replay"], max_err(np.asarray(o)[live], o_ref[live]))
    errs["conv"] = max(errs["conv"], max_err(np.asarray(oc)[live], o_ref[live]))
    assert np.all(np.asarray(o)[~live] == 0) and np.all(np.asarray(oc)[~live] == 0)
    state = rs.gdn.materialize(bufs, cursor, slots, implementation=impl)
    errs["state"] = max(errs["state"], max_err(np.asarray(state)[live], S[live]))
  assert flushes > 0
  return errs


@pytest.mark.parametrize("impl,route", [("pallas_triton", "output_only"), ("pallas_triton", "reconstruct"),
                                        ("pallas_mosaic", "output_only")])
def test_compiled_replay_f32_matches_float64_oracle(impl, route):
  errs = _run(route, jnp.float32, buffer_len=4, steps=9, impl=impl)
  # f32 throughout; a TF32 dot anywhere would show errors near 1e-3.
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs
  assert errs["conv"] < 5e-5 and errs["vs_triton"] < 5e-5, errs


@pytest.mark.parametrize("rows", [2, 4])
def test_compiled_mosaic_rows_per_program(monkeypatch, rows):
  """The Mosaic replay step and conventional decode with 2 or 4 batch rows per program (doubled
  SMEM buffers, the next row's TMA issued before the current row computes) against float64 and
  the Triton kernels."""
  set_mosaic_rows(monkeypatch, rows, "mosaic_replay_config", "mosaic_decode_config")
  errs = _run("output_only", jnp.float32, buffer_len=4, steps=9, seed=1, impl="pallas_mosaic")
  assert max(errs.values()) < 5e-5, errs


def test_compiled_flush_all_steps():
  """The small-batch policy's fold-and-step kernel on windows of 0-6 entries, between ordinary steps."""
  errs = _run("output_only", jnp.float32, buffer_len=8, steps=14, flush_all_at=(4, 5, 11))
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs


@pytest.mark.parametrize("impl", IMPLS)
def test_compiled_replay_bf16_state(impl):
  errs = _run("output_only", jnp.bfloat16, buffer_len=8, steps=17, impl=impl)
  assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


@pytest.mark.parametrize("impl", IMPLS)
def test_donated_step_does_not_copy_the_pool(impl):
  n, b = 16, 8
  cursor = rs.ReplayCursor.create(n, buffer_len=16)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, ring_dtype=jnp.bfloat16)
  step = make_gdn_step(np.random.default_rng(0), b, HK, HV, KD, VD)
  slots = jnp.arange(b, dtype=jnp.int32)

  def replay(bufs, cursor, q, k, v, g, beta):
    plan = cursor.plan(slots)
    o, bufs = rs.gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation=impl)
    return o, bufs, cursor.commit(plan)

  def conventional(pool, q, k, v, g, beta):
    return rs.gdn.decode(q, k, v, g, beta, pool, slots, implementation=impl)

  for fn, args in ((replay, (bufs, cursor)), (conventional, (bufs.state,))):
    compiled = jax.jit(fn, donate_argnums=tuple(range(len(args)))).lower(
        *args, *step.as_jax("bfloat16")).compile()
    text = compiled.as_text()
    state_shape = f"f32[{n},{HV},{VD},{KD}]"
    copies = [line for line in text.splitlines() if " copy(" in line and state_shape in line]
    assert not copies, copies
