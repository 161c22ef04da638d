"""The serving engine drafting with the model's multi-token-prediction head
(``EngineConfig(drafter="mtp")``), on test_serving's tiny hybrid with an MTP head, made looping
(``bench.engine_spec.looping_model``: the head guesses the successor map one token further, so its
drafts hit).

* Greedy requests get the tokens of the engine without drafting — synchronous and overlapped
  steps, requests asking for 0 and 1 drafts sharing the steps, a sampled 1-token lane its sampled
  tokens — and the head's drafts are accepted.
* Preempt → resume continues bit for bit (the head's KV cache and pending drafts travel in the
  cache).
* Options the engine cannot serve raise.
"""
import dataclasses

import numpy as np
import pytest

from bench.engine_spec import looping_model
from replayssm_jax.models import make_model
from replayssm_jax.serving import Engine, EngineConfig
from tests.test_serving import BASE, HYBRID, assert_same_cache, preempted
from tests.test_serving_spec import _schedule

K = 2   # the looping map's period is 4: with 3 drafts, stale drafts after full accepts stay right
DRAFTING = BASE | dict(batch_buckets=(4,))
MTP = EngineConfig(**DRAFTING, num_drafts=K, drafter="mtp", overlap=False)
RNG = np.random.RandomState(2)
PROMPTS = [RNG.randint(1, 256, n).tolist() for n in (9, 12, 5, 3)]
NEW = [14, 11, 16, 9]
DRAFTS = [None, 0, 1, None]
SUBMIT = {1: dict(temperature=8.0, seed=5)}


@pytest.fixture(scope="module")
def model():
  return looping_model(make_model(dataclasses.replace(HYBRID, mtp_layers=1), seed=0), mixer_scale=0.15)


@pytest.fixture(scope="module")
def plain(model):
  engine = Engine(model, EngineConfig(**DRAFTING))
  ids = [engine.submit(p, max_new_tokens=n, **SUBMIT.get(i, {}))
         for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
  out = engine.run()
  return [out[i] for i in ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_mtp_drafting_gives_the_plain_tokens(model, plain, overlap):
  tokens, engine = _schedule(model, dataclasses.replace(MTP, overlap=overlap), [0, 0, 1, 2],
                             prompts=PROMPTS, new=NEW, drafts=DRAFTS, options=SUBMIT)
  stats = [engine.stats(f"r{i}") for i in range(4)]
  assert tokens == plain
  assert all(s.generated_tokens == n for s, n in zip(stats, NEW))
  # The head's drafts hit: most of the 3-draft requests' drafts are accepted.
  drafted = stats[0].drafted_tokens + stats[3].drafted_tokens
  accepted = stats[0].accepted_drafts + stats[3].accepted_drafts
  assert drafted > 0 and accepted >= 0.5 * drafted, (accepted, drafted)
  assert stats[1].drafted_tokens == 0 and 0 < stats[2].drafted_tokens <= NEW[2] - 1


def test_mtp_preempt_resume_is_bit_exact(model, tmp_path):
  def start():
    engine = Engine(model, MTP)
    for i in range(4):
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, request_id=f"r{i}", num_drafts=DRAFTS[i],
                    **SUBMIT.get(i, {}))
    return engine

  full, expected, _, resumed = preempted(start, 3, tmp_path / "ckpt")
  assert resumed.config == MTP
  assert resumed.run() == expected
  assert_same_cache(full, resumed)


def test_mtp_options_the_engine_refuses(model):
  with pytest.raises(ValueError, match="drafter='mtp' with num_drafts=0"):
    EngineConfig(drafter="mtp")
  with pytest.raises(ValueError, match="drafter='beam'"):
    EngineConfig(num_drafts=2, drafter="beam")
  with pytest.raises(NotImplementedError, match="prefix_block=4"):
    EngineConfig(**BASE, num_drafts=2, drafter="mtp", prefix_block=4)
  with pytest.raises(ValueError, match="no multi-token-prediction head"):
    Engine(make_model(HYBRID, seed=0), MTP)
