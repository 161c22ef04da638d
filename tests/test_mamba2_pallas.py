"""Pallas-Triton Mamba2 kernels vs the XLA implementation (CPU interpret mode) + abstract-H200 lowering.

Parity runs through the public ops (``implementation="pallas_triton"`` vs ``"xla"``) over
multi-step sequences with staggered rows, a padding row, forced flushes (so windows wrap the
ring), grouped heads (G=2 < H=4) and NaN-poisoned ring entries outside every window. Outputs,
materialized states and the raw buffers are compared at every step; f32 runs are also checked
against the independent float64 oracle of tests/test_mamba2_ops.py.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax.pallas import mamba2_triton
from tests.helpers import lower_for_h200, max_err, run_each_setting, tolerance
from tests.test_mamba2_ops import make_params, make_step, mamba2_step_f64

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

H, G, N = 4, 2, 16                   # CPU config: two N chunks, two heads (one group) per program
NUM_SLOTS = 6
SLOTS = np.array([3, -1, 0, 5], np.int32)   # row 1 is padding throughout
START = np.array([0, 0, 1, 2])              # rows join late, so their cursors are staggered
# name: (state dtype, activation dtype = ring dtype)
DTYPES = {"f32": ("float32", "float32"), "bf16": ("bfloat16", "bfloat16")}
# (L, route, dtypes, P): both routes × dtypes at L = 4, L = 1 and 2 once each, P = 24 (not a
# power of two: tiles of 8 rows) once. Every case compiles interpreted programs of several
# seconds each, so the cross product is out of reach; the materialize kernel is compiled for the
# two L = 4 cases (others materialize the kernel's buffers with XLA).
REPLAY_CASES = [(4, "output_only", "f32", 8), (4, "reconstruct", "bf16", 8),
                (2, "reconstruct", "f32", 24), (1, "output_only", "bf16", 8)]

def _slots_at(t):
  return jnp.asarray(np.where(t >= START, SLOTS, -1), jnp.int32)


def _np(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def _initial_states(rng, p, dtype):
  return jnp.asarray(0.3 * rng.normal(size=(NUM_SLOTS, H, p, N)), dtype)


def _poisoned_buffers(cursor, p, state_dtype, S0):
  """Buffers whose checkpoints are S0 and whose ring holds NaN everywhere (nothing is live yet)."""
  bufs = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=H, head_dim=p, num_groups=G,
                                        state_dim=N, state_dtype=state_dtype)
  nan = lambda x: jnp.full_like(x, jnp.nan)
  return bufs.replace(state=S0, ring_x=nan(bufs.ring_x), ring_B=nan(bufs.ring_B),
                      ring_a=nan(bufs.ring_a))


def _params(rng):
  p = make_params(rng, H)
  return p, dict(A=jnp.asarray(p.A, jnp.float32), D=jnp.asarray(p.D, jnp.float32),
                 dt_bias=jnp.asarray(p.dt_bias, jnp.float32))


def _replay(step, dtype, jp, bufs, plan, **kw):
  a = step.as_jax(dtype)
  return rs.mamba2.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan, D=jp["D"],
                                 z=a["z"], dt_bias=jp["dt_bias"], **kw)


def _decode(step, dtype, jp, pool, slots, **kw):
  a = step.as_jax(dtype)
  return rs.mamba2.decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], pool, slots, D=jp["D"],
                          z=a["z"], dt_bias=jp["dt_bias"], **kw)


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


FIELDS = ("state", "ring_x", "ring_B", "ring_a")


# First in the file: the first Pallas program of a process is compiled twice (the tracing
# context gains an entry after the first pallas_call); this kernel is the cheapest.
@pytest.mark.parametrize("dtypes", ["f32", "bf16"])
def test_decode_parity(dtypes):
  decode_parity("pallas_triton", dtypes, 8, seed=3)


def decode_parity(impl, dtypes, p, *, seed):
  """``impl`` vs XLA and the float64 oracle (f32) over three steps with D, z and dt_bias, rows
  joining late and a padding row: padding outputs zero, slots outside the batch untouched."""
  state_dtype, act_dtype = DTYPES[dtypes]
  tol = tolerance(state_dtype, act_dtype)
  rng = np.random.default_rng(seed)
  params, jp = _params(rng)
  pools = dict.fromkeys(("xla", impl), _initial_states(rng, p, state_dtype))
  exact = np.asarray(_np(pools["xla"]), np.float64)
  for t in range(3):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    step = make_step(rng, len(SLOTS), H, G, p, N)
    out = {}
    for name in pools:
      before = pools[name]
      out[name], pools[name] = _decode(step, act_dtype, jp, before, slots, implementation=name)
    _assert_untouched("pool", before, pools[impl], np.asarray(slots)[live])
    assert np.all(_np(out[impl])[~live] == 0.0)
    _assert_close(f"t={t} y", out[impl], out["xla"], tol)
    _assert_close(f"t={t} pool", pools[impl], pools["xla"], tol)
    if state_dtype == "float32":
      sl = np.asarray(slots)[live]
      y64, s64 = mamba2_step_f64(exact[sl], step.rounded().map(lambda a: a[live]), params)
      exact[sl] = s64
      assert max_err(_np(out[impl])[live], y64) <= tol
      assert max_err(_np(pools[impl])[sl], s64) <= tol


@pytest.mark.parametrize("buffer_len,route,dtypes,p", REPLAY_CASES)
def test_replay_decode_parity(buffer_len, route, dtypes, p):
  replay_parity("pallas_triton", buffer_len, route, dtypes, p,
                materialize_impl="pallas_triton" if buffer_len == 4 else "xla")


def replay_parity(impl, buffer_len, route, dtypes, p, *, materialize_impl):
  """``impl`` vs XLA and the float64 oracle over 2L + 3 steps: staggered rows, a padding row,
  forced and natural flushes, windows that wrap the ring, NaN in the ring outside every window;
  non-flushing rows keep their checkpoint bit for bit, slots outside the batch are untouched.
  States are materialized through ``materialize_impl``."""
  state_dtype, act_dtype = DTYPES[dtypes]
  tol = tolerance(state_dtype, act_dtype)
  rng = np.random.default_rng(buffer_len + p)
  params, jp = _params(rng)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len)
  S0 = _initial_states(rng, p, state_dtype)
  bufs = {"xla": _poisoned_buffers(cursor, p, state_dtype, S0),
          impl: _poisoned_buffers(cursor, p, state_dtype, S0)}
  exact = np.asarray(_np(S0), np.float64)   # float64 oracle state per slot
  flushes, wrapped = 0, False
  for t in range(2 * buffer_len + 3):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    # Forced flushes (row 0 at its first step, row 2 at its second) move bases off the ring
    # origin, so later windows wrap around the ring.
    rows = np.arange(len(SLOTS))
    force = jnp.asarray(live & (((rows == 0) & (t == 0)) | ((rows == 2) & (t == 2))))
    plan = cursor.plan(slots, force_flush=force)
    flushes += int(np.sum(np.asarray(plan.flush)))
    ends = np.asarray(plan.base) + np.asarray(plan.count)     # this step's write index, unwrapped
    wrapped |= bool(np.any(live & (ends >= cursor.ring_size)))
    step = make_step(rng, len(SLOTS), H, G, p, N)
    out = {}
    for name in bufs:
      before = bufs[name]
      out[name], bufs[name] = _replay(step, act_dtype, jp, before, plan, route=route,
                                      implementation=name)
      if name == impl:
        for field in FIELDS:
          _assert_untouched(field, getattr(before, field), getattr(bufs[name], field),
                            np.asarray(slots)[live])
        # Non-flushing rows never write their checkpoint.
        kept = np.asarray(slots)[live & ~np.asarray(plan.flush)]
        assert (np.asarray(before.state)[kept].tobytes()
                == np.asarray(bufs[name].state)[kept].tobytes())
    assert np.all(_np(out[impl])[~live] == 0.0)
    _assert_close(f"t={t} y", out[impl], out["xla"], tol)
    for field in FIELDS:
      _assert_close(f"t={t} {field}", getattr(bufs[impl], field),
                    getattr(bufs["xla"], field), tol)
    cursor = cursor.commit(plan)
    states = {name: rs.mamba2.materialize(bufs[name], cursor, slots, implementation=materialize_impl)
              for name in bufs}
    _assert_close(f"t={t} materialize", states[impl], states["xla"], tol)
    assert np.all(_np(states[impl])[~live] == 0.0)
    if dtypes == "f32":   # float64 oracle, independent of both implementations
      sl = np.asarray(slots)[live]
      y64, s64 = mamba2_step_f64(exact[sl], step.rounded().map(lambda a: a[live]), params)
      exact[sl] = s64
      assert max_err(_np(out[impl])[live], y64) <= tol
      assert max_err(_np(states[impl])[live], s64) <= tol
  assert flushes >= 2
  assert wrapped or buffer_len == 1


@pytest.mark.parametrize("dtypes", ["f32", "bf16"])
def test_flush_all_policy_parity(dtypes):
  """Windows pending, then flush_all steps (the small-batch policy's fold-and-step kernel: the first
  folds each row's window, later ones run on empty windows), then ordinary replay: outputs,
  checkpoints and materialized states equal XLA's (and float64 for f32); padding rows inert; ring
  entries outside windows are NaN and must never leak."""
  state_dtype, act_dtype = DTYPES[dtypes]
  tol = tolerance(state_dtype, act_dtype)
  rng = np.random.default_rng(17)
  params, jp = _params(rng)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=8)
  S0 = _initial_states(rng, 8, state_dtype)
  bufs = {impl: _poisoned_buffers(cursor, 8, state_dtype, S0) for impl in ("xla", "pallas_triton")}
  exact = np.asarray(_np(S0), np.float64)
  for t in range(8):
    slots = _slots_at(t)
    live = np.asarray(slots) >= 0
    flush_all = 3 <= t < 6
    plan = cursor.plan(slots, flush_all=flush_all)
    if t == 3:
      assert np.all(np.asarray(plan.count)[live] > 0), "the first flush_all step must fold windows"
    step = make_step(rng, len(SLOTS), H, G, 8, N)
    out = {}
    for impl in bufs:
      before = bufs[impl]
      out[impl], bufs[impl] = _replay(step, act_dtype, jp, before, plan, implementation=impl)
    _assert_untouched("state", before.state, bufs["pallas_triton"].state, np.asarray(slots)[live])
    assert np.all(_np(out["pallas_triton"])[~live] == 0.0)
    _assert_close(f"t={t} y", out["pallas_triton"], out["xla"], tol)
    _assert_close(f"t={t} state", bufs["pallas_triton"].state, bufs["xla"].state, tol)
    cursor = cursor.commit(plan)
    if flush_all:
      assert np.all(np.asarray(cursor.count) == 0)
    mat = rs.mamba2.materialize(bufs["pallas_triton"], cursor, slots, implementation="xla")
    _assert_close(f"t={t} materialize", mat,
                  rs.mamba2.materialize(bufs["xla"], cursor, slots, implementation="xla"), tol)
    if dtypes == "f32":
      sl = np.asarray(slots)[live]
      y64, s64 = mamba2_step_f64(exact[sl], step.rounded().map(lambda a: a[live]), params)
      exact[sl] = s64
      assert max_err(_np(out["pallas_triton"])[live], y64) <= tol
      assert max_err(_np(mat)[live], s64) <= tol


def _one_step(seed=7, buffer_len=4, t=5):
  rng = np.random.default_rng(seed)
  _, jp = _params(rng)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len)
  bufs = _poisoned_buffers(cursor, 8, jnp.float32, _initial_states(rng, 8, jnp.float32))
  return make_step(rng, len(SLOTS), H, G, 8, N), jp, bufs, cursor, _slots_at(t)


def test_replay_route_auto_matches_output_only():
  step, jp, bufs, cursor, slots = _one_step()
  plan = cursor.plan(slots, force_flush=jnp.asarray([True, False, False, False]))
  auto = _replay(step, "float32", jp, bufs, plan, route="auto", implementation="pallas_triton")
  ref = _replay(step, "float32", jp, bufs, plan, route="output_only", implementation="pallas_triton")
  for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(ref)):
    assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def test_auto_route_rule_on_the_h200():
  """The measured route rule: reconstruct for f32 state from B = 8 at L <= 4, and up to B = 128 at
  L = 8; output-only otherwise."""
  from replayssm_jax import config  # noqa: PLC0415
  route = lambda dtype, batch, buffer_len: config.mamba2_replay_config(
      device_kind="NVIDIA H200", state_dtype=dtype, head_dim=64, state_dim=128, num_heads=128,
      num_groups=8, batch=batch, buffer_len=buffer_len, ring_size=2 * buffer_len).route
  assert route(jnp.float32, 32, 8) == route(jnp.float32, 128, 4) == "reconstruct"
  assert route(jnp.float32, 256, 4) == route(jnp.float32, 8, 4) == "reconstruct"
  assert route(jnp.float32, 1, 4) == "output_only"
  assert route(jnp.float32, 256, 8) == route(jnp.float32, 32, 16) == "output_only"
  assert route(jnp.bfloat16, 32, 8) == "output_only"
  assert config.mamba2_replay_config(device_kind="NVIDIA H200", state_dtype=jnp.float32, head_dim=64,
                                     state_dim=128, num_heads=128, num_groups=8, batch=32, buffer_len=8,
                                     ring_size=16, route="output_only").route == "output_only"


def test_the_pallas_kernels_run():
  """implementation="pallas_triton" really traces our pallas_calls (and XLA does not)."""
  step, jp, bufs, cursor, slots = _one_step()
  plan = cursor.plan(slots)
  replay = lambda b, impl: _replay(step, "float32", jp, b, plan, implementation=impl)
  decode = lambda b, impl: _decode(step, "float32", jp, b.state, slots, implementation=impl)
  mat = lambda b, impl: rs.mamba2.materialize(b, cursor, slots, implementation=impl)
  for fn, name in ((replay, "replayssm_mamba2_replay_step"), (decode, "replayssm_mamba2_decode"),
                   (mat, "replayssm_mamba2_materialize")):
    assert name in str(jax.make_jaxpr(lambda b, fn=fn: fn(b, "pallas_triton"))(bufs))
    assert "pallas_call" not in str(jax.make_jaxpr(lambda b, fn=fn: fn(b, "xla"))(bufs))


def test_unsupported_sizes_raise():
  rng = np.random.default_rng(0)
  _, jp = _params(rng)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  slots = _slots_at(5)
  for p, n, match in ((8, 24, "power-of-two.*N=24"), (12, N, "P=12 has no power-of-two tile")):
    bufs = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=H, head_dim=p, num_groups=G,
                                          state_dim=n)
    step = make_step(rng, len(SLOTS), H, G, p, n)
    with pytest.raises(NotImplementedError, match=match):
      _decode(step, "float32", jp, bufs.state, slots, implementation="pallas_triton")
    with pytest.raises(NotImplementedError, match=match):
      _replay(step, "float32", jp, bufs, cursor.plan(slots), implementation="pallas_triton")
    with pytest.raises(NotImplementedError, match=match):
      rs.mamba2.materialize(bufs, cursor, slots, implementation="pallas_triton")
  step, jp, good, cursor, slots = _one_step()
  a = step.as_jax()
  with pytest.raises(NotImplementedError, match="block_p=6"):
    mamba2_triton.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], good, cursor.plan(slots),
                                D=None, z=None, dt_bias=None, dt_softplus=True, block_p=6)
  with pytest.raises(ValueError, match="heads=0"):
    mamba2_triton.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], good, cursor.plan(slots),
                                D=None, z=None, dt_bias=None, dt_softplus=True, heads=0)


def test_knobs_change_tiling_not_results():
  """Other tiles (one P tile, four N chunks, one head per program); no D, z, dt_bias, softplus."""
  step, jp, bufs, cursor, slots = _one_step(seed=11)
  plan = cursor.plan(slots, force_flush=jnp.asarray([True, False, False, False]))
  a = step.as_jax()
  got = mamba2_triton.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan, D=None,
                                    z=None, dt_bias=None, dt_softplus=False, route="output_only",
                                    block_p=8, block_n=4, heads=1, num_warps=1)
  want = rs.mamba2.replay_decode(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan,
                                 dt_softplus=False, route="output_only", implementation="xla")
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _assert_close("knobs vs xla", x, y, tolerance("float32", "float32"))


def test_fold_tiles_change_the_fold_grid_not_results():
  """The output-only route's fold pass over P = 24 (six [8, 8] tiles per head: three row tiles,
  two N chunks) with 1 or 2 (the CPU default) tiles per program, or 4 and 64, which do not divide
  six and fall back to 2, stores bitwise the same checkpoints through natural flushes of full
  windows; a fold_tiles that is not a power of two is refused."""
  rng = np.random.default_rng(12)
  _, jp = _params(rng)
  p = 24
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  first = _poisoned_buffers(cursor, p, jnp.float32, _initial_states(rng, p, jnp.float32))
  def decode(a, bufs, plan, n):
    return mamba2_triton.replay_decode(
        a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan, D=jp["D"], z=a["z"],
        dt_bias=jp["dt_bias"], dt_softplus=True, route="output_only", fold_tiles=n)

  runs, flushed = run_each_setting(cursor, first, _slots_at, 7,
                                   lambda: make_step(rng, len(SLOTS), H, G, p, N).as_jax(), decode,
                                   (None, 1, 4, 64))
  assert flushed >= 3
  for n in (1, 4, 64):
    for x, y in zip(jax.tree.leaves(runs[None]), jax.tree.leaves(runs[n])):
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f"fold_tiles={n}"
  with pytest.raises(ValueError, match="fold_tiles=3"):
    decode(make_step(rng, len(SLOTS), H, G, p, N).as_jax(), first, cursor.plan(_slots_at(0)), 3)


def test_fold_tiles_defaults():
  """H200: one tile per fold program where the ring is short (R < 16: unrolled rank-one FMAs), four
  where the fold is a window product at B=256 (the launch table mamba2_fold_tiles)."""
  from replayssm_jax import config   # noqa: PLC0415
  kw = dict(device_kind="NVIDIA H200", state_dtype=jnp.float32, head_dim=64, state_dim=128,
            num_heads=128, num_groups=8, batch=256)
  assert config.mamba2_replay_config(buffer_len=8, ring_size=8, **kw).fold_tiles == 1
  assert config.mamba2_replay_config(buffer_len=16, ring_size=16, **kw).fold_tiles == 4
  kw["batch"] = 128   # not measured below B = 256: one tile, as GDN's small batches want
  assert config.mamba2_replay_config(buffer_len=16, ring_size=16, **kw).fold_tiles == 1


# ---------------------------------------------------------------------------------------------
# Abstract-H200 lowering at production shapes (notes/pallas-gpu.md §4): catches what interpret
# mode hides (Triton power-of-two sizes, unsupported primitives) and checks in-place aliasing.
# Nemotron-3-Super (H 128, P 64, N 128, G 8); Nemotron-3-Nano (H 96, P 80) for the P = 80 tiles.
# ---------------------------------------------------------------------------------------------

SUPER, NANO = (128, 8, 64, 128), (96, 8, 80, 128)
P_B, P_SLOTS = 8, 16


def _production(geometry, buffer_len, state_dtype):
  h, g, p, n = geometry
  bf16 = jnp.bfloat16
  slots = jnp.asarray(np.r_[np.arange(P_B - 1), -1], jnp.int32)
  cursor = rs.ReplayCursor.create(P_SLOTS, buffer_len=buffer_len)
  bufs = rs.mamba2.ReplayBuffers.create(P_SLOTS, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n, state_dtype=state_dtype, ring_dtype=bf16)
  step = (jnp.zeros((P_B, h, p), bf16), jnp.zeros((P_B, h), bf16), jnp.zeros((h,), jnp.float32),
          jnp.zeros((P_B, g, n), bf16), jnp.zeros((P_B, g, n), bf16))
  extra = dict(D=jnp.zeros((h,), jnp.float32), dt_bias=jnp.zeros((h,), jnp.float32))
  return slots, cursor, bufs, step, extra


@pytest.mark.parametrize("kernel,state_dtype,buffer_len,geometry", [
    ("decode", "float32", 8, "super"), ("decode", "bfloat16", 8, "super"),
    ("replay_output_only", "float32", 4, "super"), ("replay_output_only", "float32", 8, "super"),
    ("replay_output_only", "float32", 16, "super"), ("replay_output_only", "bfloat16", 16, "super"),
    ("replay_reconstruct", "float32", 8, "super"), ("replay_reconstruct", "bfloat16", 16, "super"),
    ("materialize", "float32", 16, "super"), ("replay_output_only", "float32", 8, "nano"),
    ("flush_all", "float32", 16, "super"), ("flush_all", "bfloat16", 32, "nano"),
])
def test_lowers_for_h200(kernel, state_dtype, buffer_len, geometry):
  slots, cursor, bufs, step, extra = _production(SUPER if geometry == "super" else NANO, buffer_len,
                                                 state_dtype)
  if kernel == "decode":
    text = lower_for_h200(lambda pool, s, x, dt, A, B, C: rs.mamba2.decode(
        x, dt, A, B, C, pool, s, z=x, implementation="pallas_triton", **extra),
        (0,), bufs.state, slots, *step)
  elif kernel == "materialize":
    text = lower_for_h200(lambda b, c, s: rs.mamba2.materialize(b, c, s, implementation="pallas_triton"),
                  (), bufs, cursor, slots)
  else:
    route = "output_only" if kernel == "flush_all" else kernel.removeprefix("replay_")
    text = lower_for_h200(lambda b, p, x, dt, A, B, C: rs.mamba2.replay_decode(
        x, dt, A, B, C, b, p, z=x, route=route, implementation="pallas_triton", **extra),
        (0,), bufs, cursor.plan(slots, flush_all=kernel == "flush_all"), *step)
  assert "__gpu$xla.gpu.triton" in text
  # Every donated buffer is updated in place: pool (decode); state and the three rings (replay;
  # flush_all passes the rings through). materialize writes a fresh array, so nothing is aliased.
  expected = {"decode": 1, "materialize": 0}.get(kernel, 4)
  assert text.count("tf.aliasing_output") == expected
