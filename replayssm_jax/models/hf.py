"""Weights from a local Hugging Face directory (``config.json`` + ``*.safetensors``).

``model, config = load_pretrained(path)`` builds an ``LM`` with the checkpoint's shape and loads
its tensors. Nothing is downloaded: ``path`` is a directory on disk. Three layouts are read:

**Qwen3-Next / Qwen3.5** (``model_type`` ``qwen3_next``, ``qwen3_5``, ``qwen3_5_text``; a nested
``text_config`` is used when present). Tensor prefix ``model.`` (or ``model.language_model.``);
``layers.{i}`` below means ``{prefix}layers.{i}``. Every layer must be ``linear_attention``.

====================================================  ===========================================
HF tensor [shape]                                      LM parameter
====================================================  ===========================================
``embed_tokens.weight`` [V, D]                          ``embed.embedding``
``layers.{i}.input_layernorm.weight`` [D]               ``blocks[i].mixer_norm.weight`` (zero-centred: ``norm_offset=1``)
``layers.{i}.post_attention_layernorm.weight`` [D]      ``blocks[i].mlp_norm.weight``
``layers.{i}.linear_attn.in_proj_qkvz.weight``          ``blocks[i].mixer.in_proj.kernel`` columns q|k|v|z:
  [2·Hk·K + 2·Hv·V, D], grouped per key head             rows regrouped from [Hk, (K, K, r·V, r·V)] (r = Hv/Hk)
``layers.{i}.linear_attn.in_proj_ba.weight`` [2·Hv, D]  columns b|a, regrouped from [Hk, (r, r)]
  or split (Qwen3.5): ``in_proj_qkv`` [2·Hk·K + Hv·V, D],  columns q|k|v, z, b, a in that order
  ``in_proj_z`` [Hv·V, D], ``in_proj_b``, ``in_proj_a`` [Hv, D]
``layers.{i}.linear_attn.conv1d.weight`` [C, 1, W]      ``blocks[i].mixer.conv_weight`` [W, C]
``layers.{i}.linear_attn.A_log``, ``dt_bias`` [Hv]      ``blocks[i].mixer.A_log``, ``dt_bias`` (float32)
``layers.{i}.linear_attn.norm.weight`` [V]              ``blocks[i].mixer.norm_weight`` (gated RMSNorm, plain weight)
``layers.{i}.linear_attn.out_proj.weight`` [D, Hv·V]    ``blocks[i].mixer.out_proj.kernel`` (transposed)
``layers.{i}.mlp.{gate,up}_proj.weight`` [I, D]         ``blocks[i].mlp.gate_up.kernel`` [D, 2·I] (both transposed, gate | up)
``layers.{i}.mlp.down_proj.weight`` [D, I]              ``blocks[i].mlp.down.kernel`` (transposed; SwiGLU)
``norm.weight`` [D]                                     ``final_norm.weight`` (zero-centred)
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed; the embedding if tied and absent)
====================================================  ===========================================

**Mamba2** (``model_type`` ``mamba2``) and **Nemotron-H** (``nemotron_h``; layer kinds from
``hybrid_override_pattern``: ``M`` Mamba2, ``-`` MLP). Prefix ``backbone.``:

====================================================  ===========================================
``embeddings.weight`` [V, D]                            ``embed.embedding``
``layers.{i}.norm.weight`` [D]                          ``blocks[i].mixer_norm.weight`` (``M``) / ``mlp_norm.weight`` (``-``)
``layers.{i}.mixer.in_proj.weight`` [I + C + H, D]      ``blocks[i].mixer.in_proj.kernel`` (z | x | B | C | dt, transposed)
``layers.{i}.mixer.conv1d.weight`` [C, 1, W], ``.bias``  ``conv_weight`` [W, C], ``conv_bias`` [C] (zeros if ``use_conv_bias`` is false)
``layers.{i}.mixer.A_log``, ``D``, ``dt_bias`` [H]       ``A_log``, ``D``, ``dt_bias`` (float32)
``layers.{i}.mixer.norm.weight`` [I]                    ``norm_weight`` (grouped gated RMSNorm)
``layers.{i}.mixer.out_proj.weight`` [D, I]             ``out_proj.kernel`` (transposed)
``layers.{i}.mixer.{up,down}_proj.weight`` (``-``)       ``blocks[i].mlp.{up,down}.kernel`` (relu², transposed)
``norm_f.weight`` [D]                                   ``final_norm.weight``
``lm_head.weight`` [V, D]                               ``head.kernel`` (transposed; the embedding if tied and absent)
====================================================  ===========================================

Here I = H·P, C = I + 2·G·N (Mamba2) or 2·Hk·K + Hv·V (GDN). Ignored tensors: ``mtp.*``
(Qwen multi-token-prediction head) and ``visual.*`` / ``model.visual.*`` (vision tower).

Errors: a tensor the mapping does not know, a missing tensor, or a wrong shape raise
``ValueError`` naming the tensor, its shape and the expected one. Valid checkpoints with parts
this library does not implement — softmax-attention layers (``full_attention``, ``*``), MoE
layers (``E``, ``num_experts > 0``), projection biases, dt clamping — raise
``NotImplementedError``. Decode mode (replay or conventional) is not a property of the weights:
choose it when generating (``generate(..., replay=...)``, ``serving.EngineConfig(replay=...)``).
"""
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.models.lm import LM, LMConfig

