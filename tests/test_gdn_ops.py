"""Gated DeltaNet op suite: replay_decode / decode / materialize / write_state / copy_slots.

Every test runs once per implementation (``implementation`` fixture; Pallas in interpret mode on
CPU). The shared driver is ``Harness``: each ``step`` runs plan → replay_decode → commit, the
conventional ``decode`` on its own pool, ``materialize``, and the independent float64 oracle
(``helpers.gdn_step_f64``) per slot, and records the per-step errors, flushes and ring wraps.
"""
import copy
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import (GEOMETRIES, PRECISION_PAIRS, GdnStep, gdn_step_f64, make_gdn_step, max_err,
                           round_to_tf32, tolerance)

i32 = jnp.int32
F32 = ("float32", "float32")


def _np(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _rows(step: GdnStep, mask) -> GdnStep:
  return GdnStep(*(x[mask] for x in (step.q, step.k, step.v, step.g, step.beta)))


# --------------------------------------------------------------------------------------------
# The shared driver.


class Harness:
  """ReplaySSM buffers + cursor, a conventional-decode pool and a float64 oracle, stepped together.

  ``flush_all = True`` plans every step with ``flush_all`` (the small-batch policy).

  ``errors[key]`` holds one max-abs error per step (live rows only):
    out: replay output vs oracle; state: materialize vs oracle; conv: decode output vs oracle;
    conv_state: decode pool vs oracle; replay_vs_conv: replay output vs decode output.
  """

  def __init__(self, implementation, *, geometry="small", num_slots=6, buffer_len=4,
               route="output_only", precision=F32, seed=0, conventional=True, materialize=True):
    self.impl, self.route = implementation, route
    self.hk, self.hv, self.kd, self.vd = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
    self.state_dtype, self.act_dtype = precision
    self.conventional, self.check_state = conventional, materialize
    self.rng = np.random.default_rng(seed)
    self.cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len)
    self.bufs = rs.gdn.ReplayBuffers.create(
        num_slots, self.cursor, num_k_heads=self.hk, num_v_heads=self.hv, head_k_dim=self.kd,
        head_v_dim=self.vd, state_dtype=self.state_dtype, ring_dtype=self.act_dtype)
    self.pool = jnp.zeros_like(self.bufs.state)
    self.oracle = {s: np.zeros((self.hv, self.vd, self.kd)) for s in range(num_slots)}
    self.errors = defaultdict(list)
    self.outputs = []
    self.flushes = np.zeros(num_slots, int)   # flushing steps per slot
    self.forced = 0                           # flushes that only force_flush asked for
    self.wraps = 0                            # live row-steps whose write index crossed the ring end
    self.steps = 0
    self.flush_all = False

  @property
  def tol(self) -> float:
    return tolerance(self.state_dtype, self.act_dtype)

  def clone(self) -> "Harness":
    twin = copy.copy(self)
    twin.oracle = {s: S.copy() for s, S in self.oracle.items()}
    twin.errors = defaultdict(list, {k: list(v) for k, v in self.errors.items()})
    twin.outputs = list(self.outputs)
    twin.flushes = self.flushes.copy()
    twin.rng = copy.deepcopy(self.rng)
    return twin

  def random_state(self, batch: int) -> np.ndarray:
    return 0.3 * self.rng.normal(size=(batch, self.hv, self.vd, self.kd))

  def prefill(self, slots, S=None):
    """write_state (e.g. after prefill): checkpoint = S, window empty; S random if None."""
    slots = np.asarray(slots, np.int32)
    S = self.random_state(len(slots)) if S is None else np.asarray(S, np.float64)
    S_dev = jnp.asarray(S, jnp.float32)
    self.bufs, self.cursor = rs.gdn.write_state(self.bufs, self.cursor, jnp.asarray(slots), S_dev,
                                                implementation=self.impl)
    live = slots >= 0
    pool = np.array(self.pool)
    pool[slots[live]] = np.asarray(S_dev.astype(self.pool.dtype))[live]
    self.pool = jnp.asarray(pool)
    stored = _np(S_dev.astype(self.state_dtype))  # the checkpoint holds S rounded to the state dtype
    for row, s in enumerate(slots):
      if s >= 0:
        self.oracle[int(s)] = stored[row].astype(np.float64)

  def copy_slots(self, src, dst):
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    self.bufs, self.cursor = rs.gdn.copy_slots(self.bufs, self.cursor, jnp.asarray(src), jnp.asarray(dst),
                                               implementation=self.impl)
    pool = np.array(self.pool)
    for s, d in zip(src, dst):
      if s >= 0 and d >= 0:
        self.oracle[int(d)] = self.oracle[int(s)].copy()
        pool[d] = pool[s]
    self.pool = jnp.asarray(pool)

  def make_step(self, batch: int) -> GdnStep:
    return make_gdn_step(self.rng, batch, self.hk, self.hv, self.kd, self.vd)

  def step(self, rows, force=None, step: GdnStep | None = None):
    """One decode step for batch ``rows`` (slot per row, negative = padding). Returns the replay output."""
    rows = np.asarray(rows, np.int32)
    live = rows >= 0
    slots = jnp.asarray(rows)
    step = self.make_step(len(rows)) if step is None else step
    x = step.as_jax(self.act_dtype)
    plan = self.cursor.plan(slots, force_flush=None if force is None else jnp.asarray(force, bool),
                            flush_all=self.flush_all)
    o, self.bufs = rs.gdn.replay_decode(*x, self.bufs, plan, route=self.route, implementation=self.impl)
    self.cursor = self.cursor.commit(plan)
    assert o.shape == (len(rows), self.hv, self.vd) and o.dtype == jnp.dtype(self.act_dtype)
    o = _np(o)
    assert np.all(o[~live] == 0), "padding rows must output exact zeros"
    self.outputs.append(o)

    # Bookkeeping: which rows flushed (and why), which wrote past the end of the ring.
    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + 1 > self.cursor.buffer_len - 1
    assert not np.any(flush[~live])
    self.forced += int(np.sum(flush & ~natural & live))
    self.wraps += int(np.sum(live & (base + count >= self.cursor.ring_size) & (self.cursor.ring_size > 1)))
    for s in rows[live & flush]:
      self.flushes[s] += 1

    # Conventional decode on its own pool, and the materialized state (padding rows: zeros).
    oc = S = None
    if self.conventional:
      oc, self.pool = rs.gdn.decode(*x, self.pool, slots, implementation=self.impl)
      oc = _np(oc)
      assert np.all(oc[~live] == 0), "decode: padding rows must output exact zeros"
    if self.check_state:
      S = _np(rs.gdn.materialize(self.bufs, self.cursor, slots, implementation=self.impl))
      assert S.shape == (len(rows), self.hv, self.vd, self.kd)
      assert np.all(S[~live] == 0), "materialize: padding rows must be zeros"

    # Float64 oracle, per slot, on the inputs as the kernel saw them (rounded to the activation dtype).
    self.steps += 1
    if not live.any():
      return o
    S_prev = np.stack([self.oracle[int(s)] for s in rows[live]])
    o_ref, S_ref = gdn_step_f64(S_prev, _rows(step.rounded(self.act_dtype), live))
    for s, S_s in zip(rows[live], S_ref):
      self.oracle[int(s)] = S_s
    self.errors["out"].append(max_err(o[live], o_ref))
    if oc is not None:
      self.errors["conv"].append(max_err(oc[live], o_ref))
      self.errors["replay_vs_conv"].append(max_err(o[live], oc[live]))
      self.errors["conv_state"].append(max_err(np.asarray(self.pool)[rows[live]], S_ref))
    if S is not None:
      self.errors["state"].append(max_err(S[live], S_ref))
    return o

  def run(self, num_steps, rows, *, force=None, joins=None):
    """``num_steps`` steps. rows / force: a value or a function of the step index.

    joins: {step: [slots]} — those slots get a random write_state (a prefill) before that step.
    """
    for t in range(num_steps):
      if joins and t in joins:
        self.prefill(joins[t])
      r = rows(t) if callable(rows) else rows
      f = force(t) if callable(force) else force
      self.step(r, f)
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
    """Host copies of every buffer, the cursor and the pool (for bitwise comparisons)."""
    leaves = dict(state=self.bufs.state, ring_k=self.bufs.ring_k, ring_u=self.bufs.ring_u,
                  ring_g=self.bufs.ring_g, base=self.cursor.base, count=self.cursor.count, pool=self.pool)
    return {k: np.array(jnp.asarray(v).view(jnp.uint16) if v.dtype.itemsize == 2 else v) for k, v in leaves.items()}


