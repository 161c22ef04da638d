"""Pallas-Triton GDN verify kernels vs XLA and the float64 oracle (CPU interpret mode) + H200 lowering.

``Lockstep`` runs ``replay_verify`` and ``verify_conventional`` with implementation="pallas_triton"
and "xla" on twin buffers, step by step (plan → verify → commit with random accepted counts), and a
float64 oracle (``helpers.gdn_step_f64``) token by token per slot. Every step checks: outputs of
every lane (padded lanes and padding rows exact zeros, their inputs NaN), all buffers against XLA
(ring cells, checkpoint, conventional stack; NaN patterns included), the checkpoint of every
non-flushing row bitwise unchanged, the materialized state and the conventional stack entry at the
accepted index against float64. Rings start NaN-poisoned, so any read outside a window shows up;
the stack is NaN except each slot's current state, so a wrong read index shows up too.
GQA (Hk=2, Hv=4), K=16, V=32: the CPU tiles give two V tiles and two K chunks per head.
"""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from replayssm_jax.pallas import gdn_verify_triton
from tests.helpers import gdn_step_f64, lower_for_h200, make_gdn_step, max_err, tolerance
from tests.test_gdn_verify import FIELDS, _token, _tokens

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

GEOMETRY = (2, 4, 16, 32)           # (Hk, Hv, K, V)
NUM_SLOTS, BATCH = 6, 4
TOL = tolerance("float32", "float32")
i32 = jnp.int32