QWEN_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text")
IGNORED_PREFIXES = ("mtp.", "visual.", "model.visual.")
_NOT_USED = dict(num_k_heads=1, num_v_heads=1, head_k_dim=1, head_v_dim=1)  # no GDN layers


def load_pretrained(path, *, dtype=jnp.float32, max_prompt_len: int = 128):
  """Builds an LM from a local Hugging Face checkpoint directory.

  Args:
    path: directory with ``config.json`` and one or more ``*.safetensors`` files.
    dtype: parameter / activation dtype of the model (float32, bfloat16 or float16); tensors are
      cast to it (A_log, dt_bias and D stay float32).
    max_prompt_len: longest prompt ``generate`` and the serving engine accept.

  Returns:
    (model: LM, config: LMConfig).
  """
  path = pathlib.Path(path)
  if not (path / "config.json").is_file():
    raise ValueError(f"path={str(path)!r} has no config.json; expected a local Hugging Face model "
                     f"directory (config.json + *.safetensors)")
  hf = json.loads((path / "config.json").read_text())
  family, config = _plan(hf, dtype=dtype, max_prompt_len=max_prompt_len)
  values = _convert(hf, family, config, _read_tensors(path))
  model = nnx.eval_shape(lambda: LM(config, rngs=nnx.Rngs(0)))
  for target, value in values.items():
    _assign(model, target, value)
  unset = [jax.tree_util.keystr(k) for k, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
           if not isinstance(x, jax.Array)]
  if unset:  # a mapping bug, not a checkpoint problem
    raise AssertionError(f"parameters left unset by the mapping: {unset}")
  return model, config


# ---- reading -------------------------------------------------------------------------------

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
  return {n: a for n, a in tensors.items() if not n.startswith(IGNORED_PREFIXES)}


def _get(hf: dict, key: str, default=None, *, required=True):
  if key in hf:
    return hf[key]
  if required and default is None:
    raise ValueError(f"config.json has no {key!r}; expected it for model_type={hf.get('model_type')!r}")
  return default


# ---- config --------------------------------------------------------------------------------

def _plan(hf: dict, *, dtype, max_prompt_len):
  """("qwen" | "mamba", LMConfig) from config.json."""
  model_type = hf.get("model_type")
  if model_type in QWEN_TYPES or "linear_num_value_heads" in hf.get("text_config", hf):
    return _plan_qwen(hf.get("text_config", hf) | {"model_type": model_type}, dtype, max_prompt_len)
  if model_type in ("mamba2", "nemotron_h"):
    return _plan_mamba(hf, dtype, max_prompt_len)
  raise NotImplementedError(
      f"config.json model_type={model_type!r} is not supported; load_pretrained reads Qwen3-Next / "
      f"Qwen3.5 ({', '.join(QWEN_TYPES)}), mamba2 and nemotron_h checkpoints")


