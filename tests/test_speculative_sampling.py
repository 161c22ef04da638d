"""Speculative sampling (temperature > 0) emits the distribution of plain sampling (CPU, float32).

Setup: a one-layer GDN LM (D 16, vocabulary 8) with a successor bias in its head (token t favours
t+1 within its block of 4: 0 → 1 → 2 → 3 → 0; p(successor) ≈ 0.7 after the prompt) and a prompt
made of that cycle: the n-gram drafter proposes the successor where its bigram occurred, the
last token elsewhere, so drafts are accepted (about 20 % of them) and rejected (the residual
draw), and both drafts of a step are accepted often enough to reach the bonus lane (~16 % of
the rows). ``generate(..., temperature=1, speculative=2)`` runs
N rows of the same prompt in ONE call; rows draw from their own keys, so they are N independent
samples of the first four tokens (t0 from the prefill, t1..t3 from one or more verify steps).

Oracle: the exact distribution of (t0, t1, t2, t3), the product of the model's next-token
distributions, from the prefill logits of every prefix (1 + 8 + 64 + 512 prompts in one call).
Test: chi-square goodness of fit over the 4096 cells (cells with expected count < 5 pooled into
one), passing at p > 1e-3. The same test fails (p < 1e-6) for two wrong acceptance rules patched
into ``sampling.speculative_sample``: accepting every draft, and drawing a rejected draft's
replacement from p instead of p without the draft.
"""
import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.stats import chi2

from bench.engine_spec import looping_model
from replayssm_jax.models import LMConfig, generate, make_model, sampling

generate_module = importlib.import_module("replayssm_jax.models.generate")

VOCAB, NUM_TOKENS, DRAFTS, ROWS = 8, 4, 2, 1 << 13
PROMPT = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
ALPHA = 1e-3
real_speculative_sample = sampling.speculative_sample


@pytest.fixture(scope="module")
def model():
  config = LMConfig.tiny(vocab_size=VOCAB, max_prompt_len=12, num_layers=1, hidden_size=16,
                         num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, intermediate_size=32)
  return looping_model(make_model(config, seed=0), strength=1.0)


@pytest.fixture(scope="module")
def exact(model):
  """float64 [VOCAB] * NUM_TOKENS: P(t0, .., t3) from the prefill logits of every prefix."""
  prefixes = [p for n in range(NUM_TOKENS) for p in itertools.product(range(VOCAB), repeat=n)]
  width = len(PROMPT) + NUM_TOKENS - 1
  tokens = np.zeros((len(prefixes), width), np.int32)
  lengths = np.array([len(PROMPT) + len(p) for p in prefixes], np.int32)
  for i, p in enumerate(prefixes):
    tokens[i, :lengths[i]] = PROMPT + list(p)
  cache = model.init_cache(len(prefixes))
  slots = jnp.arange(len(prefixes), dtype=jnp.int32)
  logits, _ = jax.jit(model.prefill)(jnp.asarray(tokens), cache, slots, jnp.asarray(lengths))
  last = np.asarray(logits)[np.arange(len(prefixes)), lengths - 1].astype(np.float64)
  probs = np.exp(last - last.max(axis=1, keepdims=True))
  probs /= probs.sum(axis=1, keepdims=True)
  index = {p: i for i, p in enumerate(prefixes)}
  joint = np.ones((VOCAB,) * NUM_TOKENS)
  for cell in np.ndindex(*joint.shape):
    for j in range(NUM_TOKENS):
      joint[cell] *= probs[index[cell[:j]], cell[j]]
  return joint


def _chi_square(samples, joint):
  """(p-value, statistic, degrees of freedom) of samples [N, NUM_TOKENS] against ``joint``."""
  observed = np.bincount(np.ravel_multi_index(samples.T, joint.shape), minlength=joint.size)
  expected = len(samples) * joint.ravel()
  small = expected < 5
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  stat = float(np.sum((obs - exp) ** 2 / exp))
  df = len(obs) - 1
  return float(chi2.sf(stat, df)), stat, df


def _draw(model, rows=ROWS):
  prompts = np.tile(np.asarray(PROMPT, np.int32), (rows, 1))
  tokens, num, stats = generate(model, prompts, np.full((rows,), len(PROMPT), np.int32),
                                max_new_tokens=NUM_TOKENS, temperature=1.0, speculative=DRAFTS,
                                seed=3, return_stats=True)
  assert (np.asarray(num) == NUM_TOKENS).all()
  return np.asarray(tokens), stats


def test_speculative_sampling_matches_the_model_distribution(model, exact):
  # Given N rows of speculative sampling with two drafts per step,
  samples, stats = _draw(model)
  steps, accepted = np.asarray(stats.steps), np.asarray(stats.accepted)
  # (drafts are accepted and rejected, and the bonus lane after two accepted drafts is reached:
  # the three tokens after t0 come from one step),
  rate = accepted.sum() / (DRAFTS * steps.sum())
  assert 0.1 < rate < 0.9, rate
  assert (steps == 1).mean() > 0.05
  # then the first four tokens have the model's exact joint distribution.
  p, stat, df = _chi_square(samples, exact)
  print(f"chi-square: p={p:.3g}, statistic {stat:.1f}, df {df}, acceptance {rate:.3f}")
  assert p > ALPHA, (p, stat, df)


def _always_accept(logits, drafts, num_drafts, temperatures, keys, positions):
  """Wrong: every draft is accepted (its logit is raised so far that p(d) = 1)."""
  t = logits.shape[1]
  lane = jnp.arange(t)[None, :]
  judged = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
  boost = (lane < num_drafts[:, None])[..., None] & (jnp.arange(logits.shape[2]) == judged[..., None])
  return real_speculative_sample(jnp.where(boost, 1e4, logits), drafts, num_drafts, temperatures,
                                 keys, positions)


def _residual_from_p(logits, drafts, num_drafts, temperatures, keys, positions):
  """Wrong: a rejected draft is replaced by a draw from p itself (the draft not removed;
  temperature 1)."""
  tokens, emitted = real_speculative_sample(logits, drafts, num_drafts, temperatures, keys, positions)
  last = emitted - 1                                             # the lane that did not accept
  rejected = last < num_drafts
  row_logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
  draw = jax.vmap(lambda k, pos, row: jax.random.categorical(
      jax.random.fold_in(jax.random.fold_in(k, pos), sampling.RESIDUAL), row))(keys, positions + last, row_logits)
  fixed = jnp.where(rejected, draw.astype(jnp.int32), jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0])
  return tokens.at[jnp.arange(tokens.shape[0]), last].set(fixed), emitted


@pytest.mark.parametrize("wrong", [_always_accept, _residual_from_p], ids=["always_accept", "residual_from_p"])
def test_the_chi_square_test_has_power(model, exact, monkeypatch, wrong):
  # Given a wrong acceptance rule in place of the real one (generate traced afresh),
  monkeypatch.setattr(sampling, "speculative_sample", wrong)
  generate_module._generate_jit.clear_cache()
  try:
    samples, _ = _draw(model, ROWS // 2)
  finally:
    generate_module._generate_jit.clear_cache()
  # then the same test rejects it.
  p, stat, df = _chi_square(samples, exact)
  print(f"chi-square ({wrong.__name__}): p={p:.3g}, statistic {stat:.1f}, df {df}")
  assert p < 1e-6, (p, stat, df)
