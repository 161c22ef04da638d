"""The attention mixer and its slot-pool KV cache (``models.attention``), CPU, float32.

Oracle: a float64 numpy step loop written from the math in the module docstring (grouped-query
causal attention, rotate-half partial rotary, q/k RMSNorm with offset, sigmoid output gate), fed
with the layer's own weights. Cache behaviour: prefill of right-padded prompts, decode, resume,
speculative verify with rollback by position, padding rows that write nothing, stale and
non-finite entries past a slot's position that never reach an output, and the overflow check.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax.models import LMConfig, make_model
from replayssm_jax.models.attention import Attention, AttentionConfig, AttentionLayerCache, rotary

D = 32
CONFIGS = {
    "qwen": AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, rope_theta=1e4,
                            qk_norm=True, norm_offset=1.0, output_gate=True),
    "nemotron": AttentionConfig(num_heads=4, num_kv_heads=1, head_dim=8, rotary_dim=0, bias=True),
}


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _layer(config, seed=0):
  layer = Attention(config, hidden_size=D, dtype=jnp.float32, rms_eps=1e-6, rngs=nnx.Rngs(seed))
  rng = np.random.RandomState(seed + 7)
  for _, var in nnx.iter_graph(layer):
    if isinstance(var, nnx.Param) and var.ndim == 1:   # norms and biases away from their inits
      var.set_value(var[...] + jnp.asarray(rng.uniform(-0.5, 0.5, var.shape), jnp.float32))
  return layer


def _w(p):
  return np.asarray(p[...], np.float64)


def _reference(layer, xs):
  """float64 outputs [T, D] of one sequence xs [T, D] (positions 0..T-1)."""
  c = layer.config
  h, hkv, dh, r = c.num_heads, c.num_kv_heads, c.head_dim, c.rotary_dim
  lin = lambda m, x: x @ _w(m.kernel) + (_w(m.bias) if c.bias else 0)
  q = lin(layer.q_proj, xs).reshape(len(xs), h, -1)
  if c.output_gate:
    q, gate = q[..., :dh], q[..., dh:]
  k = lin(layer.k_proj, xs).reshape(len(xs), hkv, dh)
  v = lin(layer.v_proj, xs).reshape(len(xs), hkv, dh)
  if c.qk_norm:
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * (c.norm_offset + _w(w))
    q, k = norm(q, layer.q_norm), norm(k, layer.k_norm)

  def rope(x):
    if not r:
      return x
    out = x.copy()
    for p in range(len(x)):
      for i in range(r // 2):
        ang = p * c.rope_theta ** (-2 * i / r)
        a, b = x[p, :, i], x[p, :, i + r // 2]
        out[p, :, i], out[p, :, i + r // 2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    return out

  q, k = rope(q), rope(k)
  o = np.zeros((len(xs), h, dh))
  for t in range(len(xs)):
    for head in range(h):
      kv = head // (h // hkv)
      logits = k[:t + 1, kv] @ q[t, head] * dh ** -0.5
      w = np.exp(logits - logits.max())
      o[t, head] = (w / w.sum()) @ v[:t + 1, kv]
  if c.output_gate:
    o = o * (1 / (1 + np.exp(-gate)))
  return lin(layer.o_proj, o.reshape(len(xs), h * dh))


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_decode_verify_match_the_float64_oracle(name):
  layer = _layer(CONFIGS[name])
  rng = np.random.RandomState(1)
  xs = rng.normal(size=(2, 12, D)).astype(np.float32)
  refs = [_reference(layer, xs[b].astype(np.float64)) for b in range(2)]
  cache = layer.init_cache(4, 16)
  slots = jnp.array([3, 1], jnp.int32)
  lengths = jnp.array([7, 4], jnp.int32)
  t = jnp.arange(8)[None, :]
  # Prefill 8 lanes, right-padded to lengths 7 and 4.
  y, cache = layer.step(jnp.asarray(xs[:, :8]), cache, slots, jnp.zeros(2, jnp.int32), t < lengths[:, None])
  for b, n in enumerate([7, 4]):
    assert _rel(y[b, :n], refs[b][:n]) < 1e-5
    assert not np.any(np.asarray(y[b, n:]))           # padded lanes: zero output
  pos = np.array([7, 4])
  # Decode one token per row, then verify 3 tokens per row (lengths 3 and 2).
  x1 = np.stack([xs[0, 7], xs[1, 4]])[:, None]
  y, cache = layer.step(jnp.asarray(x1), cache, slots, jnp.asarray(pos, jnp.int32), jnp.ones((2, 1), bool))
  assert _rel(y[0, 0], refs[0][7]) < 1e-5 and _rel(y[1, 0], refs[1][4]) < 1e-5
  pos = pos + 1
  xv = np.stack([xs[0, 8:11], xs[1, 5:8]])
  valid = jnp.array([[True, True, True], [True, True, False]])
  y, cache = layer.step(jnp.asarray(xv), cache, slots, jnp.asarray(pos, jnp.int32), valid)
  assert _rel(y[0], refs[0][8:11]) < 1e-5 and _rel(y[1, :2], refs[1][5:7]) < 1e-5
  # Rollback: row 0 keeps 1 of its 3 tokens; the next token overwrites the rejected entries.
  pos = pos + np.array([1, 2])
  x2 = np.stack([xs[0, 9], xs[1, 7]])[:, None]
  y, cache = layer.step(jnp.asarray(x2), cache, slots, jnp.asarray(pos, jnp.int32), jnp.ones((2, 1), bool))
  assert _rel(y[0, 0], refs[0][9]) < 1e-5 and _rel(y[1, 0], refs[1][7]) < 1e-5


def test_padding_rows_and_lanes_write_nothing():
  layer = _layer(CONFIGS["qwen"])
  cache = layer.init_cache(3, 8)
  cache = AttentionLayerCache(k=cache.k + 0.25, v=cache.v - 0.5)
  x = jnp.asarray(np.random.RandomState(2).normal(size=(2, 4, D)), jnp.float32)
  y, new = layer.step(x, cache, jnp.array([-1, 2], jnp.int32), jnp.array([0, 2], jnp.int32),
                      jnp.array([[True] * 4, [True, True, False, False]]))
  assert not np.any(np.asarray(y[0])) and not np.any(np.asarray(y[1, 2:]))
  for old, now in ((cache.k, new.k), (cache.v, new.v)):
    old, now = np.asarray(old), np.asarray(now)
    np.testing.assert_array_equal(now[:2], old[:2])             # slots 0, 1: untouched
    np.testing.assert_array_equal(now[2, :2], old[2, :2])       # slot 2 before its start
    np.testing.assert_array_equal(now[2, 4:], old[2, 4:])       # and past its two real tokens
    assert not np.array_equal(now[2, 2:4], old[2, 2:4])


def test_stale_entries_past_the_position_never_reach_an_output():
  """A recycled slot holding NaN (and huge) keys and values past the new sequence's end gives
  the same outputs as a fresh slot, once the new sequence's prefill (``fresh``) reset it."""
  layer = _layer(CONFIGS["qwen"])
  x = jnp.asarray(np.random.RandomState(3).normal(size=(1, 5, D)), jnp.float32)
  fresh, _ = layer.step(x, layer.init_cache(2, 8), jnp.array([1], jnp.int32), jnp.zeros(1, jnp.int32),
                        jnp.ones((1, 5), bool))
  dirty = layer.init_cache(2, 8)
  dirty = AttentionLayerCache(k=dirty.k.at[1].set(jnp.nan), v=dirty.v.at[1].set(1e30).at[1, 6].set(jnp.nan))
  valid = jnp.array([[True, True, True, False, False]])
  y, after = layer.step(x, dirty, jnp.array([1], jnp.int32), jnp.zeros(1, jnp.int32), valid, fresh=True)
  np.testing.assert_array_equal(np.asarray(y[0, :3]), np.asarray(fresh[0, :3]))
  assert np.all(np.isfinite(np.asarray(after.k))) and np.all(np.isfinite(np.asarray(after.v[1])))
  y, _ = layer.step(x, dirty, jnp.array([1], jnp.int32), jnp.zeros(1, jnp.int32), valid)
  assert np.isnan(np.asarray(y[0, :3])).all()      # without the reset, the NaN values leak


