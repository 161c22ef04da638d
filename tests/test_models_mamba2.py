"""Mamba2 mixer and Mamba2 / hybrid LMs (CPU, float32).

* Mamba2: prefill + step-by-step decode equals one prefill over the whole sequence, in replay and
  conventional mode, across many flushes (buffer_len 4); padding rows and padded positions are
  inert (a row in a mixed-length batch equals the same row run alone, and the prefilled state
  is bit-for-bit the state of the unpadded row).
* generate: greedy tokens agree between replay and conventional decode for 56 steps at
  buffer_len 4, for the all-Mamba2 and the hybrid (GDN / Mamba2) tiny LMs, and match a
  cache-free oracle.
* bad configs raise ValueError.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import replayssm_jax as rs
from replayssm_jax.models import (GatedDeltaNet, LMConfig, Mamba2, Mamba2Config, generate,
                                  make_model)
from replayssm_jax.models.mamba2 import Mamba2LayerCache

LAYER = Mamba2Config(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_dim=8)
ATOL = 1e-4


@pytest.fixture(scope="module")
def layer():
  return Mamba2(LAYER, rngs=nnx.Rngs(0))


def _x(shape, seed=1):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


@pytest.mark.parametrize("implementation", [None, "pallas_triton"])   # Triton: the conv step too
@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_layer_prefill_then_decode_equals_full_prefill(layer, replay, implementation):
  # Given a prompt of 9 tokens prefilled into sparse slots, then 23 tokens decoded one by one
  # with buffer_len 4 (5 flushes per row in replay mode),
  bsz, prompt, total, num_slots = 2, 9, 32, 5
  x = _x((bsz, total, LAYER.hidden_size))
  slots = jnp.array([3, 1], jnp.int32)
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=4)
  y_full, full_cache = layer.prefill(x, layer.init_cache(num_slots, cursor), slots,
                                     jnp.full((bsz,), total, jnp.int32), chunk_size=8)

  y0, cache = layer.prefill(x[:, :prompt], layer.init_cache(num_slots, cursor), slots,
                            jnp.full((bsz,), prompt, jnp.int32), chunk_size=8)
  assert isinstance(cache, Mamba2LayerCache)
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
  S = rs.mamba2.materialize(cache.bufs, cursor, slots)
  assert float(jnp.max(jnp.abs(S))) > 1e-2
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
  prefill = jax.jit(lambda x, cache, slots, lengths: layer.prefill(x, cache, slots, lengths, chunk_size=4))
  y, cache = prefill(x, layer.init_cache(3, cursor), slots, jnp.asarray(lengths))
  cursor = cursor.reset(slots)
  steps = _x((6, 4, LAYER.hidden_size), seed=2)
  step = jax.jit(lambda xt, cache, plan: layer.decode(xt, cache, plan, replay=replay))
  outs = []
  for t in range(6):
    plan = cursor.plan(slots)
    o, cache = step(steps[t], cache, plan)
    cursor = cursor.commit(plan) if replay else cursor
    outs.append(o)

  # Then each live row equals the same row run alone (prefill outputs, state, decode outputs),
  for b in range(3):
    n = int(lengths[b])
    c1 = rs.ReplayCursor.create(3, buffer_len=4)
    y1, cache1 = prefill(x[b:b + 1, :n], layer.init_cache(3, c1), jnp.array([b], jnp.int32),
                         jnp.array([n], jnp.int32))
    np.testing.assert_allclose(np.asarray(y[b, :n]), np.asarray(y1[0]), atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(y[b, n:]), 0.0)  # padded positions give zeros
    # The padded steps leave the state exactly unchanged: the same row padded (with garbage) to
    # T = 12 writes the same checkpoint bit for bit.
    cp = rs.ReplayCursor.create(3, buffer_len=4)
    _, cache_p = prefill(jnp.pad(x[b:b + 1, :n], ((0, 0), (0, 12 - n), (0, 0)), constant_values=3.0),
                         layer.init_cache(3, cp), jnp.array([b], jnp.int32), jnp.array([n], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache_p.bufs.state[b]), np.asarray(cache1.bufs.state[b]))
    alone = jnp.where(jnp.arange(4) == b, b, -1).astype(jnp.int32)
    c1 = c1.reset(alone)
    for t in range(6):
      plan = c1.plan(alone)
      o1, cache1 = step(steps[t], cache1, plan)
      c1 = c1.commit(plan) if replay else c1
      np.testing.assert_allclose(np.asarray(outs[t][b]), np.asarray(o1[b]), atol=ATOL, rtol=0)
  # and the padding row gives zeros and writes nothing.
  np.testing.assert_array_equal(np.asarray(y[3]), 0.0)
  np.testing.assert_array_equal(np.asarray(jnp.stack(outs)[:, 3]), 0.0)


def test_padded_step_is_exact_identity(layer):
  # The padding rule of prefill: raw dt = PAD_DT gives Δ = softplus(PAD_DT + dt_bias) = 0 exactly,
  # so with x = B = 0 one chunked step from any state returns that state bit for bit.
  from replayssm_jax.models import mamba2 as m2
  h, p, g, n = LAYER.num_heads, LAYER.head_dim, LAYER.num_groups, LAYER.state_dim
  S0 = _x((1, h, p, n), seed=5)
  zeros = lambda *s: jnp.zeros(s, jnp.float32)
  # Both step-size paths: softplus inside the op (default limit) and Δ clipped outside it.
  clipped = m2.Mamba2(dataclasses.replace(LAYER, dt_limit=(0.01, 0.05)), rngs=nnx.Rngs(0))
  for mixer in (layer, clipped):
    A, D, dt, dt_bias, softplus = mixer._ssm_params(_x((1, 3, h), seed=7), jnp.zeros((1, 3), bool))
    assert softplus == (mixer is layer)
    _, S = rs.mamba2.chunked(zeros(1, 3, h, p), dt, A, zeros(1, 3, g, n), _x((1, 3, g, n), seed=6),
                             D=D, dt_bias=dt_bias, dt_softplus=softplus, initial_state=S0)
    np.testing.assert_array_equal(np.asarray(S), np.asarray(S0))


def test_dt_limit_clips_the_step_size_in_prefill_and_decode():
  """Δ = clip(softplus(dt + dt_bias), lo, hi): a layer with a limit gives other outputs than one
  without, and its prefill equals its step-by-step decode (the clip is applied on both paths)."""
  from replayssm_jax.models import mamba2 as m2
  x = _x((1, 6, LAYER.hidden_size), seed=8)
  plain = m2.Mamba2(LAYER, rngs=nnx.Rngs(1))
  clipped = m2.Mamba2(dataclasses.replace(LAYER, dt_limit=(0.02, 0.03)), rngs=nnx.Rngs(1))
  slots, lengths = jnp.array([0], jnp.int32), jnp.array([6], jnp.int32)
  outs = {}
  for name, mixer in (("plain", plain), ("clipped", clipped)):
    cursor = rs.ReplayCursor.create(2, buffer_len=4)
    y, _ = mixer.prefill(x, mixer.init_cache(2, cursor), slots, lengths)
    cache, steps = mixer.init_cache(2, cursor), []
    for t in range(6):
      plan = cursor.plan(slots)
      yt, cache = mixer.decode(x[:, t], cache, plan)
      cursor = cursor.commit(plan)
      steps.append(yt)
    np.testing.assert_allclose(np.asarray(jnp.stack(steps, 1)), np.asarray(y), rtol=2e-4, atol=2e-5)
    outs[name] = np.asarray(y)
  assert np.abs(outs["plain"] - outs["clipped"]).max() > 1e-3


PROMPTS = np.random.RandomState(0).randint(1, 256, (3, 12)).astype(np.int32)
LENGTHS = np.array([12, 4, 9], np.int32)


@pytest.mark.parametrize("preset", ["tiny_mamba2", "tiny_hybrid"])
def test_generate_greedy_replay_equals_conventional(preset):
  config = getattr(LMConfig, preset)()
  model = make_model(config, seed=0)
  kinds = [type(b.mixer) for b in model.blocks]
  assert kinds == ([Mamba2, Mamba2] if preset == "tiny_mamba2" else [GatedDeltaNet, Mamba2])
  # Given greedy generation of 56 tokens with buffer_len 4 (13 flushes per row),
  new = 56
  a, na = generate(model, PROMPTS, LENGTHS, max_new_tokens=new, replay=True, buffer_len=4)
  b, nb = generate(model, PROMPTS, LENGTHS, max_new_tokens=new, replay=False, buffer_len=4)
  # Then replay and conventional decode emit the same tokens,
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(na), new)
  np.testing.assert_array_equal(np.asarray(nb), new)
  assert len(np.unique(np.asarray(a))) > 10  # not a degenerate constant stream
  # and they are the argmax of one cache-free prefill over prompt + generated tokens (all rows in
  # one right-padded batch).
  seqs = np.zeros((3, PROMPTS.shape[1] + new), np.int32)
  for r in range(3):
    n = int(LENGTHS[r])
    seqs[r, :n + new] = np.concatenate([PROMPTS[r, :n], np.asarray(a[r])])
  logits, _ = model.prefill(jnp.asarray(seqs), model.init_cache(3), jnp.arange(3, dtype=jnp.int32),
                            jnp.asarray(LENGTHS + new))
  for r in range(3):
    n = int(LENGTHS[r])
    oracle = np.asarray(jnp.argmax(logits[r, n - 1:n - 1 + new], axis=-1))
    np.testing.assert_array_equal(np.asarray(a[r]), oracle)


def test_presets_and_default_layer_types():
  assert LMConfig.tiny().layer_types == ("gdn", "gdn")
  assert LMConfig.tiny_mamba2().layer_types == ("mamba2", "mamba2")
  assert LMConfig.tiny_hybrid(num_layers=4).layer_types == ("gdn", "mamba2", "gdn", "mamba2")
  assert LMConfig.tiny(layer_types=["mamba2", "gdn"]).layer_types == ("mamba2", "gdn")


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=3, num_groups=2), "num_groups"),
    (dict(num_heads=0), "num_heads"),
    (dict(head_dim=2.0), "head_dim"),
    (dict(state_dim=True), "state_dim"),
    (dict(conv_kernel=1), "conv_kernel"),
    (dict(rms_eps=0.0), "rms_eps"),
    (dict(dtype=jnp.int32), "dtype"),
], ids=["groups", "heads-0", "float-dim", "bool-dim", "kernel-1", "eps-0", "int-dtype"])
def test_bad_mamba2_config(kwargs, match):
  fields = dict(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_dim=8)
  fields.update(kwargs)
  with pytest.raises(ValueError, match=match):
    Mamba2Config(**fields)


def test_bad_lm_config_and_inputs(layer):
  with pytest.raises(ValueError, match="layer_types"):
    LMConfig.tiny(layer_types=("gdn",))            # wrong length
  with pytest.raises(ValueError, match="layer_types"):
    LMConfig.tiny(layer_types=("gdn", "attention"))
  with pytest.raises(ValueError, match="layer_types"):
    LMConfig.tiny(layer_types="mamba2")
  with pytest.raises(ValueError, match="num_groups"):
    LMConfig.tiny_mamba2(mamba2_num_heads=3, mamba2_num_groups=2)
  LMConfig.tiny(mamba2_num_heads=3, mamba2_num_groups=2)  # unused Mamba2 fields are not checked
  with pytest.raises(ValueError, match="Mamba2Config"):
    Mamba2(LMConfig.tiny().mixer(), rngs=nnx.Rngs(0))
  cursor = rs.ReplayCursor.create(2)
  with pytest.raises(ValueError, match="x has shape"):
    layer.prefill(_x((1, 4, 7)), layer.init_cache(2, cursor), jnp.zeros((1,), jnp.int32),
                  jnp.array([4], jnp.int32))
  with pytest.raises(ValueError, match="Mamba2LayerCache"):
    gdn_layer = GatedDeltaNet(LMConfig.tiny(hidden_size=32).mixer(), rngs=nnx.Rngs(0))
    layer.decode(_x((1, 32)), gdn_layer.init_cache(2, cursor), cursor.plan(jnp.zeros((1,), jnp.int32)))
