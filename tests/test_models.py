"""Flax layers and the jitted decode loop (CPU, float32).

* GatedDeltaNet: prefill + step-by-step decode equals one prefill over the whole sequence, in
  replay and conventional mode, across many flushes (buffer_len 4); padding rows and padded
  positions are inert (a row in a mixed-length batch equals the same row run alone).
* generate: greedy tokens agree between replay and conventional decode for 70 steps and with a
  cache-free oracle (argmax of one full prefill over prompt + generated tokens); sampling is
  reproducible per seed; stop tokens; one compilation across prompts and lengths; bad inputs.
"""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from replayssm_jax.models import (GatedDeltaNet, GatedDeltaNetConfig, LMConfig, generate,
                                  make_model)

generate_module = importlib.import_module("replayssm_jax.models.generate")

LAYER = GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8)
ATOL = 1e-4


@pytest.fixture(scope="module")
def layer():
  return GatedDeltaNet(LAYER, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def model():
  return make_model(LMConfig.tiny(), seed=0)


def _x(shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


@pytest.mark.parametrize("implementation", [None, "pallas_triton"])   # Triton: the conv step too
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_layer_prefill_then_decode_equals_full_prefill(layer, replay, implementation):
  # Given a prompt of 9 tokens prefilled into sparse slots, then 23 tokens decoded one by one
  # with buffer_len 4 (5 natural flushes per row in replay mode),
  bsz, prompt, total, num_slots = 2, 9, 32, 5
  x = _x((bsz, total, LAYER.hidden_size))
  slots = jnp.array([3, 1], jnp.int32)
  full_len = jnp.full((bsz,), total, jnp.int32)
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=4)
  y_full, full_cache = layer.prefill(x, layer.init_cache(num_slots, cursor), slots, full_len)

  y0, cache = layer.prefill(x[:, :prompt], layer.init_cache(num_slots, cursor), slots,
                            jnp.full((bsz,), prompt, jnp.int32))
  cursor = cursor.reset(slots)
  step = jax.jit(lambda xt, cache, plan: layer.decode(xt, cache, plan, replay=replay,
                                                         implementation=implementation))
  ys, flushes = [y0], 0
  for t in range(prompt, total):
    plan = cursor.plan(slots)
    flushes += int(plan.flush.sum())
    y, cache = step(x[:, t], cache, plan)
    if replay:
      cursor = cursor.commit(plan)
    ys.append(y[:, None])

  # Then every output matches the single prefill, and so do the final state and conv state.
  np.testing.assert_allclose(np.asarray(jnp.concatenate(ys, 1)), np.asarray(y_full), atol=ATOL, rtol=0)
  assert float(jnp.max(jnp.abs(y_full))) > 0.1  # outputs are not trivially zero
  S = rs.gdn.materialize(cache.bufs, cursor, slots)
  np.testing.assert_allclose(np.asarray(S), np.asarray(full_cache.bufs.state[slots]), atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.asarray(cache.conv_state), np.asarray(full_cache.conv_state), atol=ATOL)
  if replay:
    assert flushes == bsz * ((total - prompt) // 4)  # the ring really cycled
  else:
    assert int(cursor.count.max()) == 0  # conventional mode never used the ring


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_layer_padding_is_inert(layer, replay):
  # Given rows of lengths 5, 11, 2 right-padded to 12 with garbage in the padding, plus a padding
  # row (slot -1),
  lengths = np.array([5, 11, 2, 7], np.int32)
  slots = jnp.array([0, 1, 2, -1], jnp.int32)
  x = _x((4, 12, LAYER.hidden_size))
  cursor = rs.ReplayCursor.create(3, buffer_len=4)
  y, cache = layer.prefill(x, layer.init_cache(3, cursor), slots, jnp.asarray(lengths))
  cursor = cursor.reset(slots)
  steps = _x((6, 4, LAYER.hidden_size), seed=2)
  outs = []
  for t in range(6):
    plan = cursor.plan(slots)
    o, cache = layer.decode(steps[t], cache, plan, replay=replay)
    cursor = cursor.commit(plan) if replay else cursor
    outs.append(o)

  # Then each live row equals the same row run alone (prefill outputs, decode outputs),
  # (alone: prefilled unpadded at T = n; decoded with every other row a padding row, which keeps
  # the compiled decode shapes of the mixed batch),
  for b in range(3):
    n = int(lengths[b])
    c1 = rs.ReplayCursor.create(3, buffer_len=4)
    y1, cache1 = layer.prefill(x[b:b + 1, :n], layer.init_cache(3, c1), jnp.array([b], jnp.int32),
                               jnp.array([n], jnp.int32))
    np.testing.assert_allclose(np.asarray(y[b, :n]), np.asarray(y1[0]), atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(y[b, n:]), 0.0)  # padded positions give zeros
    alone = jnp.where(jnp.arange(4) == b, b, -1).astype(jnp.int32)
    c1 = c1.reset(alone)
    for t in range(6):
      plan = c1.plan(alone)
      o1, cache1 = layer.decode(steps[t], cache1, plan, replay=replay)
      c1 = c1.commit(plan) if replay else c1
      np.testing.assert_allclose(np.asarray(outs[t][b]), np.asarray(o1[b]), atol=ATOL, rtol=0)
  # and the padding row gives zeros.
  np.testing.assert_array_equal(np.asarray(y[3]), 0.0)
  np.testing.assert_array_equal(np.asarray(jnp.stack(outs)[:, 3]), 0.0)


PROMPTS = np.random.RandomState(0).randint(1, 256, (3, 12)).astype(np.int32)
LENGTHS = np.array([12, 4, 9], np.int32)


def test_generate_greedy_replay_equals_conventional_and_oracle(model):
  # Given greedy generation of 70 tokens with buffer_len 4 (17 flushes per row),
  new = 70
  a, na = generate(model, PROMPTS, LENGTHS, max_new_tokens=new, replay=True, buffer_len=4)
  b, nb = generate(model, PROMPTS, LENGTHS, max_new_tokens=new, replay=False, buffer_len=4)
  # Then replay and conventional decode emit the same tokens,
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(na), new)
  np.testing.assert_array_equal(np.asarray(nb), new)
  assert len(np.unique(np.asarray(a))) > 10  # not a degenerate constant stream
  # and they are the argmax of one cache-free prefill over prompt + generated tokens.
  for r in range(3):
    n = int(LENGTHS[r])
    seq = np.concatenate([PROMPTS[r, :n], np.asarray(a[r])])[None].astype(np.int32)
    cache = model.init_cache(1)
    logits, _ = model.prefill(jnp.asarray(seq), cache, jnp.zeros((1,), jnp.int32),
                              jnp.array([seq.shape[1]], jnp.int32))
    oracle = np.asarray(jnp.argmax(logits[0, n - 1:n - 1 + new], axis=-1))
    np.testing.assert_array_equal(np.asarray(a[r]), oracle)
  # The head at chosen positions only (logits_at) is the full head there.
  at = jnp.asarray(LENGTHS - 1, jnp.int32)
  full, _ = model.prefill(PROMPTS, model.init_cache(3), jnp.arange(3, dtype=jnp.int32), LENGTHS)
  last, _ = model.prefill(PROMPTS, model.init_cache(3), jnp.arange(3, dtype=jnp.int32), LENGTHS, logits_at=at)
  np.testing.assert_allclose(np.asarray(last), np.asarray(full)[np.arange(3), np.asarray(at)], rtol=1e-6, atol=1e-6)


def test_flush_all_decode_equals_conventional(model):
  """LM.decode with flush_all (the small-batch policy) between ordinary replay steps: logits equal
  conventional decode's at every step, windows empty after each flush_all step."""
  slots = jnp.array([1, -1, 0], jnp.int32)
  caches = {}
  for replay in (True, False):
    cache = model.init_cache(2, buffer_len=4)
    _, caches[replay] = model.prefill(jnp.asarray(PROMPTS[:, :6]), cache, jnp.array([1, 2, 0], jnp.int32),
                                      jnp.array([6, 6, 6], jnp.int32))
  tok = jnp.array([5, 7, 9], jnp.int32)
  for t in range(7):
    flush_all = t in (2, 3, 5)
    a, caches[True] = model.decode(tok, caches[True], slots, flush_all=flush_all)
    b, caches[False] = model.decode(tok, caches[False], slots, replay=False)
    live = np.asarray(slots) >= 0
    np.testing.assert_allclose(np.asarray(a)[live], np.asarray(b)[live], atol=2e-5, rtol=0)
    if flush_all:
      assert np.all(np.asarray(caches[True].cursor.count) == 0)
    tok = jnp.argmax(b, -1).astype(jnp.int32)
  assert model._small_batch(caches[True], 1) is False   # CPU: the policy never turns itself on


def test_small_batch_policy_switch(model, monkeypatch):
  """On a GPU the policy turns on below config.replay_min_batch (GDN: 32, either state dtype;
  Mamba2 f32: 32; bf16: 32 at L >= 16, 128 at L >= 8, else 256); a hybrid takes the smaller
  threshold. Never on CPU."""
  assert model._small_batch(model.init_cache(1), 1) is False
  monkeypatch.setattr(importlib.import_module("replayssm_jax.pallas.common"), "device_kind",
                      lambda: "NVIDIA H200")
  f32, bf16 = model.init_cache(1), model.init_cache(1, state_dtype=jnp.bfloat16)
  assert [model._small_batch(f32, b) for b in (1, 31, 32, 256)] == [True, True, False, False]
  assert [model._small_batch(bf16, b) for b in (1, 31, 32, 128)] == [True, True, False, False]
  m2 = make_model(LMConfig.tiny_mamba2(), seed=0)
  assert [m2._small_batch(m2.init_cache(1, buffer_len=8), b) for b in (31, 32)] == [True, False]
  assert [m2._small_batch(m2.init_cache(1), b) for b in (31, 32, 256)] == [True, False, False]
  m2_bf16 = lambda L: m2.init_cache(1, buffer_len=L, state_dtype=jnp.bfloat16)
  assert [m2._small_batch(m2_bf16(16), b) for b in (31, 32)] == [True, False]
  assert [m2._small_batch(m2_bf16(8), b) for b in (127, 128)] == [True, False]
  assert [m2._small_batch(m2_bf16(4), b) for b in (128, 255, 256)] == [True, True, False]
  hybrid = make_model(LMConfig.tiny_hybrid(), seed=0)
  assert [hybrid._small_batch(hybrid.init_cache(1), b) for b in (31, 32)] == [True, False]
  with pytest.raises(ValueError, match="family"):
    config_lib.replay_min_batch(device_kind="NVIDIA H200", state_dtype=jnp.float32, buffer_len=8,
                               family="mlp")


def test_generate_sampling_is_reproducible(model):
  kw = dict(max_new_tokens=16, temperature=1.0, buffer_len=4)
  a, _ = generate(model, PROMPTS, LENGTHS, seed=7, **kw)
  b, _ = generate(model, PROMPTS, LENGTHS, seed=7, **kw)
  c, _ = generate(model, PROMPTS, LENGTHS, seed=8, **kw)
  greedy, _ = generate(model, PROMPTS, LENGTHS, max_new_tokens=16, buffer_len=4)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(c))
  assert not np.array_equal(np.asarray(a), np.asarray(greedy))


