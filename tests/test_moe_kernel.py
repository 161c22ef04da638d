"""The MoE grouped-matmul kernel (pallas/moe_triton.py) against a float64 per-group product, in
interpret mode on CPU (tiles of 16 rows, columns and K: several tiles per group and per row), its
tile schedule, its errors, the MoE layer through it, and the lowering for an abstract H200."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax.models import moe as moe_lib
from replayssm_jax.pallas import moe_triton
from tests.helpers import lower_for_h200

RNG = np.random.RandomState(0)


def _reference(x, w, sizes):
  """float64: rows [o_g, o_g + s_g) times w[g]; rows past Σ s are zeros."""
  x, w = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, w))
  out, start = np.zeros((x.shape[0], w.shape[2])), 0
  for g, s in enumerate(np.asarray(sizes)):
    out[start:start + s] = x[start:start + s] @ w[g]
    start += s
  return out


def _case(m, k, n, sizes, dtype):
  x = jnp.asarray(RNG.randn(m, k), dtype)
  w = jnp.asarray(RNG.randn(len(sizes), k, n) / np.sqrt(k), dtype)
  return x, w, jnp.asarray(sizes, jnp.int32)


CASES = {
    # groups of several 16-row tiles, a partial last tile, empty groups at both ends and inside
    "many_tiles": (80, 48, 64, [0, 37, 0, 16, 17, 10, 0]),
    "one_group": (40, 32, 32, [40]),
    "tiny_batch": (6, 16, 16, [2, 0, 4]),            # fewer rows than a tile
    "tail_rows": (50, 32, 48, [20, 0, 21]),           # Σ sizes < M: the rest are zeros
    "every_row_its_own_group": (12, 16, 32, [1] * 12),
}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_per_group_products(case, dtype, tol):
  m, k, n, sizes = CASES[case]
  x, w, s = _case(m, k, n, sizes, dtype)
  out = moe_triton.grouped_matmul(x, w, s, preferred_element_type=jnp.float32)
  assert out.shape == (m, n) and out.dtype == jnp.float32
  ref = _reference(x, w, s)
  assert np.max(np.abs(np.asarray(out) - ref)) <= tol * max(1.0, np.max(np.abs(ref)))
  assert not np.any(np.asarray(out)[int(np.sum(sizes)):])


def test_output_dtype_defaults_to_the_input_dtype_and_knobs_change_tiling_not_results():
  x, w, s = _case(*CASES["many_tiles"][:3], CASES["many_tiles"][3], jnp.bfloat16)
  base = moe_triton.grouped_matmul(x, w, s)
  assert base.dtype == jnp.bfloat16
  wide = moe_triton.grouped_matmul(x, w, s, block_m=32, block_n=32, block_k=32, num_warps=2)
  ref = _reference(x, w, s)
  for out in (base, wide):
    assert np.max(np.abs(np.asarray(out, np.float64) - ref)) <= 2e-2 * np.max(np.abs(ref))


def test_same_as_ragged_dot():
  x, w, s = _case(64, 32, 32, [9, 0, 30, 25], jnp.float32)
  ours = moe_triton.grouped_matmul(x, w, s)
  xla = jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[0, 37, 0, 16, 17, 10, 0], [1] * 12, [5, 0, 0], [0, 0, 3]])
def test_tile_schedule_covers_each_row_once_by_its_own_group(sizes):
  rows, block_m = max(int(np.sum(sizes)), 16), 16
  group, first, end = (np.asarray(a) for a in
                       moe_triton.tile_schedule(jnp.asarray(sizes, jnp.int32), rows, block_m))
  owner = np.repeat(np.arange(len(sizes)), sizes)
  covered = np.zeros(rows, int)
  for g, f, e in zip(group, first, end):
    if g == len(sizes):
      continue
    assert 0 < e - f <= block_m
    assert np.all(owner[f:e] == g)
    covered[f:e] += 1
  assert np.all(covered[:len(owner)] == 1) and not np.any(covered[len(owner):])


def test_bad_inputs():
  x, w, s = _case(20, 32, 32, [10, 10], jnp.float32)
  with pytest.raises(ValueError, match=r"group_sizes has shape \[3\]; expected \[2\]"):
    moe_triton.grouped_matmul(x, w, jnp.asarray([5, 5, 10]))
  with pytest.raises(ValueError, match=r"x \[20, 16\], w \[2, 32, 32\]; expected"):
    moe_triton.grouped_matmul(x[:, :16], w, s)
  with pytest.raises(NotImplementedError, match="K=24, N=32; expected multiples of 16"):
    moe_triton.grouped_matmul(x[:, :24], w[:, :24], s)
  with pytest.raises(NotImplementedError, match="x is float32, w is bfloat16"):
    moe_triton.grouped_matmul(x, w.astype(jnp.bfloat16), s)
  with pytest.raises(NotImplementedError, match="block_n"):
    moe_triton.grouped_matmul(x, w, s, block_n=24)


def test_moe_layer_through_the_kernel_equals_ragged_dot():
  cfg = moe_lib.MoEConfig(hidden_size=32, num_experts=8, top_k=3, expert_intermediate_size=16,
                          shared_intermediate_size=16, shared_expert_gate=True)
  layer = moe_lib.MoE(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 32))
  with jax.default_matmul_precision("highest"):   # XLA's f32 ragged_dot is TF32 on a GPU
    xla, ours = (layer(x, implementation=i) for i in ("xla", "pallas_triton"))
  np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-5, atol=1e-5)
  # where the kernel cannot tile (K = 20), None falls back to XLA and a named kernel refuses
  odd = moe_lib.MoE(cfg.__class__(**{**cfg.__dict__, "expert_intermediate_size": 20}),
                    rngs=nnx.Rngs(0))
  np.testing.assert_allclose(np.asarray(odd(x)), np.asarray(odd(x, implementation="xla")),
                             rtol=1e-6, atol=1e-6)
  with pytest.raises(NotImplementedError, match="expected multiples of 16"):
    odd(x, implementation="pallas_triton")


def test_model_level_implementation_reaches_the_moe_layers(monkeypatch):
  """``LM.decode(implementation=...)`` runs the MoE layers' grouped matmuls through the kernel for
  "pallas_triton" (two per MoE layer: expert in and down projections), through XLA for "xla", and
  on the automatic choice (None: the kernel on a GPU, XLA on CPU) for "pallas_mosaic", which names
  the recurrent kernels only; the logits agree. Attention mixers, so no Mosaic kernel is asked for
  at these tiny widths."""
  from replayssm_jax.models.attention import AttentionConfig
  from replayssm_jax.models.lm import LMConfig, make_model
  calls = []
  kernel = moe_triton.grouped_matmul
  monkeypatch.setattr(moe_triton, "grouped_matmul", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  cfg = LMConfig.tiny(num_layers=2, layer_types=("attention", "attention"), mlp_types=("moe", "dense"),
                      dtype=jnp.float32,
                      attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16),
                      moe=moe_lib.MoEConfig(hidden_size=64, num_experts=4, top_k=2,
                                            expert_intermediate_size=32, dtype=jnp.float32))
  model = make_model(cfg, seed=0)
  tokens, slots = jnp.asarray([3, 7, 11], jnp.int32), jnp.arange(3, dtype=jnp.int32)
  logits, counts = {}, {}
  for impl in ("xla", "pallas_triton", None, "pallas_mosaic"):
    calls.clear()
    with jax.default_matmul_precision("highest"):
      logits[impl], _ = model.decode(tokens, model.init_cache(3, max_len=64), slots, replay=True,
                                     implementation=impl)
    counts[impl] = len(calls)
  auto = 2 if jax.default_backend() == "gpu" else 0
  assert counts == {"xla": 0, "pallas_triton": 2, None: auto, "pallas_mosaic": auto}
  for impl in ("pallas_triton", None, "pallas_mosaic"):
    np.testing.assert_allclose(np.asarray(logits[impl]), np.asarray(logits["xla"]),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [10240, 2560, 8])   # Qwen3-Next (k = 10): 1024-token prefill, B = 256, 1
def test_lowers_for_h200_at_qwen3_next_shapes(rows):
  x = jnp.zeros((rows, 2048), jnp.bfloat16)
  w = jnp.zeros((512, 2048, 1024), jnp.bfloat16)
  sizes = jnp.zeros((512,), jnp.int32)
  text = lower_for_h200(lambda x, w, s: moe_triton.grouped_matmul(x, w, s), (), x, w, sizes)
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2560, 10240])   # the decode tile and, from 10240 rows, the prefill tile
def test_compiled_kernel_matches_float64(rows):
  """Group sizes skewed (a Dirichlet draw: some groups empty, some holding many tiles), both
  dtypes, the launch table's tile for that many rows."""
  from replayssm_jax import config   # noqa: PLC0415
  block_m = config.grouped_matmul_config(device_kind=jax.devices()[0].device_kind, rows=rows).block_m
  assert block_m == (32 if rows >= 10240 else 16)
  sizes = RNG.multinomial(rows, RNG.dirichlet(np.full(64, 0.3)))
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
    x, w, s = _case(rows, 256, 128, sizes, dtype)
    out = moe_triton.grouped_matmul(x, w, s, preferred_element_type=jnp.float32)
    ref = _reference(x, w, s)
    assert np.max(np.abs(np.asarray(out) - ref)) <= tol * np.max(np.abs(ref)), dtype
