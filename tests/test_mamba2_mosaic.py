"""Pallas Mosaic GPU Mamba2 decode vs XLA and the float64 oracle (Mosaic interpret mode on CPU),
plus abstract-H200 lowering at the Nemotron-3-Super geometry.

Small grids (the Mosaic interpreter costs ~0.5 s per kernel call): H 4 over G 2 groups, P 32
(two P tiles of 16), N 16, four rows (row 1 padding, rows joining late). The interpreter ignores
Mosaic layouts (16-row tiles run here but would not lower); the lowering tests cover the
production tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax.pallas import common, mamba2_mosaic
from tests.helpers import (assert_rows_agree, assert_store_waits_only_compiled, lower_for_h200,
                           set_mosaic_rows, tolerance)
from tests.test_mamba2_ops import make_step
from tests.test_mamba2_pallas import (NANO, NUM_SLOTS, SLOTS, SUPER, H, G, N, _assert_close,
                                      _initial_states, _params, _poisoned_buffers, _production,
                                      _slots_at, decode_parity, replay_parity)

IMPL = "pallas_mosaic"
P = 32


@pytest.mark.parametrize("dtypes", ["f32", "bf16"])
def test_decode_parity(dtypes):
  """Three steps with D, z and dt_bias: Mosaic == XLA, the float64 oracle (f32), padding inert."""
  decode_parity(IMPL, dtypes, P, seed=5)


def _one_step(seed):
  """(params, f32 pool, one step's inputs, slots) for single-call checks."""
  rng = np.random.default_rng(seed)
  _, jp = _params(rng)
  pool = _initial_states(rng, P, "float32")
  return jp, pool, make_step(rng, len(SLOTS), H, G, P, N).as_jax("float32"), _slots_at(2)


def test_decode_without_optional_inputs():
  """D, z, dt_bias absent and dt_softplus off: the kernel drops those terms like XLA does."""
  jp, pool, j, slots = _one_step(6)
  run = lambda impl: rs.mamba2.decode(j["x"], j["dt"], jp["A"], j["B"], j["C"], pool, slots,
                                      dt_softplus=False, implementation=impl)
  (y, s), (y_ref, s_ref) = run(IMPL), run("xla")
  tol = tolerance("float32", "float32")
  _assert_close("y", y, y_ref, tol)
  _assert_close("pool", s, s_ref, tol)


def test_replay_decode_parity():
  """Reconstruct route vs XLA and the float64 oracle (tests/test_mamba2_pallas.replay_parity:
  flushes, wrap, NaN ring, padding, untouched checkpoints and slots). f32 at L = 4 only: the bf16
  store cast is the decode kernel's (tested above), and each interpreted case costs ~30 s of CI."""
  replay_parity(IMPL, 4, "reconstruct", "f32", P, materialize_impl="xla")


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_verify_random_accepts_parity(num_tokens):
  """Speculative verify (T = 1 and 2, L=4, 14 steps) in lockstep with XLA and float64
  (test_mamba2_verify_pallas.Twin): staggered rows, a padding row, short rows with NaN in their
  padded lanes, natural and forced flushes (one with drafts pending), random accepts. At T = 1
  the one token is the last, whose tile only a flush stores."""
  from tests.test_mamba2_verify_pallas import _random_accepts
  _random_accepts(num_tokens, 4, impl=IMPL, conventional=False)


def test_verify_long_windows_parity():
  """L = 16, T = 2: rows that do not flush carry windows of 8 entries and more (at L = 2T every
  row with a window flushes)."""
  from tests.test_mamba2_verify_pallas import BATCH, Twin, _staggered_rows
  rng = np.random.default_rng(16)
  twin = Twin(num_tokens=2, buffer_len=16, seed=16, impl=IMPL, conventional=False)
  longest = 0
  for t in range(12):
    longest = max(longest, int(np.max(np.asarray(twin.cursor.count))))
    twin.step(_staggered_rows(rng, NUM_SLOTS, BATCH, t + 2), lengths=np.full(BATCH, 2),
              force=np.zeros(BATCH, bool))
  assert longest >= 8, longest


def test_decode_rows_per_program_change_the_grid_not_results():
  """The conventional step with 1, 2 or 4 batch rows per program over four rows (a padding row,
  permuted slots), three steps: bitwise the same pools and outputs, and XLA's within f32."""
  rng = np.random.default_rng(16)
  _, jp = _params(rng)
  slots = jnp.asarray([3, -1, 0, 2], jnp.int32)
  pool0 = _initial_states(rng, P, jnp.float32)
  steps = [make_step(rng, 4, H, G, P, N).as_jax() for _ in range(3)]
  runs = {}
  for rows in (1, 2, 4, "xla"):
    pool, outs = pool0, []
    for a in steps:
      kw = dict(D=jp["D"], z=a["z"], dt_bias=jp["dt_bias"])
      if rows == "xla":
        y, pool = rs.mamba2.decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], pool, slots,
                                   implementation="xla", **kw)
      else:
        y, pool = mamba2_mosaic.decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], pool, slots,
                                       dt_softplus=True, rows=rows, **kw)
      outs.append(y)
    runs[rows] = (pool, outs)
  assert_rows_agree(runs)


