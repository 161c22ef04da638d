"""The serving engine (``replayssm_jax.serving``), CPU, float32, replay decode, on two tiny models:
a GatedDeltaNet LM and a hybrid of GatedDeltaNet, attention (KV cache) and MoE layers.

* The engine's greedy tokens are ``generate``'s.
* Continuous batching: requests that join while others run, finish at different steps and land
  in other slots / batch rows get exactly the tokens they get when run alone.
* Preempt → Orbax checkpoint → resume continues bit for bit (tokens and every cache array).
* Prefix caching: a hit on a prompt-block snapshot and on a decode-boundary snapshot (forced
  flush: the snapshot's ring window is empty) gives the tokens of a cold run; a cache that never
  hits warns; bad prompts, sampling options, configs and damaged or mismatched checkpoints raise
  ValueError.
"""
import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from replayssm_jax.models import LMConfig, generate, make_model
from replayssm_jax.models.attention import AttentionConfig
from replayssm_jax.models.moe import MoEConfig
from replayssm_jax.serving import Engine, EngineConfig
from replayssm_jax.serving import engine as engine_module

MAX_PROMPT = 32
# One pool shape (3 request + 3 prefix slots) and one buffer_len everywhere: every engine in this
# module shares the same compiled programs.
BASE = dict(max_running=3, batch_buckets=(1, 2, 4), buffer_len=4, prefix_slots=3)
CFG = EngineConfig(**BASE, overlap=False)   # synchronous steps; OVERLAP below is the default
PREFIX = EngineConfig(**BASE, prefix_block=8)
RNG = np.random.RandomState(0)
PROMPTS = [RNG.randint(1, 256, n).tolist() for n in (5, 12, 3, 9)]
NEW = [6, 11, 14, 8]


HYBRID = LMConfig.tiny(
    max_prompt_len=MAX_PROMPT, num_layers=4, layer_types=("gdn", "attention", "gdn", "attention"),
    mlp_types=("dense", "moe", "dense", "dense"),
    attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, qk_norm=True,
                              norm_offset=1.0, output_gate=True),
    moe=MoEConfig(hidden_size=64, num_experts=4, top_k=2, expert_intermediate_size=32,
                  shared_intermediate_size=32, shared_expert_gate=True))


@pytest.fixture(scope="module", params=["gdn", "hybrid"])
def model(request):
  config = LMConfig.tiny(max_prompt_len=MAX_PROMPT) if request.param == "gdn" else HYBRID
  return make_model(config, seed=0)


def test_engine_tokens_are_generates(model, solo):
  for p, n, tokens in zip(PROMPTS, NEW, solo):
    out, num = generate(model, np.asarray([p], np.int32), np.asarray([len(p)], np.int32),
                        max_new_tokens=n, buffer_len=BASE["buffer_len"])
    assert np.asarray(out[0, :int(num[0])]).tolist() == tokens


@pytest.fixture(scope="module")
def solo(model):
  """Each request run alone."""
  out = []
  for p, n in zip(PROMPTS, NEW):
    engine = Engine(model, CFG)
    rid = engine.submit(p, max_new_tokens=n)
    out.append(engine.run()[rid])
  return out


def _run_schedule(model, order, joins, config=CFG):
  """Submits PROMPTS[i] for i in ``order`` at step ``joins[i]``; returns (tokens, slots) per request."""
  engine = Engine(model, config)
  step, pending = 0, list(order)
  while pending or not engine.idle:
    for i in [i for i in pending if joins[i] <= step]:
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i], request_id=f"r{i}")
      pending.remove(i)
    engine.step()
    step += 1
  out = engine.outputs()
  return [out[f"r{i}"] for i in range(4)], [engine.stats(f"r{i}").slot for i in range(4)], engine


