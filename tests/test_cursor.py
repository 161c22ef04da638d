"""ReplayCursor: property tests against a plain-Python model, config/shape errors, checked mode.

The model keeps, per slot, the committed unfolded token ids (in order) and the ring contents as a
dict ``ring index -> token id``. Every step simulates the kernels' ring writes exactly as the
cursor module documents them (token i at ``base + count + i (mod R)`` on live rows; a flushing
row folds ``count + 1`` entries) and checks the cursor rules after every commit.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replayssm_jax as rs
from replayssm_jax import _checks
from replayssm_jax.cursor import ring_size_for

i32 = jnp.int32


# --------------------------------------------------------------------------------------------
# The plain-Python model.


@dataclasses.dataclass
class SlotModel:
  pending: list = dataclasses.field(default_factory=list)   # committed, unfolded token ids
  folded: list = dataclasses.field(default_factory=list)    # token ids folded into the checkpoint
  stream: list = dataclasses.field(default_factory=list)    # every accepted token id, in order
  ring: dict = dataclasses.field(default_factory=dict)      # ring index -> token id


class CursorModel:
  """Runs cursor steps next to a per-slot model and checks every rule after each commit."""

  def __init__(self, num_slots: int, buffer_len: int, max_draft: int):
    self.cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len, max_draft=max_draft)
    self.n, self.L, self.D = num_slots, buffer_len, max_draft
    self.R = self.cursor.ring_size
    self.slots = [SlotModel() for _ in range(num_slots)]
    self.next_token = 0
    self.flushes = self.forced_flushes = self.wraps = 0

  def step(self, rows, num_tokens, force, accepted):
    """rows: slot per batch row (negative = padding); force: list[bool] or None; accepted: list or None."""
    L, R, T = self.L, self.R, num_tokens
    before_base = np.asarray(self.cursor.base).copy()
    before_count = np.asarray(self.cursor.count).copy()
    plan = self.cursor.plan(jnp.asarray(rows, i32), num_tokens=T,
                            force_flush=None if force is None else jnp.asarray(force, bool))
    assert (plan.num_tokens, plan.buffer_len, plan.ring_size) == (T, L, R)
    pb, pc, pf = (np.asarray(x) for x in (plan.base, plan.count, plan.flush))
    for row, s in enumerate(rows):
      if s < 0:  # padding rows: inert plan entries
        assert (pb[row], pc[row], bool(pf[row])) == (0, 0, False), (row, s)
        continue
      m = self.slots[s]
      assert pb[row] == before_base[s] and pc[row] == before_count[s] == len(m.pending)
      forced = force is not None and bool(force[row])
      natural = len(m.pending) + T > L - 1
      assert bool(pf[row]) == (natural or forced), (
          f"row {row} slot {s}: count={pc[row]} T={T} L={L} forced={forced} but flush={pf[row]}")
      self.flushes += int(natural or forced)
      self.forced_flushes += int(forced and not natural)
      live = {(int(pb[row]) + j) % R for j in range(int(pc[row]))}
      writes = [(int(pb[row]) + int(pc[row]) + i) % R for i in range(T)]
      assert len(set(writes)) == T and not live & set(writes), (
          f"slot {s}: step writes {writes} overlap the live window {sorted(live)} (R={R})")
      self.wraps += int(pb[row] + pc[row] + T > R)
      tokens = list(range(self.next_token, self.next_token + T))
      self.next_token += T
      for idx, tok in zip(writes, tokens):
        m.ring[idx] = tok
      a = T if accepted is None else int(accepted[row])
      m.stream += tokens[:a]
      if pf[row]:  # fold the committed window and token 0; drafts stay unfolded
        m.folded += m.pending + tokens[:1]
        m.pending = tokens[1:a]
      else:
        m.pending += tokens[:a]
      assert m.folded + m.pending == m.stream  # the model itself: nothing lost, nothing doubled
    self.cursor = self.cursor.commit(
        plan, None if accepted is None else jnp.asarray(accepted, i32))
    live_slots = {s for s in rows if s >= 0}
    self.check(untouched={s: (before_base[s], before_count[s])
                          for s in range(self.n) if s not in live_slots})

  def reset(self, rows):
    before_base = np.asarray(self.cursor.base).copy()
    before_count = np.asarray(self.cursor.count).copy()
    self.cursor = self.cursor.reset(jnp.asarray(rows, i32))
    for s in rows:
      if s >= 0:  # e.g. write_state after prefill: the checkpoint alone is the state
        m = self.slots[s]
        m.folded, m.pending = list(m.stream), []
    live_slots = {s for s in rows if s >= 0}
    for s in live_slots:
      assert int(self.cursor.base[s]) == 0 and int(self.cursor.count[s]) == 0
    self.check(untouched={s: (before_base[s], before_count[s])
                          for s in range(self.n) if s not in live_slots})

  def check(self, untouched=()):
    base, count = np.asarray(self.cursor.base), np.asarray(self.cursor.count)
    assert base.dtype == np.int32 and count.dtype == np.int32
    assert base.shape == count.shape == (self.n,)
    for s in untouched:  # padding rows and slots outside the batch change nothing
      assert (base[s], count[s]) == untouched[s], f"slot {s} not in the batch but its cursor moved"
    for s, m in enumerate(self.slots):
      assert 0 <= base[s] < self.R, f"slot {s}: base={base[s]} outside [0, {self.R})"
      assert 0 <= count[s] <= self.L - 1, f"slot {s}: count={count[s]} > buffer_len - 1 = {self.L - 1}"
      window = [m.ring.get((int(base[s]) + j) % self.R) for j in range(int(count[s]))]
      assert window == m.pending, (
          f"slot {s}: ring[{base[s]}:{base[s]}+{count[s]}] holds {window}, committed unfolded "
          f"tokens are {m.pending}")


# --------------------------------------------------------------------------------------------
# Property tests.


@st.composite
def cursor_configs(draw):
  num_slots = draw(st.integers(1, 6))
  buffer_len = draw(st.one_of(st.integers(1, 6), st.integers(7, 20)))
  max_draft = draw(st.integers(0, min(buffer_len - 1, 7)))
  return num_slots, buffer_len, max_draft


def draw_rows(data, n):
  live = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n), label="live slots")
  pads = data.draw(st.lists(st.sampled_from([-1, -2, -(2 ** 31)]), max_size=2), label="padding")
  rows = data.draw(st.permutations(live + pads), label="rows")
  return rows or [-1]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=cursor_configs(), data=st.data())
def test_cursor_matches_model(config, data):
  num_slots, buffer_len, max_draft = config
  checked = data.draw(st.booleans(), label="checked mode")
  previous = _checks.checks_enabled()
  rs.set_checks(checked)  # valid sequences must also pass the checked-mode validation
  try:
    model = CursorModel(num_slots, buffer_len, max_draft)
    model.check()
    for _ in range(data.draw(st.integers(1, 24), label="steps")):
      rows = draw_rows(data, num_slots)
      if data.draw(st.integers(0, 9), label="reset?") == 0:
        model.reset(rows)
        continue
      t = data.draw(st.integers(1, max_draft + 1), label="num_tokens")
      force = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 3).map(lambda x: x == 0),
                                                      min_size=len(rows), max_size=len(rows))),
                        label="force_flush")
      accepted = None
      if data.draw(st.booleans(), label="accept all?"):
        accepted = [data.draw(st.integers(1, t) if s >= 0 else st.integers(-3, t + 3)) for s in rows]
      model.step(rows, t, force, accepted)
  finally:
    rs.set_checks(previous)


@pytest.mark.parametrize("buffer_len,max_draft", [(1, 0), (3, 0), (4, 0), (5, 3), (8, 7), (16, 0)])
def test_long_run_flushes_wraps_and_rollbacks(buffer_len, max_draft):
  """A deterministic long run (not left to hypothesis' luck): flushes, wraps and rollbacks occur."""
  rng = np.random.default_rng(buffer_len * 10 + max_draft)
  model = CursorModel(4, buffer_len, max_draft)
  for _ in range(120):
    rows = list(rng.permutation([0, 1, 2, 3, -1])[: rng.integers(1, 6)])
    t = int(rng.integers(1, max_draft + 2))
    force = list(rng.random(len(rows)) < 0.1)
    accepted = [int(rng.integers(1, t + 1)) for _ in rows]
    model.step(rows, t, force, accepted)
  assert model.flushes > 10
  if buffer_len > 1:  # with L = 1 every flush is natural
    assert model.forced_flushes > 0
  if model.R > 1:
    assert model.wraps > 0, "no window or write ever crossed the end of the ring"


# --------------------------------------------------------------------------------------------
# Plain tests.


@pytest.mark.parametrize("buffer_len,max_draft,ring", [
    (1, 0, 1), (2, 0, 2), (3, 0, 4), (4, 0, 4), (5, 0, 8), (16, 0, 16), (16, 1, 32),
    (5, 3, 8), (9, 8, 32), (17, 0, 32), (64, 0, 64)])
def test_ring_size(buffer_len, max_draft, ring):
  cursor = rs.ReplayCursor.create(3, buffer_len=buffer_len, max_draft=max_draft)
  assert cursor.ring_size == ring == ring_size_for(buffer_len, max_draft)
  assert ring >= buffer_len + max_draft and ring & (ring - 1) == 0
  assert cursor.num_slots == 3
  np.testing.assert_array_equal(cursor.base, np.zeros(3, np.int32))
  np.testing.assert_array_equal(cursor.count, np.zeros(3, np.int32))
  assert cursor.base.dtype == jnp.int32 and cursor.count.dtype == jnp.int32


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=0), "num_slots"),
    (dict(num_slots=2.0), "num_slots"),
    (dict(buffer_len=0), "buffer_len"),
    (dict(buffer_len=-3), "buffer_len"),
    (dict(buffer_len=True), "buffer_len"),
    (dict(max_draft=-1), "max_draft"),
    (dict(max_draft=1.5), "max_draft"),
    (dict(buffer_len=3, max_draft=3), "buffer_len"),
    (dict(buffer_len=1, max_draft=1), "buffer_len"),
])
def test_create_errors(kwargs, match):
  args = dict(num_slots=4, buffer_len=4, max_draft=0) | kwargs
  with pytest.raises(ValueError, match=match):
    rs.ReplayCursor.create(**args)


