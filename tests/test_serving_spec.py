"""Speculative decoding in the serving engine (CPU, float32), on test_serving's tiny hybrid of
GatedDeltaNet, attention (KV cache) and MoE layers with a "looping" head (test_models_spec: greedy
streams fall into short cycles, so the n-gram drafts hit) and test_serving's pool shape. (Mamba2
and GDN-only stacks: test_models_spec runs their speculative generate, ReplaySSM and conventional.)

* With 3 drafts per step, requests asking for 0 and 1 drafts sharing the steps as 1- and 2-token
  lanes and requests joining at other steps, every request gets the tokens of the engine without
  drafting (greedy; and a sampled 1-token-lane request its sampled tokens); a stop token inside
  an accepted run and ``max_new_tokens`` cut exactly; one verify program, compiled once.
  (test_serving shows that the engine's tokens are ``generate``'s.)
* Prefix caching with drafting, ReplaySSM and conventional verify (state stacks): every snapshot
  (prompt blocks, forced-flush lanes, runs of accepted drafts that end on a boundary) equals a
  fresh prefill of its key tokens (recurrent state, conv state, KV entries, position), and the
  tokens — of the drafting request and of requests that hit its snapshots — are a cold run's.
* Preempt → resume with drafting, sampling and prefix caching continues bit for bit; a sampled
  drafting request gets the same tokens alone.
* ``NgramDrafter`` proposes what ``ngram_drafts`` proposes; bad options raise ValueError.
"""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bench.engine_spec import looping_model
import replayssm_jax as rs
from replayssm_jax.models import make_model
from replayssm_jax.models import _stack_verify
from replayssm_jax.models.attention import AttentionLayerCache
from replayssm_jax.models.gated_deltanet import GdnLayerCache
from replayssm_jax.serving import Engine, EngineConfig
from replayssm_jax.serving import engine as engine_module
from replayssm_jax.serving.drafter import NgramDrafter
from tests.test_serving import BASE, HYBRID, MAX_PROMPT, assert_same_cache, preempted

generate_module = importlib.import_module("replayssm_jax.models.generate")

K = 3
PLAIN = EngineConfig(**BASE)
# Drafting engines run every step in the 4-row bucket (padding rows included): one verify
# program per T to compile; PLAIN shares test_serving's programs.
DRAFTING = BASE | dict(batch_buckets=(4,))
SPEC = EngineConfig(**DRAFTING, num_drafts=K, overlap=False)   # synchronous drafting
RNG = np.random.RandomState(1)
# Prompt 0 holds the cycle its greedy stream follows (drafts hit from the first step), 2 enters a
# cycle after a few tokens, 1 and 3 are random.
PROMPTS = [[200, 201, 202, 203] * 2 + [200], RNG.randint(1, 256, 12).tolist(),
           [5, 9, 100, 101, 102, 103, 100, 101], RNG.randint(1, 256, 3).tolist()]
NEW = [14, 11, 16, 9]
DRAFTS = [None, 0, 1, None]     # per-request num_drafts (None: the engine's K)
# r1 samples; the looping head is peaked, so at temperature 8 about one draw in ten leaves the
# cycle (below: r1's tokens are not its greedy ones).
SUBMIT = {1: dict(temperature=8.0, seed=5)}


@pytest.fixture(scope="module")
def model():
  # (its four layers weigh more against the embedding than test_models_spec's one or two: a
  # smaller scale for similar cycles)
  return looping_model(make_model(HYBRID, seed=0), mixer_scale=0.15)


@pytest.fixture(scope="module")
def plain(model):
  """Tokens of the engine without drafting (all four requests in one run; r1 samples), and the
  greedy ones of all four."""
  engine = Engine(model, PLAIN)
  ids = [engine.submit(p, max_new_tokens=n, **SUBMIT.get(i, {}))
         for i, (p, n) in enumerate(zip(PROMPTS, NEW))]
  greedy = [engine.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, NEW)]
  out = engine.run()
  return [out[i] for i in ids], [out[i] for i in greedy]


def _schedule(model, config, joins, submit=None, *, prompts=PROMPTS, new=NEW, drafts=DRAFTS,
              options=SUBMIT, preempt_at=None, directory=None):
  """Submits request i (``prompts[i]``, ``new[i]`` tokens, ``drafts[i]`` drafts, ``options``
  updated by ``submit``) at step joins[i]; with ``preempt_at`` the engine is preempted to
  ``directory`` and resumed before that step (if it still runs). Returns (tokens per request,
  engine)."""
  submit = {i: options.get(i, {}) | (submit or {}).get(i, {}) for i in range(len(prompts))}
  engine = Engine(model, config)
  step, pending = 0, list(range(len(prompts)))
  while pending or not engine.idle:
    for i in [i for i in pending if joins[i] <= step]:
      engine.submit(prompts[i], max_new_tokens=new[i], num_drafts=drafts[i], request_id=f"r{i}",
                    **submit[i])
      pending.remove(i)
    if step == preempt_at and not engine.idle:
      engine.preempt(directory)
      engine = Engine.resume(directory)
    engine.step()
    step += 1
  out = engine.outputs()
  return [out[f"r{i}"] for i in range(len(prompts))], engine