def test_join_finish_and_slot_permutations_match_solo(model, solo):
  assert all(len(t) == n for t, n in zip(solo, NEW)) and len(set(map(tuple, solo))) == 4
  # Run A: three start together (max_running 3), r3 joins at step 2 and waits for a free slot.
  a, slots_a, engine = _run_schedule(model, [0, 1, 2, 3], [0, 0, 0, 2])
  # Run B: reversed order, staggered joins: other slots, other batch rows, other buckets.
  b, slots_b, _ = _run_schedule(model, [3, 2, 1, 0], [3, 1, 0, 0])
  assert slots_a != slots_b
  assert a == solo and b == solo
  st = engine.stats("r2")
  assert st.generated_tokens == NEW[2] and st.prompt_tokens == 3 and st.time_to_first_token_s > 0
  assert st.decode_tokens_per_s > 0 and st.total_s >= st.time_to_first_token_s


def test_stop_tokens_and_sampling_are_per_request(model, solo):
  stop = solo[1][3]
  engine = Engine(model, CFG)
  r1 = engine.submit(PROMPTS[1], max_new_tokens=NEW[1], stop_tokens=(stop,))
  r0 = engine.submit(PROMPTS[0], max_new_tokens=NEW[0])
  s1 = engine.submit(PROMPTS[2], max_new_tokens=8, temperature=1.0, seed=5)
  out = engine.run()
  assert out[r1] == solo[1][:solo[1].index(stop) + 1] and out[r0] == solo[0]
  engine = Engine(model, CFG)
  s2 = engine.submit(PROMPTS[2], max_new_tokens=8, temperature=1.0, seed=5)  # alone, other slot mix
  assert engine.run()[s2] == out[s1] != solo[2][:8]


OVERLAP = EngineConfig(**BASE)


def test_overlapped_steps_emit_the_same_tokens(model, solo, tmp_path, monkeypatch):
  # Per decode: were its input tokens the previous decode's output (chained on the device)?
  programs, tokens_given, outputs = engine_module._programs, [], []

  def recording(*key):
    decode = programs(*key).decode

    def wrapped(*args, **kwargs):
      tokens_given.append(any(args[2] is out for out in outputs))
      nxt, cache = decode(*args, **kwargs)
      outputs[:] = [nxt]
      return nxt, cache
    return dataclasses.replace(programs(*key), decode=wrapped)
  # Given overlapped steps (step t + 1 dispatched from step t's device tokens) in the schedules
  # of the join test: requests joining, waiting for a slot, finishing at different steps,
  _, _, sync = _run_schedule(model, [0, 1, 2, 3], [0, 0, 0, 2])
  compiled = sync._programs.decode._cache_size()
  monkeypatch.setattr(engine_module, "_programs", recording)
  a, _, _ = _run_schedule(model, [0, 1, 2, 3], [0, 0, 0, 2], OVERLAP)
  # (host and device tokens share the synchronous schedule's compiled steps),
  assert sync._programs.decode._cache_size() == compiled
  b, _, _ = _run_schedule(model, [3, 2, 1, 0], [3, 1, 0, 0], OVERLAP)
  monkeypatch.undo()
  # then every request gets its solo tokens, and most steps were chained on the device.
  assert a == solo and b == solo
  assert sum(tokens_given) > len(tokens_given) / 2 and not all(tokens_given)
  # Stop tokens (a chained row computes past its stop: nobody reads it) and sampling agree with
  # synchronous steps,
  def submit_three(config):
    engine = Engine(model, config)
    ids = [engine.submit(PROMPTS[1], max_new_tokens=NEW[1], stop_tokens=(solo[1][3],)),
           engine.submit(PROMPTS[0], max_new_tokens=NEW[0]),
           engine.submit(PROMPTS[2], max_new_tokens=8, temperature=1.0, seed=5)]
    return engine, ids
  (sync, ids), (over, over_ids) = submit_three(CFG), submit_three(OVERLAP)
  expected, got = sync.run(), over.run()
  assert [got[i] for i in over_ids] == [expected[i] for i in ids]
  assert got[over_ids[0]] == solo[1][:4]
  # and a preempt with a step in flight collects it first: the resumed engine finishes exactly.
  def start():
    engine = Engine(model, OVERLAP)
    for i in range(4):
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, request_id=f"r{i}")
    return engine
  _, expected, engine, resumed = preempted(start, 5, tmp_path / "ckpt")
  assert resumed.run() == expected