def assert_bitwise_equal(a: dict, b: dict, slots, what=""):
  for key in a:
    for s in slots:
      np.testing.assert_array_equal(a[key][s], b[key][s], err_msg=f"{what}{key}[{s}] changed")


# --------------------------------------------------------------------------------------------
# A. Parity with the float64 oracle.

ROUTES = ("output_only", "reconstruct")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("buffer_len", [1, 2, 3, 4, 16])
def test_parity_multi_flush(implementation, buffer_len, route):
  """Per step, 2L+1 steps or more: replay output, materialized state and conventional decode vs float64."""
  steps = max(2 * buffer_len + 2, 6)
  rows = lambda t: [2, -1, 0, 3] if t >= 1 else [2, -1, 0, -1]   # slot 3 joins one step later
  h = Harness(implementation, buffer_len=buffer_len, route=route, seed=buffer_len)
  h.run(steps, rows, joins={0: [0, -1, 2], 1: [3]})   # write_state skips the padding row
  h.assert_close()
  for s in (0, 2, 3):
    assert h.flushes[s] >= 2, f"slot {s} flushed {h.flushes[s]} times in {steps} steps"
  assert h.flushes[1] == h.flushes[4] == h.flushes[5] == 0


@pytest.mark.parametrize("precision", PRECISION_PAIRS, ids=lambda p: f"s_{p[0]}-a_{p[1]}")
def test_precision_pairs(implementation, precision):
  h = Harness(implementation, buffer_len=4, precision=precision, route="auto", seed=7)
  h.run(9, [1, -1, 0, 3], joins={0: [0, 1], 1: [3]})
  assert h.bufs.state.dtype == jnp.dtype(precision[0])
  assert h.bufs.ring_u.dtype == h.bufs.ring_k.dtype == jnp.dtype(precision[1])
  assert h.bufs.ring_g.dtype == jnp.float32
  h.assert_close()
  assert h.flushes[0] == 2