def test_generate_stop_tokens(model):
  # Given the greedy stream, pick row 0's 4th token as the stop token.
  base, _ = generate(model, PROMPTS, LENGTHS, max_new_tokens=16, buffer_len=4)
  base = np.asarray(base)
  stop = int(base[0, 3])
  out, num = generate(model, PROMPTS, LENGTHS, max_new_tokens=16, buffer_len=4, stop_tokens=(stop,))
  out, num = np.asarray(out), np.asarray(num)
  for r in range(3):
    hits = np.flatnonzero(base[r] == stop)
    n = int(hits[0]) + 1 if hits.size else 16  # the stop token is emitted and counted
    assert num[r] == n
    np.testing.assert_array_equal(out[r, :n], base[r, :n])
    np.testing.assert_array_equal(out[r, n:], generate_module.PAD_TOKEN)
  assert num[0] <= 4


def test_generate_compiles_once(model):
  # A fresh static configuration (max_new_tokens=5), then a second call with other prompts,
  # lengths and prompt width: exactly one new compilation of prefill + decode loop.
  jitted = generate_module._generate_jit
  before = jitted._cache_size()
  generate(model, PROMPTS, LENGTHS, max_new_tokens=5, buffer_len=4)
  other = np.random.RandomState(1).randint(0, 256, (3, 30)).astype(np.int32)
  generate(model, other, np.array([30, 1, 17], np.int32), max_new_tokens=5, buffer_len=4)
  assert jitted._cache_size() == before + 1


