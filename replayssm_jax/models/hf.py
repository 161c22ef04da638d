"""Weights from a local Hugging Face directory (``config.json`` + ``*.safetensors``).

``model, config = load_pretrained(path)`` builds an ``LM`` with the checkpoint's shape and loads
its tensors. Nothing is downloaded: ``path`` is a directory on disk. The layers are defined as
transformers 5.x defines them (the parity tests compare against its outputs, ``tests/data/hf``);
config.json files as transformers 5.x writes them (``layers_block_type``, rope parameters in
``rope_parameters``, infinity as ``{"__float__": "Infinity"}``) and as older Hub files are
(``hybrid_override_pattern``, top-level ``rope_theta``, bare ``Infinity``) both load.

**Qwen3-Next / Qwen3.5 / Qwen3.5-MoE** (``model_type`` ``qwen3_next``, ``qwen3_5``,
``qwen3_5_text``, ``qwen3_5_moe``, ``qwen3_5_moe_text``; a nested ``text_config`` is used when
present). Tensor prefix ``model.`` (or ``model.language_model.`` for the multimodal wrapper,
whose vision tower ``model.visual.*`` is skipped with a warning); ``layers.{i}`` below means
``{prefix}layers.{i}``. ``layer_types`` (or ``full_attention_interval``) picks GatedDeltaNet
(``linear_attention``) or attention (``full_attention``) per layer; the MLP is MoE where
transformers puts one (Qwen3-Next: ``num_experts > 0``, outside ``mlp_only_layers`` and every
``decoder_sparse_step``-th layer; Qwen3.5-MoE: every layer), dense SwiGLU elsewhere.

====================================================  ===========================================
HF tensor [shape]                                      LM parameter
====================================================  ===========================================
``embed_tokens.weight`` [V, D]                          ``embed.embedding``
``layers.{i}.input_layernorm.weight`` [D]               ``blocks[i].mixer_norm.weight`` (zero-centred: ``norm_offset=1``)
``layers.{i}.post_attention_layernorm.weight`` [D]      ``blocks[i].mlp_norm.weight`` (zero-centred)
``layers.{i}.linear_attn.in_proj_qkvz.weight``          ``blocks[i].mixer.in_proj.kernel`` columns q|k|v|z:
  [2·Hk·K + 2·Hv·V, D], grouped per key head             rows regrouped from [Hk, (K, K, r·V, r·V)] (r = Hv/Hk)
``layers.{i}.linear_attn.in_proj_ba.weight`` [2·Hv, D]  columns b|a, regrouped from [Hk, (r, r)]
  or split (Qwen3.5): ``in_proj_qkv`` [2·Hk·K + Hv·V, D],  columns q|k|v, z, b, a in that order
  ``in_proj_z`` [Hv·V, D], ``in_proj_b``, ``in_proj_a`` [Hv, D]
``layers.{i}.linear_attn.conv1d.weight`` [C, 1, W]      ``blocks[i].mixer.conv_weight`` [W, C]
``layers.{i}.linear_attn.A_log``, ``dt_bias`` [Hv]      ``blocks[i].mixer.A_log``, ``dt_bias`` (float32)
``layers.{i}.linear_attn.norm.weight`` [V]              ``blocks[i].mixer.norm_weight`` (gated RMSNorm, plain weight)
``layers.{i}.linear_attn.out_proj.weight`` [D, Hv·V]    ``blocks[i].mixer.out_proj.kernel`` (transposed)
``layers.{i}.self_attn.q_proj.weight`` [Hq·2hd, D]       ``blocks[i].mixer.q_proj.kernel`` (per head [q | gate])
``layers.{i}.self_attn.{k,v}_proj.weight`` [Hkv·hd, D]   ``blocks[i].mixer.{k,v}_proj.kernel``
``layers.{i}.self_attn.o_proj.weight`` [D, Hq·hd]        ``blocks[i].mixer.o_proj.kernel`` (biases if ``attention_bias``)
``layers.{i}.self_attn.{q,k}_norm.weight`` [hd]          ``blocks[i].mixer.{q,k}_norm`` (zero-centred)
``layers.{i}.mlp.{gate,up}_proj.weight`` [I, D]         ``blocks[i].mlp.gate_up.kernel`` [D, 2·I] (both transposed, gate | up)
``layers.{i}.mlp.down_proj.weight`` [D, I]              ``blocks[i].mlp.down.kernel`` (transposed; SwiGLU)
``layers.{i}.mlp.gate.weight``, ``experts.*``, ...       ``blocks[i].mlp.*`` (MoE: ``models.moe.hf_moe_params``)
``norm.weight`` [D]                                     ``final_norm.weight`` (zero-centred)
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed; the embedding if tied and absent)
====================================================  ===========================================

Attention: rotary embedding of the first ``int(head_dim · partial_rotary_factor)`` channels
(``rope_type`` "default"; Qwen3.5's multimodal rope reduces to it for text positions), q/k
RMSNorm, output gate ``o_proj(o · sigmoid(gate))``.

**Mamba2** (``model_type`` ``mamba2``) and **Nemotron-H** (``nemotron_h``; layer kinds from
``layers_block_type`` — ``linear_attention``/``mamba``, ``full_attention``/``attention``,
``mlp``, ``moe`` — or from ``hybrid_override_pattern``: ``M``, ``*``, ``-``, ``E``). Prefix
``backbone.``; every block is ``h + mixer(norm(h))``:

====================================================  ===========================================
``embeddings.weight`` [V, D]                            ``embed.embedding`` (``embedding.weight`` in old files)
``layers.{i}.norm.weight`` [D]                          ``blocks[i].mixer_norm.weight`` (``M``, ``*``) / ``mlp_norm.weight`` (``-``, ``E``)
``layers.{i}.mixer.in_proj.weight`` [I + C + H, D]      ``blocks[i].mixer.in_proj.kernel`` (z | x | B | C | dt, transposed)
``layers.{i}.mixer.conv1d.weight`` [C, 1, W], ``.bias``  ``conv_weight`` [W, C], ``conv_bias`` [C] (zeros if ``use_conv_bias`` is false)
``layers.{i}.mixer.A_log``, ``D``, ``dt_bias`` [H]       ``A_log``, ``D``, ``dt_bias`` (float32)
``layers.{i}.mixer.norm.weight`` [I]                    ``norm_weight`` (grouped gated RMSNorm)
``layers.{i}.mixer.out_proj.weight`` [D, I]             ``out_proj.kernel`` (transposed)
``layers.{i}.mixer.{q,k,v,o}_proj.weight`` (``*``)       ``blocks[i].mixer.{q,k,v,o}_proj.kernel`` (no RoPE, no biases)
``layers.{i}.mixer.{up,down}_proj.weight`` (``-``)       ``blocks[i].mlp.{up,down}.kernel`` (relu², transposed)
``layers.{i}.mixer.gate.*``, ``experts.*``, ... (``E``)  ``blocks[i].mlp.*`` (MoE: ``models.moe.hf_moe_params``)
``norm_f.weight`` [D]                                   ``final_norm.weight``
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed; the embedding if tied and absent)
====================================================  ===========================================

**Granite 4.0** (``model_type`` ``granitemoehybrid``; ``layer_types`` — ``mamba`` /
``linear_attention``, ``attention`` / ``full_attention`` — or the older key ``layers_block_type``).
Prefix ``model.``; every layer is a mixer block ``h + r·mixer(norm(h))`` followed by
``h + r·(MoE(x) + shared_mlp(x))``, x = norm(h) (the shared MLP alone when ``num_local_experts``
is 0, e.g. Granite-4.0-H-Micro), with r = ``residual_multiplier``, the embedding scaled by
``embedding_multiplier``, the logits divided by ``logits_scaling`` and the attention logits
scaled by ``attention_multiplier``. Attention has no positional encoding
(``position_embedding_type`` "nope" or null, the released checkpoints) or a rotary embedding of
the whole head (``"rope"``, ``rope_type`` "default"):

====================================================  ===========================================
``embed_tokens.weight`` [V, D]                          ``embed.embedding``
``layers.{i}.input_layernorm.weight`` [D]               ``blocks[i].mixer_norm.weight``
``layers.{i}.post_attention_layernorm.weight`` [D]      ``blocks[i].mlp_norm.weight``
``layers.{i}.mamba.*`` (as Mamba2's ``mixer.*`` above)  ``blocks[i].mixer.*`` (conv bias if ``mamba_conv_bias``)
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``          ``blocks[i].mixer.{q,k,v,o}_proj.kernel`` (biases if ``attention_bias``)
``layers.{i}.block_sparse_moe.*``, ``shared_mlp.*``     ``blocks[i].mlp.*`` (MoE: ``models.moe.granite_moe_params``)
``layers.{i}.shared_mlp.input_linear.weight`` [2S, D]   dense (no experts): ``blocks[i].mlp.gate_up.kernel`` (transposed, gate | up)
``layers.{i}.shared_mlp.output_linear.weight`` [D, S]   dense: ``blocks[i].mlp.down.kernel`` (transposed)
``norm.weight`` [D]                                     ``final_norm.weight``
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed; the embedding if tied and absent)
====================================================  ===========================================

**Bamba** (``model_type`` ``bamba``): Mamba2 layers, attention at ``attn_layer_indices``, each
followed by a SwiGLU MLP; prefix ``model.``, as Granite 4.0 but without multipliers, with
``layers.{i}.pre_ff_layernorm.weight`` → ``blocks[i].mlp_norm.weight``,
``layers.{i}.feed_forward.{gate,up,down}_proj.weight`` → ``blocks[i].mlp.gate_up.kernel`` /
``down.kernel`` (as Qwen's ``mlp.*``), ``final_layernorm.weight`` → ``final_norm.weight``, and
attention logits scaled by head_dim^-1/2 with a rotary embedding of ``partial_rotary_factor``
(0.5 when absent, as transformers sets it) of each head.

**Falcon-H1** (``model_type`` ``falcon_h1``): every layer is a parallel block (``layer_types``
"parallel"): x = norm(h), h + Mamba2(x) + attention(x), then h + SwiGLU(norm(h)); prefix
``model.``. Mamba2 of I = ``mamba_d_ssm`` (else ``mamba_expand`` · D) channels, its output norm
from ``mamba_rms_norm`` / ``mamba_norm_before_gate`` (none; rmsnorm_g(y)·w·silu(z); or Mamba2's
gated norm); attention with a rotary embedding of the whole head (``head_dim``, ``rope_type``
"default"), logits scaled by head_dim^-1/2:

====================================================  ===========================================
``embed_tokens.weight`` [V, D]                          ``embed.embedding`` (× ``embedding_multiplier`` at run time)
``layers.{i}.input_layernorm.weight`` [D]               ``blocks[i].mixer_norm.weight``
``layers.{i}.pre_ff_layernorm.weight`` [D]              ``blocks[i].mlp_norm.weight``
``layers.{i}.mamba.in_proj.weight`` [I + C + H, D]      ``blocks[i].mixer.mamba2.in_proj.kernel`` (z | x | B | C | dt, transposed;
                                                          block j × ``ssm_in_multiplier`` · ``ssm_multipliers[j]``)
``layers.{i}.mamba.{conv1d,A_log,D,dt_bias}.*``          ``blocks[i].mixer.mamba2.*`` (as Mamba2's ``mixer.*``; conv bias if ``mamba_conv_bias``)
``layers.{i}.mamba.norm.weight`` [I]                    ``blocks[i].mixer.mamba2.norm_weight`` (only if ``mamba_rms_norm``)
``layers.{i}.mamba.out_proj.weight`` [D, I]             ``blocks[i].mixer.mamba2.out_proj.kernel`` (transposed, × ``ssm_out_multiplier``)
``layers.{i}.self_attn.{q,v}_proj.weight``              ``blocks[i].mixer.attention.{q,v}_proj.kernel`` (× ``attention_in_multiplier``)
``layers.{i}.self_attn.k_proj.weight``                  ``blocks[i].mixer.attention.k_proj.kernel`` (× ``attention_in_multiplier`` · ``key_multiplier``)
``layers.{i}.self_attn.o_proj.weight``                  ``blocks[i].mixer.attention.o_proj.kernel`` (× ``attention_out_multiplier``)
``layers.{i}.feed_forward.{gate,up}_proj.weight`` [I', D]  ``blocks[i].mlp.gate_up.kernel`` (gate columns × ``mlp_multipliers[0]``)
``layers.{i}.feed_forward.down_proj.weight`` [D, I']   ``blocks[i].mlp.down.kernel`` (× ``mlp_multipliers[1]``)
``final_layernorm.weight`` [D]                          ``final_norm.weight``
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed, × ``lm_head_multiplier``; the embedding if tied and absent)
====================================================  ===========================================

Falcon-H1's multipliers other than ``embedding_multiplier`` each scale the output of one linear map
before anything nonlinear reads it (an input multiplier scales every projection of that input), so
they are folded into the converted weights (and the biases of the maps whose outputs they scale:
``key_multiplier`` and ``attention_out_multiplier`` scale the k / o biases, input multipliers none):
``ssm_multipliers`` scale z, x, B, C, dt before the silu gate, the conv and the softplus, the
``mlp_multipliers[0]`` the gate before its silu, the rest an output. Exact up to float rounding.

Here I = H·P, C = I + 2·G·N (Mamba2) or 2·Hk·K + Hv·V (GDN), S = ``shared_intermediate_size``.
Ignored tensors: the vision tower (``visual.*``, ``model.visual.*``), and ``mtp.*`` outside
Qwen3-Next / Qwen3.5 checkpoints.

**Multi-token prediction** (Qwen3-Next / Qwen3.5 with ``mtp_num_hidden_layers`` 1 and ``mtp.*``
tensors; ``models.mtp``): ``LMConfig.mtp_layers = 1`` and

====================================================  ===========================================
``mtp.fc.weight`` [D, 2·D]                               ``mtp.fc.kernel`` (transposed; input columns embedding | hidden)
``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight`` [D]   the same names (zero-centred)
``mtp.layers.0.input_layernorm.weight``, ``post_attention_layernorm.weight`` [D]   ``mtp.block.mixer_norm`` / ``mlp_norm``
``mtp.layers.0.self_attn.*``, ``mtp.layers.0.mlp.*``     ``mtp.block.mixer.*``, ``mtp.block.mlp.*`` (as a model layer's)
====================================================  ===========================================

A config that declares the head while the files hold no ``mtp.*`` tensor (transformers'
``save_pretrained`` drops them) loads without it (logged). ``mtp_use_dedicated_embeddings`` true
and more than one MTP layer raise ``NotImplementedError``.

Mamba2 step size: Δ = softplus(dt + dt_bias) clipped to ``time_step_limit`` ((0, ∞) in released
checkpoints, so nothing is clipped), as NVIDIA's reference implementation does, in prefill and
decode alike. transformers' Nemotron-H up to 5.24 instead clamped Δ at ``time_step_min`` (an
initialisation parameter) in its chunked prefill and not in its decode step (from 5.25 it follows
``time_step_limit``); see tests/data/README.md. transformers' Granite
4.0, Bamba and Falcon-H1 clamp at ``time_step_limit`` in their prefill and not in their decode step,
which agree for the released (0, ∞).

Errors: a tensor the mapping does not know, a missing tensor, or a wrong shape raise
``ValueError`` naming the tensor, its shape and the expected one; a malformed config.json raises
``ValueError`` naming the key. Valid checkpoints with parts this library does not implement
(other layer kinds, activations, rope types, Mamba2 in_proj/out_proj biases, MLP biases) raise
``NotImplementedError`` naming the layer and the feature. Decode mode (replay or conventional) is
not a property of the weights: choose it when generating (``generate(..., replay=...)``,
``serving.EngineConfig(replay=...)``).
"""
import dataclasses
import json
import logging
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.models.attention import AttentionConfig
from replayssm_jax.models.lm import LM, LMConfig
from replayssm_jax.models.moe import granite_moe_params, hf_moe_params, moe_config_from_hf
from replayssm_jax.models.sharding import shard_model