def test_f32_tolerance_catches_a_tf32_dot():
  """Anti-vacuity for the float32 tolerance: the output dot at TF32 input precision must fail it."""
  h = Harness("xla", buffer_len=4, seed=3, conventional=False, materialize=False)
  h.run(6, [0, 1, -1, -1], joins={0: [0, 1]})
  S = np.stack([h.oracle[0], h.oracle[1]])
  step = h.make_step(2)
  o_exact, S_new = gdn_step_f64(S, step)
  r = h.hv // h.hk
  q = np.repeat(step.q, r, axis=1) * h.kd ** -0.5
  o_tf32 = np.einsum("bhvk,bhk->bhv", round_to_tf32(S_new), round_to_tf32(q))
  assert max_err(o_tf32, o_exact) > tolerance(*F32), "a TF32 dot would pass the float32 tolerance"
  assert h.max("out") < tolerance(*F32) / 4


# The reconstruct route at real head counts is covered by the lowering tests; interpreting it at
# the 122B geometry cost 50 s of CPU CI.
GEOMETRY_CASES = [("small", "output_only"), ("small", "reconstruct"),
                  ("qwen35_4b", "output_only"), ("qwen35_122b", "output_only")]


@pytest.mark.parametrize("geometry,route", GEOMETRY_CASES, ids=lambda x: x)
def test_geometries(implementation, geometry, route):
  """Real head counts (GQA Hv = 2·Hk and 4·Hk, K = V = 128) at batch 2 + padding, two flushes."""
  small = geometry == "small"  # the small one shares compiled shapes with the other tests
  h = Harness(implementation, geometry=geometry, num_slots=6 if small else 3, buffer_len=2, route=route,
              seed=11)
  h.run(4, [2, -1, 0, -1] if small else [2, -1, 0], joins={0: [0, 2]})
  h.assert_close()
  assert h.flushes[0] == h.flushes[2] == 2


def test_flush_all_policy(implementation):
  """Windows pending, then flush_all steps (the small-batch policy: every row folds its window and
  steps in one pass, windows stay empty), then ordinary replay again: parity with float64 and with
  conventional decode throughout, padding rows inert."""
  h = Harness(implementation, buffer_len=8, seed=21)
  h.run(3, [2, -1, 0, 4], joins={0: [0, 2, 4]})
  assert np.all(np.asarray(h.cursor.count)[[0, 2, 4]] == 3)
  h.flush_all = True
  h.run(3, [0, 2, -1, 4])
  assert np.all(np.asarray(h.cursor.count) == 0) and all(h.flushes[s] == 3 for s in (0, 2, 4))
  h.flush_all = False
  h.run(3, [4, 0, 2, -1])
  h.assert_close()
  assert np.all(np.asarray(h.cursor.count)[[0, 2, 4]] == 3)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("buffer_len", [3, 4])
def test_staggered_cursors_and_forced_flushes(implementation, buffer_len, route):
  """Rows prefilled at different steps (all phases), permuted batches with padding, random forced
  flushes; flushes, forced flushes and ring wraps must really happen."""
  rng = np.random.default_rng(buffer_len)
  num_slots = 6
  order = [rng.permutation(num_slots) for _ in range(20)]
  joined = {0: [0, 1], 1: [2], 2: [3, 4], 3: [5]}
  live_at = lambda t: {s for j, ss in joined.items() if j <= t for s in ss}
  rows = lambda t: [s if s in live_at(t) else -1 for s in order[t]] + [-1]
  force = lambda t: list(rng.random(num_slots + 1) < 0.2)
  h = Harness(implementation, num_slots=num_slots, buffer_len=buffer_len, route=route, seed=5)
  bases = []
  for t in range(20):
    h.run(1, rows(t), force=force(t), joins={0: joined[t]} if t in joined else None)
    bases.append(np.asarray(h.cursor.base).copy())
  h.assert_close()
  assert np.all(h.flushes >= 3) and h.forced >= 3 and h.wraps >= 3, (h.flushes, h.forced, h.wraps)
  assert len({tuple(b) for b in bases}) > 3 and np.max(bases) > 0, "cursor bases never moved"
  phases = np.asarray(h.cursor.count)
  assert len(set(phases.tolist())) > 1, "rows ended in the same phase; not staggered"