def test_speculative_greedy_equals_plain_greedy(model, plain, monkeypatch):
  plain, greedy = plain
  assert plain[1] != greedy[1] and plain[0] == greedy[0]
  programs, shapes = engine_module._programs, []     # the (bucket, T) of every verify step
  jitted = programs(*_structure(model)).verify

  def recording(*args, **kwargs):
    shapes.append(args[2].shape)
    return jitted(*args, **kwargs)
  monkeypatch.setattr(engine_module, "_programs",
                      lambda *key: dataclasses.replace(programs(*key), verify=recording))
  assert plain[0][:3] == [201, 202, 203]    # prompt 0's stream continues its cycle for 3 tokens
  # Given drafting with requests joining at different steps (r3 waits for a slot),
  tokens, engine = _schedule(model, SPEC, [0, 0, 1, 2])
  # then every request gets the plain tokens — greedy, and r1's sampled ones (keys by position:
  # a 1-token lane draws as a decode step does) — max_new_tokens exactly,
  assert tokens == plain
  stats = [engine.stats(f"r{i}") for i in range(4)]
  assert all(s.generated_tokens == n for s, n in zip(stats, NEW))
  # drafts hit (r0's first step accepts two or three), the 0-draft request never drafted and the
  # 1-draft request drafted one per step, in steps of 4 rows and T = 4 (one program),
  assert stats[0].accepted_drafts >= 2 and sum(s.accepted_drafts for s in stats) >= 2 * K
  assert stats[1].drafted_tokens == 0 and 0 < stats[2].drafted_tokens <= NEW[2] - 1
  assert set(shapes) == {(4, K + 1)}
  # and a stop token inside an accepted run (r0's second token: lane 0 of its first step, whose
  # lane 1 accepts too) ends the request right there. Once r0 and r3 are done, only the 0- and
  # 1-draft requests run: steps of T = 2, the one new program that schedule compiles.
  seen, before = set(shapes), jitted._cache_size()
  cut, _ = _schedule(model, SPEC, [0, 0, 1, 2], {0: dict(stop_tokens=(plain[0][1],))})
  assert cut[0] == plain[0][:2] and cut[1:] == plain[1:]
  assert set(shapes) - seen == {(4, 2)} and jitted._cache_size() == before + 1


def test_read_copy_drafting_equals_read_copy_plain(model):
  """EngineConfig(read_copy_dtype=) with drafts: steps without drafts decode from the read copy,
  verify steps read the float32 checkpoint and write the copy with it. The looping head's margins
  are far above the copy's rounding, so the greedy tokens are those of the engine with a read copy
  and no drafts; drafts hit; every slot's copy is its rounded checkpoint at the end."""
  tokens = {}
  for drafts in (0, K):
    config = EngineConfig(**DRAFTING, num_drafts=drafts, overlap=False, read_copy_dtype="bfloat16")
    engine = Engine(model, config)
    for i in (0, 2):
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i], request_id=f"r{i}")
    tokens[drafts] = engine.run()
  assert tokens[K] == tokens[0]
  assert engine.stats("r0").accepted_drafts >= 2
  for lc in engine.cache.layers:
    if isinstance(lc, GdnLayerCache):
      np.testing.assert_array_equal(np.asarray(lc.bufs.read_copy.astype(jnp.float32)),
                                    np.asarray(lc.bufs.state.astype(jnp.bfloat16).astype(jnp.float32)))


