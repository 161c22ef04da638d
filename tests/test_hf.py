"""Loading a local Hugging Face checkpoint (``models.hf.load_pretrained``), CPU, float32.

Each test writes a tiny checkpoint itself: a seeded LM (every 1-D parameter perturbed, so norms,
gates and biases are distinguishable) is exported to the Hugging Face layout by code written
here from the HF module definitions (Qwen3-Next's per-key-head grouped ``in_proj_qkvz`` /
``in_proj_ba``, Qwen3.5's split projections, Mamba2 and Nemotron-H ``backbone.*``), loaded back,
and must give the same logits. Error cases: unknown, missing and misshapen tensors (ValueError
naming the tensor and shapes), unknown layer kinds (NotImplementedError), missing sizes, no config.
"""
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from replayssm_jax.models import LMConfig, load_pretrained, make_model

GDN = LMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_k_heads=2, num_v_heads=4, head_k_dim=8,
               head_v_dim=8, intermediate_size=48, max_prompt_len=16, norm_offset=1.0)
MAMBA = dict(vocab_size=64, hidden_size=32, intermediate_size=40, max_prompt_len=16, mixer_mlp=False,
             mlp_act="relu2", mamba2_num_heads=4, mamba2_head_dim=8, mamba2_num_groups=2,
             mamba2_state_dim=8, num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1)
TOKENS = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 12)), jnp.int32)


def _source(config, seed=0):
  """A seeded LM whose 1-D parameters are all perturbed away from their (constant) inits."""
  model = make_model(config, seed=seed)
  rng = np.random.RandomState(seed + 1)
  for _, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Param) and var.ndim == 1:
      var.set_value(var[...] + jnp.asarray(rng.uniform(-0.3, 0.3, var.shape), var.dtype))
  return model


def _np(x):
  return np.asarray(x, np.float32)


def _logits(model):
  cache = model.init_cache(2)
  logits, _ = model.prefill(TOKENS, cache, jnp.arange(2, dtype=jnp.int32), jnp.array([12, 7], jnp.int32))
  return np.asarray(logits)


def _write(tmp_path, config_json, tensors):
  (tmp_path / "config.json").write_text(json.dumps(config_json))
  names = sorted(tensors)
  half = len(names) // 2  # two shards, as real checkpoints have
  shard = lambda part: {n: np.ascontiguousarray(tensors[n]) for n in part}  # save_file ignores strides
  save_file(shard(names[:half]), str(tmp_path / "model-00001-of-00002.safetensors"))
  save_file(shard(names[half:]), str(tmp_path / "model-00002-of-00002.safetensors"))
  return tmp_path


def export_qwen(model, *, split: bool):
  """HF Qwen3-Next (split=False) or Qwen3.5 (split=True) tensors of a GDN LM."""
  c = model.config
  hk, hv, kd, vd = c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim
  r = hv // hk
  t = {"model.embed_tokens.weight": _np(model.embed.embedding[...]),
       "model.norm.weight": _np(model.final_norm.weight[...]),
       "lm_head.weight": _np(model.head.kernel[...]).T}
  for i, blk in enumerate(model.blocks):
    p, m = f"model.layers.{i}.", blk.mixer
    t[p + "input_layernorm.weight"] = _np(blk.mixer_norm.weight[...])
    t[p + "post_attention_layernorm.weight"] = _np(blk.mlp_norm.weight[...])
    gate, up = np.split(_np(blk.mlp.gate_up.kernel[...]), 2, axis=1)
    t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = gate.T, up.T
    t[p + "mlp.down_proj.weight"] = _np(blk.mlp.down.kernel[...]).T
    w = _np(m.in_proj.kernel[...]).T                      # [out, D], rows q | k | v | z | b | a
    o = np.cumsum([0, hk * kd, hk * kd, hv * vd, hv * vd, hv, hv])
    q, k, v, z, b, a = (w[o[j]:o[j + 1]] for j in range(6))
    la = p + "linear_attn."
    if split:
      t[la + "in_proj_qkv.weight"] = np.concatenate([q, k, v])
      t[la + "in_proj_z.weight"], t[la + "in_proj_b.weight"], t[la + "in_proj_a.weight"] = z, b, a
    else:  # fix_query_key_value_ordering: view [.., Hk, K + K + r·V + r·V] and [.., Hk, r + r]
      qkvz, ba = [], []
      for h in range(hk):
        qkvz += [q[h * kd:(h + 1) * kd], k[h * kd:(h + 1) * kd], v[h * r * vd:(h + 1) * r * vd],
                 z[h * r * vd:(h + 1) * r * vd]]
        ba += [b[h * r:(h + 1) * r], a[h * r:(h + 1) * r]]
      t[la + "in_proj_qkvz.weight"], t[la + "in_proj_ba.weight"] = np.concatenate(qkvz), np.concatenate(ba)
    t[la + "conv1d.weight"] = _np(m.conv_weight[...]).T[:, None, :]
    t[la + "A_log"], t[la + "dt_bias"] = _np(m.A_log[...]), _np(m.dt_bias[...])
    t[la + "norm.weight"] = _np(m.norm_weight[...])
    t[la + "out_proj.weight"] = _np(m.out_proj.kernel[...]).T
  return t