def test_checked_mode_refuses_a_cache_overflow(checked_mode):
  layer = _layer(CONFIGS["nemotron"])
  x = jnp.zeros((1, 3, D), jnp.float32)
  with pytest.raises(ValueError, match="KV cache overflow"):
    layer.step(x, layer.init_cache(1, 4), jnp.array([0], jnp.int32), jnp.array([2], jnp.int32),
               jnp.ones((1, 3), bool))


def test_config_errors():
  with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
    AttentionConfig(num_heads=6, num_kv_heads=4, head_dim=8)
  with pytest.raises(ValueError, match="rotary_dim=5"):
    AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=8, rotary_dim=5)
  with pytest.raises(ValueError, match="attention=None"):
    LMConfig.tiny(num_layers=2, layer_types=("gdn", "attention"))
  model = make_model(LMConfig.tiny(num_layers=2, layer_types=("gdn", "attention"), attention=CONFIGS["qwen"]))
  with pytest.raises(ValueError, match="max_len=None but the model has attention layers"):
    model.init_cache(2)


def test_rotary_turns_only_the_rotary_channels():
  x = jnp.asarray(np.random.RandomState(4).normal(size=(1, 3, 2, 16)), jnp.float32)
  pos = jnp.array([[0, 5, 900]], jnp.int32)
  y = rotary(x, pos, 8, 1e4)
  np.testing.assert_array_equal(np.asarray(y[..., 8:]), np.asarray(x[..., 8:]))
  np.testing.assert_allclose(np.asarray(y[0, 0]), np.asarray(x[0, 0]), rtol=0, atol=0)   # position 0
  # A rotation: each pair (i, i + 4) keeps its norm.
  pairs = lambda a: np.asarray(a[..., :4]) ** 2 + np.asarray(a[..., 4:8]) ** 2
  np.testing.assert_allclose(pairs(y), pairs(x), rtol=1e-5)