def test_buffer_len_equal_max_draft_plus_one_is_allowed():
  assert rs.ReplayCursor.create(2, buffer_len=4, max_draft=3).ring_size == 8


@pytest.mark.parametrize("num_tokens", [0, -1, 3, True, 1.0, np.float32(1)])
def test_plan_num_tokens_out_of_range(num_tokens):
  cursor = rs.ReplayCursor.create(4, buffer_len=4, max_draft=1)
  with pytest.raises(ValueError, match="num_tokens"):
    cursor.plan(jnp.array([0, 1], i32), num_tokens=num_tokens)


@pytest.mark.parametrize("slots", [
    jnp.array([0.0, 1.0], jnp.float32),
    jnp.array([0, 1], jnp.int16),
    jnp.array([0, 1], jnp.uint32),
    jnp.array([[0, 1]], i32),
    jnp.array(1, i32),
])
def test_bad_slots(slots):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  with pytest.raises(ValueError, match="slots"):
    cursor.plan(slots)
  with pytest.raises(ValueError, match="slots"):
    cursor.reset(slots)


@pytest.mark.parametrize("force", [jnp.array([True, False, True]), jnp.array([[True, False]]),
                                   jnp.array([1, 0], i32)])
def test_bad_force_flush(force):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  with pytest.raises(ValueError, match="force_flush"):
    cursor.plan(jnp.array([0, 1], i32), force_flush=force)