def qwen_config(config, **extra):
  return {"model_type": "qwen3_next", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "num_hidden_layers": config.num_layers, "intermediate_size": config.intermediate_size,
          "linear_num_key_heads": config.num_k_heads, "linear_num_value_heads": config.num_v_heads,
          "linear_key_head_dim": config.head_k_dim, "linear_value_head_dim": config.head_v_dim,
          "linear_conv_kernel_dim": config.conv_kernel, "rms_norm_eps": config.rms_eps,
          "hidden_act": "silu", "layer_types": ["linear_attention"] * config.num_layers,
          "num_experts": 0, "tie_word_embeddings": False, **extra}


def export_mamba(model):
  """HF Mamba2 / Nemotron-H ``backbone.*`` tensors."""
  t = {"backbone.embeddings.weight": _np(model.embed.embedding[...]),
       "backbone.norm_f.weight": _np(model.final_norm.weight[...]),
       "lm_head.weight": _np(model.head.kernel[...]).T}
  for i, blk in enumerate(model.blocks):
    p = f"backbone.layers.{i}."
    if blk.layer_type == "mlp":
      t[p + "norm.weight"] = _np(blk.mlp_norm.weight[...])
      t[p + "mixer.up_proj.weight"] = _np(blk.mlp.up.kernel[...]).T
      t[p + "mixer.down_proj.weight"] = _np(blk.mlp.down.kernel[...]).T
      continue
    m = blk.mixer
    t[p + "norm.weight"] = _np(blk.mixer_norm.weight[...])
    t[p + "mixer.in_proj.weight"] = _np(m.in_proj.kernel[...]).T
    t[p + "mixer.conv1d.weight"] = _np(m.conv_weight[...]).T[:, None, :]
    t[p + "mixer.conv1d.bias"] = _np(m.conv_bias[...])
    for name in ("A_log", "D", "dt_bias"):
      t[p + "mixer." + name] = _np(getattr(m, name)[...])
    t[p + "mixer.norm.weight"] = _np(m.norm_weight[...])
    t[p + "mixer.out_proj.weight"] = _np(m.out_proj.kernel[...]).T
  return t


def nemotron_config(config, pattern):
  return {"model_type": "nemotron_h", "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
          "num_hidden_layers": len(pattern), "hybrid_override_pattern": pattern,
          "intermediate_size": config.intermediate_size, "mamba_num_heads": config.mamba2_num_heads,
          "mamba_head_dim": config.mamba2_head_dim, "n_groups": config.mamba2_num_groups,
          "ssm_state_size": config.mamba2_state_dim, "conv_kernel": config.conv_kernel,
          "layer_norm_epsilon": config.rms_eps, "mlp_hidden_act": "relu2", "use_conv_bias": True,
          "use_bias": False, "tie_word_embeddings": False}


@pytest.mark.parametrize("split", [False, True], ids=["qwen3_next-fused", "qwen3_5-split"])
def test_qwen_roundtrip(tmp_path, split):
  src = _source(GDN)
  _write(tmp_path, qwen_config(GDN, model_type="qwen3_5" if split else "qwen3_next"),
         export_qwen(src, split=split))
  model, config = load_pretrained(tmp_path, max_prompt_len=16)
  assert config == GDN
  np.testing.assert_array_equal(_np(model.blocks[1].mixer.in_proj.kernel[...]),
                                _np(src.blocks[1].mixer.in_proj.kernel[...]))
  np.testing.assert_allclose(_logits(model), _logits(src), atol=1e-5, rtol=0)