logger = logging.getLogger(__name__)

QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
QWEN_MOE_EVERY_LAYER = ("qwen3_5_moe", "qwen3_5_moe_text")
VISION_PREFIXES = ("visual.", "model.visual.")
MTP_PREFIX = "mtp."
_NOT_USED = dict(num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1)  # no GDN layers
QWEN_LAYERS = {"linear_attention": "gdn", "full_attention": "attention"}
# Nemotron-H layer kinds: transformers 5.x names (and their legacy aliases), and the pattern letters.
NEMOTRON_LAYERS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention",
                   "attention": "attention", "mlp": "mlp", "moe": "moe"}
NEMOTRON_PATTERN = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
# Older Nemotron-H config.json names of the Mamba2 keys.
# Granite 4.0 layer kinds (transformers 5.x names and the Hub's legacy ones).
GRANITE_LAYERS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention",
                  "attention": "attention"}
NEMOTRON_LEGACY_KEYS = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel",
                        "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias",
                        "mamba_proj_bias": "use_bias"}


def load_pretrained(path, *, dtype=jnp.float32, max_prompt_len: int = 128, mesh=None,
                    axis: str = "tp"):
  """Builds an LM from a local Hugging Face checkpoint directory.

  Args:
    path: directory with ``config.json`` and one or more ``*.safetensors`` files.
    dtype: parameter / activation dtype of the model (float32, bfloat16 or float16); tensors are
      cast to it (A_log, dt_bias, D and MoE routers stay float32).
    max_prompt_len: longest prompt ``generate`` and the serving engine accept.
    mesh: a ``jax.sharding.Mesh``: the model is sharded over its axis ``axis`` (``shard_model``)
      straight from the host, each device receiving only its shards, so no device ever holds
      the whole model (the host copy is dropped once the shards are placed).

  Returns:
    (model: LM, or ShardedLM with ``mesh``; config: LMConfig).
  """
  path = pathlib.Path(path)
  if not (path / "config.json").is_file():
    raise ValueError(f"path={str(path)!r} has no config.json; expected a local Hugging Face model "
                     f"directory (config.json + *.safetensors)")
  hf = read_config(path / "config.json")
  family, config = _plan(hf, dtype=dtype, max_prompt_len=max_prompt_len)
  tensors = _read_tensors(path)
  has_mtp = any(n.startswith(MTP_PREFIX) for n in tensors)
  if config.mtp_layers and not has_mtp:
    logger.info("load_pretrained(%s): config.json declares mtp_num_hidden_layers=%d but no mtp.* "
                "tensor is present; loading without the multi-token-prediction head", path,
                config.mtp_layers)
    config = dataclasses.replace(config, mtp_layers=0)
  if not config.mtp_layers:
    tensors = {n: a for n, a in tensors.items() if not n.startswith(MTP_PREFIX)}
  values = _convert(hf, family, config, tensors)
  model = nnx.eval_shape(lambda: LM(config, rngs=nnx.Rngs(0)))
  for target, value in values.items():
    _assign(model, target, value, host=mesh is not None)
  unset = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
           if not isinstance(x, (jax.Array, np.ndarray))]
  if unset:  # a mapping bug, not a checkpoint problem
    raise AssertionError(f"parameters left unset by the mapping: {unset}")
  return (model if mesh is None else shard_model(model, mesh, axis=axis)), config