@pytest.mark.parametrize("accepted", [jnp.array([1, 1, 1], i32), jnp.array([1.0, 1.0]),
                                      jnp.array([[1, 1]], i32)])
def test_bad_num_accepted(accepted):
  cursor = rs.ReplayCursor.create(4, buffer_len=4, max_draft=1)
  plan = cursor.plan(jnp.array([0, 1], i32), num_tokens=2)
  with pytest.raises(ValueError, match="num_accepted"):
    cursor.commit(plan, accepted)


def test_commit_plan_from_another_cursor():
  plan = rs.ReplayCursor.create(4, buffer_len=3).plan(jnp.array([0], i32))
  for other in (rs.ReplayCursor.create(4, buffer_len=4), rs.ReplayCursor.create(4, buffer_len=8)):
    with pytest.raises(ValueError, match="plan"):
      other.commit(plan)


def test_force_flush_ignored_on_padding_rows():
  cursor = rs.ReplayCursor.create(3, buffer_len=4)
  plan = cursor.plan(jnp.array([-1, 1], i32), force_flush=jnp.array([True, False]))
  np.testing.assert_array_equal(plan.flush, [False, False])
  np.testing.assert_array_equal(plan.valid, [False, True])


def test_flush_all_flushes_every_live_row_and_empties_windows():
  cursor = rs.ReplayCursor.create(4, buffer_len=8, max_draft=3)
  slots = jnp.array([0, -1, 2, 3], jnp.int32)
  for _ in range(3):
    cursor = cursor.commit(cursor.plan(slots))
  plan = cursor.plan(slots, flush_all=True)
  assert plan.flush_all and np.asarray(plan.flush).tolist() == [True, False, True, True]
  assert np.asarray(plan.fold_length()).tolist() == [4, 0, 4, 4]
  cursor = cursor.commit(plan)
  assert np.asarray(cursor.count).tolist() == [0, 0, 0, 0]
  assert not cursor.plan(slots).flush_all