def test_forced_flush_at_block_boundary(implementation):
  """A forced flush folds everything: checkpoint = oracle state there, window empty."""
  h = Harness(implementation, buffer_len=16, seed=2)
  h.run(3, [0, 1, -1, -1], joins={0: [0, 1]})
  before = h.bufs.state
  h.step([0, 1, -1, -1], force=[True, False, True, False])
  assert int(h.cursor.count[0]) == 0 and int(h.cursor.base[0]) == 4
  assert int(h.cursor.count[1]) == 4 and int(h.cursor.base[1]) == 0
  assert max_err(_np(h.bufs.state[0]), h.oracle[0]) <= h.tol
  np.testing.assert_array_equal(np.asarray(h.bufs.state[1]), np.asarray(before[1]))
  h.run(6, [0, 1, -1, -1])
  h.assert_close()


def test_l1_replay_equals_conventional_decode(implementation):
  """L = 1 flushes every step: replay is the conventional step (tight, same dtype math)."""
  h = Harness(implementation, buffer_len=1, seed=4)
  h.run(6, [2, -1, 0, -1], joins={0: [0, 2]})
  assert np.all(h.flushes[[0, 2]] == 6) and int(np.max(np.asarray(h.cursor.count))) == 0
  h.assert_close()
  assert h.max("replay_vs_conv") <= 1e-6
  np.testing.assert_allclose(_np(h.bufs.state), _np(h.pool), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# D. Padding, isolation, recycling.


def test_padding_rows_are_inert(implementation):
  h = Harness(implementation, buffer_len=4, seed=8)
  h.run(6, [0, 1, 2, 3], joins={0: [0, 1, 2, 3, 4, 5]}, force=lambda t: [t == 2, False, False, False])
  h.run(2, [5, 4, -1, -1])
  snap = h.snapshot()
  step = h.make_step(4)
  poisoned = copy.deepcopy(step)
  for x in (poisoned.q, poisoned.k, poisoned.v, poisoned.g, poisoned.beta):
    x[[1, 3]] = np.nan
  twin = h.clone()
  o = h.step([2, -1, 0, -5], step=poisoned)
  o_clean = twin.step([2, -1, 0, -5], step=step)
  np.testing.assert_array_equal(o, o_clean)   # NaN on padding rows never reaches live rows
  assert np.all(o[[1, 3]] == 0) and np.all(np.isfinite(o))
  after = h.snapshot()
  assert_bitwise_equal(snap, after, [1, 3, 4, 5], "padding step: ")
  assert_bitwise_equal(after, twin.snapshot(), range(6), "poisoned vs clean padding: ")
  h.assert_close()


def test_all_padding_batch_is_a_noop(implementation):
  h = Harness(implementation, buffer_len=4, seed=9)
  h.run(5, [0, 2, 1, 5], joins={0: [0, 1, 2, 5]})
  snap = h.snapshot()
  o = h.step([-1, -1, -1, -1])
  assert np.all(o == 0)
  assert_bitwise_equal(snap, h.snapshot(), range(6), "all-padding step: ")
  pad = jnp.array([-1, -1, -1, -1], i32)
  S = _np(rs.gdn.materialize(h.bufs, h.cursor, pad, implementation=implementation))
  assert np.all(S == 0)
  h.prefill(pad)                                   # write_state of padding rows only
  h.copy_slots([-1, 0, -1, 2], [1, -1, -1, -1])    # every copy has a padding end
  assert_bitwise_equal(snap, h.snapshot(), range(6), "all-padding write_state / copy_slots: ")


def test_recycled_dirty_slot_equals_fresh(implementation):
  dirty = Harness(implementation, buffer_len=4, seed=10)
  dirty.run(5, [1, 0, -1, -1], joins={0: [0, 1]}, force=lambda t: [t == 1, False, False, False])
  assert int(dirty.cursor.count[1]) > 0 and int(dirty.cursor.base[1]) > 0
  # Poison everything the recycled slot still holds; write_state must make it irrelevant.
  dirty.bufs = dirty.bufs.replace(ring_u=dirty.bufs.ring_u.at[1].set(jnp.nan),
                                  ring_k=dirty.bufs.ring_k.at[1].set(jnp.nan),
                                  ring_g=dirty.bufs.ring_g.at[1].set(jnp.nan),
                                  state=dirty.bufs.state.at[1].set(jnp.inf))
  fresh = Harness(implementation, buffer_len=4, seed=10)
  S0 = dirty.random_state(1)
  dirty.prefill([1], S0)
  fresh.prefill([1], S0)
  rows = [1, -1, -1, -1]
  np.testing.assert_array_equal(
      _np(rs.gdn.materialize(dirty.bufs, dirty.cursor, jnp.array(rows, i32), implementation=implementation)),
      _np(rs.gdn.materialize(fresh.bufs, fresh.cursor, jnp.array(rows, i32), implementation=implementation)))
  for _ in range(6):
    step = dirty.make_step(4)
    np.testing.assert_array_equal(dirty.step(rows, step=step), fresh.step(rows, step=step))
  np.testing.assert_array_equal(_np(dirty.bufs.state[1]), _np(fresh.bufs.state[1]))
  dirty.assert_close()


def test_nan_in_one_slot_leaves_other_rows_bitwise_unchanged(implementation):
  h = Harness(implementation, buffer_len=4, seed=12)
  h.run(6, [0, 1, 2, 3], joins={0: [0, 1, 2, 3]})
  clean = h.clone()
  h.bufs = h.bufs.replace(state=h.bufs.state.at[1].set(jnp.nan), ring_k=h.bufs.ring_k.at[1].set(jnp.nan),
                          ring_u=h.bufs.ring_u.at[1].set(jnp.nan), ring_g=h.bufs.ring_g.at[1].set(jnp.nan))
  h.pool = h.pool.at[1].set(jnp.nan)
  for _ in range(5):
    step = h.make_step(4)
    o = h.step([2, 1, 0, -1], step=step)
    o_clean = clean.step([2, 1, 0, -1], step=step)
    np.testing.assert_array_equal(o[[0, 2, 3]], o_clean[[0, 2, 3]])
    assert not np.all(np.isfinite(o[1])), "the poisoned slot was never read"
  assert_bitwise_equal(h.snapshot(), clean.snapshot(), [0, 2, 3, 4, 5], "NaN slot 1: ")


# --------------------------------------------------------------------------------------------
# E. Lifecycle: copy_slots, teeth.


def test_copy_slots_with_pending_entries(implementation):
  h = Harness(implementation, buffer_len=16, seed=13)
  h.run(18, [0, 1, -1, -1], joins={0: [0, 1]}, force=lambda t: [t == 11, False, False, False])
  base, count, ring = int(h.cursor.base[0]), int(h.cursor.count[0]), h.cursor.ring_size
  assert count > 0 and base + count > ring, "source window should be pending and wrapped"
  h.copy_slots([0, -1, 1], [3, 2, -1])
  mat = lambda s: _np(rs.gdn.materialize(h.bufs, h.cursor, jnp.array([s, -1, -1, -1], i32),
                                          implementation=implementation))[0]
  np.testing.assert_array_equal(mat(3), mat(0))
  assert max_err(mat(3), h.oracle[0]) <= h.tol
  assert np.all(np.asarray(h.bufs.state[2]) == 0) and int(h.cursor.count[2]) == 0  # skipped row
  for _ in range(12):
    step = h.make_step(4)
    both = GdnStep(*(np.concatenate([x[:1], x[:1], x[2:]]) for x in (step.q, step.k, step.v, step.g, step.beta)))
    o = h.step([0, 3, -1, -1], step=both)
    np.testing.assert_array_equal(o[0], o[1])
  np.testing.assert_array_equal(mat(3), mat(0))
  assert h.flushes[3] >= 1
  h.assert_close()


@pytest.mark.parametrize("target", ["ring_u", "ring_k", "ring_g", "count", "base"])
def test_corruption_inside_window_is_detected(implementation, target):
  """Teeth: a perturbed ring entry inside the live window (or a wrong cursor) must fail the
  comparison; the same perturbation outside the window must change nothing."""
  h = Harness(implementation, buffer_len=16, seed=14, conventional=False)
  h.run(5, [0, 1, -1, -1], joins={0: [0, 1]})
  base, count, ring = int(h.cursor.base[0]), int(h.cursor.count[0]), h.cursor.ring_size
  assert count >= 3
  mat = lambda hh: _np(rs.gdn.materialize(hh.bufs, hh.cursor, jnp.array([0, -1, -1, -1], i32),
                                          implementation=implementation))[0]
  assert max_err(mat(h), h.oracle[0]) <= h.tol

  def corrupt(hh, pos):
    b = hh.bufs
    if target == "ring_u":
      hh.bufs = b.replace(ring_u=b.ring_u.at[0, 1, pos].add(0.25))
    elif target == "ring_k":
      hh.bufs = b.replace(ring_k=b.ring_k.at[0, 0, pos].add(0.25))
    elif target == "ring_g":
      hh.bufs = b.replace(ring_g=b.ring_g.at[0, 2, pos].add(-0.5))
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


def _sequence(rng, batch, length, geometry):
  hk, hv, kd, vd = geometry
  steps = [make_gdn_step(rng, batch, hk, hv, kd, vd) for _ in range(length)]
  stack = lambda name: jnp.asarray(np.stack([getattr(s, name) for s in steps], axis=1), jnp.float32)
  return steps, tuple(stack(n) for n in ("q", "k", "v", "g", "beta"))


def test_prefill_then_decode_matches_recurrent(implementation):
  geometry = GEOMETRIES["small"]
  prompt, gen, slots = 11, 9, [3, 1]
  rng = np.random.default_rng(15)
  steps, (q, k, v, g, beta) = _sequence(rng, 2, prompt + gen, geometry)
  o_full, S_full = rs.gdn.recurrent(q, k, v, g, beta)
  cut = lambda x: x[:, :prompt]
  o_pre, S_pre = rs.gdn.chunked(cut(q), cut(k), cut(v), cut(g), cut(beta), chunk_size=4)
  assert o_full.shape == (2, prompt + gen, geometry[1], geometry[3])
  assert S_full.shape == S_pre.shape == (2, geometry[1], geometry[3], geometry[2])

  # The references against the float64 oracle first.
  S = np.zeros((2,) + S_full.shape[1:])
  for t, st in enumerate(steps):
    o_t, S = gdn_step_f64(S, st)
    assert max_err(o_full[:, t], o_t) <= 1e-4, f"recurrent output at t={t}"
    if t == prompt - 1:
      assert max_err(S_pre, S) <= 1e-4 and max_err(o_pre, np.asarray(o_full[:, :prompt])) <= 1e-4

  h = Harness(implementation, num_slots=4, buffer_len=4, seed=15)
  h.prefill(slots, np.asarray(S_pre))
  for t in range(gen):
    o = h.step(slots, step=steps[prompt + t])
    assert max_err(o, o_full[:, prompt + t]) <= 1e-4, f"decode step {t} vs recurrent"
  S_dec = _np(rs.gdn.materialize(h.bufs, h.cursor, jnp.array(slots, i32), implementation=implementation))
  assert max_err(S_dec, S_full) <= 1e-4
  assert h.flushes[3] >= 2
  h.assert_close()


# --------------------------------------------------------------------------------------------
# F. In place under donation; the kernel that was asked for ran.


def _aliased_params(compiled_text: str) -> dict[int, int]:
  """{parameter index: output index} from the compiled HLO module's input_output_alias."""
  header = next(line for line in compiled_text.splitlines() if line.startswith("HloModule"))
  m = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
  assert m, f"no input_output_alias in: {header[:300]}"
  pairs = re.findall(r"\{(\d*)\}: \((\d+), \{\}", m.group(1))
  return {int(p): int(o) for o, p in pairs}


def _small_inputs(batch=2, geometry="small", buffer_len=4):
  hk, hv, kd, vd = GEOMETRIES[geometry]
  cursor = rs.ReplayCursor.create(3, buffer_len=buffer_len)
  bufs = rs.gdn.ReplayBuffers.create(3, cursor, num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                                     head_v_dim=vd)
  step = make_gdn_step(np.random.default_rng(0), batch, hk, hv, kd, vd).as_jax()
  return cursor, bufs, step


def test_replay_decode_donation_aliases_every_buffer(implementation):
  cursor, bufs, (q, k, v, g, beta) = _small_inputs()
  plan = cursor.plan(jnp.array([2, 0], i32))
  fn = jax.jit(lambda bufs, q, k, v, g, beta, plan:
               rs.gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation=implementation),
               donate_argnums=0)
  lowered = fn.lower(bufs, q, k, v, g, beta, plan)
  assert lowered.as_text().count("tf.aliasing_output") == 4
  aliases = _aliased_params(lowered.compile().as_text())
  # Parameters 0..3 are state, ring_k, ring_u, ring_g; outputs 1..4 the same fields of the result.
  assert aliases == {0: 1, 1: 2, 2: 3, 3: 4}, aliases