# ---- reading -------------------------------------------------------------------------------

def _special_float(obj: dict):
  """transformers 5.x writes inf / -inf / nan as ``{"__float__": "Infinity"}`` etc."""
  if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
    return float(obj["__float__"].replace("Infinity", "inf"))
  return obj


def read_config(file: pathlib.Path) -> dict:
  """config.json as a dict, special floats decoded (tagged, or the bare ``Infinity`` of older files)."""
  try:
    hf = json.loads(pathlib.Path(file).read_text(), object_hook=_special_float)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{file} is not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise ValueError(f"{file} holds a {type(hf).__name__}; expected a JSON object")
  return hf


def _read_tensors(path: pathlib.Path) -> dict:
  from safetensors.numpy import load_file
  files = sorted(path.glob("*.safetensors"))
  if not files:
    raise ValueError(f"path={str(path)!r} has no *.safetensors files")
  tensors = {}
  for f in files:
    for name, array in load_file(f).items():
      if name in tensors:
        raise ValueError(f"tensor {name!r} appears in more than one safetensors file ({f.name})")
      tensors[name] = array
  vision = sum(n.startswith(VISION_PREFIXES) for n in tensors)
  if vision:
    logger.warning("load_pretrained(%s): skipped the vision tower (%d tensors under model.visual.*): "
                   "replayssm_jax loads the language model only (text in, text out)", path, vision)
  return {n: a for n, a in tensors.items() if not n.startswith(VISION_PREFIXES)}


