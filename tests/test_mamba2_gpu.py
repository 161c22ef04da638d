"""GPU-only checks of the compiled Pallas Mamba2 kernels, Triton and Mosaic (marker ``gpu``; skipped on CPU).

Interpret mode hides what only the compiled kernels show: TF32 dots, lowering of masked loads,
register-level layouts. These tests run the real kernels at production geometry (Nemotron-3-Super:
H 128, P 64, N 128, G 8; Nemotron-3-Nano's P = 80 once) against the independent float64 oracle
across flushes, and check that a donated step compiles without copying the state pool.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import max_err, set_mosaic_rows
from tests.test_mamba2_ops import make_params, make_step, mamba2_step_f64

pytestmark = pytest.mark.gpu

SUPER, NANO = (128, 8, 64, 128), (96, 8, 80, 128)   # (H, G, P, N)
SLOTS = np.array([5, -1, 2, 7], np.int32)          # a padding row in the middle


def _run(route, state_dtype, buffer_len, steps, geometry=SUPER, seed=0, flush_all_at=(),
         implementation="pallas_triton"):
  """Replay (route) and conventional decode through ``implementation`` against the float64
  oracle; materialize through Triton. Returns the max errors."""
  h, g, p, n = geometry
  rng = np.random.default_rng(seed)
  params = make_params(rng, h)
  jp = dict(A=jnp.asarray(params.A, jnp.float32), D=jnp.asarray(params.D, jnp.float32),
            dt_bias=jnp.asarray(params.dt_bias, jnp.float32))
  num_slots = 8
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len)
  bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n, state_dtype=state_dtype, ring_dtype=jnp.float32)
  live = SLOTS >= 0
  S = rng.normal(size=(len(SLOTS), h, p, n)) * 0.1
  S = np.asarray(jnp.asarray(S, state_dtype).astype(jnp.float32), np.float64)   # as stored
  slots = jnp.asarray(SLOTS)
  bufs, cursor = rs.mamba2.write_state(bufs, cursor, slots, jnp.asarray(S, jnp.float32))
  pool = bufs.state
  errs = {"replay": 0.0, "state": 0.0, "conv": 0.0}
  flushes = 0
  for t in range(steps):
    step = make_step(rng, len(SLOTS), h, g, p, n)
    a = step.as_jax()
    plan = cursor.plan(slots, flush_all=t in flush_all_at)
    flushes += int(np.sum(np.asarray(plan.flush)))
    y, bufs = rs.mamba2.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan,
                                      D=jp["D"], z=a["z"], dt_bias=jp["dt_bias"], route=route,
                                      implementation=implementation)
    cursor = cursor.commit(plan)
    yc, pool = rs.mamba2.decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], pool, slots, D=jp["D"],
                                z=a["z"], dt_bias=jp["dt_bias"], implementation=implementation)
    y_ref, S = mamba2_step_f64(S, step.rounded(), params)
    scale = max(1.0, float(np.max(np.abs(y_ref[live]))))
    errs["replay"] = max(errs["replay"], max_err(np.asarray(y)[live], y_ref[live]) / scale)
    errs["conv"] = max(errs["conv"], max_err(np.asarray(yc)[live], y_ref[live]) / scale)
    assert np.all(np.asarray(y)[~live] == 0) and np.all(np.asarray(yc)[~live] == 0)
    state = rs.mamba2.materialize(bufs, cursor, slots, implementation="pallas_triton")
    errs["state"] = max(errs["state"], max_err(np.asarray(state)[live], S[live]))
  assert flushes > 0
  return errs


@pytest.mark.parametrize("route", ["output_only", "reconstruct"])
def test_compiled_replay_f32_matches_float64_oracle(route):
  errs = _run(route, jnp.float32, buffer_len=4, steps=9)
  # f32 throughout; a TF32 product anywhere would show errors near 1e-3.
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs
  assert errs["conv"] < 5e-5, errs


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_mosaic_kernels_match_float64_oracle(state_dtype):
  """pallas_mosaic: replay_decode (reconstruct, flush fused) and decode, compiled for Hopper."""
  errs = _run("reconstruct", state_dtype, 4, steps=10, seed=5, implementation="pallas_mosaic")
  if state_dtype == jnp.float32:
    assert max(errs.values()) < 5e-5, errs
  else:   # the bf16 pool of the conventional arm rounds every step; replay's checkpoint per flush
    assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


@pytest.mark.parametrize("rows", [2, 4])
def test_compiled_mosaic_rows_per_program(monkeypatch, rows):
  """The Mosaic replay step and conventional decode with 2 or 4 batch rows per program (doubled
  SMEM buffers, the next row's TMA issued before the current row computes) against float64."""
  # The replay and verify configs derive from the decode one.
  set_mosaic_rows(monkeypatch, rows, "mosaic_mamba2_decode_config")
  errs = _run("reconstruct", jnp.float32, 4, steps=10, seed=6, implementation="pallas_mosaic")
  assert max(errs.values()) < 5e-5, errs


def test_compiled_replay_bf16_state():
  errs = _run("output_only", jnp.bfloat16, buffer_len=8, steps=17)
  assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


def test_compiled_p80_tiles():
  """Nemotron-3-Nano's P = 80 runs in tiles of 16 rows."""
  errs = _run("output_only", jnp.float32, buffer_len=4, steps=5, geometry=NANO)
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5 and errs["conv"] < 5e-5, errs


def test_donated_step_does_not_copy_the_pool():
  h, g, p, n = SUPER
  num_slots, b = 16, 8
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=16)
  bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n, ring_dtype=jnp.bfloat16)
  a = make_step(np.random.default_rng(0), b, h, g, p, n).as_jax("bfloat16")
  A = jnp.full((h,), -1.0, jnp.float32)
  slots = jnp.arange(b, dtype=jnp.int32)

  def replay(bufs, cursor, x, dt, B, C, z):
    plan = cursor.plan(slots)
    y, bufs = rs.mamba2.replay_decode(x, dt, A, B, C, bufs, plan, z=z, implementation="pallas_triton")
    return y, bufs, cursor.commit(plan)

  def conventional(pool, x, dt, B, C, z):
    return rs.mamba2.decode(x, dt, A, B, C, pool, slots, z=z, implementation="pallas_triton")

  inputs = (a["x"], a["dt"], a["B"], a["C"], a["z"])
  for fn, args in ((replay, (bufs, cursor)), (conventional, (bufs.state,))):
    compiled = jax.jit(fn, donate_argnums=tuple(range(len(args)))).lower(*args, *inputs).compile()
    text = compiled.as_text()
    state_shape = f"f32[{num_slots},{h},{p},{n}]"
    copies = [line for line in text.splitlines() if " copy(" in line and state_shape in line]
    assert not copies, copies


def test_compiled_flush_all_steps():
  """The small-batch policy's fold-and-step kernel: the first flush_all step folds pending windows,
  the next runs on empty windows; ordinary replay steps around them."""
  errs = _run("output_only", jnp.float32, buffer_len=8, steps=12, flush_all_at=(4, 5, 9))
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs
