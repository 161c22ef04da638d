"""Pallas-Triton GDN kernels vs the XLA implementation (CPU interpret mode) + abstract-H200 lowering.

Parity runs through the public ops (``implementation="pallas_triton"`` vs ``"xla"``) over
multi-step sequences with staggered rows, a padding row, a forced flush (so windows wrap the
ring), GQA (Hk=2, Hv=4) and NaN-poisoned ring entries outside every window. Outputs, materialized
states and the raw buffers are compared at every step; the f32 run is also checked against the
independent float64 oracle of tests/helpers.py.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax.pallas import gdn_triton
from tests.helpers import (gdn_step_f64, lower_for_h200, make_gdn_step, max_err,
                           run_each_setting, tolerance)

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

HK, HV, K, V = 2, 4, 16, 32          # V = 32 with the CPU tile of 16: two V tiles per head
NUM_SLOTS = 6
SLOTS = np.array([3, -1, 0, 5], np.int32)   # row 1 is padding throughout
START = np.array([0, 0, 1, 2])              # rows join late, so their cursors are staggered
# name: (state dtype, activation dtype, ring dtype)
DTYPES = {"f32": ("float32", "float32", "float32"), "bf16": ("bfloat16", "bfloat16", "bfloat16"),
          "f32_bf16ring": ("float32", "bfloat16", "bfloat16")}
# (L, route, dtypes): every route × dtype at L = 4; at L = 1 and 2 each route once and each dtype
# once (every case compiles four interpreted programs, so the full cross product costs minutes).
REPLAY_CASES = ([(4, route, d) for route in ("output_only", "reconstruct") for d in ("f32", "bf16")]
                + [(1, "output_only", "f32"), (1, "reconstruct", "bf16"),
                   (2, "output_only", "bf16"), (2, "reconstruct", "f32"),
                   (4, "output_only", "f32_bf16ring")])


def _slots_at(t):
  return jnp.asarray(np.where(t >= START, SLOTS, -1), jnp.int32)


def _np(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def _initial_states(rng, dtype):
  return jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, HV, V, K)), dtype)


def _poisoned_buffers(cursor, state_dtype, S0, ring_dtype=None):
  """Buffers whose checkpoints are S0 and whose ring holds NaN everywhere (nothing is live yet)."""
  bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=HK, num_v_heads=HV,
                                     head_k_dim=K, head_v_dim=V, state_dtype=state_dtype,
                                     ring_dtype=ring_dtype)
  nan = lambda x: jnp.full_like(x, jnp.nan)
  return bufs.replace(state=S0, ring_k=nan(bufs.ring_k), ring_u=nan(bufs.ring_u),
                      ring_g=nan(bufs.ring_g))


def _assert_close(name, got, want, tol):
  got, want = _np(got), _np(want)
  assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN patterns differ"
  err = max_err(np.nan_to_num(got), np.nan_to_num(want))
  assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


def _assert_untouched(name, before, after, slots):
  """Bitwise: pool/ring entries of slots not in ``slots`` did not change."""
  keep = np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(slots))
  b, a = np.asarray(before)[keep], np.asarray(after)[keep]
  assert b.tobytes() == a.tobytes(), f"{name}: a slot outside the batch changed"


@pytest.mark.parametrize("buffer_len,route,dtypes", REPLAY_CASES)
def test_replay_decode_parity(buffer_len, route, dtypes):
  state_dtype, act_dtype, ring_dtype = DTYPES[dtypes]
  tol = tolerance(state_dtype, act_dtype)
  rng = np.random.default_rng(buffer_len)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len)
  S0 = _initial_states(rng, state_dtype)
  bufs = {"xla": _poisoned_buffers(cursor, state_dtype, S0, ring_dtype),
          "pallas_triton": _poisoned_buffers(cursor, state_dtype, S0, ring_dtype)}
  exact = np.asarray(_np(S0), np.float64)   # float64 oracle state per slot
  flushes, wrapped = 0, False
  for t in range(2 * buffer_len + 4):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    # Forced flushes (row 0 at its first step, row 2 at its second) move bases off the ring
    # origin, so later windows wrap around the ring.
    force = jnp.asarray(live & (((np.arange(len(SLOTS)) == 0) & (t == 0))
                                | ((np.arange(len(SLOTS)) == 2) & (t == 2))))
    plan = cursor.plan(slots, force_flush=force)
    flushes += int(np.sum(np.asarray(plan.flush)))
    ends = np.asarray(plan.base) + np.asarray(plan.count)     # this step's write index, unwrapped
    wrapped |= bool(np.any(live & (ends >= cursor.ring_size)))
    step = make_gdn_step(rng, len(SLOTS), HK, HV, K, V)
    args = step.as_jax(act_dtype)
    out = {}
    for impl in bufs:
      before = bufs[impl]
      out[impl], bufs[impl] = rs.gdn.replay_decode(*args, before, plan, route=route,
                                                   implementation=impl)
      if impl == "pallas_triton":
        for field in ("state", "ring_k", "ring_u", "ring_g"):
          _assert_untouched(field, getattr(before, field), getattr(bufs[impl], field),
                            np.asarray(slots)[live])
        # Non-flushing rows never write their checkpoint.
        kept = np.asarray(slots)[live & ~np.asarray(plan.flush)]
        assert (np.asarray(before.state)[kept].tobytes()
                == np.asarray(bufs[impl].state)[kept].tobytes())
    assert np.all(_np(out["pallas_triton"])[~live] == 0.0)
    _assert_close(f"t={t} o", out["pallas_triton"], out["xla"], tol)
    for field in ("state", "ring_k", "ring_u", "ring_g"):
      _assert_close(f"t={t} {field}", getattr(bufs["pallas_triton"], field),
                    getattr(bufs["xla"], field), tol)
    cursor = cursor.commit(plan)
    states = {impl: rs.gdn.materialize(bufs[impl], cursor, slots, implementation=impl)
              for impl in bufs}
    _assert_close(f"t={t} materialize", states["pallas_triton"], states["xla"], tol)
    assert np.all(_np(states["pallas_triton"])[~live] == 0.0)
    if dtypes == "f32":   # float64 oracle, independent of both implementations
      o64, s64 = gdn_step_f64(exact[np.asarray(slots)[live]], _take_rows(step.rounded(), live))
      exact[np.asarray(slots)[live]] = s64
      assert max_err(_np(out["pallas_triton"])[live], o64) <= tol
      assert max_err(_np(states["pallas_triton"])[live], s64) <= tol
  assert flushes >= 2
  assert wrapped or buffer_len == 1


def _take_rows(step, rows):
  return type(step)(*(x[rows] for x in (step.q, step.k, step.v, step.g, step.beta)))


def test_replay_route_auto_matches_output_only():
  rng = np.random.default_rng(7)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = _poisoned_buffers(cursor, jnp.float32, _initial_states(rng, jnp.float32))
  plan = cursor.plan(_slots_at(5))
  args = make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax()
  auto = rs.gdn.replay_decode(*args, bufs, plan, route="auto", implementation="pallas_triton")
  ref = rs.gdn.replay_decode(*args, bufs, plan, route="output_only", implementation="pallas_triton")
  for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(ref)):
    assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("dtypes", ["f32", "bf16"])
def test_decode_parity(dtypes):
  state_dtype, act_dtype, _ = DTYPES[dtypes]
  tol = tolerance(state_dtype, act_dtype)
  rng = np.random.default_rng(3)
  pools = dict.fromkeys(("xla", "pallas_triton"), _initial_states(rng, state_dtype))
  exact = np.asarray(_np(pools["xla"]), np.float64)
  for t in range(4):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    step = make_gdn_step(rng, len(SLOTS), HK, HV, K, V)
    out = {}
    for impl in pools:
      before = pools[impl]
      out[impl], pools[impl] = rs.gdn.decode(*step.as_jax(act_dtype), before, slots,
                                             implementation=impl)
    _assert_untouched("pool", before, pools["pallas_triton"], np.asarray(slots)[live])
    assert np.all(_np(out["pallas_triton"])[~live] == 0.0)
    _assert_close(f"t={t} o", out["pallas_triton"], out["xla"], tol)
    _assert_close(f"t={t} pool", pools["pallas_triton"], pools["xla"], tol)
    if state_dtype == "float32":
      o64, s64 = gdn_step_f64(exact[np.asarray(slots)[live]], _take_rows(step.rounded(), live))
      exact[np.asarray(slots)[live]] = s64
      assert max_err(_np(out["pallas_triton"])[live], o64) <= tol


def test_knobs_change_tiling_not_results():
  """Other tiles / warps give the same numbers (block_v=8: four V tiles; fold tile = V)."""
  rng = np.random.default_rng(11)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = _poisoned_buffers(cursor, jnp.float32, _initial_states(rng, jnp.float32))
  plan = cursor.plan(_slots_at(5), force_flush=jnp.asarray([True, False, False, False]))
  args = make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax()
  scale = K ** -0.5
  ref = gdn_triton.replay_decode(*args, bufs, plan, scale=scale, route="output_only")
  for knobs in (dict(block_v=8, block_k=4, num_warps=1, num_stages=2, fold_block_v=64,
                     fold_num_warps=8),
                dict(block_k=K)):   # K in one chunk: different summation order, same value
    got = gdn_triton.replay_decode(*args, bufs, plan, scale=scale, route="output_only", **knobs)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      _assert_close(f"{knobs}", a, b, 1e-6)
  o1, p1 = gdn_triton.decode(*args, bufs.state, plan.slots, scale=scale)
  o2, p2 = gdn_triton.decode(*args, bufs.state, plan.slots, scale=scale, block_v=8, num_warps=2)
  assert np.array_equal(np.asarray(o1), np.asarray(o2))
  assert np.array_equal(np.asarray(p1), np.asarray(p2))


def test_fold_tiles_change_the_fold_grid_not_results():
  """The fold pass with 1, 2 (the CPU default) or all 4 of a head's [16, 8] tiles per program (64
  asks for more: clipped to 4) stores bitwise the same checkpoints, natural flushes of full
  windows included; a fold_tiles that does not split a head's tiles evenly is refused."""
  rng = np.random.default_rng(12)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  first = _poisoned_buffers(cursor, jnp.float32, _initial_states(rng, jnp.float32))
  runs, flushed = run_each_setting(
      cursor, first, _slots_at, 7, lambda: make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax(),
      lambda args, bufs, plan, n: gdn_triton.replay_decode(
          *args, bufs, plan, scale=K ** -0.5, route="output_only", fold_tiles=n),
      (None, 1, 64))
  assert flushed >= 3
  for n in (1, 64):
    for a, b in zip(jax.tree.leaves(runs[None]), jax.tree.leaves(runs[n])):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"fold_tiles={n}"
  args = make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax()
  with pytest.raises(ValueError, match="fold_tiles=3"):
    gdn_triton.replay_decode(*args, first, cursor.plan(_slots_at(0)), scale=K ** -0.5,
                             fold_tiles=3)