def test_overlap_is_the_default():
  assert OVERLAP.overlapped and not CFG.overlapped and PREFIX.overlapped
  assert EngineConfig(**BASE, num_drafts=2).overlapped
  assert EngineConfig(**BASE, prefix_block=8, num_drafts=2).overlapped
  assert not EngineConfig(**BASE, overlap=False, num_drafts=2).overlapped
  with pytest.raises(ValueError, match="overlap=1; expected None or a bool"):
    EngineConfig(**BASE, overlap=1)


def preempted(start, steps, directory):
  """``start()`` makes an engine with its requests queued. Returns (an engine run to the end, its
  tokens, an engine preempted to ``directory`` after ``steps`` steps, and its resumed twin)."""
  full = start()
  expected = full.run()
  engine = start()
  for _ in range(steps):
    engine.step()
  engine.preempt(directory)
  return full, expected, engine, Engine.resume(directory)


def assert_same_cache(a: Engine, b: Engine):
  for x, y in zip(jax.tree.leaves(a.cache), jax.tree.leaves(b.cache)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_preempt_resume_is_bit_exact(model, tmp_path):
  def start():
    engine = Engine(model, CFG)
    for i in range(4):  # r3 waits for a slot: it is still queued when we preempt
      engine.submit(PROMPTS[i], max_new_tokens=NEW[i] + 4, request_id=f"r{i}")
    return engine

  full, expected, engine, resumed = preempted(start, 5, tmp_path / "ckpt")
  assert resumed._programs is engine._programs
  programs = lambda: [f._cache_size() for f in (engine._programs.prefill, engine._programs.decode)]
  with pytest.raises(RuntimeError, match="preempted"):
    engine.step()
  assert not resumed.idle and resumed.outputs()["r3"] == []
  compiled = programs()
  assert resumed.run() == expected
  # with the programs the first engine compiled (restored arrays are committed like the engine's),
  assert programs() == compiled
  assert_same_cache(full, resumed)


PREFIX_SYNC = dataclasses.replace(PREFIX, overlap=False)


@pytest.mark.parametrize("config", [PREFIX_SYNC, PREFIX], ids=["synchronous", "overlapped"])
def test_prefix_reuse_matches_cold_run(model, config):
  shared = RNG.randint(1, 256, 16).tolist()
  a = shared + [7, 9, 11]                              # 19 tokens: snapshots at 8 and 16
  engine = Engine(model, config)
  ra = engine.submit(a, max_new_tokens=12)
  while not engine.idle:                                # decode crosses 24: forced flush + snapshot
    engine.step()
  gen_a = engine.outputs()[ra]
  snap = engine._snapshots[tuple((a + gen_a)[:24])]
  # With L = 4 the natural flushes fold at 23, 27, ... (prefill ends at 19), so at 24 the window
  # would hold one entry; the forced flush left it empty.
  assert int(engine.cache.cursor.count[snap]) == 0
  b = shared + [3, 5, 8]                               # hits the 16-token prompt snapshot
  c = (a + gen_a)[:25]                                 # hits the 24-token decode snapshot
  rb = engine.submit(b, max_new_tokens=10)
  rc = engine.submit(c, max_new_tokens=6)
  out = engine.run()
  assert (engine.stats(rb).prefix_hit_tokens, engine.stats(rc).prefix_hit_tokens) == (16, 24)
  assert engine.prefix_hits == 2 and engine.prefix_lookups == 3

  cold = Engine(model, CFG)
  cb, cc = cold.submit(b, max_new_tokens=10), cold.submit(c, max_new_tokens=6)
  cold_out = cold.run()
  assert out[rb] == cold_out[cb] and out[rc] == cold_out[cc]
  assert out[rc] == gen_a[6:12]                         # c continues a's own stream


def test_overlapped_prefix_caching_equals_synchronous(model, solo, tmp_path):
  # Given prefix caching in blocks of 4 (3 snapshot slots: evictions), requests that cross
  # decode boundaries (r0: 11 + 14 tokens crosses 12, 16, ..., 28), share a prompt prefix (r2
  # hits r0's 8-token prompt snapshot), join late on a decode snapshot (r3: r0's prompt and first
  # two tokens hit its 12-token decode snapshot), stop early (r4 at its 4th token), and a preempt
  # with an overlapped step in flight,
  block = dataclasses.replace(PREFIX, prefix_block=4)
  shared = RNG.randint(1, 256, 9).tolist()
  prompts = [shared + [1, 2], PROMPTS[0], shared + [4]]

  def run(config, preempt_dir=None):
    engine = Engine(model, config)
    for i, (p, n) in enumerate(zip(prompts, [14, 12, 3])):   # r2 frees its slot for r3
      engine.submit(p, max_new_tokens=n, request_id=f"r{i}")
    for _ in range(3):
      engine.step()
    engine.submit(prompts[0] + engine.outputs()["r0"][:2], max_new_tokens=9, request_id="r3")
    engine.submit(PROMPTS[2], max_new_tokens=8, stop_tokens=(solo[2][3],), request_id="r4")
    if preempt_dir is not None:
      engine.step()
      assert engine._inflight is not None
      engine.preempt(preempt_dir)
      engine = Engine.resume(preempt_dir)
    return engine.run(), engine

  expected, sync = run(dataclasses.replace(block, overlap=False))
  assert expected["r4"] == solo[2][:4] and sync.prefix_hits == 2
  assert (sync.stats("r2").prefix_hit_tokens, sync.stats("r3").prefix_hit_tokens) == (8, 12)
  # overlapped steps give the same tokens, snapshots (prefix → slot) and snapshot slots (every
  # pool array past the request slots, up to float32 rounding: a row that finishes in flight is a
  # padding row of the next step, so some steps run other batch widths; a request slot differs
  # where r4 ran a step past its stop),
  got, over = run(block)
  assert over.config.overlapped and got == expected
  assert over._snapshots == sync._snapshots and over.prefix_hits == sync.prefix_hits
  n, first = block.num_slots, block.max_running
  for x, y in zip(jax.tree.leaves(sync.cache), jax.tree.leaves(over.cache)):
    if x.ndim and x.shape[0] == n:
      np.testing.assert_allclose(np.asarray(x)[first:], np.asarray(y)[first:], rtol=1e-5,
                                 atol=1e-6)
  # also across a preempt with a step in flight.
  got, resumed = run(block, tmp_path / "ckpt")
  assert got == expected and resumed._snapshots == sync._snapshots


def test_prefix_cache_that_never_hits_warns(model):
  engine = Engine(model, PREFIX)
  engine.submit(RNG.randint(1, 256, 12).tolist(), max_new_tokens=2)
  engine.submit(RNG.randint(1, 256, 10).tolist(), max_new_tokens=2)
  with pytest.warns(RuntimeWarning, match="0 of 2 prompt lookups hit"):
    engine.run()


def test_bad_inputs(model):
  engine = Engine(model, CFG)
  with pytest.raises(ValueError, match="prompt has 33 tokens; expected 1 to max_prompt_len = 32"):
    engine.submit(list(range(1, 34)), max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt has 0 tokens"):
    engine.submit([], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompt holds ids in \[1, 256\]"):
    engine.submit([1, 256], max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    engine.submit([1], max_new_tokens=0)
  engine.submit([1], max_new_tokens=1, request_id="x")
  with pytest.raises(ValueError, match="already submitted"):
    engine.submit([1], max_new_tokens=1, request_id="x")
  with pytest.raises(ValueError, match="batch_buckets"):
    EngineConfig(max_running=4, batch_buckets=(1, 2))
  with pytest.raises(ValueError, match="prefix_slots"):
    EngineConfig(prefix_block=8)
  with pytest.raises(ValueError, match="prefix_block=64 exceeds max_prompt_len=32"):
    Engine(model, EngineConfig(prefix_block=64, prefix_slots=1))
  with pytest.raises(ValueError, match=r"prompt=\[1.5, 2\]; expected a flat sequence of integer token ids"):
    engine.submit([1.5, 2], max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt=.*expected a flat sequence"):
    engine.submit([[1, 2], [3, 4]], max_new_tokens=4)
  with pytest.raises(ValueError, match="stop_tokens=.*expected a flat sequence"):
    engine.submit([1, 2], max_new_tokens=4, stop_tokens=(0.5,))
  for bad in (float("nan"), float("inf"), -1.0):
    with pytest.raises(ValueError, match="temperature=.*expected a finite float >= 0"):
      engine.submit([1, 2], max_new_tokens=4, temperature=bad)
  with pytest.raises(ValueError, match="seed=-1"):
    engine.submit([1, 2], max_new_tokens=4, seed=-1)


def test_kv_capacity_is_checked_at_submit():
  model = make_model(HYBRID, seed=0)
  engine = Engine(model, EngineConfig(**BASE, max_seq_len=40))
  engine.submit(list(range(1, 31)), max_new_tokens=10)               # 30 + 10 = 40 fits
  with pytest.raises(ValueError, match="exceeds max_seq_len=40, the KV cache capacity"):
    engine.submit(list(range(1, 31)), max_new_tokens=11)
  with pytest.raises(ValueError, match="leaves no room to generate"):
    Engine(model, EngineConfig(**BASE, max_seq_len=32))


def test_resume_of_a_damaged_directory_names_the_file(tmp_path):
  with pytest.raises(ValueError, match="has no engine.json"):
    Engine.resume(tmp_path)
  (tmp_path / "engine.json").write_text('{"model_config": {')
  with pytest.raises(ValueError, match=r"engine.json is not a valid engine state .*JSONDecodeError"):
    Engine.resume(tmp_path)
  (tmp_path / "engine.json").write_text('{"model_config": {"vocab_size": 3}}')
  with pytest.raises(ValueError, match=r"engine.json is not a valid engine state"):
    Engine.resume(tmp_path)


def test_resume_of_a_missing_or_mismatched_cache_says_so(model, tmp_path):
  engine = Engine(model, CFG)
  engine.submit([1, 2, 3], max_new_tokens=2)
  engine.preempt(tmp_path)
  written = (tmp_path / "engine.json").read_text()
  state = json.loads(written)
  state["engine_config"]["buffer_len"] = 8     # rings of another length than those saved
  (tmp_path / "engine.json").write_text(json.dumps(state))
  with pytest.raises(ValueError, match=r"the saved cache does not match the model and engine config "
                                       r"of its engine.json .*: layers\.0\.bufs\.ring_g saved as "):
    Engine.resume(tmp_path)
  (tmp_path / "engine.json").write_text(written)
  shutil.rmtree(tmp_path / "cache")
  with pytest.raises(ValueError, match="cache holds no checkpoint written by Engine.preempt"):
    Engine.resume(tmp_path)


@pytest.mark.parametrize("num_drafts", [0, 2])
def test_read_copy_engine(model, tmp_path, num_drafts):
  """EngineConfig(read_copy_dtype=), without and with drafts: requests run to their exact lengths,
  prefix snapshots and preempt/resume keep every slot's read copy equal to its rounded checkpoint;
  conventional decode refuses the option."""
  import jax.numpy as jnp
  config = dataclasses.replace(PREFIX_SYNC, read_copy_dtype="bfloat16", num_drafts=num_drafts)
  shared = RNG.randint(1, 256, 16).tolist()   # a common prefix: the later requests hit its snapshot

  def start():
    engine = Engine(model, config)
    for i in range(4):
      engine.submit(shared + PROMPTS[i], max_new_tokens=NEW[i], request_id=f"r{i}")
    return engine

  full, expected, _, resumed = preempted(start, 5, tmp_path / "ckpt")
  assert [len(expected[f"r{i}"]) for i in range(4)] == NEW
  assert resumed.run() == expected
  for engine in (full, resumed):
    layers = [lc for lc in engine.cache.layers if hasattr(lc, "bufs")]
    assert layers
    for lc in layers:
      np.testing.assert_array_equal(np.asarray(lc.bufs.read_copy.astype(jnp.float32)),
                                    np.asarray(lc.bufs.state.astype(jnp.bfloat16).astype(jnp.float32)))
  with pytest.raises(ValueError, match="replay=False"):
    EngineConfig(**BASE, read_copy_dtype="bfloat16", replay=False)