def test_decode_donation_aliases_pool(implementation):
  _, bufs, (q, k, v, g, beta) = _small_inputs()
  fn = jax.jit(lambda pool, q, k, v, g, beta, slots:
               rs.gdn.decode(q, k, v, g, beta, pool, slots, implementation=implementation),
               donate_argnums=0)
  lowered = fn.lower(bufs.state, q, k, v, g, beta, jnp.array([1, -1], i32))
  assert lowered.as_text().count("tf.aliasing_output") == 1
  assert _aliased_params(lowered.compile().as_text()) == {0: 1}


def test_write_state_and_copy_slots_donation(implementation):
  cursor, bufs, _ = _small_inputs()
  S = jnp.ones((1,) + bufs.state.shape[1:])
  fn = jax.jit(lambda b, c, s, S: rs.gdn.write_state(b, c, s, S, implementation=implementation),
               donate_argnums=(0, 1))
  aliases = _aliased_params(fn.lower(bufs, cursor, jnp.array([1], i32), S).compile().as_text())
  assert set(aliases) == set(range(6)), aliases
  fn = jax.jit(lambda b, c, s, d: rs.gdn.copy_slots(b, c, s, d, implementation=implementation),
               donate_argnums=(0, 1))
  aliases = _aliased_params(fn.lower(bufs, cursor, jnp.array([1], i32), jnp.array([2], i32)).compile().as_text())
  assert set(aliases) == set(range(6)), aliases


