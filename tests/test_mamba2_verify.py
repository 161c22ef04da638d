"""Mamba2 speculative verify: replay_verify and verify_conventional (XLA).

The driver mirrors tests/test_gdn_verify.py: each ``step`` runs plan → replay_verify → commit with
random accepted counts, the conventional baseline on its own state stack, ``materialize``, and the
float64 oracle (``mamba2_step_f64`` of tests/test_mamba2_ops.py) token by token per slot. Every
step also checks that padding rows and padded lanes are inert and that checkpoints of rows that
did not flush are bitwise unchanged. Mamba2 has no fold modes (its ring holds raw inputs).
"""
import copy
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from tests.helpers import max_err, tolerance
from tests.test_mamba2_ops import GEOMETRIES, Step, make_params, make_step, mamba2_step_f64

i32 = jnp.int32
TOL = tolerance("float32", "float32")


def _np(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _tokens(rng, batch, t, geometry) -> Step:
  """T decode steps stacked on axis 1: x, z [B, T, H, P]; dt [B, T, H]; B, C [B, T, G, N]."""
  steps = [make_step(rng, batch, *geometry) for _ in range(t)]
  return Step(*(np.stack([getattr(s, f) for s in steps], axis=1) for f in Step.FIELDS))


def _token(step: Step, i, rows) -> Step:
  return step.map(lambda a: a[rows, i])


class VerifyHarness:
  """ReplaySSM buffers + cursor, a conventional state stack and a float64 oracle, stepped together."""

  def __init__(self, *, max_tokens=4, buffer_len=8, num_slots=6, seed=0, conventional=True,
               read_copy_dtype=None, implementation=None, geometry=None):
    self.geometry = GEOMETRIES["small"] if geometry is None else geometry
    h, g, p, n = self.geometry
    self.rng = np.random.default_rng(seed)
    self.params = make_params(self.rng, h)
    self.kw = dict(A=jnp.asarray(self.params.A, jnp.float32), D=jnp.asarray(self.params.D, jnp.float32),
                   dt_bias=jnp.asarray(self.params.dt_bias, jnp.float32))
    self.cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len, max_draft=max_tokens - 1)
    self.bufs = rs.mamba2.ReplayBuffers.create(num_slots, self.cursor, num_heads=h, head_dim=p,
                                               num_groups=g, state_dim=n, read_copy_dtype=read_copy_dtype)
    self.implementation = implementation
    self.conventional = conventional
    self.stack = jnp.zeros((num_slots, max_tokens, h, p, n), jnp.float32)
    self.read_index = np.zeros(num_slots, np.int32)
    self.oracle = {s: np.zeros((h, p, n)) for s in range(num_slots)}
    self.errors = defaultdict(list)
    self.flushes = np.zeros(num_slots, int)
    self.natural = self.forced = self.wraps = 0

  def prefill(self, slots):
    slots = np.asarray(slots, np.int32)
    h, _, p, n = self.geometry
    S = jnp.asarray(0.3 * self.rng.normal(size=(len(slots), h, p, n)), jnp.float32)
    self.bufs, self.cursor = rs.mamba2.write_state(self.bufs, self.cursor, jnp.asarray(slots), S)
    self.stack = self.stack.at[slots, 0].set(S)
    for row, s in enumerate(slots):
      self.read_index[s] = 0
      self.oracle[int(s)] = _np(S[row]).astype(np.float64)

  def rings(self) -> dict:
    return {n: np.array(getattr(self.bufs, n)) for n in ("ring_x", "ring_B", "ring_a")}

  def step(self, rows, num_tokens, accept="random", *, lengths=None, force=None, via="verify"):
    """As tests/test_gdn_verify.py ``VerifyHarness.step``; returns the output [B, T, H, P]."""
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
    poisoned = clean.map(lambda a: np.where(lanes.reshape(lanes.shape + (1,) * (a.ndim - 2)), a, np.nan))
    x = poisoned.as_jax()
    slots = jnp.asarray(rows)
    plan = self.cursor.plan(slots, num_tokens=t, force_flush=None if force is None else jnp.asarray(force))
    state_before, rings_before = np.array(self.bufs.state), self.rings()
    if via == "decode":
      y, self.bufs = rs.mamba2.replay_decode(x["x"][:, 0], x["dt"][:, 0], self.kw["A"], x["B"][:, 0],
                                             x["C"][:, 0], self.bufs, plan, D=self.kw["D"], z=x["z"][:, 0],
                                             dt_bias=self.kw["dt_bias"], implementation=self.implementation)
      y = _np(y)[:, None]
    else:
      y, self.bufs = rs.mamba2.replay_verify(x["x"], x["dt"], self.kw["A"], x["B"], x["C"], self.bufs, plan,
                                             D=self.kw["D"], z=x["z"], dt_bias=self.kw["dt_bias"],
                                             lengths=None if lengths is None else jnp.asarray(n),
                                             implementation=self.implementation)
      y = _np(y)
    self.cursor = self.cursor.commit(plan, jnp.asarray(acc))
    assert y.shape == (b, t) + self.bufs.state.shape[1:3]
    assert np.all(y[~lanes] == 0), "padding rows and padded lanes must output exact zeros"

    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + t > self.cursor.buffer_len - 1
    assert not np.any(flush[~live])
    self.natural += int(np.sum(flush & natural))
    self.forced += int(np.sum(flush & ~natural))
    self.wraps += int(np.sum(live & (base + count + n > self.cursor.ring_size)))
    self.flushes[rows[flush]] += 1
    keep = np.ones(self.bufs.num_slots, bool)
    keep[rows[flush]] = False
    np.testing.assert_array_equal(np.array(self.bufs.state)[keep], state_before[keep],
                                  err_msg="a checkpoint changed on a row that did not flush")
    written = np.zeros((self.bufs.num_slots, self.cursor.ring_size), bool)
    for r, i in zip(*np.nonzero(lanes)):
      written[rows[r], (base[r] + count[r] + i) % self.cursor.ring_size] = True
    for name, after in self.rings().items():
      np.testing.assert_array_equal(np.moveaxis(after, 2, 1)[~written], np.moveaxis(rings_before[name], 2, 1)[~written],
                                    err_msg=f"{name}: a ring cell outside the written lanes changed")

    yc = None
    if self.conventional:
      yc, self.stack = rs.mamba2.verify_conventional(
          x["x"], x["dt"], self.kw["A"], x["B"], x["C"], self.stack, slots,
          jnp.asarray(self.read_index[np.maximum(rows, 0)]), D=self.kw["D"], z=x["z"],
          dt_bias=self.kw["dt_bias"], lengths=None if lengths is None else jnp.asarray(n))
      yc = _np(yc)
      assert np.all(yc[~lanes] == 0), "verify_conventional: padded lanes must output zeros"
      self.read_index[rows[live]] = acc[live] - 1

    if not live.any():
      return y
    idx = np.flatnonzero(live)
    S = np.stack([self.oracle[int(s)] for s in rows[idx]])
    states = []
    for i in range(t):
      y_ref, S = mamba2_step_f64(S, _token(clean, i, idx).rounded(), self.params)
      states.append(S)
      real = lanes[idx, i]
      if not real.any():
        continue
      self.errors["out"].append(max_err(y[idx[real], i], y_ref[real]))
      if yc is not None:
        self.errors["conv"].append(max_err(yc[idx[real], i], y_ref[real]))
    for j, r in enumerate(idx):
      self.oracle[int(rows[r])] = states[acc[r] - 1][j]
    ref = np.stack([self.oracle[int(s)] for s in rows[idx]])
    M = _np(rs.mamba2.materialize(self.bufs, self.cursor, slots))
    assert np.all(M[~live] == 0)
    self.errors["state"].append(max_err(M[idx], ref))
    if yc is not None:
      got = _np(self.stack)[rows[idx], self.read_index[rows[idx]]]
      self.errors["conv_state"].append(max_err(got, ref))
    return y

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


