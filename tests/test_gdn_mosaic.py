"""Pallas Mosaic GPU GDN kernels vs XLA and the float64 oracle (Mosaic interpret mode on CPU),
plus abstract-H200 lowering at the Qwen3.5-4B geometry.

The Mosaic interpreter costs ~0.5 s per kernel call, so grids are small: Hk 1, Hv 2 (GQA group 2),
K 16, V 32 (two V tiles of 16), three rows (row 1 padding, rows joining late so cursors are
staggered), forced plus natural flushes so windows wrap the ring, NaN-poisoned ring entries
outside every window. The interpreter ignores Mosaic layouts (16-row tiles run here but would
not lower); the lowering tests cover the production tiles.
"""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax.pallas import common, gdn_mosaic
from tests.helpers import (assert_rows_agree, assert_store_waits_only_compiled, gdn_step_f64,
                           lower_for_h200, make_gdn_step, max_err, run_each_setting,
                           set_mosaic_rows, tolerance)
from tests.test_gdn_pallas import _assert_close, _np, _take_rows
from tests.test_gdn_verify_pallas import _forced_flush_with_pending_drafts, _random_accepts

IMPL = "pallas_mosaic"
HK, HV, K, V = 1, 2, 16, 32
NUM_SLOTS = 4
SLOTS = np.array([2, -1, 0], np.int32)   # row 1 is padding throughout
START = np.array([0, 0, 1])              # row 2 joins late: staggered cursors


def _slots_at(t):
  return jnp.asarray(np.where(t >= START, SLOTS, -1), jnp.int32)


def _poisoned_buffers(cursor, state_dtype, S0):
  bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=HK, num_v_heads=HV,
                                     head_k_dim=K, head_v_dim=V, state_dtype=state_dtype)
  nan = lambda x: jnp.full_like(x, jnp.nan)
  return bufs.replace(state=S0, ring_k=nan(bufs.ring_k), ring_u=nan(bufs.ring_u),
                      ring_g=nan(bufs.ring_g))


def _same_bits(a, b):
  return np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("buffer_len,state_dtype", [(2, "float32"), (4, "float32"),
                                                    (2, "bfloat16")])
def test_replay_decode_parity(buffer_len, state_dtype):
  tol = tolerance(state_dtype, state_dtype)
  rng = np.random.default_rng(buffer_len)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len)
  S0 = jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, HV, V, K)), state_dtype)
  bufs = dict.fromkeys(("xla", IMPL), _poisoned_buffers(cursor, state_dtype, S0))
  exact = np.asarray(_np(S0), np.float64)
  flushes, wrapped = 0, False
  for t in range(2 * buffer_len + 1):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    # Row 0 flushes at its first step (forced), so its later windows start off the ring origin
    # and wrap.
    plan = cursor.plan(slots, force_flush=jnp.asarray(live & (np.arange(3) == 0) & (t == 0)))
    flush = np.asarray(plan.flush)
    flushes += int(flush.sum())
    wrapped |= bool(np.any(live & (np.asarray(plan.base) + np.asarray(plan.count)
                                   >= cursor.ring_size)))
    step = make_gdn_step(rng, len(SLOTS), HK, HV, K, V)
    out = {}
    for impl in bufs:
      before = bufs[impl]
      out[impl], bufs[impl] = rs.gdn.replay_decode(*step.as_jax(state_dtype), before, plan,
                                                   implementation=impl)
    after = bufs[IMPL]
    # Non-flushing rows and slots outside the batch keep their checkpoint bit for bit.
    kept = np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(slots)[flush])
    assert _same_bits(np.asarray(before.state)[kept], np.asarray(after.state)[kept])
    assert np.all(_np(out[IMPL])[~live] == 0.0)
    _assert_close(f"t={t} o", out[IMPL], out["xla"], tol)
    for field in ("state", "ring_k", "ring_u", "ring_g"):
      _assert_close(f"t={t} {field}", getattr(after, field), getattr(bufs["xla"], field), tol)
    cursor = cursor.commit(plan)
    state = rs.gdn.materialize(after, cursor, slots, implementation=IMPL)
    _assert_close(f"t={t} materialize", state,
                  rs.gdn.materialize(bufs["xla"], cursor, slots, implementation="xla"), tol)
    assert np.all(_np(state)[~live] == 0.0)
    if state_dtype == "float32":   # float64 oracle, independent of both implementations
      o64, s64 = gdn_step_f64(exact[np.asarray(slots)[live]], _take_rows(step.rounded(), live))
      exact[np.asarray(slots)[live]] = s64
      assert max_err(_np(out[IMPL])[live], o64) <= tol
      assert max_err(_np(state)[live], s64) <= tol
  assert flushes >= 2 and wrapped