def test_fold_tiles_defaults():
  """H200: two tiles per fold program for f32 state from B=128, four for bf16 at B=256, one at
  smaller batches (the launch table gdn_fold_tiles: few flushing rows need many programs)."""
  from replayssm_jax import config   # noqa: PLC0415
  kw = dict(device_kind="NVIDIA H200", head_k_dim=128, head_v_dim=128, num_k_heads=16,
            buffer_len=16, ring_size=16)
  tiles = {(dtype, b): config.replay_config(state_dtype=dtype, batch=b, **kw).fold_tiles
           for dtype in (jnp.float32, jnp.bfloat16) for b in (32, 128, 256)}
  assert tiles == {(jnp.float32, 32): 1, (jnp.float32, 128): 2, (jnp.float32, 256): 2,
                   (jnp.bfloat16, 32): 1, (jnp.bfloat16, 128): 1, (jnp.bfloat16, 256): 4}


def test_the_pallas_kernels_run():
  """implementation="pallas_triton" really traces our pallas_calls (and XLA does not)."""
  rng = np.random.default_rng(0)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = _poisoned_buffers(cursor, jnp.float32, _initial_states(rng, jnp.float32))
  plan = cursor.plan(_slots_at(5))
  args = make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax()
  text = lambda impl: str(jax.make_jaxpr(
      lambda b: rs.gdn.replay_decode(*args, b, plan, implementation=impl))(bufs))
  assert "replayssm_gdn_replay_step" in text("pallas_triton")
  assert "replayssm_gdn_fold" in text("pallas_triton")
  assert "pallas_call" not in text("xla")