@pytest.mark.parametrize("prompts, lengths, match", [
    (np.zeros((2, 65), np.int32), np.array([3, 3], np.int32), "prompts"),       # > max_prompt_len 64
    (np.zeros((2, 8), np.float32), np.array([3, 3], np.int32), "prompts"),      # wrong dtype
    (np.zeros((2, 8), np.int64), np.array([3, 3], np.int32), "prompts"),
    (np.full((2, 8), 256, np.int32), np.array([3, 3], np.int32), "prompts"),    # id >= vocab
    (np.zeros((2, 8), np.int32), np.array([3, 3], np.int64), "lengths"),
    (np.zeros((2, 8), np.int32), np.array([3, 9], np.int32), "lengths"),        # > T
    (np.zeros((2, 8), np.int32), np.array([0, 3], np.int32), "lengths"),
    (np.zeros((2, 8), np.int32), np.array([3], np.int32), "lengths"),
], ids=["too-long", "float", "int64", "vocab", "lengths-int64", "lengths>T", "lengths-0", "lengths-shape"])
def test_generate_bad_inputs(model, prompts, lengths, match):
  with pytest.raises(ValueError, match=match):
    generate(model, prompts, lengths, max_new_tokens=4)


def test_bad_options_and_configs(model, layer):
  ok = (PROMPTS, LENGTHS)
  with pytest.raises(ValueError, match="max_new_tokens"):
    generate(model, *ok, max_new_tokens=0)
  with pytest.raises(ValueError, match="temperature"):
    generate(model, *ok, max_new_tokens=2, temperature=-1.0)
  with pytest.raises(ValueError, match="stop_tokens"):
    generate(model, *ok, max_new_tokens=2, stop_tokens=(999,))
  with pytest.raises(ValueError, match="num_v_heads"):
    GatedDeltaNetConfig(hidden_size=8, num_k_heads=3, num_v_heads=4, head_k_dim=4, head_v_dim=4)
  with pytest.raises(ValueError, match="x has shape"):
    cursor = rs.ReplayCursor.create(2)
    layer.prefill(_x((1, 4, 7)), layer.init_cache(2, cursor), jnp.zeros((1,), jnp.int32),
                  jnp.array([4], jnp.int32))