def _get(hf: dict, key: str, default=None, *, required=True):
  if key in hf and hf[key] is not None:
    return hf[key]
  if required and default is None:
    raise ValueError(f"config.json has no {key!r}; expected it for model_type={hf.get('model_type')!r}")
  return default


def _int(hf: dict, key: str, default=None) -> int:
  value = _get(hf, key, default)
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"config.json {key}={value!r}; expected an int >= 1")
  return value


def _float(hf: dict, key: str, default: float) -> float:
  """A positive finite number (Granite's multipliers)."""
  value = _get(hf, key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
    raise ValueError(f"config.json {key}={value!r}; expected a finite number > 0")
  return float(value)


# ---- config --------------------------------------------------------------------------------

def _plan(hf: dict, *, dtype, max_prompt_len):
  """("qwen" | "mamba" | "granite" | "bamba" | "falcon", LMConfig) from config.json."""
  model_type = hf.get("model_type")
  text = hf.get("text_config", hf)
  if model_type in QWEN_TYPES or (isinstance(text, dict) and "linear_num_value_heads" in text):
    inner = text.get("model_type")
    merged = text | {"model_type": model_type if model_type in QWEN_TYPES else inner}
    if "tie_word_embeddings" in hf:  # the wrapper's own flag is the one transformers reads
      merged["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return _plan_qwen(merged, dtype, max_prompt_len)
  if model_type in ("mamba2", "nemotron_h"):
    return _plan_mamba(hf, dtype, max_prompt_len)
  if model_type == "granitemoehybrid":
    return _plan_granite(hf, dtype, max_prompt_len)
  if model_type == "bamba":
    return _plan_bamba(hf, dtype, max_prompt_len)
  if model_type == "falcon_h1":
    return _plan_falcon(hf, dtype, max_prompt_len)
  raise NotImplementedError(
      f"config.json model_type={model_type!r} is not supported; load_pretrained reads Qwen3-Next / "
      f"Qwen3.5 / Qwen3.5-MoE ({', '.join(QWEN_TYPES)}), mamba2, nemotron_h, granitemoehybrid, "
      f"bamba and falcon_h1 checkpoints")


def _layer_kinds(names, table, what):
  kinds = []
  for i, name in enumerate(names):
    if name not in table:
      raise NotImplementedError(f"layer {i} is {name!r} ({what}); implemented layer kinds: "
                                f"{sorted(table)}")
    kinds.append(table[name])
  return tuple(kinds)


def _rope(hf: dict, head_dim: int, *, default_factor: float | None = 0.25):
  """(rotary_dim, theta) from ``rope_parameters`` (5.x) or the top-level keys of older files.

  ``default_factor``: the family's ``partial_rotary_factor`` when the config has none (Qwen 0.25,
  Bamba 0.5); None: the whole head turns whatever the config says (Granite's rope ignores it)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict):
    raise ValueError(f"config.json rope_parameters={params!r}; expected an object")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type != "default":
    raise NotImplementedError(f"attention with rope_type={rope_type!r}; only the default rotary "
                              f"embedding is implemented")
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  factor = (1.0 if default_factor is None
            else params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_factor)))
  rotary = int(head_dim * factor)
  return rotary - rotary % 2, float(theta)


def _plan_qwen(hf, dtype, max_prompt_len):
  model_type = hf["model_type"]
  n = _int(hf, "num_hidden_layers")
  names = hf.get("layer_types")
  if names is None:
    interval = _int(hf, "full_attention_interval", 4)
    names = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
  if len(names) != n:
    raise ValueError(f"config.json layer_types has {len(names)} entries; expected num_hidden_layers = {n}")
  types = _layer_kinds(names, QWEN_LAYERS, "layer_types")
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}; only silu is implemented")
  if hf.get("mlp_bias"):
    raise NotImplementedError("mlp_bias=true (MLP projection biases) is not implemented")

  # MLP per layer, as transformers builds it (Qwen3NextDecoderLayer / Qwen3_5MoeDecoderLayer).
  if model_type in QWEN_MOE_EVERY_LAYER:
    mlp_types = ("moe",) * n
  elif (hf.get("num_experts") or 0) > 0:
    step, dense = _int(hf, "decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    mlp_types = tuple("moe" if i not in dense and (i + 1) % step == 0 else "dense" for i in range(n))
  else:
    mlp_types = ("dense",) * n
  moe = moe_config_from_hf(hf, dtype=dtype) if "moe" in mlp_types else None
  intermediate = _int(hf, "intermediate_size") if "dense" in mlp_types else 1

  attention = None
  if "attention" in types:
    heads = _int(hf, "num_attention_heads")
    head_dim = _int(hf, "head_dim", _int(hf, "hidden_size") // heads)
    rotary, theta = _rope(hf, head_dim)
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=_int(hf, "num_key_value_heads", heads), head_dim=head_dim,
        rotary_dim=rotary, rope_theta=theta, qk_norm=True, norm_offset=1.0, output_gate=True,
        bias=bool(hf.get("attention_bias", False)))
  gdn = "gdn" in types
  mtp_layers = hf.get("mtp_num_hidden_layers") or 0
  if not isinstance(mtp_layers, int) or isinstance(mtp_layers, bool) or mtp_layers < 0:
    raise ValueError(f"config.json mtp_num_hidden_layers={mtp_layers!r}; expected an int >= 0")
  if mtp_layers > 1:
    raise NotImplementedError(f"mtp_num_hidden_layers={mtp_layers}: a multi-token-prediction head of "
                              f"more than one layer is not implemented")
  if mtp_layers and hf.get("mtp_use_dedicated_embeddings"):
    raise NotImplementedError("mtp_use_dedicated_embeddings=true (an MTP head with its own "
                              "embedding) is not implemented")
  if mtp_layers and attention is None:
    raise NotImplementedError("an MTP head in a model without full-attention layers (its block "
                              "takes the model's attention shape)")
  config = LMConfig(
      vocab_size=_int(hf, "vocab_size"), hidden_size=_int(hf, "hidden_size"), num_layers=n,
      num_k_heads=_int(hf, "linear_num_key_heads") if gdn else 1,
      num_v_heads=_int(hf, "linear_num_value_heads") if gdn else 1,
      head_k_dim=_int(hf, "linear_key_head_dim") if gdn else 1,
      head_v_dim=_int(hf, "linear_value_head_dim") if gdn else 1,
      intermediate_size=intermediate, conv_kernel=_int(hf, "linear_conv_kernel_dim", 4),
      rms_eps=float(_get(hf, "rms_norm_eps", 1e-6)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=types, norm_offset=1.0, attention=attention, moe=moe, mlp_types=mlp_types,
      mtp_layers=mtp_layers)
  return "qwen", config


def _nemotron_types(hf: dict) -> tuple:
  """Layer kinds of a Nemotron-H config: ``layers_block_type`` (5.x) or ``hybrid_override_pattern``."""
  names, pattern = hf.get("layers_block_type"), hf.get("hybrid_override_pattern")
  if names is not None:
    if not isinstance(names, list):
      raise ValueError(f"config.json layers_block_type={names!r}; expected a list of layer kinds")
    types = _layer_kinds(names, NEMOTRON_LAYERS, "layers_block_type")
  elif pattern is not None:
    if not isinstance(pattern, str):
      raise ValueError(f"config.json hybrid_override_pattern={pattern!r}; expected a string such as 'M*M-'")
    types = _layer_kinds(pattern, NEMOTRON_PATTERN, f"hybrid_override_pattern={pattern!r}")
  else:
    raise ValueError("config.json has neither 'layers_block_type' nor 'hybrid_override_pattern'; "
                     "expected one of them for model_type='nemotron_h'")
  n = hf.get("num_hidden_layers")
  if n is not None and n != len(types):
    raise ValueError(f"config.json num_hidden_layers={n} but the layer kinds list {len(types)} layers")
  return types


def _time_step_limit(hf: dict) -> tuple:
  limit = hf.get("time_step_limit", (0.0, math.inf))
  if limit is None:
    return 0.0, math.inf
  if (not isinstance(limit, (list, tuple)) or len(limit) != 2
      or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in limit)):
    raise ValueError(f"config.json time_step_limit={limit!r}; expected [lo, hi] numbers")
  return float(limit[0]), float(limit[1])


def _plan_mamba(hf, dtype, max_prompt_len):
  nemotron = hf["model_type"] == "nemotron_h"
  attention = moe = None
  if nemotron:
    hf = hf | {new: hf[old] for old, new in NEMOTRON_LEGACY_KEYS.items() if old in hf and new not in hf}
    types = _nemotron_types(hf)
    heads, head_dim = _int(hf, "mamba_num_heads"), _int(hf, "mamba_head_dim")
    state = _int(hf, "ssm_state_size")
    intermediate = _int(hf, "intermediate_size") if "mlp" in types else 1
    if hf.get("mlp_hidden_act", "relu2") != "relu2" or hf.get("mlp_bias"):
      raise NotImplementedError(f"Nemotron-H MLP with mlp_hidden_act={hf.get('mlp_hidden_act')!r}, "
                                f"mlp_bias={hf.get('mlp_bias')}; only relu² without bias is implemented")
    if "attention" in types:
      q_heads = _int(hf, "num_attention_heads")
      attn_dim = _int(hf, "head_dim", hf.get("attention_head_dim") or _int(hf, "hidden_size") // q_heads)
      # transformers' NemotronHAttention: no positional encoding, projections without biases.
      attention = AttentionConfig(num_heads=q_heads, num_kv_heads=_int(hf, "num_key_value_heads", q_heads),
                                  head_dim=attn_dim, rotary_dim=0)
    if "moe" in types:
      moe = moe_config_from_hf(hf, dtype=dtype)
  else:
    types = ("mamba2",) * _int(hf, "num_hidden_layers")
    heads, head_dim, state, intermediate = (_int(hf, "num_heads"), _int(hf, "head_dim"),
                                           _int(hf, "state_size"), 1)
  if hf.get("use_bias"):
    raise NotImplementedError("use_bias=true (Mamba2 in_proj/out_proj biases) is not implemented")
  act = hf.get("mamba_hidden_act", hf.get("hidden_act", "silu"))
  if act != "silu":
    raise NotImplementedError(f"Mamba2 activation {act!r}; only silu is implemented")
  config = LMConfig(
      vocab_size=_int(hf, "vocab_size"), hidden_size=_int(hf, "hidden_size"), num_layers=len(types),
      intermediate_size=intermediate, conv_kernel=_int(hf, "conv_kernel", 4),
      rms_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=types, mixer_mlp=False, mlp_act="relu2", mamba2_num_heads=heads,
      mamba2_head_dim=head_dim, mamba2_num_groups=_int(hf, "n_groups", 1), mamba2_state_dim=state,
      mamba2_dt_limit=_time_step_limit(hf), attention=attention, moe=moe, **_NOT_USED)
  return "mamba", config


def _mamba_shape(hf: dict, hidden: int) -> dict:
  """Mamba2 LMConfig fields from the ``mamba_*`` keys of a Granite 4.0 / Bamba / Falcon-H1 config
  (Falcon-H1's ``mamba_d_ssm``, when set, is the inner width instead of mamba_expand · hidden_size)."""
  heads = _int(hf, "mamba_n_heads")
  inner = _int(hf, "mamba_d_ssm") if hf.get("mamba_d_ssm") is not None else _int(hf, "mamba_expand", 2) * hidden
  head_dim = hf.get("mamba_d_head", "auto")
  head_dim = inner // heads if head_dim == "auto" else head_dim
  if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim * heads != inner:
    raise ValueError(f"config.json mamba_d_head={hf.get('mamba_d_head')!r}, mamba_n_heads={heads}; expected "
                     f"mamba_n_heads · mamba_d_head = the Mamba2 inner width {inner}")
  if hf.get("mamba_proj_bias"):
    raise NotImplementedError("mamba_proj_bias=true (Mamba2 in_proj biases) is not implemented")
  return dict(mamba2_num_heads=heads, mamba2_head_dim=head_dim, mamba2_num_groups=_int(hf, "mamba_n_groups", 1),
              mamba2_state_dim=_int(hf, "mamba_d_state"), conv_kernel=_int(hf, "mamba_d_conv", 4),
              mamba2_dt_limit=_time_step_limit(hf))


def _plan_granite(hf, dtype, max_prompt_len):
  """Granite 4.0 (GraniteMoeHybridForCausalLM): h + r·mixer(norm(h)), then h + r·(MoE + shared
  MLP)(norm(h)) in every layer (the shared MLP alone when num_local_experts = 0)."""
  names = hf["layer_types"] if hf.get("layer_types") is not None else hf.get("layers_block_type")
  if not isinstance(names, list):
    raise ValueError(f"config.json layer_types={names!r}; expected a list of layer kinds "
                     f"(\"mamba\" / \"attention\" or \"linear_attention\" / \"full_attention\")")
  types = _layer_kinds(names, GRANITE_LAYERS, "layer_types")
  n = hf.get("num_hidden_layers")
  if n is not None and n != len(types):
    raise ValueError(f"config.json num_hidden_layers={n} but layer_types lists {len(types)} layers")
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}; only silu is implemented")
  d = _int(hf, "hidden_size")
  experts = hf.get("num_local_experts", 8)   # transformers' default
  if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
    raise ValueError(f"config.json num_local_experts={experts!r}; expected an int >= 0 (0 = dense)")
  moe = moe_config_from_hf(hf, dtype=dtype) if experts else None
  attention = None
  if "attention" in types:
    heads = _int(hf, "num_attention_heads")
    head_dim = _int(hf, "head_dim", d // heads)
    position = hf.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
      raise NotImplementedError(f"position_embedding_type={position!r}; implemented: 'rope', 'nope' / null")
    rotary, theta = _rope(hf, head_dim, default_factor=None) if position == "rope" else (0, 10000.0)
    # GraniteMoeHybridAttention: logits scaled by attention_multiplier (not head_dim^-1/2).
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=_int(hf, "num_key_value_heads", heads), head_dim=head_dim,
        rotary_dim=rotary, rope_theta=theta, bias=bool(hf.get("attention_bias", False)),
        scale=_float(hf, "attention_multiplier", 1.0))
  mamba = _mamba_shape(hf, d) if "mamba2" in types else {}
  config = LMConfig(
      vocab_size=_int(hf, "vocab_size"), hidden_size=d, num_layers=len(types),
      intermediate_size=1 if experts else _int(hf, "shared_intermediate_size"),
      rms_eps=float(_get(hf, "rms_norm_eps", 1e-6)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=types, attention=attention, moe=moe, mlp_types=("moe" if experts else "dense",) * len(types),
      embedding_multiplier=_float(hf, "embedding_multiplier", 1.0),
      residual_multiplier=_float(hf, "residual_multiplier", 1.0),
      logits_scaling=_float(hf, "logits_scaling", 1.0), **mamba, **_NOT_USED)
  return "granite", config


def _plan_bamba(hf, dtype, max_prompt_len):
  """Bamba (BambaForCausalLM): Mamba2 layers, attention at ``attn_layer_indices``, a SwiGLU MLP
  in every layer; attention with rotary embedding of ``partial_rotary_factor`` (0.5) of each head."""
  n = _int(hf, "num_hidden_layers")
  indices = hf.get("attn_layer_indices") or []
  if (not isinstance(indices, list)
      or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in indices)):
    raise ValueError(f"config.json attn_layer_indices={indices!r}; expected a list of layer indices in [0, {n})")
  types = tuple("attention" if i in indices else "mamba2" for i in range(n))
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}; only silu is implemented")
  if hf.get("mlp_bias"):
    raise NotImplementedError("mlp_bias=true (MLP projection biases) is not implemented")
  d = _int(hf, "hidden_size")
  attention = None
  if indices:
    heads = _int(hf, "num_attention_heads")
    head_dim = _int(hf, "head_dim", d // heads)
    rotary, theta = _rope(hf, head_dim, default_factor=0.5)
    attention = AttentionConfig(num_heads=heads, num_kv_heads=_int(hf, "num_key_value_heads", heads),
                                head_dim=head_dim, rotary_dim=rotary, rope_theta=theta,
                                bias=bool(hf.get("attention_bias", False)))
  mamba = _mamba_shape(hf, d) if len(indices) < n else {}
  config = LMConfig(
      vocab_size=_int(hf, "vocab_size"), hidden_size=d, num_layers=n, intermediate_size=_int(hf, "intermediate_size"),
      rms_eps=float(_get(hf, "rms_norm_eps", 1e-5)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=types, attention=attention, **mamba, **_NOT_USED)
  return "bamba", config


def _multipliers(hf: dict, key: str, n: int) -> list:
  """A list of n positive finite numbers (Falcon-H1's ``ssm_multipliers`` / ``mlp_multipliers``)."""
  values = _get(hf, key, [1.0] * n)
  if (not isinstance(values, list) or len(values) != n
      or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf for v in values)):
    raise ValueError(f"config.json {key}={values!r}; expected a list of {n} finite numbers > 0")
  return [float(v) for v in values]


def _falcon_multipliers(hf: dict) -> dict:
  """The Falcon-H1 multipliers folded into the weights (see the module docstring)."""
  scalars = ("lm_head_multiplier", "key_multiplier", "attention_in_multiplier", "attention_out_multiplier",
             "ssm_in_multiplier", "ssm_out_multiplier")
  return ({k: _float(hf, k, 1.0) for k in scalars}
          | {"ssm_multipliers": _multipliers(hf, "ssm_multipliers", 5),
             "mlp_multipliers": _multipliers(hf, "mlp_multipliers", 2)})


def _plan_falcon(hf, dtype, max_prompt_len):
  """Falcon-H1 (FalconH1ForCausalLM): x = norm(h), h + Mamba2(x) + attention(x) in every layer, then
  h + SwiGLU(norm(h)); the muP multipliers folded into the weights by ``_convert``."""
  n = _int(hf, "num_hidden_layers")
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}; only silu is implemented")
  if hf.get("mlp_bias"):
    raise NotImplementedError("mlp_bias=true (MLP projection biases) is not implemented")
  if hf.get("projectors_bias"):
    raise NotImplementedError("projectors_bias=true (the Mamba2 out_proj bias) is not implemented")
  _falcon_multipliers(hf)  # validated here, applied by _convert
  d = _int(hf, "hidden_size")
  heads = _int(hf, "num_attention_heads")
  head_dim = _int(hf, "head_dim", d // heads)
  # FalconH1RotaryEmbedding turns the whole head (partial_rotary_factor is not read).
  rotary, theta = _rope(hf, head_dim, default_factor=None)
  attention = AttentionConfig(num_heads=heads, num_kv_heads=_int(hf, "num_key_value_heads", heads),
                              head_dim=head_dim, rotary_dim=rotary, rope_theta=theta,
                              bias=bool(hf.get("attention_bias", False)))
  if not hf.get("mamba_rms_norm", False):
    norm = "none"
  else:
    norm = "norm_then_gate" if hf.get("mamba_norm_before_gate", True) else "gate_then_norm"
  config = LMConfig(
      vocab_size=_int(hf, "vocab_size"), hidden_size=d, num_layers=n, intermediate_size=_int(hf, "intermediate_size"),
      rms_eps=float(_get(hf, "rms_norm_eps", 1e-5)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=("parallel",) * n, attention=attention, mamba2_norm=norm,
      embedding_multiplier=_float(hf, "embedding_multiplier", 1.0), **_mamba_shape(hf, d), **_NOT_USED)
  return "falcon", config


# ---- tensors -------------------------------------------------------------------------------

class _Tensors:
  """Pops named tensors with shape checks; reports leftovers (unknown names) at the end."""

  def __init__(self, tensors: dict):
    self.left = dict(tensors)

  def has(self, name):
    return name in self.left

  def take(self, name, shape, *, what=""):
    if name not in self.left:
      raise ValueError(f"checkpoint is missing tensor {name!r}; expected shape {list(shape)}"
                       f"{' ' + what if what else ''}")
    array = self.left.pop(name)
    if tuple(array.shape) != tuple(shape):
      raise ValueError(f"tensor {name!r} has shape {list(array.shape)}; expected {list(shape)}"
                       f"{' ' + what if what else ''}")
    return np.asarray(array, np.float32)

  def finish(self):
    if self.left:
      names = sorted(self.left)
      listed = ", ".join(f"{n!r} {list(self.left[n].shape)}" for n in names[:8])
      raise ValueError(f"checkpoint has {len(names)} tensor(s) the mapping does not know: {listed}"
                       f"{' ...' if len(names) > 8 else ''} (see replayssm_jax.models.hf for the names)")


def _convert(hf, family: str, config: LMConfig, tensors: dict) -> dict:
  """{LM parameter path: float32 array in the LM's layout}."""
  t = _Tensors(tensors)
  c = config
  d, v = c.hidden_size, c.vocab_size
  out = {}
  qwen = family == "qwen"
  if family != "mamba":
    prefix = "model.language_model." if t.has("model.language_model.embed_tokens.weight") else "model."
    embed = prefix + "embed_tokens.weight"
    final = prefix + ("final_layernorm.weight" if family in ("bamba", "falcon") else "norm.weight")
  else:
    prefix = "backbone."
    embed = prefix + ("embedding.weight" if t.has(prefix + "embedding.weight") else "embeddings.weight")
    final = prefix + "norm_f.weight"
  out["embed.embedding"] = t.take(embed, (v, d))
  out["final_norm.weight"] = t.take(final, (d,))
  tied = hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False))
  if t.has("lm_head.weight") or not tied:
    out["head.kernel"] = t.take("lm_head.weight", (v, d)).T
  else:
    out["head.kernel"] = out["embed.embedding"].T

  if family == "falcon":
    mult = _falcon_multipliers(hf)
    out["head.kernel"] = out["head.kernel"] * mult["lm_head_multiplier"]

  for i, kind in enumerate(c.layer_types):
    blk, layer = f"blocks.{i}.", f"{prefix}layers.{i}."
    if family == "falcon":
      out.update(_falcon_block(t, layer, blk, c, mult, hf.get("mamba_conv_bias", True)))
      continue
    if family in ("granite", "bamba"):
      out.update(_ibm_block(t, layer, blk, kind, c, family, hf.get("mamba_conv_bias", True)))
      continue
    if qwen:
      out[blk + "mixer_norm.weight"] = t.take(layer + "input_layernorm.weight", (d,))
      out[blk + "mlp_norm.weight"] = t.take(layer + "post_attention_layernorm.weight", (d,))
      if kind == "attention":
        out.update(_attention(t, layer + "self_attn.", blk + "mixer.", c))
      else:
        out.update(_gdn(t, layer + "linear_attn.", blk + "mixer.", c))
      if c.block_mlp(i) == "moe":
        out.update(_moe(t, layer + "mlp.", blk + "mlp.", c))
      else:
        out.update(_swiglu(t, layer + "mlp.", blk + "mlp.", c))
      continue
    norm = t.take(layer + "norm.weight", (d,))
    if kind == "mamba2":
      out[blk + "mixer_norm.weight"] = norm
      out.update(_mamba2(t, layer + "mixer.", blk + "mixer.", c, hf.get("use_conv_bias", True)))
    elif kind == "attention":
      out[blk + "mixer_norm.weight"] = norm
      out.update(_attention(t, layer + "mixer.", blk + "mixer.", c))
    elif kind == "moe":
      out[blk + "mlp_norm.weight"] = norm
      out.update(_moe(t, layer + "mixer.", blk + "mlp.", c))
    else:
      out[blk + "mlp_norm.weight"] = norm
      out[blk + "mlp.up.kernel"] = t.take(layer + "mixer.up_proj.weight", (c.intermediate_size, d)).T
      out[blk + "mlp.down.kernel"] = t.take(layer + "mixer.down_proj.weight", (d, c.intermediate_size)).T
  if c.mtp_layers:
    out.update(_mtp(t, c))
  t.finish()
  return out


def _mtp(t: _Tensors, c: LMConfig) -> dict:
  """The Qwen3-Next / Qwen3.5 multi-token-prediction head (``mtp.*``; module docstring)."""
  d, src = c.hidden_size, MTP_PREFIX + "layers.0."
  out = {"mtp.fc.kernel": t.take(MTP_PREFIX + "fc.weight", (d, 2 * d),
                                 what="(input columns: embedding | hidden)").T}
  for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
    out[f"mtp.{name}.weight"] = t.take(MTP_PREFIX + name + ".weight", (d,))
  out["mtp.block.mixer_norm.weight"] = t.take(src + "input_layernorm.weight", (d,))
  out["mtp.block.mlp_norm.weight"] = t.take(src + "post_attention_layernorm.weight", (d,))
  out.update(_attention(t, src + "self_attn.", "mtp.block.mixer.", c))
  mlp = _moe if c.mtp_mlp == "moe" else _swiglu
  out.update(mlp(t, src + "mlp.", "mtp.block.mlp.", c))
  return out


def _ibm_block(t: _Tensors, layer: str, blk: str, kind: str, c: LMConfig, family: str, conv_bias: bool) -> dict:
  """One Granite 4.0 or Bamba decoder layer: norms, ``mamba.*`` or ``self_attn.*``, the MLP."""
  d = c.hidden_size
  mlp_norm = "pre_ff_layernorm" if family == "bamba" else "post_attention_layernorm"
  out = {blk + "mixer_norm.weight": t.take(layer + "input_layernorm.weight", (d,)),
         blk + "mlp_norm.weight": t.take(layer + mlp_norm + ".weight", (d,))}
  if kind == "attention":
    out.update(_attention(t, layer + "self_attn.", blk + "mixer.", c))
  else:
    out.update(_mamba2(t, layer + "mamba.", blk + "mixer.", c, conv_bias))
  if family == "bamba":
    out.update(_swiglu(t, layer + "feed_forward.", blk + "mlp.", c))
  elif c.moe is not None:
    out.update({blk + "mlp." + k: v for k, v in granite_moe_params(t.take, t.has, layer, c.moe).items()})
  else:   # the shared MLP alone: a dense SwiGLU, input_linear rows gate | up
    s = c.intermediate_size
    out[blk + "mlp.gate_up.kernel"] = t.take(layer + "shared_mlp.input_linear.weight", (2 * s, d),
                                             what="(gate rows | up rows)").T
    out[blk + "mlp.down.kernel"] = t.take(layer + "shared_mlp.output_linear.weight", (d, s)).T
  return out


def _falcon_block(t: _Tensors, layer: str, blk: str, c: LMConfig, mult: dict, conv_bias: bool) -> dict:
  """One Falcon-H1 decoder layer, its multipliers folded into the weights (module docstring)."""
  d, m = c.hidden_size, c.mamba2_mixer()
  out = {blk + "mixer_norm.weight": t.take(layer + "input_layernorm.weight", (d,)),
         blk + "mlp_norm.weight": t.take(layer + "pre_ff_layernorm.weight", (d,))}
  ssm = _mamba2(t, layer + "mamba.", blk + "mixer.mamba2.", c, conv_bias)
  gn = m.num_groups * m.state_dim
  # Columns z | x | B | C | dt of in_proj (compute_mup_vector's layout), each scaled by its multiplier.
  scale = np.repeat(np.float32(mult["ssm_in_multiplier"]) * np.asarray(mult["ssm_multipliers"], np.float32),
                    [m.inner_dim, m.inner_dim, gn, gn, m.num_heads])
  ssm[blk + "mixer.mamba2.in_proj.kernel"] = ssm[blk + "mixer.mamba2.in_proj.kernel"] * scale
  ssm[blk + "mixer.mamba2.out_proj.kernel"] = ssm[blk + "mixer.mamba2.out_proj.kernel"] * mult["ssm_out_multiplier"]
  out.update(ssm)
  attn = _attention(t, layer + "self_attn.", blk + "mixer.attention.", c)
  a_in, key = mult["attention_in_multiplier"], mult["key_multiplier"]
  for name, factor in (("q_proj.kernel", a_in), ("k_proj.kernel", a_in * key), ("k_proj.bias", key),
                       ("v_proj.kernel", a_in), ("o_proj.kernel", mult["attention_out_multiplier"]),
                       ("o_proj.bias", mult["attention_out_multiplier"])):
    if blk + "mixer.attention." + name in attn:
      attn[blk + "mixer.attention." + name] = attn[blk + "mixer.attention." + name] * np.float32(factor)
  out.update(attn)
  mlp = _swiglu(t, layer + "feed_forward.", blk + "mlp.", c)
  gate_up, i = mlp[blk + "mlp.gate_up.kernel"], c.intermediate_size
  mlp[blk + "mlp.gate_up.kernel"] = np.concatenate([gate_up[:, :i] * np.float32(mult["mlp_multipliers"][0]),
                                                    gate_up[:, i:]], axis=1)
  mlp[blk + "mlp.down.kernel"] = mlp[blk + "mlp.down.kernel"] * np.float32(mult["mlp_multipliers"][1])
  out.update(mlp)
  return out


def _swiglu(t: _Tensors, src: str, dst: str, c: LMConfig) -> dict:
  """A dense SwiGLU MLP from ``{gate,up,down}_proj.weight``."""
  d, i = c.hidden_size, c.intermediate_size
  gate, up = (t.take(src + f"{name}_proj.weight", (i, d)) for name in ("gate", "up"))
  return {dst + "gate_up.kernel": np.concatenate([gate, up]).T,
          dst + "down.kernel": t.take(src + "down_proj.weight", (d, i)).T}


def _gdn(t: _Tensors, src: str, dst: str, c: LMConfig) -> dict:
  hk, hv, kd, vd, w, d = (c.num_k_heads, c.num_v_heads, c.head_k_dim, c.head_v_dim, c.conv_kernel,
                          c.hidden_size)
  r, conv_dim = hv // hk, 2 * hk * kd + hv * vd
  if t.has(src + "in_proj_qkvz.weight"):
    qkvz = t.take(src + "in_proj_qkvz.weight", (2 * hk * kd + 2 * hv * vd, d),
                  what="(Qwen3-Next: rows grouped per key head as q, k, v, z)")
    ba = t.take(src + "in_proj_ba.weight", (2 * hv, d), what="(Qwen3-Next: rows grouped per key head as b, a)")
    q, k, vv, z = np.split(qkvz.reshape(hk, 2 * kd + 2 * r * vd, d), np.cumsum([kd, kd, r * vd]), axis=1)
    b, a = np.split(ba.reshape(hk, 2 * r, d), [r], axis=1)
    rows = [x.reshape(-1, d) for x in (q, k, vv, z, b, a)]
  else:
    rows = [t.take(src + "in_proj_qkv.weight", (conv_dim, d), what="(Qwen3.5: q | k | v)"),
            t.take(src + "in_proj_z.weight", (hv * vd, d)),
            t.take(src + "in_proj_b.weight", (hv, d)),
            t.take(src + "in_proj_a.weight", (hv, d))]
  return {
      dst + "in_proj.kernel": np.concatenate(rows, axis=0).T,
      dst + "conv_weight": t.take(src + "conv1d.weight", (conv_dim, 1, w))[:, 0, :].T,
      dst + "A_log": t.take(src + "A_log", (hv,)),
      dst + "dt_bias": t.take(src + "dt_bias", (hv,)),
      dst + "norm_weight": t.take(src + "norm.weight", (vd,)),
      dst + "out_proj.kernel": t.take(src + "out_proj.weight", (d, hv * vd)).T,
  }


def _attention(t: _Tensors, src: str, dst: str, c: LMConfig) -> dict:
  a, d = c.attention, c.hidden_size
  q_rows = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
  kv_rows, o_cols = a.num_kv_heads * a.head_dim, a.num_heads * a.head_dim
  what = "(per head [query | gate])" if a.output_gate else ""
  out = {dst + "q_proj.kernel": t.take(src + "q_proj.weight", (q_rows, d), what=what).T,
         dst + "k_proj.kernel": t.take(src + "k_proj.weight", (kv_rows, d)).T,
         dst + "v_proj.kernel": t.take(src + "v_proj.weight", (kv_rows, d)).T,
         dst + "o_proj.kernel": t.take(src + "o_proj.weight", (d, o_cols)).T}
  if a.bias:
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows), ("o", d)):
      out[dst + f"{name}_proj.bias"] = t.take(src + f"{name}_proj.bias", (rows,))
  if a.qk_norm:
    out[dst + "q_norm"] = t.take(src + "q_norm.weight", (a.head_dim,))
    out[dst + "k_norm"] = t.take(src + "k_norm.weight", (a.head_dim,))
  return out