def test_non_power_of_two_raises():
  kd = 96
  rng = np.random.default_rng(0)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=HK, num_v_heads=HV,
                                     head_k_dim=kd, head_v_dim=V)
  slots = _slots_at(5)
  args = make_gdn_step(rng, len(SLOTS), HK, HV, kd, V).as_jax()
  with pytest.raises(NotImplementedError, match="power-of-two.*K=96"):
    rs.gdn.decode(*args, bufs.state, slots, implementation="pallas_triton")
  with pytest.raises(NotImplementedError, match="power-of-two.*K=96"):
    rs.gdn.replay_decode(*args, bufs, cursor.plan(slots), implementation="pallas_triton")
  with pytest.raises(NotImplementedError, match="power-of-two.*K=96"):
    rs.gdn.materialize(bufs, cursor, slots, implementation="pallas_triton")
  # implementation=None never fails on valid input: it falls back to XLA.
  o, _ = rs.gdn.replay_decode(*args, bufs, cursor.plan(slots))
  assert o.shape == (len(SLOTS), HV, V)
  good = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=HK, num_v_heads=HV,
                                     head_k_dim=K, head_v_dim=V)
  good_args = make_gdn_step(rng, len(SLOTS), HK, HV, K, V).as_jax()
  with pytest.raises(NotImplementedError, match="block_v=24"):
    gdn_triton.replay_decode(*good_args, good, cursor.plan(slots), scale=1.0, block_v=24)
  with pytest.raises(NotImplementedError, match="block_k=12"):
    gdn_triton.replay_decode(*good_args, good, cursor.plan(slots), scale=1.0, block_k=12)