def test_replay_rows_per_program_change_the_grid_not_results():
  """The replay step with 1, 2 or 4 batch rows per program (4: two pairs, a buffer staged again
  while the other row computes) over four rows (a padding row, staggered joins) and natural
  flushes leaves bitwise the same buffers, and they match XLA's."""
  from tests.helpers import run_each_setting
  rng = np.random.default_rng(14)
  _, jp = _params(rng)
  slots4, start4 = np.array([2, -1, 0, 3], np.int32), np.array([0, 0, 1, 2])
  slots_at = lambda t: jnp.asarray(np.where(t >= start4, slots4, -1), jnp.int32)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=2)
  first = _poisoned_buffers(cursor, P, "float32", _initial_states(rng, P, jnp.float32))

  def decode(a, bufs, plan, rows):
    kw = dict(D=jp["D"], z=a["z"], dt_bias=jp["dt_bias"])
    if rows == "xla":
      return rs.mamba2.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan,
                                     implementation="xla", **kw)
    return mamba2_mosaic.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan,
                                       dt_softplus=True, rows=rows, **kw)

  runs, flushed = run_each_setting(cursor, first, slots_at, 6,
                                   lambda: make_step(rng, 4, H, G, P, N).as_jax(), decode,
                                   (1, 2, 4, "xla"))
  assert flushed >= 3
  assert_rows_agree(runs)


def test_verify_rows_per_program_change_the_grid_not_results(monkeypatch):
  """1, 2 or 4 batch rows per verify program (4: two pairs, a buffer staged again while the other
  row computes) leave bitwise the same checkpoints and rings after steps with natural and forced
  flushes, padding rows and short rows; every step of every run is also checked against XLA and
  float64 (Twin, batch 4)."""
  from tests.test_mamba2_verify_pallas import BATCH, Twin, _staggered_rows
  finals, flushes = {}, {}
  for rows in (1, 2, 4):
    set_mosaic_rows(monkeypatch, rows, "mosaic_mamba2_verify_config")
    rng = np.random.default_rng(22)
    twin = Twin(num_tokens=2, buffer_len=4, seed=22, impl=IMPL, conventional=False)
    for t in range(5):
      rows_t = _staggered_rows(rng, NUM_SLOTS, BATCH, t + 2)
      short = rng.random(BATCH) < 0.3
      twin.step(rows_t, lengths=np.where(short, 1, 2),
                force=(rng.random(BATCH) < 0.2) & (np.asarray(rows_t) >= 0))
    finals[rows], flushes[rows] = twin.bufs[IMPL], twin.natural + twin.forced
  assert flushes[1] >= 3
  assert_rows_agree(finals)


def test_the_mosaic_kernel_runs_and_refuses_unlowerable_shapes():
  jp, pool, j, slots = _one_step(7)
  run = lambda: rs.mamba2.decode(j["x"], j["dt"], jp["A"], j["B"], j["C"], pool, slots,
                                 implementation=IMPL)
  assert "replayssm_mamba2_decode_mosaic" in str(jax.make_jaxpr(run)())
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = _poisoned_buffers(cursor, P, "float32", pool)
  replay = lambda route="auto": rs.mamba2.replay_decode(
      j["x"], j["dt"], jp["A"], j["B"], j["C"], bufs, cursor.plan(slots), route=route,
      implementation=IMPL)
  assert "replayssm_mamba2_replay_mosaic" in str(jax.make_jaxpr(replay)())
  verify_cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4, max_draft=1)
  verify_bufs = _poisoned_buffers(verify_cursor, P, "float32", pool)
  verify = lambda: rs.mamba2.replay_verify(
      *(j[k][:, None] for k in ("x", "dt")), jp["A"], *(j[k][:, None] for k in ("B", "C")), verify_bufs,
      verify_cursor.plan(slots, num_tokens=1), implementation=IMPL)
  assert "replayssm_mamba2_verify_mosaic" in str(jax.make_jaxpr(verify)())
  with pytest.raises(NotImplementedError, match="reconstruct route"):
    replay("output_only")
  # Compiling (not interpreting): 32-row tiles and N = 16 cannot take the WGMMA layouts.
  with common.force_lowering():
    with pytest.raises(NotImplementedError, match="P tile 32 of P=32.*N=16"):
      run()
    with pytest.raises(NotImplementedError, match="N=16"):
      replay()