def test_in_place_and_gathered_reads_agree():
  """A pool the size of the batch read in place (slots 0..B-1) and through the slot gather
  (permuted slots over a permuted pool) give the same outputs and caches."""
  layer = _layer(CONFIGS["qwen"])
  rng = np.random.RandomState(5)
  x = jnp.asarray(rng.normal(size=(3, 2, D)), jnp.float32)
  base = layer.init_cache(3, 8)
  base = AttentionLayerCache(k=jnp.asarray(rng.normal(size=base.k.shape), jnp.float32),
                             v=jnp.asarray(rng.normal(size=base.v.shape), jnp.float32))
  start, valid = jnp.array([3, 1, 5], jnp.int32), jnp.ones((3, 2), bool)
  y0, c0 = layer.step(x, base, jnp.arange(3, dtype=jnp.int32), start, valid)
  perm = np.array([2, 0, 1])                       # row b lives in slot perm[b]
  inv = np.argsort(perm)
  permuted = AttentionLayerCache(k=base.k[inv], v=base.v[inv])
  y1, c1 = layer.step(x, permuted, jnp.asarray(perm, jnp.int32), start, valid)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(c1.k)[perm], np.asarray(c0.k))


@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_step_matches_the_xla_step(cache_dtype):
  """``implementation="pallas_triton"`` (the decode-attention kernel, interpreted here) gives the
  XLA step's outputs and caches: permuted slots in a larger pool, a padding row, decode (T = 1) and
  verify (T = 3, a padded lane), rows from position 0 to the end of the cache."""
  layer = _layer(CONFIGS["qwen"])
  rng = np.random.RandomState(6)
  base = layer.init_cache(6, 24, dtype=cache_dtype)
  base = AttentionLayerCache(k=jnp.asarray(rng.normal(size=base.k.shape), cache_dtype),
                             v=jnp.asarray(rng.normal(size=base.v.shape), cache_dtype))
  slots = jnp.array([4, -1, 0, 5], jnp.int32)
  for t, start, valid in ((1, [0, 0, 16, 23], [[True]] * 4),
                          (3, [15, 2, 0, 21], [[True] * 3, [True] * 3, [True] * 3, [True, False, False]])):
    x = jnp.asarray(rng.normal(size=(4, t, D)), jnp.float32)
    args = (x, base, slots, jnp.array(start, jnp.int32), jnp.array(valid))
    y_xla, c_xla = layer.step(*args, implementation="xla")
    y_tri, c_tri = layer.step(*args, implementation="pallas_triton")
    y_auto, _ = layer.step(*args)
    tol = 1e-5 if cache_dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(y_tri), np.asarray(y_xla), rtol=tol, atol=tol)
    assert not np.any(np.asarray(y_tri[1]))                     # the padding row
    np.testing.assert_array_equal(np.asarray(c_tri.k), np.asarray(c_xla.k))
    np.testing.assert_array_equal(np.asarray(c_tri.v), np.asarray(c_xla.v))
    np.testing.assert_array_equal(np.asarray(y_auto), np.asarray(y_xla))   # CPU: auto is XLA


def test_kernel_step_refuses_shapes_it_cannot_run():
  """Head size 8 is below the kernel's smallest tensor-core product: the named kernel raises,
  the automatic choice still runs (XLA)."""
  layer = _layer(CONFIGS["nemotron"])
  args = (jnp.zeros((1, 1, D), jnp.float32), layer.init_cache(1, 16), jnp.array([0], jnp.int32),
          jnp.array([2], jnp.int32), jnp.ones((1, 1), bool))
  with pytest.raises(NotImplementedError, match="Dh=8"):
    layer.step(*args, implementation="pallas_triton")
  layer.step(*args)