def test_qwen_tied_head_nested_config_and_bf16(tmp_path):
  # Qwen3.5 multimodal layout: text_config, model.language_model.* prefix, visual.* ignored,
  # tied head (no lm_head.weight), bfloat16 tensors.
  src = _source(GDN)
  tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in export_qwen(src, split=True).items()
             if k != "lm_head.weight"}
  tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  tensors["model.visual.patch_embed.weight"] = np.zeros((4, 4), np.float32)
  cfg = {"model_type": "qwen3_5", "text_config": qwen_config(GDN, tie_word_embeddings=True)}
  model, _ = load_pretrained(_write(tmp_path, cfg, tensors), dtype=jnp.bfloat16, max_prompt_len=16)
  assert model.head.kernel[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(_np(model.head.kernel[...]), _np(model.embed.embedding[...]).T)
  np.testing.assert_array_equal(_np(model.blocks[0].mixer.A_log[...]),
                                _np(src.blocks[0].mixer.A_log[...]).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_mamba2_and_nemotron_h_roundtrip(tmp_path):
  pure = LMConfig(num_layers=2, layer_types=("mamba2",) * 2, **MAMBA)
  src = _source(pure)
  cfg = {"model_type": "mamba2", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
         "num_heads": 4, "head_dim": 8, "n_groups": 2, "state_size": 8, "conv_kernel": 4,
         "layer_norm_epsilon": pure.rms_eps, "tie_word_embeddings": False}
  (tmp_path / "m").mkdir()
  model, config = load_pretrained(_write(tmp_path / "m", cfg, export_mamba(src)), max_prompt_len=16)
  assert config.layer_types == ("mamba2", "mamba2") and not config.mixer_mlp
  np.testing.assert_allclose(_logits(model), _logits(src), atol=1e-5, rtol=0)

  hybrid = LMConfig(num_layers=3, layer_types=("mamba2", "mlp", "mamba2"), **MAMBA)
  src = _source(hybrid, seed=3)
  (tmp_path / "n").mkdir()
  model, config = load_pretrained(_write(tmp_path / "n", nemotron_config(hybrid, "M-M"), export_mamba(src)),
                                  max_prompt_len=16)
  assert config.layer_types == ("mamba2", "mlp", "mamba2") and config.mlp_act == "relu2"
  assert len(model.init_cache(2).layers) == 2  # MLP-only blocks have no cache
  np.testing.assert_allclose(_logits(model), _logits(src), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def qwen_tensors():
  return export_qwen(_source(GDN), split=False)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update({"model.layers.0.linear_attn.extra.weight": np.zeros((3, 2), np.float32)}),
     r"does not know: 'model.layers.0.linear_attn.extra.weight' \[3, 2\]"),
    (lambda t: t.pop("model.layers.1.linear_attn.A_log"),
     r"missing tensor 'model.layers.1.linear_attn.A_log'; expected shape \[4\]"),
    (lambda t: t.update({"model.layers.0.linear_attn.conv1d.weight": np.zeros((64, 1, 3), np.float32)}),
     r"tensor 'model.layers.0.linear_attn.conv1d.weight' has shape \[64, 1, 3\]; expected \[64, 1, 4\]"),
    (lambda t: t.update({"lm_head.weight": np.zeros((32, 64), np.float32)}),
     r"tensor 'lm_head.weight' has shape \[32, 64\]; expected \[64, 32\]"),
], ids=["unknown", "missing", "conv-shape", "head-shape"])
def test_bad_tensors(tmp_path, qwen_tensors, edit, match):
  tensors = dict(qwen_tensors)
  edit(tensors)
  with pytest.raises(ValueError, match=match):
    load_pretrained(_write(tmp_path, qwen_config(GDN), tensors))


def test_unsupported_layers_and_configs(tmp_path, qwen_tensors):
  # Attention and MoE layers load (tests/test_hf_parity.py); a config that names them without
  # their sizes is a ValueError naming the key, an unknown layer kind a NotImplementedError.
  _write(tmp_path, qwen_config(GDN, layer_types=["linear_attention", "full_attention"]), qwen_tensors)
  with pytest.raises(ValueError, match="config.json has no 'num_attention_heads'"):
    load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(qwen_config(GDN, layer_types=["linear_attention", "swa"])))
  with pytest.raises(NotImplementedError, match=r"layer 1 is 'swa' \(layer_types\)"):
    load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(qwen_config(GDN, num_experts=4, decoder_sparse_step=1)))
  with pytest.raises(ValueError, match="no 'num_experts_per_tok'"):
    load_pretrained(tmp_path)
  hybrid = LMConfig(num_layers=3, layer_types=("mamba2", "mlp", "mamba2"), **MAMBA)
  (tmp_path / "config.json").write_text(json.dumps(nemotron_config(hybrid, "M?M")))
  with pytest.raises(NotImplementedError, match=r"layer 1 is '\?'"):
    load_pretrained(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(NotImplementedError, match="model_type='llama' is not supported"):
    load_pretrained(tmp_path)
  with pytest.raises(ValueError, match="no config.json"):
    load_pretrained(tmp_path / "nowhere")