def test_the_requested_kernel_ran(implementation):
  """Path proof: a Pallas implementation shows a pallas_call in the jaxpr; XLA shows none."""
  cursor, bufs, (q, k, v, g, beta) = _small_inputs()
  plan = cursor.plan(jnp.array([2, 0], i32))
  for fn in (lambda: rs.gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation=implementation),
             lambda: rs.gdn.decode(q, k, v, g, beta, bufs.state, plan.slots, implementation=implementation)):
    text = str(jax.make_jaxpr(fn)())
    assert ("pallas_call" in text) == implementation.startswith("pallas"), implementation


# --------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument.


def _bad_replay_cases():
  hk, hv, kd, vd = GEOMETRIES["small"]
  other = rs.ReplayCursor.create(3, buffer_len=8)
  return {
      "q rank": (dict(q=lambda x: x[0]), "q"),
      "q dtype": (dict(q=lambda x: x.astype(i32)), "q"),
      "q head dim": (dict(q=lambda x: jnp.zeros((2, hk, kd + 1))), "q"),
      "k shape": (dict(k=lambda x: x[:, :, :-1]), "k"),
      "k batch": (dict(k=lambda x: x[:1]), "k"),
      "k dtype": (dict(k=lambda x: x.astype(i32)), "k"),
      "v heads": (dict(v=lambda x: jnp.zeros((2, hv + 1, vd))), "v"),
      "v dim": (dict(v=lambda x: jnp.zeros((2, hv, vd + 1))), "v"),
      "g shape": (dict(g=lambda x: x[:, 0]), "g"),
      "g dtype": (dict(g=lambda x: x.astype(i32)), "g"),
      "beta shape": (dict(beta=lambda x: x[..., None]), "beta"),
      "key heads vs bufs": (dict(q=lambda x: jnp.zeros((2, 1, kd)), k=lambda x: jnp.zeros((2, 1, kd))), "key heads"),
      "plan from another cursor": (dict(plan=lambda p: other.plan(p.slots)), "plan"),
      "plan batch": (dict(plan=lambda p: p.replace(slots=p.slots[:1])), "plan.slots"),
      "plan num_tokens": (dict(plan=lambda p: p.replace(num_tokens=2)), "num_tokens"),
      "plan not a plan": (dict(plan=lambda p: "plan"), "plan"),
      "bufs not buffers": (dict(bufs=lambda b: b.state), "bufs"),
      "route typo": (dict(route="output-only"), "route"),
      "implementation typo": (dict(implementation="pallas_trition"), "implementation"),
  }