def test_overlapped_drafting_equals_synchronous_drafting(model, plain, tmp_path, monkeypatch):
  plain, _ = plain
  chained = []                       # per speculative dispatch: from the device carry?
  dispatch = Engine._speculate

  def recording(self, reqs, live, carry=None):
    chained.append(carry is not None)
    return dispatch(self, reqs, live, carry)
  monkeypatch.setattr(Engine, "_speculate", recording)
  overlapped = EngineConfig(**DRAFTING, num_drafts=K)   # the default: overlapped steps
  assert overlapped.overlapped
  # Given overlapped steps drafted on the device, requests joining at different steps,
  sync, sync_engine = _schedule(model, SPEC, [0, 0, 1, 2])
  tokens, engine = _schedule(model, overlapped, [0, 0, 1, 2])
  # then every request gets the plain tokens with the synchronous engine's drafts (the device
  # drafter proposes what the host drafter does), and steps were chained on the device wherever
  # no request waited (7 of 18 here: r3 waits for a slot);
  assert tokens == plain == sync
  for i in range(4):
    a, b = engine.stats(f"r{i}"), sync_engine.stats(f"r{i}")
    assert (a.drafted_tokens, a.accepted_drafts) == (b.drafted_tokens, b.accepted_drafts), i
  assert sum(chained) >= len(chained) // 3 and not all(chained)
  # a stop token inside an accepted run ends the request there, as synchronously,
  stop = {0: dict(stop_tokens=(plain[0][1],))}
  assert (_schedule(model, overlapped, [0, 0, 1, 2], stop)[0]
          == _schedule(model, SPEC, [0, 0, 1, 2], stop)[0])
  # and a preempt with a step in flight collects it first: the resumed engine finishes exactly.
  def start():
    engine = Engine(model, overlapped)
    for i in range(4):
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, num_drafts=DRAFTS[i],
                    request_id=f"r{i}", **SUBMIT.get(i, {}))
    return engine
  _, expected, _, resumed = preempted(start, 3, tmp_path / "ckpt")
  assert resumed.run() == expected


def test_overlapped_drafting_needs_the_history_to_fit_max_seq_len():
  gdn_only = make_model(rs.models.LMConfig.tiny(max_prompt_len=MAX_PROMPT), seed=0)
  engine = Engine(gdn_only, EngineConfig(**DRAFTING, num_drafts=K, max_seq_len=40))
  with pytest.raises(ValueError, match="exceeds max_seq_len=40, the device token history of "
                                       "overlapped drafting per request .* or overlap=False"):
    engine.submit([1, 2, 3], max_new_tokens=38)
  engine.submit([1, 2, 3], max_new_tokens=37)
  Engine(gdn_only, EngineConfig(**DRAFTING, num_drafts=K, max_seq_len=40, overlap=False)).submit(
      [1, 2, 3], max_new_tokens=38)   # synchronous drafting keeps no device history


def _structure(model):
  """The key of the engine's programs for ``model``: (graphdef, parameter treedef)."""
  graphdef, params = nnx.split(model)
  return graphdef, jax.tree.structure(params)


def _slot_view(model, cache, slot):
  """Everything that makes a slot's sequence state: per layer the exact recurrent state
  (checkpoint ⊕ window, or the stack entry), the conv state, the KV entries before the
  position; and the position."""
  slots = jnp.array([slot], jnp.int32)
  pos = int(cache.positions[slot])
  view = {"position": pos}
  stacks = cache.stacks or (None,) * len(cache.layers)
  for i, (lc, stack) in enumerate(zip(cache.layers, stacks)):
    if isinstance(lc, AttentionLayerCache):
      view[f"k{i}"], view[f"v{i}"] = np.asarray(lc.k[slot, :pos]), np.asarray(lc.v[slot, :pos])
      continue
    ops = rs.gdn if isinstance(lc, GdnLayerCache) else rs.mamba2
    state = (ops.materialize(lc.bufs, cache.cursor, slots) if stack is None
             else _stack_verify.current_state(stack, cache.read_index, slots))
    view[f"state{i}"], view[f"conv{i}"] = np.asarray(state[0]), np.asarray(lc.conv_state[slot])
  return view


def _reference_view(model, tokens):
  """_slot_view of a fresh prefill of ``tokens`` (one slot, padded to MAX_PROMPT: one compile)."""
  leaves = jax.tree.leaves(nnx.state(model))
  cache = model.init_cache(1, buffer_len=BASE["buffer_len"], max_len=MAX_PROMPT)
  padded = np.zeros((1, MAX_PROMPT), np.int32)
  padded[0, :len(tokens)] = tokens
  one, zero = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  prefill = engine_module._programs(*_structure(model)).prefill
  _, cache = prefill(leaves, cache, jnp.asarray(padded), zero, len(tokens) * one,
                     zero.astype(jnp.float32), zero, resume=False)
  return _slot_view(model, cache, 0)