def _np(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _nan_like(x):
  return jnp.full_like(x, jnp.nan)


def _assert_close(name, got, want, tol=TOL):
  got, want = _np(got), _np(want)
  assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN patterns differ"
  err = max_err(np.nan_to_num(got), np.nan_to_num(want))
  assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


class Lockstep:
  """Twin ReplaySSM buffers and conventional stacks (one per implementation) and a float64 oracle.

  ``impl`` is the implementation under test against XLA; with ``conventional=False`` the
  conventional verify (which ``impl`` may not have) is left out."""

  def __init__(self, *, num_tokens, buffer_len, seed, impl="pallas_triton", conventional=True):
    hk, hv, kd, vd = GEOMETRY
    self.t, self.impl, self.conventional = num_tokens, impl, conventional
    self.impls = ("xla", impl)
    self.rng = np.random.default_rng(seed)
    self.cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len, max_draft=num_tokens - 1)
    bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, self.cursor, num_k_heads=hk, num_v_heads=hv,
                                       head_k_dim=kd, head_v_dim=vd)
    S0 = jnp.asarray(0.3 * self.rng.normal(size=(NUM_SLOTS, hv, vd, kd)), jnp.float32)
    slots = jnp.arange(NUM_SLOTS, dtype=i32)
    bufs, self.cursor = rs.gdn.write_state(bufs, self.cursor, slots, S0)
    bufs = bufs.replace(ring_k=_nan_like(bufs.ring_k), ring_u=_nan_like(bufs.ring_u),
                        ring_g=_nan_like(bufs.ring_g))       # nothing is live yet
    stack = jnp.full((NUM_SLOTS, num_tokens, hv, vd, kd), jnp.nan, jnp.float32).at[:, 0].set(S0)
    self.bufs = dict.fromkeys(self.impls, bufs)
    self.stack = dict.fromkeys(self.impls, stack)
    self.read_index = np.zeros(NUM_SLOTS, np.int32)
    self.oracle = {s: _np(S0[s]).astype(np.float64) for s in range(NUM_SLOTS)}
    self.flushes = np.zeros(NUM_SLOTS, int)
    self.natural = self.forced = self.pending_forced = self.wraps = 0

  def step(self, rows, *, lengths=None, force=None, accept=None):
    rows = np.asarray(rows, np.int32)
    t, b = self.t, len(rows)
    live = rows >= 0
    n = np.full(b, t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    lanes = live[:, None] & (np.arange(t)[None, :] < n[:, None])
    acc = self.rng.integers(1, n + 1).astype(np.int32) if accept is None else np.asarray(accept, np.int32)
    clean = _tokens(self.rng, b, t, GEOMETRY)
    mask = lambda x: lanes.reshape(lanes.shape + (1,) * (x.ndim - 2))
    x = [jnp.asarray(np.where(mask(getattr(clean, f)), getattr(clean, f), np.nan), jnp.float32)
         for f in FIELDS]
    slots, lens = jnp.asarray(rows), jnp.asarray(n)
    plan = self.cursor.plan(slots, num_tokens=t, force_flush=None if force is None else jnp.asarray(force))
    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + t > self.cursor.buffer_len - 1
    self.natural += int(np.sum(flush & natural))
    self.forced += int(np.sum(flush & ~natural))
    self.pending_forced += int(np.sum(flush & ~natural & (count > 0) & (n > 1)))
    self.wraps += int(np.sum(live & (base + count + n > self.cursor.ring_size)))
    self.flushes[rows[flush]] += 1

    me = self.impl
    before = np.array(self.bufs[me].state)
    o, oc = {}, {}
    for impl in self.impls:
      o[impl], self.bufs[impl] = rs.gdn.replay_verify(*x, self.bufs[impl], plan, lengths=lens,
                                                      implementation=impl)
      if self.conventional:
        oc[impl], self.stack[impl] = rs.gdn.verify_conventional(
            *x, self.stack[impl], slots, jnp.asarray(self.read_index[np.maximum(rows, 0)]),
            lengths=lens, implementation=impl)
    got = _np(o[me])
    assert np.all(got[~lanes] == 0), "padding rows and padded lanes must output exact zeros"
    keep = np.ones(NUM_SLOTS, bool)
    keep[rows[flush]] = False
    assert np.array(self.bufs[me].state)[keep].tobytes() == before[keep].tobytes(), \
        "a checkpoint changed on a row that did not flush"
    _assert_close("o", got, o["xla"])
    if self.conventional:
      assert np.all(_np(oc[me])[~lanes] == 0), "conventional verify: padded lanes must output zeros"
      _assert_close("conventional o", oc[me], oc["xla"])
      _assert_close("stack", self.stack[me], self.stack["xla"])
    for field in ("state", "ring_k", "ring_u", "ring_g"):
      _assert_close(field, getattr(self.bufs[me], field), getattr(self.bufs["xla"], field))

    # float64 oracle over the real lanes; keep the state after the last accepted token.
    idx = np.flatnonzero(live)
    S = np.stack([self.oracle[int(s)] for s in rows[idx]])
    states = []
    for i in range(t):
      o64, S = gdn_step_f64(S, _token(clean, i, idx).rounded())
      states.append(S)
      real = lanes[idx, i]
      if not real.any():
        continue
      assert max_err(got[idx[real], i], o64[real]) <= TOL
      if self.conventional:
        assert max_err(_np(oc[me])[idx[real], i], o64[real]) <= TOL
    for j, r in enumerate(idx):
      self.oracle[int(rows[r])] = states[acc[r] - 1][j]
    self.cursor = self.cursor.commit(plan, jnp.asarray(acc))
    self.read_index[rows[live]] = acc[live] - 1
    want = np.stack([self.oracle[int(s)] for s in rows[idx]])
    M = _np(rs.gdn.materialize(self.bufs[me], self.cursor, slots))
    assert max_err(M[idx], want) <= TOL, "materialized state vs float64"
    if self.conventional:
      conv = _np(self.stack[me])[rows[idx], self.read_index[rows[idx]]]
      assert max_err(conv, want) <= TOL, "conventional stack state vs float64"


def _rows(rng, step):
  """A permuted batch of the slots that have joined by ``step`` (slot s joins at step s), one padding row at least."""
  joined = [s for s in rng.permutation(NUM_SLOTS) if s <= step][:BATCH - 1]
  rows = joined + [-1] * (BATCH - len(joined))
  return [rows[i] for i in rng.permutation(BATCH)]


@pytest.fixture
def output_only_route(monkeypatch):
  """Makes the Pallas verify take the output-only route (fused: the step kernel reads the checkpoint)."""
  real = config_lib.verify_config
  monkeypatch.setattr(config_lib, "verify_config", lambda **kw: real(**{**kw, "route": "output_only"}))


@pytest.fixture
def split_route(monkeypatch):
  """Makes the Pallas verify take the split output-only route (readout launch + step kernel
  without a state tile)."""
  real = config_lib.verify_config
  monkeypatch.setattr(config_lib, "verify_config", lambda **kw: dataclasses.replace(
      real(**{**kw, "route": "output_only"}), split=True))


@pytest.fixture
def reconstruct_route(monkeypatch):
  """Makes the Pallas verify take the one-launch reconstruct route."""
  real = config_lib.verify_config
  monkeypatch.setattr(config_lib, "verify_config", lambda **kw: real(**{**kw, "route": "reconstruct"}))


@pytest.mark.parametrize("num_tokens,buffer_len,steps", [(2, 4, 14), (4, 8, 14), (8, 16, 10)])
def test_random_accepts_parity(num_tokens, buffer_len, steps):
  """Staggered rows (slots join late, permuted batches), a padding row, short rows (NaN in padded
  lanes), random forced flushes, random accepts; Pallas == XLA == float64 at every step."""
  _random_accepts(num_tokens, buffer_len, steps)


def test_random_accepts_parity_split_route(split_route):
  """The same checks with the checkpoint readouts computed in their own launch."""
  _random_accepts(4, 8, 14)


@pytest.mark.parametrize("num_tokens,buffer_len,steps", [(4, 8, 14)])   # T=8: the gpu test
def test_random_accepts_parity_reconstruct_route(reconstruct_route, num_tokens, buffer_len, steps):
  """The same checks on the reconstruct route (window replayed into the tile, flush stored in the
  same launch)."""
  _random_accepts(num_tokens, buffer_len, steps)


def test_reconstruct_route_forced_flush_with_pending_drafts(reconstruct_route):
  _forced_flush_with_pending_drafts()


def _random_accepts(num_tokens, buffer_len, steps, **lockstep):
  rng = np.random.default_rng(num_tokens)
  h = Lockstep(num_tokens=num_tokens, buffer_len=buffer_len, seed=num_tokens, **lockstep)
  for t in range(steps):
    short = rng.random(BATCH) < 0.3
    lengths = np.where(short, rng.integers(1, num_tokens + 1, size=BATCH), num_tokens)
    h.step(_rows(rng, t), lengths=lengths, force=rng.random(BATCH) < 0.15)
  assert h.natural >= 2 and h.forced >= 1 and h.wraps >= 1, (h.natural, h.forced, h.wraps)
  assert np.sum(h.flushes >= 1) >= 3, h.flushes
  assert len(set(np.asarray(h.cursor.count).tolist())) > 1, "rows ended in the same phase"


def test_forced_flush_with_pending_drafts():
  """A forced flush on rows with a committed window and drafts in flight folds window + token 0 only."""
  _forced_flush_with_pending_drafts()


def _forced_flush_with_pending_drafts(**lockstep):
  h = Lockstep(num_tokens=4, buffer_len=8, seed=5, **lockstep)
  h.step([0, 1, -1, 2], accept=[3, 2, 1, 1])
  h.step([0, 1, -1, 2], accept=[3, 2, 1, 1], force=[True, True, True, False])
  assert h.pending_forced == 2 and h.natural == 0
  for _ in range(3):
    h.step([0, 1, -1, 2])


def test_t1_equals_replay_decode():
  """replay_verify with T = 1 is replay_decode: every buffer bitwise (a flush included), outputs to f32
  rounding (1 ulp: the compiler may contract a product into an FMA differently)."""
  hk, hv, kd, vd = GEOMETRY
  rng = np.random.default_rng(1)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=hk, num_v_heads=hv,
                                     head_k_dim=kd, head_v_dim=vd)
  bufs = bufs.replace(state=jnp.asarray(0.3 * rng.normal(size=bufs.state.shape), jnp.float32),
                      ring_k=_nan_like(bufs.ring_k), ring_u=_nan_like(bufs.ring_u),
                      ring_g=_nan_like(bufs.ring_g))
  slots = jnp.array([3, -1, 0, 5], i32)
  flushed = False
  for t in range(5):
    plan = cursor.plan(slots, force_flush=jnp.array([t == 1, False, False, False]))
    flushed |= bool(np.any(np.asarray(plan.flush)))
    step = make_gdn_step(rng, BATCH, *GEOMETRY).as_jax()
    o_dec, b_dec = rs.gdn.replay_decode(*step, bufs, plan, implementation="pallas_triton")
    o_ver, bufs = rs.gdn.replay_verify(*(a[:, None] for a in step), bufs, plan,
                                       implementation="pallas_triton")
    assert max_err(o_ver[:, 0], o_dec) <= 1e-6
    for a, b in zip(jax.tree.leaves(bufs), jax.tree.leaves(b_dec)):
      assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    cursor = cursor.commit(plan)
  assert flushed