# ---------------------------------------------------------------------------------------------
# Abstract-H200 lowering at production shapes (notes/pallas-gpu.md §4): catches what interpret
# mode hides (Triton power-of-two sizes, unsupported primitives) and checks in-place aliasing.
# ---------------------------------------------------------------------------------------------

P_HK, P_HV, P_K, P_V, P_B, P_N, P_L = 16, 32, 128, 128, 8, 16, 16


@pytest.fixture(scope="module")
def production_inputs():
  slots = jnp.asarray(np.r_[np.arange(P_B - 1), -1], jnp.int32)
  bf16 = jnp.bfloat16
  step = (jnp.zeros((P_B, P_HK, P_K), bf16), jnp.zeros((P_B, P_HK, P_K), bf16),
          jnp.zeros((P_B, P_HV, P_V), bf16), jnp.zeros((P_B, P_HV), bf16),
          jnp.zeros((P_B, P_HV), bf16))
  return slots, step


# L = 8, 16, 32 give rings of 8, 16 and 32 entries: the unrolled and the dot accumulation.
@pytest.mark.parametrize("buffer_len", [8, P_L, 32])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["decode", "replay_output_only", "replay_reconstruct",
                                    "replay_output_only_k64", "materialize", "flush_all"])
def test_lowers_for_h200(kernel, state_dtype, buffer_len, production_inputs):
  if kernel == "decode" and buffer_len != P_L:
    pytest.skip("the conventional kernel has no ring")
  slots, step = production_inputs
  cursor = rs.ReplayCursor.create(P_N, buffer_len=buffer_len)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV,
                                     head_k_dim=P_K, head_v_dim=P_V, state_dtype=state_dtype,
                                     ring_dtype=jnp.bfloat16)
  if kernel == "decode":
    text = lower_for_h200(lambda pool, s, *x: rs.gdn.decode(*x, pool, s, implementation="pallas_triton"),
                  (0,), bufs.state, slots, *step)
  elif kernel == "materialize":
    text = lower_for_h200(lambda b, c, s: rs.gdn.materialize(b, c, s, implementation="pallas_triton"),
                  (), bufs, cursor, slots)
  elif kernel == "replay_output_only_k64":   # K in two chunks (a benchmark knob)
    text = lower_for_h200(lambda b, p, *x: gdn_triton.replay_decode(*x, b, p, scale=P_K ** -0.5,
                                                            route="output_only", block_k=64),
                  (0,), bufs, cursor.plan(slots), *step)
  elif kernel == "flush_all":   # the small-batch policy's one-pass fold-and-step kernel
    text = lower_for_h200(lambda b, p, *x: rs.gdn.replay_decode(*x, b, p, implementation="pallas_triton"),
                  (0,), bufs, cursor.plan(slots, flush_all=True), *step)
    assert text.count("__gpu$xla.gpu.triton") == 1
  else:
    route = kernel.removeprefix("replay_")
    text = lower_for_h200(lambda b, p, *x: rs.gdn.replay_decode(*x, b, p, route=route,
                                                        implementation="pallas_triton"),
                  (0,), bufs, cursor.plan(slots), *step)
    # output-only: step kernel + fold pass; reconstruct: one launch (flush stored in place)
    assert text.count("__gpu$xla.gpu.triton") == (1 if route == "reconstruct" else 2)
  assert "__gpu$xla.gpu.triton" in text
  # Every donated buffer is updated in place: pool (decode); state and the three rings (replay).
  # materialize writes a fresh array, so nothing is aliased there.
  expected = {"decode": 1, "materialize": 0}.get(kernel, 4)
  assert text.count("tf.aliasing_output") == expected