def _snapshots_of_a_drafting_run(model, prompt, *, replay, overlap, num_drafts=K):
  """Runs ``prompt`` (12 new tokens) through an engine drafting ``num_drafts`` with prefix caching
  in blocks of 4; returns (engine, request id, {key: _slot_view of each snapshot when first seen after a
  step}, [ring window length of each decode snapshot])."""
  config = EngineConfig(**DRAFTING, prefix_block=4, num_drafts=num_drafts, replay=replay,
                        overlap=overlap)
  engine = Engine(model, config)
  rid = engine.submit(prompt, max_new_tokens=12)
  seen, kinds = {}, []
  while not engine.idle:
    engine.step()
    for key, slot in engine._snapshots.items():
      if key not in seen:
        seen[key] = _slot_view(model, engine.cache, slot)
        if len(key) > len(prompt):
          kinds.append(int(engine.cache.cursor.count[slot]))
  return engine, rid, seen, kinds


@pytest.mark.parametrize("replay,overlap", [(True, False), (False, False), (True, True)],
                         ids=["replay", "conventional", "replay_overlapped"])
def test_prefix_snapshots_with_drafting_are_exact(model, replay, overlap):
  # Given prefix caching in blocks of 4 with drafting (3 snapshot slots, LRU): a 19-token prompt
  # (snapshots at 4 .. 16) that decodes across 20, 24 and 28 (decode snapshots), with
  # synchronous or overlapped steps (the device holds a row that reaches a boundary for a step),
  a = [16, 17, 18, 19] * 4 + [16, 17, 18]               # both models' streams continue the cycle
  engine, ra, seen, kinds = _snapshots_of_a_drafting_run(model, a, replay=replay, overlap=overlap)
  gen_a = engine.outputs()[ra]
  # every snapshot seen after a step (a synchronous first step prefills and decodes: 4 and 8 are
  # evicted in it; an overlapped one only dispatches its decode) equals, when it was made, a
  # prefill of its key tokens — overlapped, with the ring windows of the synchronous run's (the
  # device cuts drafts and forces flushes as the host does; with 1 draft, where a forced flush is
  # not also the T = 4 lane's natural one at L = 4),
  assert sorted(map(len, seen)) == [8, 12, 16, 20, 24, 28][0 if overlap else 1:]
  if overlap:
    windows = [_snapshots_of_a_drafting_run(model, a, replay=replay, overlap=o, num_drafts=1)[3]
               for o in (False, True)]
    assert windows[0] == windows[1] and min(windows[0]) == 0 < max(windows[0]), windows
  for key, view in seen.items():
    ref = _reference_view(model, list(key))
    assert view["position"] == ref["position"] == len(key)
    for name in ref:
      np.testing.assert_allclose(view[name], ref[name], atol=1e-4, rtol=0, err_msg=f"{len(key)}: {name}")
  # (with ReplaySSM, decode snapshots of both kinds: a forced-flush lane leaves an empty window,
  # a run of accepted drafts that ends on the boundary keeps its window)
  if replay:
    assert min(kinds) == 0 < max(kinds), kinds
  # and requests that hit the decode snapshots (d leaves the cycle: drafts are rejected) get the
  # tokens of a cold run without drafting, as a does.
  full = a + gen_a
  c, d = full[:29], full[:25] + [7]
  rc, rd = engine.submit(c, max_new_tokens=3), engine.submit(d, max_new_tokens=6)
  out = engine.run()
  assert (engine.stats(rc).prefix_hit_tokens, engine.stats(rd).prefix_hit_tokens) == (28, 24)
  assert engine.stats(rd).accepted_drafts < engine.stats(rd).drafted_tokens
  cold = Engine(model, PLAIN)
  ca, cc, cd = (cold.submit(a, max_new_tokens=12), cold.submit(c, max_new_tokens=3),
                cold.submit(d, max_new_tokens=6))
  cold_out = cold.run()
  assert gen_a == cold_out[ca] and out[rc] == cold_out[cc] and out[rd] == cold_out[cd]


@pytest.mark.filterwarnings("ignore:prefix caching is on")
@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_preempt_resume_with_drafting_is_bit_exact(model, plain, tmp_path, overlap):
  # Given drafting, prefix caching and a sampled drafting request (r2),
  config = EngineConfig(**DRAFTING, prefix_block=4, num_drafts=K, overlap=overlap)
  sampled = dict(temperature=8.0, seed=7, num_drafts=K)

  def start():
    engine = Engine(model, config)
    for i in range(4):  # r3 waits for a slot: it is still queued when we preempt
      opts = sampled if i == 2 else dict(num_drafts=DRAFTS[i])
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, request_id=f"r{i}", **opts)
    return engine

  full, expected, _, resumed = preempted(start, 3, tmp_path / "ckpt")
  assert resumed.outputs()["r3"] == [] and resumed.config == config
  # then the resumed engine continues bit for bit (tokens and every cache array),
  assert resumed.run() == expected
  assert_same_cache(full, resumed)
  # and the sampled request alone gets its tokens of the shared run (which are not greedy).
  alone = Engine(model, config)
  rid = alone.submit(PROMPTS[2], max_new_tokens=NEW[2] + 4, **sampled)
  assert alone.run()[rid] == expected["r2"]
  assert expected["r2"][:NEW[2]] != plain[1][2] and full.stats("r2").accepted_drafts > 0


