"""Mamba2 op suite (XLA): replay_decode / decode / materialize / write_state / copy_slots.

The shared driver is ``Harness``: each ``step`` runs plan → replay_decode → commit, the
conventional ``decode`` on its own pool, ``materialize``, and an independent float64 numpy oracle
(``mamba2_step_f64``, written from DESIGN §2, no library code) per slot, and records the per-step
errors, flushes and ring wraps. The Pallas kernels come later; these tests pin the XLA statement.
"""
import copy
import dataclasses
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import max_err, round_to_tf32, tolerance

i32 = jnp.int32
F32 = ("float32", "float32")
IMPL = "xla"
# (H, G, P, N): P ≠ N so a transposed state cannot pass.
GEOMETRIES = {"small": (4, 2, 8, 16), "nemotron_slice": (8, 2, 80, 128)}
ROUTES = ("output_only", "reconstruct")


def _np(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _f32(x) -> np.ndarray:
  """float64 copy of x rounded to float32 (what the op receives)."""
  return np.asarray(x, np.float32).astype(np.float64)


@dataclasses.dataclass
class Params:
  A: np.ndarray                # [H], negative
  dt_bias: np.ndarray          # [H]
  D: np.ndarray | None         # [H]


@dataclasses.dataclass
class Step:
  x: np.ndarray                # [B, H, P]
  dt: np.ndarray               # [B, H]
  B: np.ndarray                # [B, G, N]
  C: np.ndarray                # [B, G, N]
  z: np.ndarray | None         # [B, H, P]

  FIELDS = ("x", "dt", "B", "C", "z")

  def map(self, fn) -> "Step":
    return Step(*(None if getattr(self, f) is None else fn(getattr(self, f)) for f in self.FIELDS))

  def as_jax(self, dtype="float32") -> dict:
    return {f: None if getattr(self, f) is None else jnp.asarray(getattr(self, f), dtype) for f in self.FIELDS}

  def rounded(self, dtype="float32") -> "Step":
    return self.map(lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64))


def make_params(rng, h, *, skip=True) -> Params:
  """As in the peers' Mamba2 tests: A = −(rand + 1), dt_bias = rand − 4 (rounded to float32)."""
  return Params(A=_f32(-(rng.uniform(size=h) + 1)), dt_bias=_f32(rng.uniform(size=h) - 4),
                D=_f32(rng.normal(size=h)) if skip else None)


def make_step(rng, batch, h, g, p, n, *, gate=True) -> Step:
  return Step(x=rng.normal(size=(batch, h, p)), dt=rng.normal(size=(batch, h)),
              B=rng.normal(size=(batch, g, n)), C=rng.normal(size=(batch, g, n)),
              z=rng.normal(size=(batch, h, p)) if gate else None)


def mamba2_step_f64(S, step: Step, params: Params):
  """One exact Mamba2 step in float64 per row. S: [B, H, P, N]. Returns (y [B, H, P], S_new)."""
  S = np.asarray(S, np.float64)
  h, g = S.shape[1], step.B.shape[1]
  group = np.arange(h) // (h // g)
  delta = np.logaddexp(0.0, step.dt + params.dt_bias)                  # softplus, [B, H]
  Bh, Ch = step.B[:, group], step.C[:, group]                          # [B, H, N]
  S_new = (np.exp(delta * params.A)[..., None, None] * S
           + (delta[..., None] * step.x)[..., :, None] * Bh[:, :, None, :])
  y = np.einsum("bhpn,bhn->bhp", S_new, Ch)
  if params.D is not None:
    y = y + params.D[:, None] * step.x
  if step.z is not None:
    y = y * step.z / (1.0 + np.exp(-step.z))
  return y, S_new


def _rows(step: Step, mask) -> Step:
  return step.map(lambda a: a[mask])


# --------------------------------------------------------------------------------------------
# The shared driver.