@pytest.mark.parametrize("kwargs,match", [(dict(flush_all=1), "Python bool"),
                                          (dict(flush_all=True, num_tokens=2), "one-token decode")])
def test_bad_flush_all(kwargs, match):
  cursor = rs.ReplayCursor.create(4, buffer_len=8, max_draft=3)
  with pytest.raises(ValueError, match=match):
    cursor.plan(jnp.array([0, 1], jnp.int32), **kwargs)


def test_reset_empties_only_the_given_slots():
  cursor = rs.ReplayCursor.create(4, buffer_len=8)
  plan = cursor.plan(jnp.array([0, 1, 2, 3], i32))
  cursor = cursor.commit(plan)
  cursor = cursor.commit(cursor.plan(jnp.array([0, 1, 2, 3], i32), force_flush=jnp.array([True] * 4)))
  cursor = cursor.commit(cursor.plan(jnp.array([0, 1, 2, 3], i32)))
  np.testing.assert_array_equal(cursor.base, [2] * 4)
  np.testing.assert_array_equal(cursor.count, [1] * 4)
  cursor = cursor.reset(jnp.array([2, -1, 0], i32))
  np.testing.assert_array_equal(cursor.base, [0, 2, 0, 2])
  np.testing.assert_array_equal(cursor.count, [0, 1, 0, 1])


# --------------------------------------------------------------------------------------------
# Checked mode.


def test_checked_mode_slot_out_of_range(checked_mode):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  for slots in (jnp.array([0, 4], i32), jnp.array([-1, 1000], i32)):
    with pytest.raises(ValueError, match="slots.*pool has 4 slots"):
      cursor.plan(slots)
    with pytest.raises(ValueError, match="slots"):
      cursor.reset(slots)