def _h200_call(kernel, state_dtype, buffer_len, geometry):
  """(fn, donated argnums, args) of one Mosaic kernel at a production geometry."""
  slots, cursor, bufs, step, extra = _production(SUPER if geometry == "super" else NANO,
                                                 buffer_len, state_dtype)
  if kernel == "decode":
    return (lambda pool, s, x, dt, A, B, C: rs.mamba2.decode(
        x, dt, A, B, C, pool, s, z=x, implementation=IMPL, **extra), (0,), (bufs.state, slots, *step))
  if kernel == "decode_rows4":
    return (lambda pool, s, x, dt, A, B, C: mamba2_mosaic.decode(
        x, dt, A, B, C, pool, s, z=x, dt_softplus=True, rows=4, **extra), (0,),
        (bufs.state, slots, *step))
  if kernel.startswith("verify"):   # T = 4 tokens per row
    cursor = rs.ReplayCursor.create(cursor.num_slots, buffer_len=buffer_len, max_draft=3)
    bufs = rs.mamba2.ReplayBuffers.create(cursor.num_slots, cursor, num_heads=bufs.num_heads,
                                          head_dim=bufs.head_dim, num_groups=bufs.num_groups,
                                          state_dim=bufs.state_dim, state_dtype=state_dtype,
                                          ring_dtype=jnp.bfloat16)
    tokens = [x if x.ndim == 1 else jnp.stack([x] * 4, axis=1) for x in step]   # A stays [H]
    if kernel == "verify":
      verify = lambda b, p, x, dt, A, B, C: rs.mamba2.replay_verify(
          x, dt, A, B, C, b, p, z=x, implementation=IMPL, **extra)
    else:   # four rows per program: doubled SMEM buffers, the next row staged during this one
      lengths = jnp.full(slots.shape, 4, jnp.int32)
      verify = lambda b, p, x, dt, A, B, C: mamba2_mosaic.replay_verify(
          x, dt, A, B, C, b, p, lengths, z=x, dt_softplus=True, rows=4, **extra)
    return verify, (0,), (bufs, cursor.plan(slots, num_tokens=4), *tokens)
  if kernel == "replay":
    return (lambda b, p, x, dt, A, B, C: rs.mamba2.replay_decode(
        x, dt, A, B, C, b, p, z=x, implementation=IMPL, **extra), (0,),
        (bufs, cursor.plan(slots), *step))
  # four rows per program: doubled SMEM buffers, the next row staged during this one
  return (lambda b, p, x, dt, A, B, C: mamba2_mosaic.replay_decode(
      x, dt, A, B, C, b, p, z=x, dt_softplus=True, rows=4, **extra), (0,),
      (bufs, cursor.plan(slots), *step))


@pytest.mark.parametrize("kernel,state_dtype,buffer_len,geometry", [
    ("decode", "float32", 8, "super"), ("decode", "bfloat16", 8, "super"),
    ("decode", "float32", 8, "nano"), ("replay", "float32", 16, "super"),
    ("replay", "bfloat16", 8, "super"), ("replay", "float32", 8, "nano"),
    ("verify", "float32", 8, "super"), ("verify", "bfloat16", 8, "super"),
    ("verify_rows4", "float32", 8, "super"), ("replay_rows4", "float32", 8, "super"),
    ("decode_rows4", "float32", 8, "super")])
def test_lowers_for_h200(kernel, state_dtype, buffer_len, geometry):
  """Super (P 64, N 128): one Mosaic kernel, every donated buffer updated in place (pool; state
  and the three rings). Nano (P 80): no 64-row tile divides P, so compiling refuses it
  (implementation=None then falls back)."""
  fn, donate, args = _h200_call(kernel, state_dtype, buffer_len, geometry)
  lower = lambda: lower_for_h200(fn, donate, *args, strict=True)
  if geometry == "nano":
    with pytest.raises(NotImplementedError, match="P=80"):
      lower()
    return
  text = lower()
  assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
  assert text.count("tf.aliasing_output") == {"decode": 1, "replay": 4, "verify": 4,
                                               "verify_rows4": 4, "replay_rows4": 4,
                                               "decode_rows4": 1}[kernel]


@pytest.mark.parametrize("kernel", ["decode_rows4", "replay_rows4", "verify_rows4"])
def test_store_waits_are_compiled_not_interpreted(kernel):
  fn, _, args = _h200_call(kernel, "float32", 8, "super")
  assert_store_waits_only_compiled(fn, *args)


def test_softplus_without_log1p_is_f32_accurate():
  """Mosaic GPU has no log1p: softplus through ``log1p_from_log`` stays within f32 rounding of the
  float64 value over the range where exp(-|x|) does not underflow (naive log(1 + e) loses all
  digits below |x| ≈ 17)."""
  x = jnp.asarray(np.r_[np.linspace(-80.0, 30.0, 20001), 0.0, 1e-8, -1e-8], jnp.float32)
  got = np.asarray(common.softplus(x, log1p=common.log1p_from_log), np.float64)
  want = np.logaddexp(np.asarray(x, np.float64), 0.0)
  assert np.max(np.abs(got - want) / want) < 4e-7