def test_the_pallas_kernels_run_and_exact_layout_falls_back():
  """pallas_triton traces our kernels; fold="exact" buffers are NotImplementedError there, and
  implementation=None falls back to XLA."""
  hk, hv, kd, vd = GEOMETRY
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=8, max_draft=1)
  kw = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd)
  bufs = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, **kw)
  exact = rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, fold="exact", **kw)
  slots = jnp.array([0, 1, -1, 2], i32)
  plan = cursor.plan(slots, num_tokens=2)
  x = [jnp.asarray(getattr(_tokens(np.random.default_rng(0), BATCH, 2, GEOMETRY), f), jnp.float32)
       for f in FIELDS]
  text = str(jax.make_jaxpr(lambda b: rs.gdn.replay_verify(*x, b, plan, implementation="pallas_triton"))(bufs))
  assert "replayssm_gdn_verify_step" in text and "replayssm_gdn_fold" in text
  stack = jnp.zeros((NUM_SLOTS, 2, hv, vd, kd))
  text = str(jax.make_jaxpr(lambda s: rs.gdn.verify_conventional(
      *x, s, slots, jnp.zeros((BATCH,), i32), implementation="pallas_triton"))(stack))
  assert "replayssm_gdn_verify_conventional" in text
  with pytest.raises(NotImplementedError, match="fold"):
    rs.gdn.replay_verify(*x, exact, plan, implementation="pallas_triton")
  o, _ = rs.gdn.replay_verify(*x, exact, plan)
  assert o.shape == (BATCH, 2, hv, vd)