@pytest.mark.parametrize("case", list(_bad_replay_cases()))
def test_replay_decode_bad_inputs(implementation, case):
  change, match = _bad_replay_cases()[case]
  cursor, bufs, step = _small_inputs()
  args = dict(zip(("q", "k", "v", "g", "beta"), step), bufs=bufs, plan=cursor.plan(jnp.array([2, 0], i32)),
              route="auto", implementation=implementation)
  for name, fn in change.items():
    args[name] = fn if isinstance(fn, str) else fn(args[name])
  with pytest.raises(ValueError, match=match):
    rs.gdn.replay_decode(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"),
                         args.pop("bufs"), args.pop("plan"), **args)


def _bad_decode_cases():
  hk, hv, kd, vd = GEOMETRIES["small"]
  return {
      "pool rank": (dict(pool=lambda p: p[0]), "pool"),
      "pool dtype": (dict(pool=lambda p: p.astype(i32)), "pool"),
      "pool heads": (dict(pool=lambda p: jnp.zeros((3, hv * 2, vd, kd))), "v"),
      "slots dtype": (dict(slots=lambda s: s.astype(jnp.float32)), "slots"),
      "slots length": (dict(slots=lambda s: s[:1]), "slots"),
      "slots rank": (dict(slots=lambda s: s[None]), "slots"),
      "q rank": (dict(q=lambda x: x[..., None]), "q"),
      "v shape": (dict(v=lambda x: x[:, :, :-1]), "v"),
      "beta dtype": (dict(beta=lambda x: x.astype(i32)), "beta"),
      "implementation typo": (dict(implementation=lambda _: "XLA"), "implementation"),
  }


