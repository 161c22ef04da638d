"""Seeded random schedules of the serving engine against the plain engine (CPU, float32).

Each seed draws 1–5 greedy requests (prompts that repeat a block of four ids, so the n-gram
drafter hits, or random ids; some start with an earlier request's prompt, or its prompt and
tokens, so prefix caching hits), their join steps, per-request draft counts (the engine's k or
fewer, 0 included), stop tokens taken from the plain stream, and the engine's options: ReplaySSM or
conventional verify, k = 1–3 drafts, overlapped or synchronous steps, prefix caching on or off
and a preempt → resume at a random step. Models: test_serving_spec's looping hybrid (GDN,
attention, MoE) and a Mamba2 / attention / GDN stack made to loop the same way. Every request must
get the plain synchronous engine's tokens exactly, cut after its stop token: the features that
the other serving tests check one or two at a time, combined.
"""
import numpy as np
import pytest

from bench.engine_spec import looping_model
from replayssm_jax.models import LMConfig, make_model
from replayssm_jax.serving import EngineConfig
from tests.test_serving import HYBRID, MAX_PROMPT
from tests.test_serving_spec import _schedule

# One pool shape and bucket for every engine here: the plain and drafting engines of a model and
# verify mode share their compiled programs across seeds.
POOL = dict(max_running=3, batch_buckets=(4,), buffer_len=4, prefix_slots=3)
MAMBA2_HYBRID = LMConfig.tiny_mamba2(max_prompt_len=MAX_PROMPT, num_layers=3,
                                     layer_types=("mamba2", "attention", "gdn"),
                                     attention=HYBRID.attention)
SEEDS = range(12)


@pytest.fixture(scope="module")
def models():
  return {"hybrid": looping_model(make_model(HYBRID, seed=0), mixer_scale=0.15),
          "mamba2": looping_model(make_model(MAMBA2_HYBRID, seed=0), mixer_scale=0.15)}


def _run(model, config, prompts, new, drafts=None, joins=None, stops=None, **preempt):
  """Tokens per request of ``test_serving_spec._schedule`` (greedy; stop tokens ``stops[i]``;
  ``preempt``: its ``preempt_at`` and ``directory``)."""
  n = len(prompts)
  submit = {i: dict(stop_tokens=stop) for i, stop in enumerate(stops or [()] * n)}
  return _schedule(model, config, joins or [0] * n, submit, prompts=prompts, new=new,
                   drafts=drafts or [None] * n, options={}, **preempt)[0]


@pytest.mark.parametrize("seed", SEEDS)
def test_random_schedule_equals_plain_greedy(models, seed, tmp_path):
  rng = np.random.RandomState(seed)
  kind = ("hybrid", "mamba2")[rng.randint(2)]
  model = models[kind]
  replay = bool(rng.rand() < 0.7)
  plain_config = EngineConfig(**POOL, replay=replay, overlap=False)
  prompts, new = [], []
  for i in range(rng.randint(1, 6)):
    length = rng.randint(1, MAX_PROMPT - 4)
    block = rng.randint(1, 60) * 4
    prompt = ([block + j % 4 for j in range(length)] if rng.rand() < 0.5
              else rng.randint(1, 256, length).tolist())
    if i and rng.rand() < 0.4:
      # An earlier request's prompt, or its prompt and generated tokens, first: prefix-cache hits
      # on prompt blocks and on blocks a drafting request's accepted runs completed.
      j = rng.randint(i)
      earlier = prompts[j]
      if rng.rand() < 0.5:
        earlier = earlier + _run(model, plain_config, [earlier], [new[j]])[0]
      prompt = (earlier + prompt)[:MAX_PROMPT - 4]
    prompts.append(prompt)
    new.append(int(rng.randint(1, 16)))
  n = len(prompts)
  plain = _run(model, plain_config, prompts, new)

  k = int(rng.randint(1, 4))
  drafts = [None if rng.rand() < 0.5 else int(rng.randint(0, k + 1)) for _ in range(n)]
  stops = [(plain[i][rng.randint(len(plain[i]))],) if rng.rand() < 0.4 else () for i in range(n)]
  joins = [int(rng.randint(0, 6)) for _ in range(n)]
  config = EngineConfig(**POOL, replay=replay, num_drafts=k, overlap=bool(rng.rand() < 0.5),
                        prefix_block=int(rng.choice([0, 8])))
  preempt_at = int(rng.randint(1, 10)) if rng.rand() < 0.4 else None

  got = _run(model, config, prompts, new, drafts, joins, stops, preempt_at=preempt_at,
             directory=tmp_path / "ckpt")
  want = [tokens[:tokens.index(stop[0]) + 1] if stop else tokens
          for tokens, stop in zip(plain, stops)]
  assert got == want, (f"seed {seed}: {kind} replay={replay} k={k} drafts={drafts} joins={joins} "
                       f"{config} preempt_at={preempt_at}")