class Harness:
  """ReplaySSM buffers + cursor, a conventional-decode pool and a float64 oracle, stepped together.

  ``errors[key]``, one max-abs error per step (live rows): out (replay vs oracle), state
  (materialize vs oracle), conv / conv_state (decode vs oracle), replay_vs_conv.
  """

  def __init__(self, *, geometry="small", num_slots=6, buffer_len=4, route="output_only", precision=F32,
               seed=0, skip=True, gate=True, conventional=True, materialize=True):
    self.route = route
    self.h, self.g, self.p, self.n = GEOMETRIES[geometry]
    self.state_dtype, self.act_dtype = precision
    self.gate, self.conventional, self.check_state = gate, conventional, materialize
    self.rng = np.random.default_rng(seed)
    self.params = make_params(self.rng, self.h, skip=skip)
    self.cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len)
    self.bufs = rs.mamba2.ReplayBuffers.create(
        num_slots, self.cursor, num_heads=self.h, head_dim=self.p, num_groups=self.g, state_dim=self.n,
        state_dtype=self.state_dtype, ring_dtype=self.act_dtype)
    self.pool = jnp.zeros_like(self.bufs.state)
    self.oracle = {s: np.zeros((self.h, self.p, self.n)) for s in range(num_slots)}
    self.errors = defaultdict(list)
    self.flushes = np.zeros(num_slots, int)
    self.forced = 0
    self.wraps = 0

  @property
  def tol(self) -> float:
    return tolerance(self.state_dtype, self.act_dtype)

  @property
  def jparams(self) -> dict:
    p = self.params
    return dict(A=jnp.asarray(p.A, jnp.float32), dt_bias=jnp.asarray(p.dt_bias, jnp.float32),
                D=None if p.D is None else jnp.asarray(p.D, jnp.float32))

  def clone(self) -> "Harness":
    twin = copy.copy(self)
    twin.oracle = {s: S.copy() for s, S in self.oracle.items()}
    twin.errors = defaultdict(list, {k: list(v) for k, v in self.errors.items()})
    twin.flushes = self.flushes.copy()
    twin.rng = copy.deepcopy(self.rng)
    return twin

  def random_state(self, batch: int) -> np.ndarray:
    return 0.3 * self.rng.normal(size=(batch, self.h, self.p, self.n))

  def prefill(self, slots, S=None):
    slots = np.asarray(slots, np.int32)
    S = self.random_state(len(slots)) if S is None else np.asarray(S, np.float64)
    S_dev = jnp.asarray(S, jnp.float32)
    self.bufs, self.cursor = rs.mamba2.write_state(self.bufs, self.cursor, jnp.asarray(slots), S_dev,
                                                   implementation=IMPL)
    live = slots >= 0
    pool = np.array(self.pool)
    pool[slots[live]] = np.asarray(S_dev.astype(self.pool.dtype))[live]
    self.pool = jnp.asarray(pool)
    stored = _np(S_dev.astype(self.state_dtype))
    for row, s in enumerate(slots):
      if s >= 0:
        self.oracle[int(s)] = stored[row].astype(np.float64)

  def copy_slots(self, src, dst):
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    self.bufs, self.cursor = rs.mamba2.copy_slots(self.bufs, self.cursor, jnp.asarray(src), jnp.asarray(dst),
                                                  implementation=IMPL)
    for s, d in zip(src, dst):
      if s >= 0 and d >= 0:
        self.oracle[int(d)] = self.oracle[int(s)].copy()

  def make_step(self, batch: int) -> Step:
    return make_step(self.rng, batch, self.h, self.g, self.p, self.n, gate=self.gate)

  def mat(self, rows) -> np.ndarray:
    return _np(rs.mamba2.materialize(self.bufs, self.cursor, jnp.asarray(rows, i32), implementation=IMPL))

  def step(self, rows, force=None, step: Step | None = None):
    rows = np.asarray(rows, np.int32)
    live = rows >= 0
    slots = jnp.asarray(rows)
    step = self.make_step(len(rows)) if step is None else step
    x = step.as_jax(self.act_dtype)
    plan = self.cursor.plan(slots, force_flush=None if force is None else jnp.asarray(force, bool))
    y, self.bufs = rs.mamba2.replay_decode(x["x"], x["dt"], self.jparams["A"], x["B"], x["C"], self.bufs, plan,
                                           D=self.jparams["D"], z=x["z"], dt_bias=self.jparams["dt_bias"],
                                           route=self.route, implementation=IMPL)
    self.cursor = self.cursor.commit(plan)
    assert y.shape == (len(rows), self.h, self.p) and y.dtype == jnp.dtype(self.act_dtype)
    y = _np(y)
    assert np.all(y[~live] == 0), "padding rows must output exact zeros"

    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + 1 > self.cursor.buffer_len - 1
    assert not np.any(flush[~live])
    self.forced += int(np.sum(flush & ~natural & live))
    self.wraps += int(np.sum(live & (base + count >= self.cursor.ring_size) & (self.cursor.ring_size > 1)))
    for s in rows[live & flush]:
      self.flushes[s] += 1

    yc = S = None
    if self.conventional:
      yc, self.pool = rs.mamba2.decode(x["x"], x["dt"], self.jparams["A"], x["B"], x["C"], self.pool, slots,
                                       D=self.jparams["D"], z=x["z"], dt_bias=self.jparams["dt_bias"],
                                       implementation=IMPL)
      yc = _np(yc)
      assert np.all(yc[~live] == 0), "decode: padding rows must output exact zeros"
    if self.check_state:
      S = self.mat(rows)
      assert S.shape == (len(rows), self.h, self.p, self.n)
      assert np.all(S[~live] == 0), "materialize: padding rows must be zeros"

    if not live.any():
      return y
    S_prev = np.stack([self.oracle[int(s)] for s in rows[live]])
    y_ref, S_ref = mamba2_step_f64(S_prev, _rows(step.rounded(self.act_dtype), live), self.params)
    for s, S_s in zip(rows[live], S_ref):
      self.oracle[int(s)] = S_s
    self.errors["out"].append(max_err(y[live], y_ref))
    if yc is not None:
      self.errors["conv"].append(max_err(yc[live], y_ref))
      self.errors["replay_vs_conv"].append(max_err(y[live], yc[live]))
      self.errors["conv_state"].append(max_err(np.asarray(self.pool)[rows[live]], S_ref))
    if S is not None:
      self.errors["state"].append(max_err(S[live], S_ref))
    return y

  def run(self, num_steps, rows, *, force=None, joins=None):
    for t in range(num_steps):
      if joins and t in joins:
        self.prefill(joins[t])
      self.step(rows(t) if callable(rows) else rows, force(t) if callable(force) else force)
    return self

  def max(self, key) -> float:
    return max(self.errors[key]) if self.errors[key] else 0.0

  def assert_close(self, tol=None, keys=("out", "state", "conv", "conv_state")):
    tol = self.tol if tol is None else tol
    for key in keys:
      if key in self.errors or key == "out":
        errs = np.asarray(self.errors[key])
        assert errs.size and np.all(np.isfinite(errs)), f"{key}: no or non-finite errors {errs}"
        assert errs.max() <= tol, (f"{key}: max error {errs.max():.3g} > {tol:.3g} at step "
                                   f"{int(errs.argmax())} of {errs.size}; per step {np.array2string(errs, precision=2)}")

  def snapshot(self):
    leaves = dict(state=self.bufs.state, ring_x=self.bufs.ring_x, ring_B=self.bufs.ring_B,
                  ring_a=self.bufs.ring_a, base=self.cursor.base, count=self.cursor.count, pool=self.pool)
    return {k: np.array(jnp.asarray(v).view(jnp.uint16) if v.dtype.itemsize == 2 else v) for k, v in leaves.items()}


