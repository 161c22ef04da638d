"""Pallas-Triton Mamba2 verify kernels vs XLA (CPU interpret mode), the float64 oracle, and the
abstract-H200 lowering.

``Twin`` steps XLA and Pallas-Triton buffers (and conventional state stacks) side by side through
plan → replay_verify → commit with random accepted counts, staggered rows, a padding row, short rows
whose padded lanes hold NaN, and natural and forced flushes (also with pending drafts). The ring
starts NaN everywhere and the stack NaN outside each slot's first entry, so a read outside a
window (or of a stack entry other than ``read_index``) shows. Every step compares outputs and raw
buffers of both implementations, checks inert lanes and rows, bitwise-unchanged checkpoints of
rows that did not flush, and the Pallas outputs and states against the float64 oracle.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from tests.helpers import lower_for_h200, max_err, tolerance
from tests.test_mamba2_ops import make_params, mamba2_step_f64
from tests.test_mamba2_pallas import SUPER
from tests.test_mamba2_verify import _staggered_rows, _token, _tokens

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")

GEOMETRY = (4, 2, 8, 16)          # (H, G, P, N): CPU config = two P tiles, two heads per program
NUM_SLOTS, BATCH = 6, 4
TOL = tolerance("float32", "float32")
FIELDS = ("state", "ring_x", "ring_B", "ring_a")


def _np(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def _assert_close(name, got, want, tol=TOL):
  """Equal NaN patterns, then max-abs error within tol."""
  got, want = _np(got), _np(want)
  assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN patterns differ"
  err = max_err(np.nan_to_num(got), np.nan_to_num(want))
  assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g}"


def _params(rng):
  p = make_params(rng, GEOMETRY[0])
  return p, {k: jnp.asarray(getattr(p, k), jnp.float32) for k in ("A", "D", "dt_bias")}


class Twin:
  """XLA and Pallas replay buffers and conventional stacks, stepped together with a float64 oracle
  of every slot's state. ``impl`` is the implementation under test; with ``conventional=False``
  the conventional verify (which ``impl`` may not have) is left out."""

  def __init__(self, *, num_tokens, buffer_len, seed, impl="pallas_triton", conventional=True):
    h, g, p, n = GEOMETRY
    self.rng = np.random.default_rng(seed)
    self.params, self.jp = _params(self.rng)
    self.cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=buffer_len, max_draft=num_tokens - 1)
    S0 = jnp.asarray(0.3 * self.rng.normal(size=(NUM_SLOTS, h, p, n)), jnp.float32)
    bufs = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, self.cursor, num_heads=h, head_dim=p,
                                          num_groups=g, state_dim=n)
    nan = lambda a: jnp.full_like(a, jnp.nan)
    bufs = bufs.replace(state=S0, ring_x=nan(bufs.ring_x), ring_B=nan(bufs.ring_B),
                        ring_a=nan(bufs.ring_a))
    stack = jnp.full((NUM_SLOTS, num_tokens, h, p, n), jnp.nan).at[:, 0].set(S0)
    # Pallas first, its cheapest kernel (conventional) first: the first Pallas program of a
    # process is compiled twice (the tracing context gains an entry after the first pallas_call),
    # and so is every XLA program compiled before it.
    self.impl, self.conventional, self.impls = impl, conventional, (impl, "xla")
    self.bufs = dict.fromkeys(self.impls, bufs)
    self.stack = dict.fromkeys(self.impls, stack)
    self.read_index = np.zeros(NUM_SLOTS, np.int32)
    self.oracle = np.asarray(_np(S0), np.float64)
    self.num_tokens = num_tokens
    self.natural = self.forced = self.wraps = self.steps = 0

  def _run(self, impl, x, plan, lengths):
    kw = dict(D=self.jp["D"], z=x["z"], dt_bias=self.jp["dt_bias"], lengths=lengths,
              implementation=impl)
    read = jnp.asarray(self.read_index[np.maximum(np.asarray(plan.slots), 0)])
    yc = None
    if self.conventional:
      yc, self.stack[impl] = rs.mamba2.verify_conventional(
          x["x"], x["dt"], self.jp["A"], x["B"], x["C"], self.stack[impl], plan.slots, read, **kw)
    y, self.bufs[impl] = rs.mamba2.replay_verify(x["x"], x["dt"], self.jp["A"], x["B"], x["C"],
                                                 self.bufs[impl], plan, **kw)
    return y, yc

  def step(self, rows, *, lengths, force):
    """One verify step of both implementations; every check of the module doc."""
    t = self.num_tokens
    rows, lengths = np.asarray(rows, np.int32), np.asarray(lengths, np.int32)
    live = rows >= 0
    lanes = live[:, None] & (np.arange(t)[None, :] < lengths[:, None])
    acc = self.rng.integers(1, lengths + 1).astype(np.int32)
    clean = _tokens(self.rng, len(rows), t, GEOMETRY)
    x = clean.map(lambda a: np.where(lanes.reshape(lanes.shape + (1,) * (a.ndim - 2)), a, np.nan))
    plan = self.cursor.plan(jnp.asarray(rows), num_tokens=t, force_flush=jnp.asarray(force))
    before = self.bufs[self.impl]
    out = {impl: self._run(impl, x.as_jax(), plan, jnp.asarray(lengths)) for impl in self.impls}
    self.cursor = self.cursor.commit(plan, jnp.asarray(acc))

    base, count, flush = (np.asarray(a) for a in (plan.base, plan.count, plan.flush))
    natural = count + t > self.cursor.buffer_len - 1
    self.natural += int(np.sum(flush & natural))
    self.forced += int(np.sum(flush & ~natural))
    self.wraps += int(np.sum(live & (base + count + lengths > self.cursor.ring_size)))
    self.steps += 1

    # Implementations agree (outputs, raw buffers with their NaN pattern, conventional stacks).
    (y, yc), (y_x, yc_x) = out[self.impl], out["xla"]
    after = self.bufs[self.impl]
    _assert_close("y", y, y_x)
    if self.conventional:
      _assert_close("conventional y", yc, yc_x)
      _assert_close("stack", self.stack[self.impl], self.stack["xla"])
      assert np.all(_np(yc)[~lanes] == 0)
    for f in FIELDS:
      _assert_close(f, getattr(after, f), getattr(self.bufs["xla"], f))
    # Inert lanes and rows; checkpoints of non-flushing rows and other slots bitwise unchanged.
    assert np.all(_np(y)[~lanes] == 0)
    kept = np.setdiff1d(np.arange(NUM_SLOTS), rows[flush])
    assert np.asarray(before.state)[kept].tobytes() == np.asarray(after.state)[kept].tobytes()
    others = np.setdiff1d(np.arange(NUM_SLOTS), rows[live])
    for f in FIELDS[1:]:
      assert np.asarray(getattr(before, f))[others].tobytes() == np.asarray(getattr(after, f))[others].tobytes()

    # Float64 oracle: outputs of real lanes, then the state after the accepted prefix.
    idx = np.flatnonzero(live)
    S, states = self.oracle[rows[idx]], []
    for i in range(t):
      y_ref, S = mamba2_step_f64(S, _token(clean, i, idx).rounded(), self.params)
      states.append(S)
      real = lanes[idx, i]
      assert max_err(_np(y)[idx[real], i], y_ref[real]) <= TOL
      if self.conventional:
        assert max_err(_np(yc)[idx[real], i], y_ref[real]) <= TOL
    for j, r in enumerate(idx):
      self.oracle[rows[r]] = states[acc[r] - 1][j]
      self.read_index[rows[r]] = acc[r] - 1
    state = rs.mamba2.materialize(after, self.cursor, jnp.asarray(rows), implementation="xla")
    assert max_err(_np(state)[idx], self.oracle[rows[idx]]) <= TOL
    if self.conventional:
      got = _np(self.stack[self.impl])[rows[idx], self.read_index[rows[idx]]]
      assert max_err(got, self.oracle[rows[idx]]) <= TOL


@pytest.fixture
def reconstruct_route(monkeypatch):
  """Makes the Pallas verify take the reconstruct route (window replayed into the tile)."""
  real = config_lib.mamba2_verify_config
  monkeypatch.setattr(config_lib, "mamba2_verify_config", lambda **kw: real(**{**kw, "route": "reconstruct"}))


@pytest.mark.parametrize("num_tokens,buffer_len", [(2, 4), (4, 8)])
def test_verify_parity_random_accepts(num_tokens, buffer_len):
  """14 steps: staggered rows, a padding row, short rows with NaN lanes, random forced flushes, and
  at step 6 a forced flush of a row that holds committed entries (its drafts stay pending)."""
  _random_accepts(num_tokens, buffer_len)


def test_verify_parity_random_accepts_reconstruct_route(reconstruct_route):
  """The same on the reconstruct route (flush stored in the same program, after token 0)."""
  _random_accepts(4, 8)


def test_bad_verify_route():
  with pytest.raises(ValueError, match="route"):
    config_lib.mamba2_verify_config(device_kind="cpu", state_dtype=jnp.float32, head_dim=8, state_dim=16,
                                    num_heads=4, num_groups=2, batch=4, buffer_len=8, ring_size=16,
                                    num_tokens=2, route="fused")


def _random_accepts(num_tokens, buffer_len, **twin):
  twin = Twin(num_tokens=num_tokens, buffer_len=buffer_len, seed=num_tokens, **twin)
  rng = np.random.default_rng(10 * num_tokens + buffer_len)
  pending = 0
  for t in range(14):
    rows = _staggered_rows(rng, NUM_SLOTS, BATCH, t + 2)
    short = rng.random(BATCH) < 0.3
    lengths = np.where(short, rng.integers(1, num_tokens + 1, size=BATCH), num_tokens)
    force = rng.random(BATCH) < 0.15
    if t == 6:  # force the row with the most committed entries
      counts = np.where(np.asarray(rows) >= 0, np.asarray(twin.cursor.count)[np.maximum(rows, 0)], -1)
      force[np.argmax(counts)] = True
      pending = counts.max()
    twin.step(rows, lengths=lengths, force=force & (np.asarray(rows) >= 0))
  assert pending >= 1 and twin.natural >= 3 and twin.forced >= 1 and twin.wraps >= 1, \
      (pending, twin.natural, twin.forced, twin.wraps)


def test_t1_equals_replay_decode():
  """With T = 1 the verify kernel is the output-only replay step: same outputs and buffers."""
  rng = np.random.default_rng(7)
  _, jp = _params(rng)
  h, g, p, n = GEOMETRY
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=4)
  nan = lambda a: jnp.full_like(a, jnp.nan)
  bufs = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n)
  bufs = bufs.replace(state=jnp.asarray(rng.normal(size=bufs.state.shape), jnp.float32),
                      ring_x=nan(bufs.ring_x), ring_B=nan(bufs.ring_B), ring_a=nan(bufs.ring_a))
  slots = jnp.asarray([3, -1, 0, 5], jnp.int32)
  for t in range(5):   # L = 4: windows fill, flush (natural at t = 3, forced on row 0 at t = 1)
    x = _tokens(rng, BATCH, 1, GEOMETRY).as_jax()
    plan = cursor.plan(slots, force_flush=jnp.asarray([t == 1, False, False, False]))
    kw = dict(D=jp["D"], dt_bias=jp["dt_bias"], implementation="pallas_triton")
    y_v, b_v = rs.mamba2.replay_verify(x["x"], x["dt"], jp["A"], x["B"], x["C"], bufs, plan,
                                       z=x["z"], **kw)
    y_d, b_d = rs.mamba2.replay_decode(x["x"][:, 0], x["dt"][:, 0], jp["A"], x["B"][:, 0],
                                       x["C"][:, 0], bufs, plan, z=x["z"][:, 0],
                                       route="output_only", **kw)
    _assert_close(f"t={t} y", y_v[:, 0], y_d, tol=1e-6)
    for f in FIELDS:
      _assert_close(f"t={t} {f}", getattr(b_v, f), getattr(b_d, f), tol=1e-6)
    bufs, cursor = b_v, cursor.commit(plan)
  assert int(np.asarray(cursor.base)[3]) != 0   # slot 3 (row 0) flushed off the ring origin


def test_the_kernels_run_and_limits():
  """implementation="pallas_triton" traces our kernels; T > 8 and odd sizes are NotImplemented."""
  rng = np.random.default_rng(1)
  _, jp = _params(rng)
  h, g, p, n = GEOMETRY
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=16, max_draft=8)
  bufs = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n)
  slots = jnp.arange(BATCH, dtype=jnp.int32)
  stack = jnp.zeros((NUM_SLOTS, 9, h, p, n))
  zero = jnp.zeros((BATCH,), jnp.int32)

  def ops(t, bufs, stack, impl):
    """(replay_verify, verify_conventional) of T tokens as thunks."""
    x = _tokens(rng, BATCH, t, (h, g, bufs.head_dim, bufs.state_dim)).as_jax()
    args = (x["x"], x["dt"], jp["A"], x["B"], x["C"])
    plan = cursor.plan(slots, num_tokens=t)
    return (lambda: rs.mamba2.replay_verify(*args, bufs, plan, implementation=impl),
            lambda: rs.mamba2.verify_conventional(*args, stack, slots, zero, implementation=impl))

  for op, name in zip(ops(2, bufs, stack, "pallas_triton"),
                      ("replayssm_mamba2_replay_verify", "replayssm_mamba2_verify_conventional")):
    assert name in str(jax.make_jaxpr(op)())
  for op in ops(2, bufs, stack, "xla"):
    assert "pallas_call" not in str(jax.make_jaxpr(op)())
  odd = rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=h, head_dim=p, num_groups=g,
                                       state_dim=24)
  for (op, match) in [*((o, "T=9") for o in ops(9, bufs, stack, "pallas_triton")),
                      *((o, "N=24") for o in ops(2, odd, jnp.zeros((NUM_SLOTS, 2, h, p, 24)),
                                                 "pallas_triton"))]:
    with pytest.raises(NotImplementedError, match=match):
      op()


# ---------------------------------------------------------------------------------------------
# Abstract-H200 lowering at Nemotron-3-Super geometry (H 128, P 64, N 128, G 8): Triton
# power-of-two sizes and unsupported primitives show here, and the donated buffers are aliased.
# ---------------------------------------------------------------------------------------------

def _verify_inputs(t, h, g, p, n, batch=8):
  bf16 = jnp.bfloat16
  return (jnp.zeros((batch, t, h, p), bf16), jnp.zeros((batch, t, h), bf16),
          jnp.zeros((h,), jnp.float32), jnp.zeros((batch, t, g, n), bf16),
          jnp.zeros((batch, t, g, n), bf16))


@pytest.mark.parametrize("kernel,num_tokens,buffer_len,state_dtype", [
    ("output_only", 2, 8, "float32"), ("output_only", 4, 16, "bfloat16"),
    ("output_only", 8, 16, "float32"), ("output_only", 8, 8, "bfloat16"),
    ("conventional", 2, 8, "float32"), ("conventional", 4, 16, "bfloat16"),
    ("conventional", 8, 16, "float32"), ("default", 4, 16, "float32"), ("default", 8, 16, "bfloat16"),
])
def test_lowers_for_h200(kernel, num_tokens, buffer_len, state_dtype, monkeypatch):
  """``default`` is the config's route on an H200 (reconstruct); ``output_only`` is named."""
  if kernel == "output_only":
    real = config_lib.mamba2_verify_config
    monkeypatch.setattr(config_lib, "mamba2_verify_config", lambda **kw: real(**{**kw, "route": "output_only"}))
  h, g, p, n = SUPER
  batch, num_slots = 8, 16
  slots = jnp.asarray(np.r_[np.arange(batch - 1), -1], jnp.int32)
  lengths = jnp.full((batch,), num_tokens, jnp.int32)
  step = _verify_inputs(num_tokens, h, g, p, n, batch)
  extra = dict(D=jnp.zeros((h,), jnp.float32), dt_bias=jnp.zeros((h,), jnp.float32),
               implementation="pallas_triton")
  if kernel in ("output_only", "default"):
    cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len, max_draft=num_tokens - 1)
    bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=h, head_dim=p,
                                          num_groups=g, state_dim=n, state_dtype=state_dtype,
                                          ring_dtype=jnp.bfloat16)
    text = lower_for_h200(lambda b, pl_, x, dt, A, B, C, n_: rs.mamba2.replay_verify(
        x, dt, A, B, C, b, pl_, z=x, lengths=n_, **extra),
        (0,), bufs, cursor.plan(slots, num_tokens=num_tokens), *step, lengths)
    aliased = 4    # checkpoint and the three rings, in place
  else:
    stack = jnp.zeros((num_slots, num_tokens, h, p, n), state_dtype)
    text = lower_for_h200(lambda st, s, r, x, dt, A, B, C, n_: rs.mamba2.verify_conventional(
        x, dt, A, B, C, st, s, r, z=x, lengths=n_, **extra),
        (0,), stack, slots, jnp.zeros((batch,), jnp.int32), *step, lengths)
    aliased = 1    # the state stack, in place
  assert "__gpu$xla.gpu.triton" in text
  assert text.count("tf.aliasing_output") == aliased