@pytest.mark.parametrize("num_tokens,buffer_len", [(2, 16), (4, 8), (6, 8), (8, 16)])
def test_random_accepts(num_tokens, buffer_len):
  """44 steps, accepted counts uniform in [1, length], staggered rows, padding, short rows with NaN
  in padded lanes, random forced flushes: outputs, states and the baseline match float64."""
  rng = np.random.default_rng(num_tokens * 100 + buffer_len)
  h = VerifyHarness(max_tokens=num_tokens, buffer_len=buffer_len, seed=num_tokens)
  h.prefill(range(6))
  for t in range(44):
    rows = _staggered_rows(rng, 6, 4, t)
    short = rng.random(4) < 0.3
    lengths = np.where(short, rng.integers(1, num_tokens + 1, size=4), num_tokens)
    h.step(rows, num_tokens, lengths=lengths, force=rng.random(4) < 0.15)
  h.assert_close()
  assert np.all(h.flushes >= 1) and h.natural >= 4 and h.forced >= 1 and h.wraps >= 1, \
      (h.flushes, h.natural, h.forced, h.wraps)


@pytest.mark.parametrize("accept", ["all", "bonus"])
def test_all_accept_and_bonus_only(accept):
  h = VerifyHarness(seed=3)
  h.prefill(range(6))
  for _ in range(16):
    h.step([0, 3, -1, 5], 4, accept=accept)
  h.assert_close()
  assert h.flushes[0] >= (4 if accept == "all" else 2)