def _plan_qwen(hf, dtype, max_prompt_len):
  n = _get(hf, "num_hidden_layers")
  types = hf.get("layer_types")
  if types is None:
    interval = _get(hf, "full_attention_interval", 4)
    types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
  for i, t in enumerate(types):
    if t != "linear_attention":
      raise NotImplementedError(
          f"layer {i} is {t!r}: replayssm_jax implements the linear-attention (GatedDeltaNet) and "
          f"Mamba2 mixers, not softmax attention, so hybrid checkpoints with attention layers "
          f"cannot be loaded (layer_types={types})")
  num_experts = hf.get("num_experts", 0) or 0
  if num_experts > 0:
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers", []))
    moe = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    if moe:
      raise NotImplementedError(f"layers {moe} are mixture-of-experts MLPs (num_experts={num_experts}); "
                                f"only dense SwiGLU MLPs are implemented")
  if hf.get("hidden_act", "silu") != "silu":
    raise NotImplementedError(f"hidden_act={hf['hidden_act']!r}; only silu is implemented")
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise NotImplementedError("projection biases are not implemented")
  config = LMConfig(
      vocab_size=_get(hf, "vocab_size"), hidden_size=_get(hf, "hidden_size"), num_layers=n,
      num_k_heads=_get(hf, "linear_num_key_heads"), num_v_heads=_get(hf, "linear_num_value_heads"),
      head_k_dim=_get(hf, "linear_key_head_dim"), head_v_dim=_get(hf, "linear_value_head_dim"),
      intermediate_size=_get(hf, "intermediate_size"), conv_kernel=_get(hf, "linear_conv_kernel_dim", 4),
      rms_eps=float(_get(hf, "rms_norm_eps", 1e-6)), dtype=dtype, max_prompt_len=max_prompt_len,
      norm_offset=1.0)
  return "qwen", config