def test_replay_rows_per_program_change_the_grid_not_results():
  """The replay step with 1, 2 or 4 batch rows per program (4: two pairs, a buffer staged again
  while the other row computes) over four rows (a padding row, staggered joins) and natural
  flushes leaves bitwise the same buffers, and they match XLA's."""
  rng = np.random.default_rng(13)
  slots4, start4 = np.array([2, -1, 0, 3], np.int32), np.array([0, 0, 1, 2])
  slots_at = lambda t: jnp.asarray(np.where(t >= start4, slots4, -1), jnp.int32)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=2)
  S0 = jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, HV, V, K)), jnp.float32)

  def decode(args, bufs, plan, rows):
    if rows == "xla":
      return rs.gdn.replay_decode(*args, bufs, plan, implementation="xla")
    return gdn_mosaic.replay_decode(*args, bufs, plan, scale=K ** -0.5, rows=rows)

  runs, flushed = run_each_setting(cursor, _poisoned_buffers(cursor, "float32", S0), slots_at, 6,
                                   lambda: make_gdn_step(rng, 4, HK, HV, K, V).as_jax(), decode,
                                   (1, 2, 4, "xla"))
  assert flushed >= 3
  assert_rows_agree(runs)


def test_decode_rows_per_program_change_the_grid_not_results():
  """The conventional step with 1, 2 or 4 batch rows per program over four rows (a padding row,
  permuted slots), three steps: bitwise the same pools and outputs, and XLA's within f32."""
  rng = np.random.default_rng(15)
  slots = jnp.asarray([3, -1, 0, 2], jnp.int32)
  pool0 = jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, HV, V, K)), jnp.float32)
  steps = [make_gdn_step(rng, 4, HK, HV, K, V).as_jax() for _ in range(3)]
  runs = {}
  for rows in (1, 2, 4, "xla"):
    pool, outs = pool0, []
    for args in steps:
      if rows == "xla":
        o, pool = rs.gdn.decode(*args, pool, slots, implementation="xla")
      else:
        o, pool = gdn_mosaic.decode(*args, pool, slots, scale=K ** -0.5, rows=rows)
      outs.append(o)
    runs[rows] = (pool, outs)
  assert_rows_agree(runs)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_decode_parity(state_dtype):
  tol = tolerance(state_dtype, state_dtype)
  rng = np.random.default_rng(3)
  pools = dict.fromkeys(("xla", IMPL),
                        jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, HV, V, K)), state_dtype))
  exact = np.asarray(_np(pools["xla"]), np.float64)
  for t in range(2):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    step = make_gdn_step(rng, len(SLOTS), HK, HV, K, V)
    out = {}
    for impl in pools:
      before = pools[impl]
      out[impl], pools[impl] = rs.gdn.decode(*step.as_jax(state_dtype), before, slots,
                                             implementation=impl)
    untouched = np.setdiff1d(np.arange(NUM_SLOTS), np.asarray(slots)[live])
    assert _same_bits(np.asarray(before)[untouched], np.asarray(pools[IMPL])[untouched])
    assert np.all(_np(out[IMPL])[~live] == 0.0)
    _assert_close(f"t={t} o", out[IMPL], out["xla"], tol)
    _assert_close(f"t={t} pool", pools[IMPL], pools["xla"], tol)
    if state_dtype == "float32":
      o64, s64 = gdn_step_f64(exact[np.asarray(slots)[live]], _take_rows(step.rounded(), live))
      exact[np.asarray(slots)[live]] = s64
      assert max_err(_np(out[IMPL])[live], o64) <= tol
      assert max_err(_np(pools[IMPL])[np.asarray(slots)[live]], s64) <= tol


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_verify_random_accepts_parity(num_tokens):
  """Speculative verify (T = 1 and 2, L=4) in lockstep with XLA and float64: staggered and permuted
  rows, a padding row, short rows with NaN in their padded lanes, random forced flushes and
  accepts (test_gdn_verify_pallas.Lockstep, GQA Hk=2, Hv=4, K=16, V=32; the Mosaic interpreter's
  tiles are [16, K]). At T = 1 the one token is the last, whose tile only a flush stores."""
  _random_accepts(num_tokens, 4, 8, impl=IMPL, conventional=False)


def test_verify_forced_flush_with_pending_drafts():
  _forced_flush_with_pending_drafts(impl=IMPL, conventional=False)