# ---------------------------------------------------------------------------------------------
# Abstract-H200 lowering at the Qwen3.5-4B geometry (notes/pallas-gpu.md §4): Triton power-of-two
# sizes, unsupported primitives and in-place aliasing, which interpret mode hides.
# ---------------------------------------------------------------------------------------------

P_HK, P_HV, P_K, P_V, P_B, P_N = 16, 32, 128, 128, 8, 16


def _lower(fn, *args):
  return lower_for_h200(fn, (0,), *args)      # the buffers / stack (argument 0) are donated


def _production_tokens(t):
  bf16 = jnp.bfloat16
  return (jnp.zeros((P_B, t, P_HK, P_K), bf16), jnp.zeros((P_B, t, P_HK, P_K), bf16),
          jnp.zeros((P_B, t, P_HV, P_V), bf16), jnp.zeros((P_B, t, P_HV), jnp.float32),
          jnp.zeros((P_B, t, P_HV), bf16))


_SLOTS = jnp.asarray(np.r_[np.arange(P_B - 1), -1], i32)


# Each T, L and state dtype at least once (every lowering traces a large unrolled kernel).
@pytest.mark.parametrize("num_tokens,buffer_len,state_dtype", [
    (2, 8, "float32"), (4, 16, "float32"), (8, 16, "float32"), (8, 8, "bfloat16"), (4, 8, "bfloat16")])