def test_alternating_no_draft_steps():
  """T = 1 steps between T = 4 steps; T = 1 runs replay_verify and replay_decode on twins."""
  rng = np.random.default_rng(4)
  h = VerifyHarness(seed=4, conventional=False)
  h.prefill(range(6))
  for t in range(24):
    rows = _staggered_rows(rng, 6, 4, t + 6)
    if t % 2 == 0:
      h.step(rows, 4)
      continue
    twin = copy.copy(h)
    twin.oracle, twin.errors, twin.rng = dict(h.oracle), defaultdict(list), copy.deepcopy(h.rng)
    y_dec = twin.step(rows, 1, via="decode")
    y_ver = h.step(rows, 1)
    np.testing.assert_allclose(y_ver, y_dec, rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(h.bufs), jax.tree.leaves(twin.bufs)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
  h.assert_close()
  assert h.natural >= 4


def test_forced_flush_with_pending_drafts():
  h = VerifyHarness(seed=5)
  h.prefill(range(6))
  h.step([0, 1, -1, 2], 4, accept=[3, 2, 1, 1])
  before = np.array(h.bufs.state)
  peek = _tokens(copy.deepcopy(h.rng), 4, 4, h.geometry)
  state0 = {s: mamba2_step_f64(h.oracle[s][None], _token(peek, 0, [s]).rounded(), h.params)[1][0]
            for s in (0, 1)}
  h.step([0, 1, -1, 2], 4, accept=[3, 2, 1, 1], force=[True, True, True, False])
  for s in (0, 1):
    assert max_err(_np(h.bufs.state[s]), state0[s]) <= TOL
  np.testing.assert_array_equal(np.array(h.bufs.state)[2], before[2])
  assert np.asarray(h.cursor.count)[:3].tolist() == [2, 1, 2]
  assert np.asarray(h.cursor.base)[:3].tolist() == [4, 3, 0]
  for _ in range(6):
    h.step([0, 1, -1, 2], 4)
  h.assert_close()


def test_padding_is_inert():
  """All-padding batch: nothing changes; NaN in padded lanes leaves other rows bitwise equal."""
  h = VerifyHarness(seed=6, conventional=False)
  h.prefill(range(6))
  h.step([0, 1, 2, 3], 4)
  kw = dict(D=h.kw["D"], dt_bias=h.kw["dt_bias"])
  nan = _tokens(h.rng, 4, 4, h.geometry).map(lambda a: np.full(a.shape, np.nan)).as_jax()
  plan = h.cursor.plan(jnp.full((4,), -1, i32), num_tokens=4)
  y, out = rs.mamba2.replay_verify(nan["x"], nan["dt"], h.kw["A"], nan["B"], nan["C"], h.bufs, plan,
                                   z=nan["z"], **kw)
  assert np.all(_np(y) == 0)
  for a, b in zip(jax.tree.leaves(h.bufs), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  clean = _tokens(h.rng, 4, 4, h.geometry)
  lengths = np.array([4, 2, 4, 1], np.int32)
  mask = np.arange(4)[None, :] < lengths[:, None]
  dirty = clean.map(lambda a: np.where(mask.reshape(mask.shape + (1,) * (a.ndim - 2)), a, np.nan))
  plan = h.cursor.plan(jnp.array([0, 1, 2, 3], i32), num_tokens=4)
  outs = [rs.mamba2.replay_verify(s["x"], s["dt"], h.kw["A"], s["B"], s["C"], h.bufs, plan, z=s["z"],
                                  lengths=jnp.asarray(lengths), **kw) for s in (clean.as_jax(), dirty.as_jax())]
  for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_inputs(checked_mode):
  h = VerifyHarness(seed=10, conventional=False)
  h.prefill(range(6))
  slots = jnp.array([0, 1, 2, -1], i32)
  plan = h.cursor.plan(slots, num_tokens=4)
  s = _tokens(h.rng, 4, 4, h.geometry).as_jax()
  A, bufs = h.kw["A"], h.bufs
  with pytest.raises(ValueError, match="T=4"):
    rs.mamba2.replay_verify(s["x"][:, :3], s["dt"][:, :3], A, s["B"][:, :3], s["C"][:, :3], bufs, plan)
  with pytest.raises(ValueError, match="x"):
    rs.mamba2.replay_verify(s["x"][:, 0], s["dt"], A, s["B"], s["C"], bufs, plan)
  with pytest.raises(ValueError, match="groups"):
    rs.mamba2.replay_verify(s["x"], s["dt"], A, s["B"][:, :, :1], s["C"][:, :, :1], bufs, plan)
  with pytest.raises(ValueError, match="lengths must lie in"):
    rs.mamba2.replay_verify(s["x"], s["dt"], A, s["B"], s["C"], bufs, plan, lengths=jnp.array([0, 1, 1, 1], i32))
  with pytest.raises(TypeError, match="fold"):  # Mamba2 has no fold choice
    rs.mamba2.replay_verify(s["x"], s["dt"], A, s["B"], s["C"], bufs, plan, fold="exact")
  stack = jnp.zeros((6, 4) + bufs.state.shape[1:])
  with pytest.raises(ValueError, match="stack"):
    rs.mamba2.verify_conventional(s["x"], s["dt"], A, s["B"], s["C"], stack[:, :2], slots, jnp.zeros((4,), i32))
  with pytest.raises(ValueError, match="read_index"):
    rs.mamba2.verify_conventional(s["x"], s["dt"], A, s["B"], s["C"], stack, slots, jnp.zeros((4,), jnp.float32))
  with pytest.raises(NotImplementedError, match="pallas_mosaic"):   # no Mosaic conventional verify
    rs.mamba2.verify_conventional(s["x"], s["dt"], A, s["B"], s["C"], stack, slots, jnp.zeros((4,), i32),
                                  implementation="pallas_mosaic")