def test_verify_long_windows_parity():
  """L = 16, T = 2: rows that do not flush carry windows of 8 entries and more. At L = 2T (the
  tests above) every row with a window flushes, so no other test holds a long window on a
  non-flushing row."""
  from tests.test_gdn_verify_pallas import Lockstep, _rows
  rng = np.random.default_rng(16)
  h = Lockstep(num_tokens=2, buffer_len=16, seed=16, impl=IMPL, conventional=False)
  longest = 0
  for t in range(12):
    longest = max(longest, int(np.max(np.asarray(h.cursor.count))))
    h.step(_rows(rng, t))
  assert longest >= 8, longest


def test_verify_rows_per_program_change_the_grid_not_results(monkeypatch):
  """1, 2 or 4 batch rows per verify program (4: two pairs, so a buffer is staged again while the
  other row computes) leave bitwise the same checkpoints and rings after steps with natural and
  forced flushes, padding rows and short rows; every step of every run is also checked against
  XLA and float64 (Lockstep, batch 4)."""
  from replayssm_jax import config as config_lib
  from tests.test_gdn_verify_pallas import Lockstep, _rows
  real = config_lib.mosaic_verify_config
  finals, flushes = {}, {}
  for rows in (1, 2, 4):
    set_mosaic_rows(monkeypatch, rows, "mosaic_verify_config")
    rng = np.random.default_rng(21)
    h = Lockstep(num_tokens=2, buffer_len=4, seed=21, impl=IMPL, conventional=False)
    for t in range(5):
      h.step(_rows(rng, t), lengths=rng.integers(1, 3, size=4), force=rng.random(4) < 0.2)
    finals[rows], flushes[rows] = h.bufs[IMPL], int(h.flushes.sum())
  assert flushes[1] >= 3
  assert_rows_agree(finals)
  with pytest.raises(ValueError, match="rows=3"):
    dataclasses.replace(real(device_kind="cpu", head_v_dim=V, batch=4, num_tokens=2), rows=3)


def test_the_mosaic_kernels_run():
  """implementation="pallas_mosaic" traces our Mosaic kernels (not the Triton ones)."""
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = _poisoned_buffers(cursor, jnp.float32, jnp.zeros((NUM_SLOTS, HV, V, K)))
  args = make_gdn_step(np.random.default_rng(0), len(SLOTS), HK, HV, K, V).as_jax()
  slots = _slots_at(5)
  text = lambda f: str(jax.make_jaxpr(f)(bufs))
  replay = text(lambda b: rs.gdn.replay_decode(*args, b, cursor.plan(slots), implementation=IMPL))
  assert "replayssm_gdn_replay_mosaic" in replay and "replayssm_gdn_fold" not in replay
  assert "replayssm_gdn_decode_mosaic" in text(
      lambda b: rs.gdn.decode(*args, b.state, slots, implementation=IMPL))
  assert "replayssm_gdn_materialize_mosaic" in text(
      lambda b: rs.gdn.materialize(b, cursor, slots, implementation=IMPL))
  verify = text(lambda b: rs.gdn.replay_verify(*(a[:, None] for a in args), b, cursor.plan(slots),
                                               implementation=IMPL))
  assert "replayssm_gdn_verify_mosaic" in verify and "replayssm_gdn_fold" not in verify


def test_unsupported_inputs_raise():
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  args = make_gdn_step(np.random.default_rng(0), len(SLOTS), HK, HV, K, V).as_jax()
  bufs = _poisoned_buffers(cursor, jnp.float32, jnp.zeros((NUM_SLOTS, HV, V, K)))
  slots = _slots_at(5)
  with pytest.raises(NotImplementedError, match="output_only"):
    rs.gdn.replay_decode(*args, bufs, cursor.plan(slots), route="reconstruct", implementation=IMPL)
  # Compiling (not interpreting): 16-row tiles and K = 16 cannot take the WGMMA layouts.
  with common.force_lowering():
    with pytest.raises(NotImplementedError, match="V tile 32 of V=32.*K=16"):
      rs.gdn.decode(*args, bufs.state, slots, implementation=IMPL)
    with pytest.raises(NotImplementedError, match="K=16"):
      rs.gdn.materialize(bufs, cursor, slots, implementation=IMPL)
    with pytest.raises(NotImplementedError, match="cannot lower"):
      gdn_mosaic.replay_decode(*args, bufs, cursor.plan(slots), scale=1.0, block_v=V)


# ---------------------------------------------------------------------------------------------
# Abstract-H200 lowering at the Qwen3.5-4B geometry (notes/pallas-gpu.md §4): the Mosaic layouts,
# TMA boxes and written-Ref aliasing that the interpreter does not check.
# ---------------------------------------------------------------------------------------------

P_HK, P_HV, P_K, P_V, P_B, P_N, P_L = 16, 32, 128, 128, 8, 16, 16