def test_output_only_route_lowers_for_h200(output_only_route, num_tokens, buffer_len, state_dtype):
  cursor = rs.ReplayCursor.create(P_N, buffer_len=buffer_len, max_draft=num_tokens - 1)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV, head_k_dim=P_K,
                                     head_v_dim=P_V, state_dtype=state_dtype, ring_dtype=jnp.bfloat16)
  text = _lower(lambda b, p, n, *x: rs.gdn.replay_verify(*x, b, p, lengths=n, implementation="pallas_triton"),
                bufs, cursor.plan(_SLOTS, num_tokens=num_tokens), jnp.full((P_B,), num_tokens, i32),
                *_production_tokens(num_tokens))
  assert text.count("__gpu$xla.gpu.triton") == 2          # the verify step and the fold pass
  assert text.count("tf.aliasing_output") == 4             # state and the three rings, in place


def test_split_route_lowers_for_h200(split_route):
  cursor = rs.ReplayCursor.create(P_N, buffer_len=16, max_draft=3)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV, head_k_dim=P_K,
                                     head_v_dim=P_V, ring_dtype=jnp.bfloat16)
  text = _lower(lambda b, p, n, *x: rs.gdn.replay_verify(*x, b, p, lengths=n, implementation="pallas_triton"),
                bufs, cursor.plan(_SLOTS, num_tokens=4), jnp.full((P_B,), 4, i32), *_production_tokens(4))
  assert text.count("__gpu$xla.gpu.triton") == 3          # readout, verify step, fold pass
  assert text.count("tf.aliasing_output") == 4


@pytest.mark.parametrize("num_tokens,state_dtype", [(4, "float32"), (8, "bfloat16")])
def test_default_route_lowers_for_h200(num_tokens, state_dtype):
  """The H200 default is the reconstruct route: one launch."""
  cursor = rs.ReplayCursor.create(P_N, buffer_len=16, max_draft=num_tokens - 1)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV, head_k_dim=P_K,
                                     head_v_dim=P_V, state_dtype=state_dtype, ring_dtype=jnp.bfloat16)
  text = _lower(lambda b, p, n, *x: rs.gdn.replay_verify(*x, b, p, lengths=n, implementation="pallas_triton"),
                bufs, cursor.plan(_SLOTS, num_tokens=num_tokens), jnp.full((P_B,), num_tokens, i32),
                *_production_tokens(num_tokens))
  assert text.count("__gpu$xla.gpu.triton") == 1          # one launch: no fold pass
  assert text.count("tf.aliasing_output") == 4             # state and the three rings, in place


def test_bad_verify_route():
  cursor = rs.ReplayCursor.create(P_N, buffer_len=8, max_draft=1)
  bufs = rs.gdn.ReplayBuffers.create(P_N, cursor, num_k_heads=P_HK, num_v_heads=P_HV, head_k_dim=P_K,
                                     head_v_dim=P_V)
  with pytest.raises(ValueError, match="route"):
    gdn_verify_triton.verify_cfg("op", bufs, cursor.plan(_SLOTS, num_tokens=2), P_B, route="fused")
  with pytest.raises(ValueError, match="route"):
    config_lib.VerifyConfig(step=config_lib.KernelConfig(block_v=16, num_warps=2),
                            readout=config_lib.KernelConfig(block_v=16, num_warps=2), split=False,
                            fold=config_lib.KernelConfig(block_v=16, num_warps=2), route="fused")


@pytest.mark.parametrize("num_tokens,state_dtype", [(2, "bfloat16"), (4, "float32"), (8, "float32")])
def test_verify_conventional_lowers_for_h200(num_tokens, state_dtype):
  stack = jnp.zeros((P_N, num_tokens, P_HV, P_V, P_K), state_dtype)
  text = _lower(lambda s, r, *x: rs.gdn.verify_conventional(*x, s, _SLOTS, r, implementation="pallas_triton"),
                stack, jnp.zeros((P_B,), i32), *_production_tokens(num_tokens))
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert text.count("tf.aliasing_output") == 1
