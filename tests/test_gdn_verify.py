"""Gated DeltaNet speculative verify: replay_verify, verify_conventional, fold modes (XLA).

The shared driver is ``VerifyHarness``: each ``step`` runs plan → replay_verify → commit with
random accepted counts, the conventional baseline ``verify_conventional`` on its own state stack,
``materialize``, and the float64 oracle (``helpers.gdn_step_f64``) token by token per slot; the
oracle keeps the state after the last accepted token. Every step also checks that padding rows
and padded lanes are inert (zero output, NaN inputs harmless, no ring cell written) and that the
checkpoint of every row that did not flush is bitwise unchanged.

One configuration (T = 4, L = 8, 6 slots, batch 4) is shared by most tests so that each compiled
program is reused (CPU CI time).
"""
import copy
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import GEOMETRIES, GdnStep, gdn_step_f64, make_gdn_step, max_err, tolerance

i32 = jnp.int32
FIELDS = ("q", "k", "v", "g", "beta")
TOL = tolerance("float32", "float32")


def _np(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _tokens(rng, batch, t, geometry) -> GdnStep:
  """T decode steps stacked on axis 1: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]."""
  steps = [make_gdn_step(rng, batch, *geometry) for _ in range(t)]
  return GdnStep(*(np.stack([getattr(s, f) for s in steps], axis=1) for f in FIELDS))


def _token(step: GdnStep, i, rows) -> GdnStep:
  return GdnStep(*(getattr(step, f)[rows, i] for f in FIELDS))


class VerifyHarness:
  """ReplaySSM buffers + cursor, a conventional state stack and a float64 oracle, stepped together.

  ``errors[key]``, one max-abs error per step over real lanes of live rows: out (replay output vs
  oracle), state (materialize vs oracle after commit), conv (conventional output vs oracle),
  conv_state (stack entry at the accepted index vs oracle).
  """

  def __init__(self, *, max_tokens=4, buffer_len=8, fold="u", num_slots=6, seed=0, conventional=True,
               read_copy_dtype=None, implementation=None, geometry=None):
    self.geometry = GEOMETRIES["small"] if geometry is None else geometry
    hk, hv, kd, vd = self.geometry
    self.rng = np.random.default_rng(seed)
    self.cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len, max_draft=max_tokens - 1)
    self.bufs = rs.gdn.ReplayBuffers.create(num_slots, self.cursor, num_k_heads=hk, num_v_heads=hv,
                                            head_k_dim=kd, head_v_dim=vd, fold=fold,
                                            read_copy_dtype=read_copy_dtype)
    self.implementation = implementation
    self.conventional = conventional
    self.stack = jnp.zeros((num_slots, max_tokens, hv, vd, kd), jnp.float32)
    self.read_index = np.zeros(num_slots, np.int32)
    self.oracle = {s: np.zeros((hv, vd, kd)) for s in range(num_slots)}
    self.errors = defaultdict(list)
    self.flushes = np.zeros(num_slots, int)
    self.natural = self.forced = self.wraps = self.pending_forced = 0

  def prefill(self, slots):
    slots = np.asarray(slots, np.int32)
    hk, hv, kd, vd = self.geometry
    S = jnp.asarray(0.3 * self.rng.normal(size=(len(slots), hv, vd, kd)), jnp.float32)
    self.bufs, self.cursor = rs.gdn.write_state(self.bufs, self.cursor, jnp.asarray(slots), S)
    self.stack = self.stack.at[slots, 0].set(S)
    for row, s in enumerate(slots):
      self.read_index[s] = 0
      self.oracle[int(s)] = _np(S[row]).astype(np.float64)

  def rings(self) -> dict:
    names = ("ring_k", "ring_u", "ring_g") + (("ring_v", "ring_beta") if self.bufs.fold == "exact" else ())
    return {n: np.array(getattr(self.bufs, n)) for n in names}

  def step(self, rows, num_tokens, accept="random", *, lengths=None, force=None, via="verify"):
    """One step for batch ``rows`` (slot per row, negative = padding) with T = ``num_tokens``.

    accept: "random" (uniform in [1, length]), "all", "bonus" (1) or an int array per row.
    lengths: real tokens per row (None = all T); padded lanes and padding rows get NaN inputs.
    via: "verify" (replay_verify) or "decode" (replay_decode, T = 1).
    Returns the replay output [B, T, Hv, V] as numpy.
    """
    rows = np.asarray(rows, np.int32)
    live = rows >= 0
    t, b = num_tokens, len(rows)
    n = np.full(b, t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    lanes = live[:, None] & (np.arange(t)[None, :] < n[:, None])
    if isinstance(accept, str):
      acc = {"all": n, "bonus": np.ones(b, np.int32)}.get(accept)
      acc = self.rng.integers(1, n + 1).astype(np.int32) if acc is None else acc
    else:
      acc = np.asarray(accept, np.int32)
    clean = _tokens(self.rng, b, t, self.geometry)
    poisoned = GdnStep(*(np.where(lanes.reshape(lanes.shape + (1,) * (getattr(clean, f).ndim - 2)),
                                  getattr(clean, f), np.nan) for f in FIELDS))
    x = [jnp.asarray(getattr(poisoned, f), jnp.float32) for f in FIELDS]
    slots = jnp.asarray(rows)
    plan = self.cursor.plan(slots, num_tokens=t, force_flush=None if force is None else jnp.asarray(force))
    state_before, rings_before = np.array(self.bufs.state), self.rings()
    if via == "decode":
      o, self.bufs = rs.gdn.replay_decode(*(a[:, 0] for a in x), self.bufs, plan,
                                          implementation=self.implementation)
      o = _np(o)[:, None]
    else:
      o, self.bufs = rs.gdn.replay_verify(*x, self.bufs, plan, lengths=None if lengths is None else jnp.asarray(n),
                                          implementation=self.implementation)
      o = _np(o)
    self.cursor = self.cursor.commit(plan, jnp.asarray(acc))
    assert o.shape == (b, t) + self.bufs.state.shape[1:3]
    assert np.all(o[~lanes] == 0), "padding rows and padded lanes must output exact zeros"

    # Bookkeeping, and the inert-ness of everything the step may not touch.
    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + t > self.cursor.buffer_len - 1
    assert not np.any(flush[~live])
    self.natural += int(np.sum(flush & natural))
    self.forced += int(np.sum(flush & ~natural))
    self.pending_forced += int(np.sum(flush & ~natural & (count > 0) & (n > 1)))
    self.wraps += int(np.sum(live & (base + count + n > self.cursor.ring_size)))
    self.flushes[rows[flush]] += 1
    state_after = np.array(self.bufs.state)
    keep = np.ones(self.bufs.num_slots, bool)
    keep[rows[flush]] = False
    np.testing.assert_array_equal(state_after[keep], state_before[keep],
                                  err_msg="a checkpoint changed on a row that did not flush")
    written = np.zeros((self.bufs.num_slots, self.cursor.ring_size), bool)
    for r, i in zip(*np.nonzero(lanes)):
      written[rows[r], (base[r] + count[r] + i) % self.cursor.ring_size] = True
    for name, after in self.rings().items():
      np.testing.assert_array_equal(np.moveaxis(after, 2, 1)[~written], np.moveaxis(rings_before[name], 2, 1)[~written],
                                    err_msg=f"{name}: a ring cell outside the written lanes changed")

    oc = None
    if self.conventional:
      oc, self.stack = rs.gdn.verify_conventional(
          *x, self.stack, slots, jnp.asarray(self.read_index[np.maximum(rows, 0)]),
          lengths=None if lengths is None else jnp.asarray(n))
      oc = _np(oc)
      assert np.all(oc[~lanes] == 0), "verify_conventional: padded lanes must output zeros"
      self.read_index[rows[live]] = acc[live] - 1

    # Float64 oracle: every real lane from the slot's state; keep the state after the last accepted.
    if not live.any():
      return o
    idx = np.flatnonzero(live)
    S = np.stack([self.oracle[int(s)] for s in rows[idx]])
    states = []
    for i in range(t):
      o_ref, S = gdn_step_f64(S, _token(clean, i, idx).rounded())
      states.append(S)
      real = lanes[idx, i]
      if not real.any():
        continue
      self.errors["out"].append(max_err(o[idx[real], i], o_ref[real]))
      if oc is not None:
        self.errors["conv"].append(max_err(oc[idx[real], i], o_ref[real]))
    for j, r in enumerate(idx):
      self.oracle[int(rows[r])] = states[acc[r] - 1][j]
    ref = np.stack([self.oracle[int(s)] for s in rows[idx]])
    M = _np(rs.gdn.materialize(self.bufs, self.cursor, slots))
    assert np.all(M[~live] == 0)
    self.errors["state"].append(max_err(M[idx], ref))
    if oc is not None:
      got = _np(self.stack)[rows[idx], self.read_index[rows[idx]]]
      self.errors["conv_state"].append(max_err(got, ref))
    return o

  def assert_close(self, tol=TOL):
    for key in ("out", "state") + (("conv", "conv_state") if self.conventional else ()):
      errs = np.asarray(self.errors[key])
      assert errs.size and np.all(np.isfinite(errs)), f"{key}: no or non-finite errors"
      assert errs.max() <= tol, f"{key}: max error {errs.max():.3g} > {tol:.3g} at step {int(errs.argmax())}"


def _staggered_rows(rng, num_slots, batch, t):
  """A permuted batch of the slots that have joined by step t (slot s joins at step s), padded."""
  live = [s for s in rng.permutation(num_slots) if s <= t][:batch - 1]
  rows = live + [-1] * (batch - len(live))
  return [rows[i] for i in rng.permutation(batch)]


# --------------------------------------------------------------------------------------------
# Random accepts against the float64 oracle and the conventional baseline.


@pytest.mark.parametrize("num_tokens,buffer_len,fold", [
    (2, 16, "u"), (4, 8, "exact"), (6, 8, "u"), (8, 16, "exact")])
def test_random_accepts(num_tokens, buffer_len, fold):
  """44 steps, accepted counts uniform in [1, length]: rows joining at different steps (all phases),
  permuted batches with a padding row, random short rows (padded lanes, NaN inputs), random forced
  flushes. Outputs of every real lane, materialized states and the baseline match float64."""
  rng = np.random.default_rng(num_tokens * 100 + buffer_len)
  h = VerifyHarness(max_tokens=num_tokens, buffer_len=buffer_len, fold=fold, seed=num_tokens)
  h.prefill(range(6))
  for t in range(44):
    rows = _staggered_rows(rng, 6, 4, t)
    short = rng.random(4) < 0.3
    lengths = np.where(short, rng.integers(1, num_tokens + 1, size=4), num_tokens)
    h.step(rows, num_tokens, lengths=lengths, force=rng.random(4) < 0.15)
  h.assert_close()
  assert np.all(h.flushes >= 1) and h.natural >= 4 and h.forced >= 1 and h.wraps >= 1, \
      (h.flushes, h.natural, h.forced, h.wraps)
  assert len(set(np.asarray(h.cursor.count).tolist())) > 1, "rows ended in the same phase"


@pytest.mark.parametrize("accept", ["all", "bonus"])
def test_all_accept_and_bonus_only(accept):
  """Every draft accepted (windows fill fastest) / only the emitted token (drafts always rolled back)."""
  h = VerifyHarness(seed=3)
  h.prefill(range(6))
  for _ in range(16):
    h.step([0, 3, -1, 5], 4, accept=accept)
  h.assert_close()
  assert h.flushes[0] >= (4 if accept == "all" else 2)
  assert np.all(np.asarray(h.cursor.count)[[1, 2, 4]] == 0)


@pytest.mark.parametrize("fold", ["u", "exact"])
def test_alternating_no_draft_steps(fold):
  """T = 1 steps between T = 4 steps (a step without drafts after accepting several, vllm #52942).
  T = 1 steps run replay_verify and replay_decode on twins: they must agree."""
  rng = np.random.default_rng(4)
  h = VerifyHarness(fold=fold, seed=4, conventional=False)
  h.prefill(range(6))
  for t in range(24):
    rows = _staggered_rows(rng, 6, 4, t + 6)
    if t % 2 == 0:
      h.step(rows, 4)
      continue
    twin = copy.copy(h)
    twin.oracle, twin.errors, twin.rng = dict(h.oracle), defaultdict(list), copy.deepcopy(h.rng)
    twin.read_index = h.read_index.copy()
    o_dec = twin.step(rows, 1, via="decode")
    o_ver = h.step(rows, 1)
    np.testing.assert_allclose(o_ver, o_dec, rtol=0, atol=1e-6)
    np.testing.assert_allclose(_np(h.bufs.state), _np(twin.bufs.state), rtol=0, atol=1e-6)
    for name, ring in h.rings().items():
      np.testing.assert_allclose(ring, twin.rings()[name], rtol=0, atol=1e-6, err_msg=name)
  h.assert_close()
  assert h.natural >= 4


def test_forced_flush_with_pending_drafts():
  """A forced flush (prefix-cache boundary) on rows with a committed window and drafts in flight:
  the checkpoint becomes the state after token 0 exactly; the accepted drafts stay in the window."""
  h = VerifyHarness(seed=5)
  h.prefill(range(6))
  h.step([0, 1, -1, 2], 4, accept=[3, 2, 1, 1])
  assert np.asarray(h.cursor.count)[:3].tolist() == [3, 2, 1]
  before = np.array(h.bufs.state)
  peek = _tokens(copy.deepcopy(h.rng), 4, 4, h.geometry)   # the next step's inputs
  state0 = {s: gdn_step_f64(h.oracle[s][None], _token(peek, 0, [s]).rounded())[1][0] for s in (0, 1)}
  h.step([0, 1, -1, 2], 4, accept=[3, 2, 1, 1], force=[True, True, True, False])
  assert h.pending_forced == 2 and h.natural == 0
  for s in (0, 1):
    assert max_err(_np(h.bufs.state[s]), state0[s]) <= TOL
  np.testing.assert_array_equal(np.array(h.bufs.state)[2], before[2])
  assert np.asarray(h.cursor.count)[:3].tolist() == [2, 1, 2]
  assert np.asarray(h.cursor.base)[:3].tolist() == [4, 3, 0]
  for _ in range(6):
    h.step([0, 1, -1, 2], 4)
  h.assert_close()


def test_padding_is_inert():
  """An all-padding batch changes nothing; NaN in one row's padded lanes leaves other rows bitwise equal."""
  h = VerifyHarness(seed=6, conventional=False)
  h.prefill(range(6))
  for _ in range(3):
    h.step([0, 1, 2, 3], 4)
  bufs, cursor = h.bufs, h.cursor
  x = [jnp.full(a.shape, jnp.nan) for a in (jnp.zeros((4, 4, 2, 16)),) * 2 + (jnp.zeros((4, 4, 4, 8)),)
       + (jnp.zeros((4, 4, 4)),) * 2]
  plan = cursor.plan(jnp.full((4,), -1, i32), num_tokens=4)
  o, out = rs.gdn.replay_verify(*x, bufs, plan)
  assert np.all(_np(o) == 0)
  for a, b in zip(jax.tree.leaves(bufs), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  clean = [jnp.asarray(getattr(_tokens(h.rng, 4, 4, h.geometry), f), jnp.float32) for f in FIELDS]
  lengths = jnp.array([4, 2, 4, 1], i32)
  mask = (jnp.arange(4)[None, :] < lengths[:, None])
  dirty = [jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a, jnp.nan) for a in clean]
  plan = cursor.plan(jnp.array([0, 1, 2, 3], i32), num_tokens=4)
  o_clean, b_clean = rs.gdn.replay_verify(*clean, bufs, plan, lengths=lengths)
  o_dirty, b_dirty = rs.gdn.replay_verify(*dirty, bufs, plan, lengths=lengths)
  np.testing.assert_array_equal(np.asarray(o_clean), np.asarray(o_dirty))
  for a, b in zip(jax.tree.leaves(b_clean), jax.tree.leaves(b_dirty)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tree_drafts_are_refused(checked_mode):
  """Acceptance must be a prefix of the chain; a tree-style mask is a ValueError, eagerly and in jit."""
  good = jnp.array([[True, True, False, False], [True, False, False, False], [False, True, True, False]])
  np.testing.assert_array_equal(np.asarray(rs.count_accepted(good, jnp.array([0, 1, -1], i32))), [2, 1, 1])
  tree = jnp.array([[True, False, True, False]])
  with pytest.raises(ValueError, match="prefix"):
    rs.count_accepted(tree)
  with pytest.raises(ValueError, match="token 0"):
    rs.count_accepted(jnp.array([[False, True]]))
  with pytest.raises(ValueError, match="accepted"):
    rs.count_accepted(jnp.array([[1, 1]], i32))
  with pytest.raises(Exception, match="prefix"):
    jax.block_until_ready(jax.jit(rs.count_accepted)(tree))
  rs.set_checks(False)
  unchecked = jax.jit(lambda a: rs.count_accepted(a))  # a fresh trace: checks are read when tracing
  assert int(unchecked(tree)[0]) == 1, "unchecked jit must commit the leading run only"


# --------------------------------------------------------------------------------------------
# Fold modes.


def test_fold_layouts_and_pallas_refusal():
  cursor = rs.ReplayCursor.create(6, buffer_len=8, max_draft=3)
  kw = dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, ring_dtype=jnp.bfloat16)
  u = rs.gdn.ReplayBuffers.create(6, cursor, **kw)
  exact = rs.gdn.ReplayBuffers.create(6, cursor, fold="exact", **kw)
  assert u.fold == "u" and u.ring_v is None and u.ring_beta is None and len(jax.tree.leaves(u)) == 4
  assert exact.ring_v.shape == exact.ring_u.shape and exact.ring_v.dtype == jnp.bfloat16
  assert exact.ring_beta.shape == exact.ring_g.shape and exact.ring_beta.dtype == jnp.float32
  with pytest.raises(ValueError, match="fold"):
    rs.gdn.ReplayBuffers.create(6, cursor, fold="raw", **kw)
  slots = jnp.array([0, 1], i32)
  with pytest.raises(NotImplementedError, match="fold"):
    rs.gdn.materialize(exact, cursor, slots, implementation="pallas_triton")
  step = make_gdn_step(np.random.default_rng(0), 2, 2, 4, 16, 8).as_jax()
  with pytest.raises(NotImplementedError, match="fold"):
    rs.gdn.replay_decode(*step, exact, cursor.plan(slots), implementation="pallas_triton")
  x = [a[:, None] for a in step]
  with pytest.raises(ValueError, match="fold='exact'"):
    rs.gdn.replay_verify(*x, u, cursor.plan(slots), fold="exact")
  with pytest.raises(ValueError, match="fold"):
    rs.gdn.replay_verify(*x, exact, cursor.plan(slots), fold="raw")


def test_fold_u_on_exact_buffers_and_exact_checkpoint():
  """fold="u" on exact-layout buffers folds the u's (raw ring still kept); both agree with float64,
  and the exact fold's checkpoint equals the conventional stack state at flushes."""
  rng = np.random.default_rng(8)
  h = VerifyHarness(fold="exact", seed=8)
  h.prefill(range(6))
  for t in range(6):
    h.step(_staggered_rows(rng, 6, 4, t + 6), 4)
  h.assert_close()
  x = [jnp.asarray(getattr(_tokens(rng, 4, 4, h.geometry), f), jnp.float32) for f in FIELDS]
  plan = h.cursor.plan(jnp.array([0, 1, 2, 3], i32), num_tokens=4, force_flush=jnp.ones((4,), bool))
  o_u, b_u = rs.gdn.replay_verify(*x, h.bufs, plan, fold="u")
  o_x, b_x = rs.gdn.replay_verify(*x, h.bufs, plan)
  np.testing.assert_array_equal(np.asarray(o_u), np.asarray(o_x))   # outputs never use the fold
  for name in ("ring_k", "ring_u", "ring_g", "ring_v", "ring_beta"):
    np.testing.assert_array_equal(np.asarray(getattr(b_u, name)), np.asarray(getattr(b_x, name)))
  assert 0 < max_err(_np(b_u.state[:4]), _np(b_x.state[:4])) <= TOL


def test_a_corrupted_ring_entry_is_caught():
  """Teeth: one perturbed live ring entry must break the materialized-state comparison."""
  for fold, field in (("u", "ring_u"), ("exact", "ring_v")):
    h = VerifyHarness(fold=fold, seed=9, conventional=False)
    h.prefill(range(6))
    h.step([0, 1, 2, 3], 4, accept="all")
    slots = jnp.array([0, 1, 2, 3], i32)
    M = _np(rs.gdn.materialize(h.bufs, h.cursor, slots))
    assert max_err(M[1], h.oracle[1]) <= TOL
    ring = getattr(h.bufs, field)
    bad = h.bufs.replace(**{field: ring.at[1, :, 2].add(1e-2)})
    M = _np(rs.gdn.materialize(bad, h.cursor, slots))
    assert max_err(M[1], h.oracle[1]) > TOL, fold


# --------------------------------------------------------------------------------------------
# Bad inputs: ValueError naming the argument.


def test_bad_inputs(checked_mode):
  h = VerifyHarness(seed=10, conventional=False)
  h.prefill(range(6))
  slots = jnp.array([0, 1, 2, -1], i32)
  plan = h.cursor.plan(slots, num_tokens=4)
  x = [jnp.asarray(getattr(_tokens(h.rng, 4, 4, h.geometry), f), jnp.float32) for f in FIELDS]
  bufs = h.bufs
  with pytest.raises(ValueError, match="T=4"):
    rs.gdn.replay_verify(*(a[:, :3] for a in x), bufs, plan)
  with pytest.raises(ValueError, match="q"):
    rs.gdn.replay_verify(x[0][:, 0], *x[1:], bufs, plan)
  with pytest.raises(ValueError, match="V"):
    rs.gdn.replay_verify(*x[:2], jnp.zeros((4, 4, 4, 6)), *x[3:], bufs, plan)
  with pytest.raises(ValueError, match="lengths"):
    rs.gdn.replay_verify(*x, bufs, plan, lengths=jnp.array([1, 2, 3, 4], jnp.int16))
  with pytest.raises(ValueError, match="lengths"):
    rs.gdn.replay_verify(*x, bufs, plan, lengths=jnp.array([1, 2, 3], i32))
  with pytest.raises(ValueError, match="lengths must lie in"):
    rs.gdn.replay_verify(*x, bufs, plan, lengths=jnp.array([1, 5, 3, 0], i32))
  with pytest.raises(ValueError, match="plan"):
    rs.gdn.replay_verify(*x, bufs, "plan")
  stack = jnp.zeros((6, 4, 4, 8, 16))
  ri = jnp.zeros((4,), i32)
  with pytest.raises(ValueError, match="stack"):
    rs.gdn.verify_conventional(*x, stack[:, :3], slots, ri)
  with pytest.raises(ValueError, match="stack"):
    rs.gdn.verify_conventional(*x, stack[:, 0], slots, ri)
  with pytest.raises(ValueError, match="read_index"):
    rs.gdn.verify_conventional(*x, stack, slots, ri[:3])
  with pytest.raises(ValueError, match="read_index must lie in"):
    rs.gdn.verify_conventional(*x, stack, slots, jnp.array([0, 4, 0, 0], i32))
  with pytest.raises(ValueError, match="V"):
    rs.gdn.verify_conventional(*x, jnp.zeros((6, 4, 4, 4, 16)), slots, ri)
  with pytest.raises(NotImplementedError, match="pallas_mosaic"):   # no Mosaic conventional verify
    rs.gdn.verify_conventional(*x, stack, slots, ri, implementation="pallas_mosaic")
