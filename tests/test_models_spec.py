"""Speculative decoding in the models (CPU, float32).

* Layers: ``verify`` + ``commit`` with random accepted counts (garbage in the rejected drafts)
  equal one prefill over the accepted tokens — outputs, recurrent state and conv state — across
  flushes (buffer_len 4, T = 4), for GatedDeltaNet and Mamba2.
* ``ngram_drafts``: hit, periodic continuation, most recent occurrence, miss → last token.
* ``generate(speculative=k)``, k ∈ {2, 4}, and conventional verify (``replay=False``: state stacks,
  k = 4): greedy tokens equal ``speculative=0`` for the GDN, Mamba2 and hybrid tiny LMs over 48
  tokens, with random weights (drafts nearly always miss, so
  every step rolls back) and with a "looping" head (a short successor cycle added to the head, so
  greedy streams repeat and drafts hit); the step counts equal a numpy replay of the drafter over
  the greedy stream, and are well below the token counts when drafts hit; budget cuts inside an
  accepted run; a stop token inside an accepted run; exactly one compilation.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.engine_spec import looping_model
import replayssm_jax as rs
from replayssm_jax.models import (GatedDeltaNet, GatedDeltaNetConfig, LMConfig, Mamba2,
                                  Mamba2Config, generate, make_model)

generate_module = importlib.import_module("replayssm_jax.models.generate")

ATOL = 1e-4
NEW, BUFFER_LEN, NGRAM = 48, 8, 2
# One-layer GDN / Mamba2 stacks and the two-layer hybrid: three compilations each (k = 0, 2, 4).
CONFIGS = {"gdn": lambda: LMConfig.tiny(num_layers=1),
           "mamba2": lambda: LMConfig.tiny_mamba2(num_layers=1),
           "hybrid": LMConfig.tiny_hybrid}
PROMPTS = np.zeros((3, 16), np.int32)
PROMPTS[0, :15] = [5, 6, 7, 8, 9] * 3
PROMPTS[1] = np.random.RandomState(0).randint(1, 256, 16)
PROMPTS[2, :12] = [40, 41, 42, 43] * 3
LENGTHS = np.array([15, 16, 12], np.int32)


# ---- layers ---------------------------------------------------------------------------------

LAYERS = {
    "gdn": (GatedDeltaNet, GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4,
                                               head_k_dim=8, head_v_dim=8), rs.gdn),
    "mamba2": (Mamba2, Mamba2Config(hidden_size=32, num_heads=4, head_dim=8, num_groups=2,
                                    state_dim=8), rs.mamba2),
}


@pytest.mark.parametrize("kind", LAYERS)
def test_layer_verify_commit_equals_prefill_of_accepted_tokens(kind):
  # Given a layer, a 6-token prompt in sparse slots and 14 verify steps of T = 4 tokens: token
  # 0 and the accepted drafts continue the sequence x, rejected drafts are random garbage,
  cls, config, ops = LAYERS[kind]
  layer = cls(config, rngs=nnx.Rngs(0))
  bsz, t, prompt, steps, num_slots = 2, 4, 6, 14, 5
  slots = jnp.array([3, 1], jnp.int32)
  rng = np.random.RandomState(0)
  accepted = rng.randint(1, t + 1, (steps, bsz)).astype(np.int32)
  accepted[0] = 1      # a step that rejects every draft
  accepted[1] = t      # and one that accepts all of them
  total = prompt + int(accepted.sum(0).max())
  x = jax.random.normal(jax.random.PRNGKey(1), (bsz, total + t, config.hidden_size), jnp.float32)
  garbage = 3.0 * jax.random.normal(jax.random.PRNGKey(2), (steps, bsz, t, config.hidden_size))
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=4, max_draft=t - 1)

  # (one jitted prefill shape for the prompt and for the final reference: lengths mark the rows)
  prefill = jax.jit(lambda lengths: layer.prefill(x[:, :total], layer.init_cache(num_slots, cursor),
                                                  slots, lengths))
  _, cache = prefill(jnp.full((bsz,), prompt, jnp.int32))
  cursor = cursor.reset(slots)

  @jax.jit
  def step(xs, cache, cursor, num_accepted):
    plan = cursor.plan(slots, num_tokens=t)
    y, cache, window = layer.verify(xs, cache, plan)
    return y, layer.commit(cache, window, plan, num_accepted), cursor.commit(plan, num_accepted), plan.flush

  pos = np.full(bsz, prompt)
  outs = [[] for _ in range(bsz)]
  flushes = 0
  for s in range(steps):
    lane = np.arange(t)[None, :]
    real = jnp.asarray(lane < accepted[s][:, None])[..., None]
    xs = jnp.stack([x[b, pos[b]:pos[b] + t] for b in range(bsz)])
    y, cache, cursor, flush = step(jnp.where(real, xs, garbage[s]), cache, cursor,
                                   jnp.asarray(accepted[s]))
    flushes += int(flush.sum())
    for b in range(bsz):
      outs[b].append(np.asarray(y[b, :accepted[s, b]]))
    pos += accepted[s]

  # Then each row equals one prefill over its accepted tokens (right-padded to the longest row):
  # outputs, recurrent state and conv state.
  assert flushes >= 2 * bsz  # the rings cycled
  y_full, full = prefill(jnp.asarray(pos, jnp.int32))
  for b in range(bsz):
    np.testing.assert_allclose(np.concatenate(outs[b]), np.asarray(y_full[b, prompt:pos[b]]), atol=ATOL, rtol=0)
  S = ops.materialize(cache.bufs, cursor, slots)
  np.testing.assert_allclose(np.asarray(S), np.asarray(full.bufs.state[slots]), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(cache.conv_state), np.asarray(full.conv_state), atol=ATOL, rtol=0)


# ---- drafter --------------------------------------------------------------------------------


def _reference_drafts(history, k, n):
  """numpy drafter: the tokens after the most recent earlier occurrence of the last n-gram,
  continued periodically; no occurrence → the last token k times."""
  history = list(history)
  for p in range(len(history) - n - 1, -1, -1):
    if history[p:p + n] == history[-n:]:
      follow = history[p + n:]
      return [follow[i % len(follow)] for i in range(k)]
  return [history[-1]] * k


def test_ngram_drafts():
  rows = [[1, 2, 3, 9, 1, 2, 3, 4, 1, 2],   # two occurrences of (1, 2): the later one wins → 3 4 1 2
          [7, 8, 7, 8, 7],                 # (8, 7) at 1, followed by 8 7 → 8 7 8 7
          [5, 6, 5, 6, 5, 6],              # (5, 6) at 2 → 5 6 5 6
          [1, 2, 3, 4],                    # no earlier (3, 4) → 4 4 4 4
          [3]]                             # shorter than the n-gram → 3 3 3 3
  history = np.zeros((len(rows), 12), np.int32)
  for r, row in enumerate(rows):
    history[r, :len(row)] = row
  length = np.array([len(r) for r in rows], np.int32)
  got = generate_module.ngram_drafts(jnp.asarray(history), jnp.asarray(length), num_drafts=4, ngram=2)
  expected = [_reference_drafts(r, 4, 2) for r in rows]
  assert expected[0] == [3, 4, 1, 2] and expected[3] == [4] * 4
  np.testing.assert_array_equal(np.asarray(got), expected)


# ---- generate -------------------------------------------------------------------------------


def _simulate(prompt, stream, k, n, budget):
  """Replays speculative generate over a greedy ``stream`` with the numpy drafter. Returns
  (steps, accepted, budget_cuts, inner): model steps, tokens emitted beyond one per step,
  whether the budget cut a run of accepted drafts, and the positions emitted inside a run (not
  the last token of their step)."""
  history, num, steps, cut, inner = list(prompt) + [int(stream[0])], 1, 0, False, []
  while num < budget:
    drafts, left = _reference_drafts(history, k, n), budget - num
    j = 0
    while j < min(k, left) and drafts[j] == stream[num + j]:
      j += 1
    emit = min(j + 1, left)
    cut |= j + 1 > left
    inner += list(range(num, num + emit - 1))
    history += [int(s) for s in stream[num:num + emit]]
    num, steps = num + emit, steps + 1
  return steps, num - 1 - steps, cut, inner


@pytest.fixture(scope="module")
def streams():
  """Greedy ``speculative=0`` streams per (kind, weights), computed once."""
  cache = {}

  def get(kind, weights):
    if (kind, weights) not in cache:
      model = make_model(CONFIGS[kind](), seed=0)
      model = looping_model(model) if weights == "looping" else model
      tokens, num = generate(model, PROMPTS, LENGTHS, max_new_tokens=NEW, buffer_len=BUFFER_LEN)
      cache[kind, weights] = (model, np.asarray(tokens), np.asarray(num))
    return cache[kind, weights]
  return get


@pytest.mark.parametrize("kind", CONFIGS)
def test_speculative_greedy_equals_plain_greedy(streams, kind):
  cuts = 0
  for weights in ("random", "looping"):
    model, base, base_num = streams(kind, weights)
    np.testing.assert_array_equal(base_num, NEW)
    for k, replay in ((2, True), (4, True), (4, False)):
      # Given speculative generation with k drafts per step (ReplaySSM or conventional verify),
      tokens, num, stats = generate(model, PROMPTS, LENGTHS, max_new_tokens=NEW, buffer_len=BUFFER_LEN,
                                    speculative=k, ngram=NGRAM, replay=replay, return_stats=True)
      # Then the tokens are the plain greedy tokens,
      np.testing.assert_array_equal(np.asarray(tokens), base, err_msg=f"{weights}, k={k}, replay={replay}")
      np.testing.assert_array_equal(np.asarray(num), NEW)
      steps, accepted = np.asarray(stats.steps), np.asarray(stats.accepted)
      np.testing.assert_array_equal(1 + steps + accepted, NEW)
      # the steps are those of the numpy drafter replayed over the greedy stream,
      for r in range(len(PROMPTS)):
        sim_steps, sim_accepted, cut, _ = _simulate(PROMPTS[r, :LENGTHS[r]], base[r], k, NGRAM, NEW)
        assert (steps[r], accepted[r]) == (sim_steps, sim_accepted), (weights, k, r)
        cuts += cut
      # and with the looping head drafts hit: far fewer model steps than tokens.
      if weights == "looping":
        assert steps.min() < 2 * (NEW - 1) // 3, steps
        assert steps.max() == NEW - 1 or accepted.min() < accepted.max()  # hits and misses
  assert cuts >= 1  # the budget cut an accepted run at least once (max_new_tokens is exact)


def test_stop_token_inside_accepted_run_and_one_compilation(streams):
  # Given the looping GDN model's greedy stream and a stop token that first appears in the middle
  # of a run of accepted drafts (k = 4),
  model, base, _ = streams("gdn", "looping")
  k, r = 4, 2
  _, _, _, inner = _simulate(PROMPTS[r, :LENGTHS[r]], base[r], k, NGRAM, NEW)
  p = next((p for p in inner if p > 0 and base[r, p] not in base[r, :p]), None)
  assert p is not None, "no fresh token inside an accepted run; pick another row"
  stop = int(base[r, p])
  jitted = generate_module._generate_jit
  before = jitted._cache_size()
  out, num = generate(model, PROMPTS, LENGTHS, max_new_tokens=NEW, buffer_len=BUFFER_LEN,
                      speculative=k, stop_tokens=(stop,))
  # Then every row stops right after its first stop token (row r inside the run; other rows go
  # on as padding rows come and go) and pads the rest,
  out, num = np.asarray(out), np.asarray(num)
  assert num[r] == p + 1
  for row in range(len(PROMPTS)):
    hits = np.flatnonzero(base[row] == stop)
    n = int(hits[0]) + 1 if hits.size else NEW
    assert num[row] == n
    np.testing.assert_array_equal(out[row, :n], base[row, :n])
    np.testing.assert_array_equal(out[row, n:], generate_module.PAD_TOKEN)
  # and other prompts, lengths and prompt widths reuse the one compilation.
  other = np.random.RandomState(1).randint(0, 256, (3, 30)).astype(np.int32)
  generate(model, other, np.array([30, 1, 17], np.int32), max_new_tokens=NEW, buffer_len=BUFFER_LEN,
           speculative=k, stop_tokens=(stop,))
  assert jitted._cache_size() == before + 1


def test_speculative_bad_options():
  model = make_model(LMConfig.tiny(), seed=0)
  ok = dict(max_new_tokens=4, speculative=2)
  with pytest.raises(ValueError, match="speculative"):
    generate(model, PROMPTS, LENGTHS, max_new_tokens=4, speculative=8)
  with pytest.raises(ValueError, match="speculative"):
    generate(model, PROMPTS, LENGTHS, max_new_tokens=4, speculative=-1)
  with pytest.raises(ValueError, match="buffer_len"):
    generate(model, PROMPTS, LENGTHS, max_new_tokens=4, speculative=4, buffer_len=4)
  with pytest.raises(ValueError, match="ngram"):
    generate(model, PROMPTS, LENGTHS, ngram=0, **ok)
  with pytest.raises(ValueError, match="step"):
    model.commit(model.init_cache(3), jnp.ones((3,), jnp.int32))


def test_default_buffer_len_follows_the_verify_measurement():
  """buffer_len=None: L = 16 without drafts, L = max(T, min(2T, 8)) for T = k + 1 verify tokens
  (H200: shorter windows verify faster), and never shorter than T (drafts fit a flushed window)."""
  from replayssm_jax import config  # noqa: PLC0415
  assert config.buffer_len_for(1) == 16
  assert [config.buffer_len_for(t) for t in (2, 3, 4, 8)] == [4, 6, 8, 8]
  assert all(config.buffer_len_for(t) >= t for t in range(1, 9))
  # generate takes it when drafting (k = 3 → L = 8; an L below k + 1 would raise).
  tokens, _ = generate(make_model(LMConfig.tiny(), seed=0), PROMPTS, LENGTHS, max_new_tokens=4,
                       speculative=3)
  assert np.asarray(tokens).shape == (len(PROMPTS), 4)
