"""The serving engine drafting with the model's multi-token-prediction head
(``EngineConfig(drafter="mtp")``), on test_serving's tiny hybrid with an MTP head, made looping
(``bench.engine_spec.looping_model``: the head guesses the successor map one token further, so its
drafts hit).

* Greedy requests get the tokens of the engine without drafting — synchronous and overlapped
  steps, requests asking for 0 and 1 drafts sharing the steps, a sampled 1-token lane its sampled
  tokens — and the head's drafts are accepted.
* Preempt → resume continues bit for bit, with and without prefix caching (the head's KV cache
  and pending drafts travel in the cache).
* Prefix caching: every snapshot (prompt blocks, decode boundaries) holds the head's KV entries
  and last hidden state of a fresh prefill of its key tokens; requests that hit one — also where
  their next token differs from the one that followed in the snapshot's sequence — start with the
  head's cache of a whole-prompt prefill, and get a cold run's tokens.
* Options the engine cannot serve raise.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.engine_spec import looping_model
from replayssm_jax.models import make_model
from replayssm_jax.serving import Engine, EngineConfig
from replayssm_jax.serving import engine as engine_module
from tests.test_serving import BASE, HYBRID, MAX_PROMPT, assert_same_cache, preempted
from tests.test_serving_spec import _schedule, _slot_view, _structure

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


@pytest.mark.filterwarnings("ignore:prefix caching is on")
@pytest.mark.parametrize("prefix_block", [0, 4], ids=["no_prefix_cache", "prefix_cache"])
def test_mtp_preempt_resume_is_bit_exact(model, tmp_path, prefix_block):
  config = dataclasses.replace(MTP, prefix_block=prefix_block)

  def start():
    engine = Engine(model, config)
    for i in range(4):
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, request_id=f"r{i}", num_drafts=DRAFTS[i],
                    **SUBMIT.get(i, {}))
    return engine

  full, expected, _, resumed = preempted(start, 3, tmp_path / "ckpt")
  assert resumed.config == config
  assert resumed.run() == expected
  assert_same_cache(full, resumed)


def _head_view(model, cache, slot, *, last_entry=True):
  """``_slot_view`` plus the MTP head's KV entries before the slot's position (``last_entry``
  False: but the last, which read the token after the covered ones) and its last hidden state."""
  view = _slot_view(model, cache, slot)
  end = view["position"] - (0 if last_entry else 1)
  view["mtp_k"] = np.asarray(cache.mtp.kv.k[slot, :end])
  view["mtp_v"] = np.asarray(cache.mtp.kv.v[slot, :end])
  view["mtp_last_hidden"] = np.asarray(cache.mtp.last_hidden[slot])
  return view


def _head_reference(model, tokens, *, last_entry=True):
  """``_head_view`` of one fresh prefill of ``tokens`` (padded to MAX_PROMPT) with the head."""
  cache = model.init_cache(1, buffer_len=BASE["buffer_len"], max_len=MAX_PROMPT, mtp_drafts=K)
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(tokens)] = tokens
  one, zero = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  prefill = engine_module._programs(*_structure(model)).prefill
  _, cache = prefill(jax.tree.leaves(nnx.state(model)), cache, jnp.asarray(padded), zero,
                     len(tokens) * one, zero.astype(jnp.float32), zero, resume=False, mtp=True)
  return _head_view(model, cache, 0, last_entry=last_entry)


def _assert_view(view, ref, what):
  assert view["position"] == ref["position"], what
  for name in ref:
    np.testing.assert_allclose(view[name], ref[name], atol=1e-4, rtol=0, err_msg=f"{what}: {name}")


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_mtp_prefix_snapshots_are_exact(model, overlap):
  # Given prefix caching in blocks of 4 with the MTP drafter: a 19-token prompt (block snapshots
  # at 4 .. 16) that decodes across 20, 24 and 28 (decode snapshots), synchronous or overlapped,
  config = dataclasses.replace(MTP, prefix_block=4, overlap=overlap)
  a = [16, 17, 18, 19] * 4 + [16, 17, 18]
  engine = Engine(model, config)
  ra = engine.submit(a, max_new_tokens=12)
  seen = {}
  while not engine.idle:
    engine.step()
    for key, slot in engine._snapshots.items():
      seen.setdefault(key, _head_view(model, engine.cache, slot, last_entry=False))
  gen_a = engine.outputs()[ra]
  full = a + gen_a
  # each snapshot seen after a step (as in test_serving_spec) holds (recurrent, conv and KV state,
  # the head's KV entries but the last, and its last hidden state) a fresh prefill of its key tokens,
  assert sorted(map(len, seen)) == [8, 12, 16, 20, 24, 28][0 if overlap else 1:]
  for key, view in seen.items():
    _assert_view(view, _head_reference(model, list(key), last_entry=False), f"snapshot of {len(key)}")
  # and requests admitted from them start from a whole-prompt prefill's head cache: c hits the
  # decode snapshot at 28, e the one at 24, after which its token differs from a's (the head's
  # entry at 23 is rewritten),
  c, e = full[:30], full[:24] + [7, 7]
  rc, re = engine.submit(c, max_new_tokens=3), engine.submit(e, max_new_tokens=5)
  engine._admit()
  for rid, prompt in ((rc, c), (re, e)):   # (both last entries read the greedy first token)
    _assert_view(_head_view(model, engine.cache, engine.stats(rid).slot),
                 _head_reference(model, prompt), f"request {rid} after admission")
  out = engine.run()
  assert (engine.stats(rc).prefix_hit_tokens, engine.stats(re).prefix_hit_tokens) == (28, 24)
  # with a cold run's tokens.
  cold = Engine(model, EngineConfig(**DRAFTING))
  ca, cc, ce = (cold.submit(p, max_new_tokens=n) for p, n in ((a, 12), (c, 3), (e, 5)))
  cold_out = cold.run()
  assert gen_a == cold_out[ca] and out[rc] == cold_out[cc] and out[re] == cold_out[ce]
  # A request without drafts is not snapshotted at a decode boundary (synchronous steps decode it
  # without the head while no drafting request runs): its prompt block (4) is cached, 8 is not.
  f = [3, 1, 4, 1, 5]
  engine.submit(f, max_new_tokens=6, num_drafts=0)
  engine.run()
  assert [len(key) for key in engine._snapshots if key[:4] == tuple(f[:4])] == [4]


def test_mtp_options_the_engine_refuses(model):
  with pytest.raises(ValueError, match="drafter='mtp' with num_drafts=0"):
    EngineConfig(drafter="mtp")
  with pytest.raises(ValueError, match="drafter='beam'"):
    EngineConfig(num_drafts=2, drafter="beam")
  with pytest.raises(ValueError, match="no multi-token-prediction head"):
    Engine(make_model(HYBRID, seed=0), MTP)