def test_checked_mode_duplicate_live_slots(checked_mode):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  with pytest.raises(ValueError, match="slots.*more than once"):
    cursor.plan(jnp.array([2, 0, 2], i32))
  # Many padding rows are fine (no writes), also in checked mode.
  cursor.plan(jnp.array([-1, 0, -1, -1], i32))


@pytest.mark.parametrize("accepted", [[0, 1], [1, 3], [-1, 2]])
def test_checked_mode_num_accepted_out_of_range(checked_mode, accepted):
  cursor = rs.ReplayCursor.create(4, buffer_len=4, max_draft=1)
  plan = cursor.plan(jnp.array([0, 1], i32), num_tokens=2)
  with pytest.raises(ValueError, match="num_accepted"):
    cursor.commit(plan, jnp.array(accepted, i32))
  # Padding rows are ignored.
  plan = cursor.plan(jnp.array([0, -1], i32), num_tokens=2)
  cursor.commit(plan, jnp.array([2, 0], i32))


def test_checked_mode_corrupted_cursor(checked_mode):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  for bad in (cursor.replace(count=cursor.count.at[1].set(4)),      # count > L - 1
              cursor.replace(base=cursor.base.at[2].set(4)),        # base outside the ring
              cursor.replace(base=cursor.base.at[0].set(-1))):
    with pytest.raises(ValueError, match="cursor out of range"):
      bad.plan(jnp.array([0], i32))


def test_checked_mode_inside_jit(checked_mode):
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  step = jax.jit(lambda c, s: c.commit(c.plan(s)))
  step(cursor, jnp.array([0, 1], i32)).base.block_until_ready()
  with pytest.raises(Exception, match="more than once"):
    step(cursor, jnp.array([1, 1], i32)).base.block_until_ready()
  with pytest.raises(Exception, match="pool has 4 slots"):
    step(cursor, jnp.array([1, 7], i32)).base.block_until_ready()


def test_unchecked_mode_drops_out_of_range_writes():
  """Checks off (the default): slots past the pool are not validated; commit drops their writes."""
  assert not _checks.checks_enabled()
  cursor = rs.ReplayCursor.create(2, buffer_len=4)
  new = cursor.commit(cursor.plan(jnp.array([5, 0], i32)))
  np.testing.assert_array_equal(new.count, [1, 0])


# --------------------------------------------------------------------------------------------
# No recompilation across cursor values.


def test_no_recompilation_across_cursor_values():
  traces = []

  @jax.jit
  def step(cursor, slots, force, accepted):
    traces.append(1)
    plan = cursor.plan(slots, num_tokens=3, force_flush=force)
    return cursor.commit(plan, accepted), plan.flush

  rng = np.random.default_rng(0)
  cursor = rs.ReplayCursor.create(6, buffer_len=5, max_draft=2)
  flushed = 0
  for _ in range(40):
    slots = rng.permutation([0, 1, 2, 3, 4, 5, -1, -1])[:4].astype(np.int32)
    force = rng.random(4) < 0.2
    accepted = rng.integers(1, 4, size=4).astype(np.int32)
    cursor, flush = step(cursor, jnp.asarray(slots), jnp.asarray(force), jnp.asarray(accepted))
    flushed += int(np.sum(flush))
  cursor = cursor.reset(jnp.array([0, 1, -1, 3], i32))
  step(cursor, jnp.array([-1, -1, -1, -1], i32), jnp.zeros(4, bool), jnp.ones(4, i32))
  assert len(traces) == 1, f"plan+commit traced {len(traces)} times across cursor values"
  assert flushed > 5 and int(np.max(np.asarray(cursor.base))) > 0


def test_created_cursor_is_donatable():
  # base and count must be distinct buffers: donating one buffer twice is an error in JAX.
  cursor = rs.ReplayCursor.create(4, buffer_len=4)
  step = jax.jit(lambda c: c.commit(c.plan(jnp.arange(2, dtype=jnp.int32))), donate_argnums=0)
  cursor = step(cursor)
  assert np.asarray(cursor.count).tolist() == [1, 1, 0, 0]