def assert_bitwise_equal(a: dict, b: dict, slots, what=""):
  for key in a:
    for s in slots:
      np.testing.assert_array_equal(a[key][s], b[key][s], err_msg=f"{what}{key}[{s}] changed")


# --------------------------------------------------------------------------------------------
# Parity with the float64 oracle.


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("buffer_len", [1, 2, 4, 8, 16])
def test_parity_multi_flush(buffer_len, route):
  """Per step, ≥ 2L+1 steps: replay output, materialized state and conventional decode vs float64."""
  steps = max(2 * buffer_len + 2, 6)
  rows = lambda t: [2, -1, 0, 3] if t >= 1 else [2, -1, 0, -1]   # slot 3 joins one step later
  h = Harness(buffer_len=buffer_len, route=route, seed=buffer_len)
  h.run(steps, rows, joins={0: [0, -1, 2], 1: [3]})
  h.assert_close()
  for s in (0, 2, 3):
    assert h.flushes[s] >= 2, f"slot {s} flushed {h.flushes[s]} times in {steps} steps"
  assert h.flushes[1] == h.flushes[4] == h.flushes[5] == 0


@pytest.mark.parametrize("skip,gate", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("route", ROUTES)
def test_skip_and_gate_options(skip, gate, route):
  """D and z each on and off (both on: the parity test)."""
  h = Harness(buffer_len=4, route=route, seed=21, skip=skip, gate=gate)
  h.run(9, [1, -1, 0, 3], joins={0: [0, 1, 3]})
  h.assert_close()
  assert h.flushes[0] == 2


@pytest.mark.parametrize("precision", [("float32", "bfloat16"), ("bfloat16", "bfloat16")],
                         ids=lambda p: f"s_{p[0]}-a_{p[1]}")
def test_low_precision_buffers(precision):
  h = Harness(buffer_len=4, precision=precision, route="auto", seed=7)
  h.run(9, [1, -1, 0, 3], joins={0: [0, 1], 1: [3]})
  assert h.bufs.state.dtype == jnp.dtype(precision[0])
  assert h.bufs.ring_x.dtype == h.bufs.ring_B.dtype == jnp.dtype(precision[1])
  assert h.bufs.ring_a.dtype == jnp.float32
  h.assert_close()
  assert h.max("out") > tolerance(*F32), "low-precision storage should be visible; is it really bf16?"
  assert h.flushes[0] == 2


def test_f32_tolerance_catches_a_tf32_dot():
  """Anti-vacuity for the float32 tolerance: the output dot at TF32 input precision must fail it."""
  h = Harness(buffer_len=4, seed=3, conventional=False, materialize=False, skip=False, gate=False)
  h.run(6, [0, 1, -1, -1], joins={0: [0, 1]})
  S = np.stack([h.oracle[0], h.oracle[1]])
  step = h.make_step(2)
  y_exact, S_new = mamba2_step_f64(S, step, h.params)
  C = step.C[:, np.arange(h.h) // (h.h // h.g)]
  y_tf32 = np.einsum("bhpn,bhn->bhp", round_to_tf32(S_new), round_to_tf32(C))
  assert max_err(y_tf32, y_exact) > tolerance(*F32), "a TF32 dot would pass the float32 tolerance"
  assert h.max("out") < tolerance(*F32) / 4


@pytest.mark.parametrize("route", ROUTES)
def test_nemotron_slice(route):
  """Nemotron-like head geometry (P = 80, N = 128, 4 heads per group), batch 2 + padding, 2 flushes."""
  h = Harness(geometry="nemotron_slice", num_slots=3, buffer_len=2, route=route, seed=11)
  h.run(4, [2, -1, 0], joins={0: [0, 2]})
  h.assert_close()
  assert h.flushes[0] == h.flushes[2] == 2


@pytest.mark.parametrize("route", ROUTES)
def test_staggered_cursors_and_forced_flushes(route):
  """Rows joining at different steps, permuted batches with padding, random forced flushes;
  flushes, forced flushes and ring wraps must really happen."""
  rng = np.random.default_rng(3)
  num_slots = 6
  order = [rng.permutation(num_slots) for _ in range(20)]
  joined = {0: [0, 1], 1: [2], 2: [3, 4], 3: [5]}
  live_at = lambda t: {s for j, ss in joined.items() if j <= t for s in ss}
  rows = lambda t: [s if s in live_at(t) else -1 for s in order[t]] + [-1]
  h = Harness(num_slots=num_slots, buffer_len=4, route=route, seed=5)
  bases = []
  for t in range(20):
    h.run(1, rows(t), force=list(rng.random(num_slots + 1) < 0.2),
          joins={0: joined[t]} if t in joined else None)
    bases.append(np.asarray(h.cursor.base).copy())
  h.assert_close()
  assert np.all(h.flushes >= 3) and h.forced >= 3 and h.wraps >= 3, (h.flushes, h.forced, h.wraps)
  assert len({tuple(b) for b in bases}) > 3, "cursor bases never moved"
  assert len(set(np.asarray(h.cursor.count).tolist())) > 1, "rows ended in the same phase; not staggered"


def test_forced_flush_at_block_boundary():
  """A forced flush folds everything: checkpoint = oracle state there, window empty."""
  h = Harness(buffer_len=16, seed=2)
  h.run(3, [0, 1, -1, -1], joins={0: [0, 1]})
  before = h.bufs.state
  h.step([0, 1, -1, -1], force=[True, False, True, False])
  assert int(h.cursor.count[0]) == 0 and int(h.cursor.base[0]) == 4
  assert int(h.cursor.count[1]) == 4 and int(h.cursor.base[1]) == 0
  assert max_err(_np(h.bufs.state[0]), h.oracle[0]) <= h.tol
  np.testing.assert_array_equal(np.asarray(h.bufs.state[1]), np.asarray(before[1]))
  h.run(6, [0, 1, -1, -1])
  h.assert_close()


@pytest.mark.parametrize("route", ROUTES)
def test_l1_replay_equals_conventional_decode(route):
  """L = 1 flushes every step: replay is the conventional step."""
  h = Harness(buffer_len=1, seed=4, route=route)
  h.run(6, [2, -1, 0, -1], joins={0: [0, 2]})
  assert np.all(h.flushes[[0, 2]] == 6) and int(np.max(np.asarray(h.cursor.count))) == 0
  h.assert_close()
  assert h.max("replay_vs_conv") <= 1e-6
  np.testing.assert_allclose(_np(h.bufs.state), _np(h.pool), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Padding, isolation, recycling, copies.


def test_padding_rows_are_inert():
  h = Harness(buffer_len=4, seed=8)
  h.run(6, [0, 1, 2, 3], joins={0: [0, 1, 2, 3, 4, 5]}, force=lambda t: [t == 2, False, False, False])
  h.run(2, [5, 4, -1, -1])
  snap = h.snapshot()
  step = h.make_step(4)
  poisoned = copy.deepcopy(step)
  for name in Step.FIELDS:
    getattr(poisoned, name)[[1, 3]] = np.nan
  twin = h.clone()
  y = h.step([2, -1, 0, -5], step=poisoned)
  y_clean = twin.step([2, -1, 0, -5], step=step)
  np.testing.assert_array_equal(y, y_clean)   # NaN on padding rows never reaches live rows
  assert np.all(y[[1, 3]] == 0) and np.all(np.isfinite(y))
  after = h.snapshot()
  assert_bitwise_equal(snap, after, [1, 3, 4, 5], "padding step: ")
  assert_bitwise_equal(after, twin.snapshot(), range(6), "poisoned vs clean padding: ")
  h.assert_close()


def test_all_padding_batch_is_a_noop():
  h = Harness(buffer_len=4, seed=9)
  h.run(5, [0, 2, 1, 5], joins={0: [0, 1, 2, 5]})
  snap = h.snapshot()
  assert np.all(h.step([-1, -1, -1, -1]) == 0)
  assert_bitwise_equal(snap, h.snapshot(), range(6), "all-padding step: ")
  assert np.all(h.mat([-1, -1, -1, -1]) == 0)
  h.prefill([-1, -1, -1, -1])
  h.copy_slots([-1, 0, -1, 2], [1, -1, -1, -1])
  assert_bitwise_equal(snap, h.snapshot(), range(6), "all-padding write_state / copy_slots: ")


def test_nan_in_one_slot_leaves_other_rows_bitwise_unchanged():
  h = Harness(buffer_len=4, seed=12)
  h.run(6, [0, 1, 2, 3], joins={0: [0, 1, 2, 3]})
  clean = h.clone()
  b = h.bufs
  h.bufs = b.replace(state=b.state.at[1].set(jnp.nan), ring_x=b.ring_x.at[1].set(jnp.nan),
                     ring_B=b.ring_B.at[1].set(jnp.nan), ring_a=b.ring_a.at[1].set(jnp.nan))
  h.pool = h.pool.at[1].set(jnp.nan)
  for _ in range(5):
    step = h.make_step(4)
    y = h.step([2, 1, 0, -1], step=step)
    y_clean = clean.step([2, 1, 0, -1], step=step)
    np.testing.assert_array_equal(y[[0, 2, 3]], y_clean[[0, 2, 3]])
    assert not np.all(np.isfinite(y[1])), "the poisoned slot was never read"
  assert_bitwise_equal(h.snapshot(), clean.snapshot(), [0, 2, 3, 4, 5], "NaN slot 1: ")


def test_write_state_recycles_a_dirty_slot():
  dirty = Harness(buffer_len=4, seed=10)
  dirty.run(5, [1, 0, -1, -1], joins={0: [0, 1]}, force=lambda t: [t == 1, False, False, False])
  assert int(dirty.cursor.count[1]) > 0 and int(dirty.cursor.base[1]) > 0
  b = dirty.bufs
  dirty.bufs = b.replace(ring_x=b.ring_x.at[1].set(jnp.nan), ring_B=b.ring_B.at[1].set(jnp.nan),
                         ring_a=b.ring_a.at[1].set(jnp.nan), state=b.state.at[1].set(jnp.inf))
  fresh = Harness(buffer_len=4, seed=10)
  S0 = dirty.random_state(1)
  dirty.prefill([1], S0)
  fresh.prefill([1], S0)
  rows = [1, -1, -1, -1]
  np.testing.assert_array_equal(dirty.mat(rows), fresh.mat(rows))
  for _ in range(6):
    step = dirty.make_step(4)
    np.testing.assert_array_equal(dirty.step(rows, step=step), fresh.step(rows, step=step))
  np.testing.assert_array_equal(_np(dirty.bufs.state[1]), _np(fresh.bufs.state[1]))
  dirty.assert_close()


def test_copy_slots_with_pending_entries():
  h = Harness(buffer_len=16, seed=13)
  h.run(18, [0, 1, -1, -1], joins={0: [0, 1]}, force=lambda t: [t == 11, False, False, False])
  base, count, ring = int(h.cursor.base[0]), int(h.cursor.count[0]), h.cursor.ring_size
  assert count > 0 and base + count > ring, "source window should be pending and wrapped"
  h.copy_slots([0, -1, 1], [3, 2, -1])
  mat = lambda s: h.mat([s, -1, -1, -1])[0]
  np.testing.assert_array_equal(mat(3), mat(0))
  assert max_err(mat(3), h.oracle[0]) <= h.tol
  assert np.all(np.asarray(h.bufs.state[2]) == 0) and int(h.cursor.count[2]) == 0  # skipped row
  h.conventional = False   # the conventional pool was not copied
  for _ in range(12):
    step = h.make_step(4).map(lambda a: np.concatenate([a[:1], a[:1], a[2:]]))
    y = h.step([0, 3, -1, -1], step=step)
    np.testing.assert_array_equal(y[0], y[1])
  np.testing.assert_array_equal(mat(3), mat(0))
  assert h.flushes[3] >= 1
  h.assert_close()


@pytest.mark.parametrize("target", ["ring_x", "ring_B", "ring_a", "count", "base"])
def test_corruption_inside_window_is_detected(target):
  """Teeth: a perturbed ring entry inside the live window (or a wrong cursor) must fail the
  comparison; the same perturbation outside the window must change nothing."""
  h = Harness(buffer_len=16, seed=14, conventional=False)
  h.run(5, [0, 1, -1, -1], joins={0: [0, 1]})
  base, count, ring = int(h.cursor.base[0]), int(h.cursor.count[0]), h.cursor.ring_size
  assert count >= 3
  mat = lambda hh: hh.mat([0, -1, -1, -1])[0]
  assert max_err(mat(h), h.oracle[0]) <= h.tol

  def corrupt(hh, pos):
    b = hh.bufs
    if target == "ring_x":
      hh.bufs = b.replace(ring_x=b.ring_x.at[0, 1, pos].add(0.25))
    elif target == "ring_B":
      hh.bufs = b.replace(ring_B=b.ring_B.at[0, 0, pos].add(0.25))
    elif target == "ring_a":
      hh.bufs = b.replace(ring_a=b.ring_a.at[0, 2, pos].add(-0.5))
    elif target == "count":
      hh.cursor = hh.cursor.replace(count=hh.cursor.count.at[0].add(-1))
    else:
      hh.cursor = hh.cursor.replace(base=hh.cursor.base.at[0].add(1))

  bad = h.clone()
  corrupt(bad, (base + 1) % ring)
  assert max_err(mat(bad), h.oracle[0]) > h.tol, "materialize did not see the corruption"
  bad.step([0, 1, -1, -1])
  assert bad.errors["out"][-1] > h.tol, "replay_decode did not see the corruption"
  if target.startswith("ring"):
    outside = h.clone()
    corrupt(outside, (base + count) % ring)
    np.testing.assert_array_equal(mat(outside), mat(h))


# --------------------------------------------------------------------------------------------
# Prefill (chunked) then decode == recurrent over the whole sequence.


def test_prefill_then_decode_matches_recurrent():
  prompt, gen, slots = 11, 9, [3, 1]
  h = Harness(num_slots=4, buffer_len=4, seed=15)
  steps = [h.make_step(2) for _ in range(prompt + gen)]
  seq = {f: jnp.asarray(np.stack([getattr(s, f) for s in steps], axis=1), jnp.float32) for f in Step.FIELDS}
  p = h.jparams
  y_full, S_full = rs.mamba2.recurrent(seq["x"], seq["dt"], p["A"], seq["B"], seq["C"], D=p["D"], z=seq["z"],
                                       dt_bias=p["dt_bias"])
  cut = {f: a[:, :prompt] for f, a in seq.items()}
  y_pre, S_pre = rs.mamba2.chunked(cut["x"], cut["dt"], p["A"], cut["B"], cut["C"], D=p["D"], z=cut["z"],
                                   dt_bias=p["dt_bias"], chunk_size=4)
  assert max_err(y_pre, np.asarray(y_full[:, :prompt])) <= 1e-4
  h.prefill(slots, np.asarray(S_pre))
  for t in range(gen):
    y = h.step(slots, step=steps[prompt + t])
    assert max_err(y, y_full[:, prompt + t]) <= 1e-4, f"decode step {t} vs recurrent"
  assert max_err(h.mat(slots), S_full) <= 1e-4
  assert h.flushes[3] >= 2
  h.assert_close()


# --------------------------------------------------------------------------------------------
# Donation, dispatch, bad inputs.


def _aliased_params(compiled_text: str) -> dict[int, int]:
  header = next(line for line in compiled_text.splitlines() if line.startswith("HloModule"))
  m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
  assert m, f"no input_output_alias in: {header[:300]}"
  return {int(p): int(o) for o, p in re.findall(r"\{(\d*)\}: \((\d+), \{\}", m.group(1))}


def _small_inputs(batch=2):
  h, g, p, n = GEOMETRIES["small"]
  cursor = rs.ReplayCursor.create(3, buffer_len=4)
  bufs = rs.mamba2.ReplayBuffers.create(3, cursor, num_heads=h, head_dim=p, num_groups=g, state_dim=n)
  rng = np.random.default_rng(0)
  step = make_step(rng, batch, h, g, p, n).as_jax()
  params = make_params(rng, h)
  args = dict(x=step["x"], dt=step["dt"], A=jnp.asarray(params.A, jnp.float32), B=step["B"], C=step["C"],
              D=jnp.asarray(params.D, jnp.float32), z=step["z"], dt_bias=jnp.asarray(params.dt_bias, jnp.float32))
  return cursor, bufs, args


def _call_replay(args, bufs, plan, **kw):
  a = dict(args)
  return rs.mamba2.replay_decode(a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"), bufs, plan,
                                 **a, **kw)


def test_replay_decode_donation_aliases_every_buffer():
  cursor, bufs, args = _small_inputs()
  plan = cursor.plan(jnp.array([2, 0], i32))
  fn = jax.jit(lambda bufs, args, plan: _call_replay(args, bufs, plan), donate_argnums=0)
  aliases = _aliased_params(fn.lower(bufs, args, plan).compile().as_text())
  assert aliases == {0: 1, 1: 2, 2: 3, 3: 4}, aliases


def test_unavailable_implementation_raises():
  """An op without a kernel for the named implementation says so; auto never fails on that."""
  cursor, bufs, args = _small_inputs()
  slots = jnp.array([2, 0], i32)
  plan = cursor.plan(slots)
  with pytest.raises(NotImplementedError, match="pallas_mosaic.*not available"):
    rs.mamba2.materialize(bufs, cursor, slots, implementation="pallas_mosaic")
  with pytest.raises(NotImplementedError, match="reconstruct route"):   # Mosaic has one route
    _call_replay(args, bufs, plan, route="output_only", implementation="pallas_mosaic")
  y, _ = _call_replay(args, bufs, plan, implementation=None)   # auto picks XLA
  assert y.shape == args["x"].shape


def _bad_replay_cases():
  h, g, p, n = GEOMETRIES["small"]
  other = rs.ReplayCursor.create(3, buffer_len=8)
  return {
      "x rank": (dict(x=lambda a: a[0]), "x"),
      "x dtype": (dict(x=lambda a: a.astype(i32)), "x"),
      "x head dim": (dict(x=lambda a: jnp.zeros((2, h, p + 1))), "x"),
      "x heads": (dict(x=lambda a: jnp.zeros((2, h + 1, p))), "x"),
      "dt shape": (dict(dt=lambda a: a[:, :-1]), "dt"),
      "dt dtype": (dict(dt=lambda a: a.astype(i32)), "dt"),
      "A shape": (dict(A=lambda a: a[:-1]), "A"),
      "B state dim": (dict(B=lambda a: a[..., :-1]), "B"),
      "B batch": (dict(B=lambda a: a[:1]), "B"),
      "H % G": (dict(B=lambda a: jnp.zeros((2, 3, n)), C=lambda a: jnp.zeros((2, 3, n))), "multiple of G"),
      "groups vs bufs": (dict(B=lambda a: jnp.zeros((2, 4, n)), C=lambda a: jnp.zeros((2, 4, n))), "groups"),
      "C shape": (dict(C=lambda a: a[:, :1]), "C"),
      "D shape": (dict(D=lambda a: a[:, None]), "D"),
      "z shape": (dict(z=lambda a: a[..., :-1]), "z"),
      "z dtype": (dict(z=lambda a: a.astype(i32)), "z"),
      "dt_bias shape": (dict(dt_bias=lambda a: a[:2]), "dt_bias"),
      "dt_softplus": (dict(dt_softplus="yes"), "dt_softplus"),
      "plan from another cursor": (dict(plan=lambda pl: other.plan(pl.slots)), "plan"),
      "plan batch": (dict(plan=lambda pl: pl.replace(slots=pl.slots[:1])), "plan.slots"),
      "plan num_tokens": (dict(plan=lambda pl: pl.replace(num_tokens=2)), "num_tokens"),
      "bufs not buffers": (dict(bufs=lambda b: b.state), "bufs"),
      "route typo": (dict(route="output-only"), "route"),
      "implementation typo": (dict(implementation="pallas_trition"), "implementation"),
  }


@pytest.mark.parametrize("case", list(_bad_replay_cases()))
def test_replay_decode_bad_inputs(case):
  change, match = _bad_replay_cases()[case]
  cursor, bufs, args = _small_inputs()
  args.update(bufs=bufs, plan=cursor.plan(jnp.array([2, 0], i32)))
  for name, fn in change.items():
    args[name] = fn if isinstance(fn, str) else fn(args[name])
  bufs, plan = args.pop("bufs"), args.pop("plan")
  with pytest.raises(ValueError, match=match):
    _call_replay(args, bufs, plan)


def test_decode_and_buffer_op_bad_inputs():
  cursor, bufs, args = _small_inputs()
  a = dict(args)
  x, dt, A, B, C = (a.pop(k) for k in ("x", "dt", "A", "B", "C"))
  slots = jnp.array([0, 1], i32)
  with pytest.raises(ValueError, match="pool"):
    rs.mamba2.decode(x, dt, A, B, C, bufs.state[0], slots, **a)
  with pytest.raises(ValueError, match="pool"):
    rs.mamba2.decode(x, dt, A, B, C, bufs.state.astype(i32), slots, **a)
  with pytest.raises(ValueError, match="x"):
    rs.mamba2.decode(x, dt, A, B, C, jnp.zeros((3, 8, 8, 16)), slots, **a)
  with pytest.raises(ValueError, match="slots"):
    rs.mamba2.decode(x, dt, A, B, C, bufs.state, slots[:1], **a)
  with pytest.raises(ValueError, match="multiple of G"):
    rs.mamba2.decode(x, dt, A, jnp.zeros((2, 3, 16)), jnp.zeros((2, 3, 16)), bufs.state, slots, **a)
  S = jnp.zeros((2,) + bufs.state.shape[1:])
  other = rs.ReplayCursor.create(5, buffer_len=4)
  with pytest.raises(ValueError, match="S"):
    rs.mamba2.write_state(bufs, cursor, slots, S[:1])
  with pytest.raises(ValueError, match="S"):
    rs.mamba2.write_state(bufs, cursor, slots, S.astype(i32))
  with pytest.raises(ValueError, match="cursor"):
    rs.mamba2.write_state(bufs, other, slots, S)
  with pytest.raises(ValueError, match="bufs"):
    rs.mamba2.write_state(bufs.state, cursor, slots, S)
  with pytest.raises(ValueError, match="cursor"):
    rs.mamba2.materialize(bufs, other, slots)
  with pytest.raises(ValueError, match="slots"):
    rs.mamba2.materialize(bufs, cursor, slots[None])
  with pytest.raises(ValueError, match="dst"):
    rs.mamba2.copy_slots(bufs, cursor, slots, slots[:1])
  with pytest.raises(ValueError, match="implementation"):
    rs.mamba2.write_state(bufs, cursor, slots, S, implementation="pallas")
  kw = dict(num_heads=4, head_dim=8, num_groups=2, state_dim=16)
  with pytest.raises(ValueError, match="num_heads"):
    rs.mamba2.ReplayBuffers.create(3, cursor, **(kw | dict(num_groups=3)))
  with pytest.raises(ValueError, match="state_dtype"):
    rs.mamba2.ReplayBuffers.create(3, cursor, **kw, state_dtype=jnp.int32)
  with pytest.raises(ValueError, match="ring_dtype"):
    rs.mamba2.ReplayBuffers.create(3, cursor, **kw, ring_dtype=jnp.float64)
  with pytest.raises(ValueError, match="cursor"):
    rs.mamba2.ReplayBuffers.create(4, cursor, **kw)
  with pytest.raises(ValueError, match="head_dim"):
    rs.mamba2.ReplayBuffers.create(3, cursor, **(kw | dict(head_dim=0)))
  bf = rs.mamba2.ReplayBuffers.create(3, cursor, **kw, state_dtype=jnp.bfloat16)
  assert bf.ring_x.dtype == bf.ring_B.dtype == jnp.bfloat16 and bf.ring_a.dtype == jnp.float32
  assert bf.ring_x.shape == (3, 4, 4, 8) and bf.ring_B.shape == (3, 2, 4, 16)