def _plan_mamba(hf, dtype, max_prompt_len):
  n = _get(hf, "num_hidden_layers")
  if hf["model_type"] == "nemotron_h":
    pattern = _get(hf, "hybrid_override_pattern")
    if len(pattern) != n:
      raise ValueError(f"config.json hybrid_override_pattern has {len(pattern)} entries; expected "
                       f"num_hidden_layers = {n}")
    kinds = {"M": "mamba2", "-": "mlp"}
    for i, ch in enumerate(pattern):
      if ch not in kinds:
        what = {"*": "softmax attention", "E": "a mixture-of-experts MLP"}.get(ch, f"kind {ch!r}")
        raise NotImplementedError(
            f"layer {i} is {what} ({ch!r} in hybrid_override_pattern={pattern!r}): replayssm_jax "
            f"implements Mamba2 ('M') and MLP ('-') layers of Nemotron-H, not attention or MoE")
    types = tuple(kinds[ch] for ch in pattern)
    heads, head_dim = _get(hf, "mamba_num_heads"), _get(hf, "mamba_head_dim")
    state, intermediate = _get(hf, "ssm_state_size"), _get(hf, "intermediate_size")
    if hf.get("mlp_hidden_act", "relu2") != "relu2" or hf.get("mlp_bias"):
      raise NotImplementedError(f"Nemotron-H MLP with mlp_hidden_act={hf.get('mlp_hidden_act')!r}, "
                                f"mlp_bias={hf.get('mlp_bias')}; only relu² without bias is implemented")
  else:
    types = ("mamba2",) * n
    heads, head_dim, state, intermediate = (_get(hf, "num_heads"), _get(hf, "head_dim"),
                                           _get(hf, "state_size"), 1)
  if hf.get("use_bias"):
    raise NotImplementedError("use_bias=true (in_proj/out_proj biases) is not implemented")
  limit = hf.get("time_step_limit", [0.0, math.inf])
  if limit is not None and (limit[0] > 0 or math.isfinite(limit[1])):
    raise NotImplementedError(f"time_step_limit={limit} (dt clamping) is not implemented")
  act = hf.get("mamba_hidden_act", hf.get("hidden_act", "silu"))
  if act != "silu":
    raise NotImplementedError(f"Mamba2 activation {act!r}; only silu is implemented")
  config = LMConfig(
      vocab_size=_get(hf, "vocab_size"), hidden_size=_get(hf, "hidden_size"), num_layers=n,
      intermediate_size=intermediate, conv_kernel=_get(hf, "conv_kernel", 4),
      rms_eps=float(_get(hf, "layer_norm_epsilon", 1e-5)), dtype=dtype, max_prompt_len=max_prompt_len,
      layer_types=types, mixer_mlp=False, mlp_act="relu2", mamba2_num_heads=heads,
      mamba2_head_dim=head_dim, mamba2_num_groups=_get(hf, "n_groups", 1), mamba2_state_dim=state,
      **_NOT_USED)
  return "mamba", config


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
  if qwen:
    prefix = "model.language_model." if t.has("model.language_model.embed_tokens.weight") else "model."
    embed, final = prefix + "embed_tokens.weight", prefix + "norm.weight"
  else:
    prefix = "backbone."
    embed, final = prefix + "embeddings.weight", prefix + "norm_f.weight"
  out["embed.embedding"] = t.take(embed, (v, d))
  out["final_norm.weight"] = t.take(final, (d,))
  tied = hf.get("tie_word_embeddings", hf.get("text_config", {}).get("tie_word_embeddings", False))
  if t.has("lm_head.weight") or not tied:
    out["head.kernel"] = t.take("lm_head.weight", (v, d)).T
  else:
    out["head.kernel"] = out["embed.embedding"].T

  for i, kind in enumerate(c.layer_types):
    blk = f"blocks.{i}."
    if qwen:
      layer = f"{prefix}layers.{i}."
      out[blk + "mixer_norm.weight"] = t.take(layer + "input_layernorm.weight", (d,))
      out[blk + "mlp_norm.weight"] = t.take(layer + "post_attention_layernorm.weight", (d,))
      out.update(_gdn(t, layer + "linear_attn.", blk + "mixer.", c))
      gate, up = (t.take(layer + f"mlp.{name}_proj.weight", (c.intermediate_size, d)) for name in ("gate", "up"))
      out[blk + "mlp.gate_up.kernel"] = np.concatenate([gate, up]).T
      out[blk + "mlp.down.kernel"] = t.take(layer + "mlp.down_proj.weight", (d, c.intermediate_size)).T
    else:
      layer = f"{prefix}layers.{i}."
      if kind == "mamba2":
        out[blk + "mixer_norm.weight"] = t.take(layer + "norm.weight", (d,))
        out.update(_mamba2(t, layer + "mixer.", blk + "mixer.", c, hf.get("use_conv_bias", True)))
      else:
        out[blk + "mlp_norm.weight"] = t.take(layer + "norm.weight", (d,))
        out[blk + "mlp.up.kernel"] = t.take(layer + "mixer.up_proj.weight", (c.intermediate_size, d)).T
        out[blk + "mlp.down.kernel"] = t.take(layer + "mixer.down_proj.weight", (d, c.intermediate_size)).T
  t.finish()
  return out


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
      dst + "norm_weight": t.take(src + "norm.weight", (m.inner_dim,)),
      dst + "out_proj.kernel": t.take(src + "out_proj.weight", (d, m.inner_dim)).T,
  }


def _assign(model: LM, target: str, value: np.ndarray) -> None:
  """Sets the parameter at dotted path ``target`` (e.g. ``blocks.0.mixer.A_log``)."""
  obj = model
  *parents, leaf = target.split(".")
  for part in parents:
    obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
  var = getattr(obj, leaf)
  if tuple(var.shape) != value.shape:  # a mapping bug, not a checkpoint problem
    raise AssertionError(f"{target}: converted shape {value.shape} != parameter shape {var.shape}")
  var.set_value(jnp.asarray(value, var.dtype))