@pytest.mark.parametrize("case", list(_bad_decode_cases()))
def test_decode_bad_inputs(implementation, case):
  change, match = _bad_decode_cases()[case]
  _, bufs, step = _small_inputs()
  args = dict(zip(("q", "k", "v", "g", "beta"), step), pool=bufs.state, slots=jnp.array([2, -1], i32),
              implementation=implementation)
  for name, fn in change.items():
    args[name] = fn(args[name])
  with pytest.raises(ValueError, match=match):
    rs.gdn.decode(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"),
                  args.pop("pool"), args.pop("slots"), **args)


def test_buffer_op_bad_inputs(implementation):
  cursor, bufs, _ = _small_inputs()
  S = jnp.zeros((2,) + bufs.state.shape[1:])
  slots = jnp.array([0, 1], i32)
  other = rs.ReplayCursor.create(5, buffer_len=4)
  with pytest.raises(ValueError, match="S"):
    rs.gdn.write_state(bufs, cursor, slots, S[:1], implementation=implementation)
  with pytest.raises(ValueError, match="S"):
    rs.gdn.write_state(bufs, cursor, slots, S.astype(i32), implementation=implementation)
  with pytest.raises(ValueError, match="slots"):
    rs.gdn.write_state(bufs, cursor, slots.astype(jnp.float32), S, implementation=implementation)
  with pytest.raises(ValueError, match="cursor"):
    rs.gdn.write_state(bufs, other, slots, S, implementation=implementation)
  with pytest.raises(ValueError, match="cursor"):
    rs.gdn.materialize(bufs, other, slots, implementation=implementation)
  with pytest.raises(ValueError, match="slots"):
    rs.gdn.materialize(bufs, cursor, slots[None], implementation=implementation)
  with pytest.raises(ValueError, match="dst"):
    rs.gdn.copy_slots(bufs, cursor, slots, slots[:1], implementation=implementation)
  with pytest.raises(ValueError, match="src"):
    rs.gdn.copy_slots(bufs, cursor, slots.astype(jnp.int16), slots, implementation=implementation)
  with pytest.raises(ValueError, match="implementation"):
    rs.gdn.write_state(bufs, cursor, slots, S, implementation="pallas")
  with pytest.raises(ValueError, match="num_v_heads"):
    rs.gdn.ReplayBuffers.create(3, cursor, num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8)
  with pytest.raises(ValueError, match="state_dtype"):
    rs.gdn.ReplayBuffers.create(3, cursor, num_k_heads=1, num_v_heads=1, head_k_dim=8, head_v_dim=8,
                                state_dtype=jnp.int32)
  with pytest.raises(ValueError, match="cursor"):
    rs.gdn.ReplayBuffers.create(4, cursor, num_k_heads=1, num_v_heads=1, head_k_dim=8, head_v_dim=8)


def test_checked_mode_slot_errors(implementation, checked_mode):
  cursor, bufs, (q, k, v, g, beta) = _small_inputs()
  S = jnp.zeros((2,) + bufs.state.shape[1:])
  for slots, match in ((jnp.array([0, 3], i32), "pool has 3 slots"), (jnp.array([1, 1], i32), "more than once")):
    with pytest.raises(ValueError, match=match):
      rs.gdn.decode(q, k, v, g, beta, bufs.state, slots, implementation=implementation)
    with pytest.raises(ValueError, match=match):
      cursor.plan(slots)
    with pytest.raises(ValueError, match=match):
      rs.gdn.materialize(bufs, cursor, slots, implementation=implementation)
    with pytest.raises(ValueError, match=match):
      rs.gdn.write_state(bufs, cursor, slots, S, implementation=implementation)
  with pytest.raises(ValueError, match="overlap"):
    rs.gdn.copy_slots(bufs, cursor, jnp.array([0, 1], i32), jnp.array([1, 2], i32), implementation=implementation)
  with pytest.raises(ValueError, match="src"):
    rs.gdn.copy_slots(bufs, cursor, jnp.array([3], i32), jnp.array([1], i32), implementation=implementation)
  with pytest.raises(ValueError, match="dst"):
    rs.gdn.copy_slots(bufs, cursor, jnp.array([0, 1], i32), jnp.array([2, 2], i32), implementation=implementation)
  # Valid calls with padding rows still pass.
  rs.gdn.decode(q, k, v, g, beta, bufs.state, jnp.array([-1, 2], i32), implementation=implementation)


def test_checked_mode_plan_slots_beyond_the_buffers(implementation, checked_mode):
  """A plan from a cursor with more slots than the buffers (same ring size) must not silently read
  another slot's state (gathers clamp) and drop its write."""
  cursor, bufs, (q, k, v, g, beta) = _small_inputs()
  bigger = rs.ReplayCursor.create(8, buffer_len=4)
  plan = bigger.plan(jnp.array([6, 0], i32))
  with pytest.raises(ValueError, match="slot"):
    rs.gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation=implementation)