def test_ngram_drafter_equals_ngram_drafts():
  rng = np.random.RandomState(0)
  history = rng.randint(0, 4, (6, 40)).astype(np.int32)   # vocabulary 4: n-grams recur
  for n in (1, 2, 3):
    drafters = [NgramDrafter(row[:1].tolist(), ngram=n) for row in history]
    for length in range(1, 41):
      expected = generate_module.ngram_drafts(jnp.asarray(history), jnp.full((6,), length, jnp.int32),
                                              num_drafts=5, ngram=n)
      assert [d.drafts(5) for d in drafters] == np.asarray(expected).tolist(), (n, length)
      for d, row in zip(drafters, history):
        d.extend(row[length:length + 1].tolist())


def test_boundary_rule_is_one_rule_on_host_and_device():
  """The draft cut and boundary flush the host applies per request (Python ints) are what the
  overlapped step applies per row (int32 arrays under jit), at every length, budget and block."""
  n, drafts, remaining = (a.ravel() for a in np.meshgrid(np.arange(0, 40), np.arange(0, 5),
                                                          np.arange(0, 6), indexing="ij"))
  for block, max_prompt_len in ((0, 32), (4, 32), (8, 20), (5, 5)):
    rule = dict(block=block, max_prompt_len=max_prompt_len)
    on_device = jax.jit(lambda n, d, r: (
        engine_module._draft_limit(n, d, r, **rule, xp=jnp), engine_module._on_boundary(n, **rule)))
    limit, boundary = (np.asarray(x) for x in on_device(*(jnp.asarray(a, jnp.int32)
                                                           for a in (n, drafts, remaining))))
    host = [(int(engine_module._draft_limit(int(a), int(d), int(r), **rule)),
             bool(engine_module._on_boundary(int(a), **rule))) for a, d, r in zip(n, drafts, remaining)]
    assert host == list(zip(limit.tolist(), boundary.tolist())), rule
    # What the rule is: no run passes the budget nor, with a block, the next boundary below
    # max_prompt_len.
    for (k, at), a, d, r in zip(host, n, drafts, remaining):
      assert 0 <= k <= min(d, max(r - 1, 0))
      nxt = -(-a // block) * block if block else None
      if block and nxt < max_prompt_len:
        assert a + k <= nxt
      assert at == bool(block and a % block == 0 and a < max_prompt_len)


def test_speculative_bad_options(model):
  with pytest.raises(ValueError, match="num_drafts=8; expected at most 7"):
    EngineConfig(num_drafts=8)
  with pytest.raises(ValueError, match="buffer_len=3 with num_drafts=3"):
    EngineConfig(num_drafts=3, buffer_len=3)
  with pytest.raises(ValueError, match="ngram=0"):
    EngineConfig(num_drafts=2, ngram=0)
  assert EngineConfig().buffer_len == 16 and EngineConfig(num_drafts=3).buffer_len == 8
  engine = Engine(model, SPEC)
  for bad in (K + 1, -1, 1.5):
    with pytest.raises(ValueError, match=rf"num_drafts={bad}; expected None or an int in \[0, {K}\]"):
      engine.submit([1, 2], max_new_tokens=4, num_drafts=bad)
  with pytest.raises(ValueError, match=r"num_drafts=1; expected None or an int in \[0, 0\]"):
    Engine(model, PLAIN).submit([1, 2], max_new_tokens=4, num_drafts=1)
  with pytest.raises(ValueError, match="ngram=0"):
    NgramDrafter([1], ngram=0)
  # A conventional-verify cache steps through verify(replay=False) only.
  stacked = model.init_cache(2, buffer_len=4, max_draft=1, max_len=8, verify_stacks=True)
  tokens, slots = jnp.ones((2, 2), jnp.int32), jnp.arange(2, dtype=jnp.int32)
  with pytest.raises(ValueError, match="replay=True but the cache was made with verify_stacks=True"):
    model.verify(tokens, stacked, slots)
  with pytest.raises(ValueError, match="replay=False but the cache was made with verify_stacks=False"):
    model.verify(tokens, model.init_cache(2, buffer_len=4, max_draft=1, max_len=8), slots, replay=False)
  with pytest.raises(ValueError, match="verify stacks"):
    model.decode(tokens[:, 0], stacked, slots)