def test_multipliers_default_to_identity_round_trip_and_are_validated():
  """Granite's embedding / residual multipliers and logits scaling: 1.0 by default, kept by the
  JSON round trip a preempted engine writes (``to_dict`` / ``from_dict``), bad values refused."""
  import json
  plain = LMConfig.tiny()
  assert (plain.embedding_multiplier, plain.residual_multiplier, plain.logits_scaling) == (1.0, 1.0, 1.0)
  scaled = LMConfig.tiny(embedding_multiplier=12, residual_multiplier=0.22, logits_scaling=8.0)
  assert scaled.embedding_multiplier == 12.0 and isinstance(scaled.embedding_multiplier, float)
  assert LMConfig.from_dict(json.loads(json.dumps(scaled.to_dict()))) == scaled
  for name, value in (("embedding_multiplier", 0.0), ("residual_multiplier", -1.0),
                      ("logits_scaling", float("inf")), ("logits_scaling", True)):
    with pytest.raises(ValueError, match=f"{name}={value!r}; expected a finite float > 0"):
      LMConfig.tiny(**{name: value})


def test_parallel_blocks_share_one_input_and_keep_two_cache_entries():
  """Falcon-H1's parallel block (Mamba2 + attention on one normed input, outputs added): its two
  caches sit side by side in ``cache.layers``; prefill + decode (replay and conventional), prefill
  with ``resume``, ``copy_slots``, and ReplaySSM / conventional speculative verify + commit all equal
  one full prefill; the config survives the JSON round trip (the sum itself is checked against
  transformers by the Falcon-H1 parity tests)."""
  import json
  from replayssm_jax.models.attention import AttentionConfig, AttentionLayerCache
  from replayssm_jax.models.mamba2 import Mamba2LayerCache
  attention = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=8, rope_theta=1e4)
  config = LMConfig.tiny_mamba2(num_layers=3, layer_types=("parallel", "gdn", "parallel"), attention=attention,
                                mamba2_norm="norm_then_gate", embedding_multiplier=3.0, max_prompt_len=16)
  assert LMConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  model = make_model(config, seed=0)
  assert [type(m).__name__ for m in model.mixers] == ["Mamba2", "Attention", "GatedDeltaNet", "Mamba2", "Attention"]
  seq = jnp.asarray(PROMPTS[:1, :12])
  one, zero = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
  full, _ = model.prefill(seq, model.init_cache(2, max_len=32), one, jnp.array([12], jnp.int32))
  close = lambda a, b, what: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0, err_msg=what)

  def head(t, max_draft=0, verify_stacks=False):   # slot 1 holds the first t tokens
    cache = model.init_cache(2, buffer_len=4, max_len=32, max_draft=max_draft, verify_stacks=verify_stacks)
    return model.prefill(seq[:, :t], cache, one, jnp.array([t], jnp.int32))[1]

  cache = head(5)
  assert [type(lc) for lc in cache.layers] == [Mamba2LayerCache, AttentionLayerCache, type(cache.layers[2]),
                                              Mamba2LayerCache, AttentionLayerCache]
  for replay in (True, False):
    c = head(5)
    for t in range(5, 12):
      logits, c = model.decode(seq[:, t], c, one, replay=replay)
      close(logits[0], full[0, t], f"decode token {t}, replay={replay}")
  logits, c = model.prefill(seq[:, 5:], head(5), one, jnp.array([7], jnp.int32), resume=True)
  close(logits[0], full[0, 5:], "prefill resume")
  c = model.copy_slots(head(5), jnp.array([1], jnp.int32), zero)
  logits, _ = model.prefill(seq[:, 5:], c, zero, jnp.array([7], jnp.int32), resume=True)
  close(logits[0], full[0, 5:], "resume on a copied slot")
  for replay in (True, False):   # verify 4 tokens, accept 2, then verify the rest
    c = head(5, max_draft=3, verify_stacks=not replay)
    logits, step = model.verify(seq[:, 5:9], c, one, replay=replay)
    close(logits[0], full[0, 5:9], f"verify, replay={replay}")
    c = model.commit(step, jnp.array([2], jnp.int32))
    logits, step = model.verify(seq[:, 7:11], c, one, replay=replay)
    close(logits[0], full[0, 7:11], f"verify after a rollback, replay={replay}")