KERNELS = ["decode", "decode_rows4", "replay", "replay_rows4", "materialize", "verify", "verify_rows4"]


def _h200_call(kernel, state_dtype):
  """(fn, donated argnums, args) of one Mosaic kernel at the production geometry."""
  bf16 = jnp.bfloat16
  slots = jnp.asarray(np.r_[np.arange(P_B - 1), -1], jnp.int32)
  step = (jnp.zeros((P_B, P_HK, P_K), bf16), jnp.zeros((P_B, P_HK, P_K), bf16),
          jnp.zeros((P_B, P_HV, P_V), bf16), jnp.zeros((P_B, P_HV), bf16),
          jnp.zeros((P_B, P_HV), bf16))
  cursor = rs.ReplayCursor.create(P_N, buffer_len=P_L)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV,
                                     head_k_dim=P_K, head_v_dim=P_V, state_dtype=state_dtype,
                                     ring_dtype=bf16)
  if kernel == "decode":
    return (lambda pool, s, *x: rs.gdn.decode(*x, pool, s, implementation=IMPL),
            (0,), (bufs.state, slots, *step))
  if kernel == "decode_rows4":
    return (lambda pool, s, *x: gdn_mosaic.decode(*x, pool, s, scale=1.0, rows=4),
            (0,), (bufs.state, slots, *step))
  if kernel == "materialize":
    return lambda b, c, s: rs.gdn.materialize(b, c, s, implementation=IMPL), (), (bufs, cursor, slots)
  if kernel.startswith("verify"):   # T = 4 tokens per row, ring sized for L = 8 plus the drafts
    cursor = rs.ReplayCursor.create(P_N, buffer_len=8, max_draft=3)
    bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV,
                                       head_k_dim=P_K, head_v_dim=P_V, state_dtype=state_dtype,
                                       ring_dtype=bf16)
    tokens = tuple(jnp.stack([x] * 4, axis=1) for x in step)
    if kernel == "verify":
      verify = lambda b, p, *x: rs.gdn.replay_verify(*x, b, p, implementation=IMPL)
    else:   # four rows per program: doubled SMEM buffers, the next row staged during this one
      lengths = jnp.full((P_B,), 4, jnp.int32)
      verify = lambda b, p, *x: gdn_mosaic.replay_verify(*x, b, p, lengths, scale=1.0, rows=4)
    return verify, (0,), (bufs, cursor.plan(slots, num_tokens=4), *tokens)
  if kernel == "replay":
    return (lambda b, p, *x: rs.gdn.replay_decode(*x, b, p, implementation=IMPL),
            (0,), (bufs, cursor.plan(slots), *step))
  # four rows per program: doubled SMEM buffers, the next row staged during this one
  return (lambda b, p, *x: gdn_mosaic.replay_decode(*x, b, p, scale=1.0, rows=4),
          (0,), (bufs, cursor.plan(slots), *step))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_lowers_for_h200(kernel, state_dtype):
  fn, donate, args = _h200_call(kernel, state_dtype)
  text = lower_for_h200(fn, donate, *args, strict=True)
  assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
  # Written Refs alias their donated buffers: pool (decode); state and three rings (replay, verify).
  assert text.count("tf.aliasing_output") == {"decode": 1, "decode_rows4": 1, "replay": 4,
                                               "replay_rows4": 4,
                                               "materialize": 0, "verify": 4,
                                               "verify_rows4": 4}[kernel]


@pytest.mark.parametrize("kernel", ["decode_rows4", "replay_rows4", "materialize", "verify_rows4"])
def test_store_waits_are_compiled_not_interpreted(kernel):
  fn, _, args = _h200_call(kernel, "float32")
  assert_store_waits_only_compiled(fn, *args)


def test_interpreting_under_async_cpu_dispatch_warns():
  """The suite runs with CPU async dispatch off (conftest), so the Mosaic interpreter is used
  silently; with it on, the Mosaic wrappers' interpret decision warns that it can deadlock."""
  assert not jax.config.read("jax_cpu_enable_async_dispatch")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert common.mosaic_interpret_mode()
  jax.config.update("jax_cpu_enable_async_dispatch", True)   # the running client keeps its mode
  try:
    with pytest.warns(RuntimeWarning, match="jax_cpu_enable_async_dispatch"):
      assert common.mosaic_interpret_mode()
    with warnings.catch_warnings(), common.force_lowering():
      warnings.simplefilter("error")   # lowering for a GPU interprets nothing: no warning
      assert not common.mosaic_interpret_mode()
  finally:
    jax.config.update("jax_cpu_enable_async_dispatch", False)