def _moe(t: _Tensors, src: str, dst: str, c: LMConfig) -> dict:
  params = hf_moe_params(t.take, t.has, src, c.moe)
  return {dst + name: value for name, value in params.items()}


def _mamba2(t: _Tensors, src: str, dst: str, c: LMConfig, conv_bias: bool) -> dict:
  m = c.mamba2_mixer()
  h, d, w = m.num_heads, m.hidden_size, m.conv_kernel
  return {
      dst + "in_proj.kernel": t.take(src + "in_proj.weight", (m.inner_dim + m.conv_dim + h, d),
                                     what="(z | x | B | C | dt)").T,
      dst + "conv_weight": t.take(src + "conv1d.weight", (m.conv_dim, 1, w))[:, 0, :].T,
      dst + "conv_bias": (t.take(src + "conv1d.bias", (m.conv_dim,)) if conv_bias
                          else np.zeros((m.conv_dim,), np.float32)),
      dst + "A_log": t.take(src + "A_log", (h,)),
      dst + "D": t.take(src + "D", (h,)),
      dst + "dt_bias": t.take(src + "dt_bias", (h,)),
      dst + "out_proj.kernel": t.take(src + "out_proj.weight", (d, m.inner_dim)).T,
  } | ({} if m.norm == "none" else {dst + "norm_weight": t.take(src + "norm.weight", (m.inner_dim,))})


def _assign(model: LM, target: str, value: np.ndarray, *, host: bool = False) -> None:
  """Sets the parameter at dotted path ``target`` (e.g. ``blocks.0.mixer.A_log``): a device array,
  or with ``host`` a numpy array (``shard_model`` places its shards)."""
  obj = model
  *parents, leaf = target.split(".")
  for part in parents:
    obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
  var = getattr(obj, leaf)
  if tuple(var.shape) != value.shape:  # a mapping bug, not a checkpoint problem
    raise AssertionError(f"{target}: converted shape {value.shape} != parameter shape {var.shape}")
  var.set_value(np.asarray(value).astype(var.dtype) if host else jnp.asarray(value, var.dtype))
