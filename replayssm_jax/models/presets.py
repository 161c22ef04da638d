"""Architecture presets: the shapes of released checkpoints, for benchmarks and random-weight runs.

Each preset is the checkpoint's ``config.json`` content (the fields that shape the model, in the
layout transformers 5.x writes), mapped to an ``LMConfig`` by the same code that reads a
checkpoint directory (``models.hf``), so a preset and the real checkpoint give the same model
shape. ``preset(name, num_layers=...)`` can cut the depth (keeping the layer pattern from the
start) for models that do not fit one device.

==========================  =====================================================================
name                        layers (GDN / Mamba2 / attention / MLP / MoE)
==========================  =====================================================================
``qwen3.5-4b``              32: GatedDeltaNet ×3 then attention, 8 times; SwiGLU MLP 9216 in every block;
                            an MTP head (one attention block, ``models.mtp``)
``qwen3-next-80b-a3b``      48: GatedDeltaNet ×3 then attention, 12 times; MoE (512 experts, top-10,
                            shared expert) in every block
``nemotron-h-8b``           52: ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-``
                            (24 Mamba2, 4 attention, 24 relu² MLP)
``mamba-codestral-7b``      64 Mamba2 (mixer-only blocks)
==========================  =====================================================================
"""
from replayssm_jax.models.hf import _plan
from replayssm_jax.models.lm import LMConfig

_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4)

CONFIGS = {
    # Qwen/Qwen3.5-4B, text model.
    "qwen3.5-4b": dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=2560, intermediate_size=9216,
        num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10]), mtp_num_hidden_layers=1, **_GDN),
    # Qwen/Qwen3-Next-80B-A3B-Instruct (without its MTP head: a 512-expert MoE block that the
    # benchmarks' depth cuts would carry whole).
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], **_GDN),
    # nvidia/Nemotron-H-8B-Base-8K.
    "nemotron-h-8b": dict(
        model_type="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, layer_norm_epsilon=1e-5,
        mlp_hidden_act="relu2", use_conv_bias=True, use_bias=False, tie_word_embeddings=False,
        time_step_limit=[0.0, float("inf")]),
    # mistralai/Mamba-Codestral-7B-v0.1.
    "mamba-codestral-7b": dict(
        model_type="mamba2", vocab_size=32768, hidden_size=4096, num_hidden_layers=64, num_heads=128,
        head_dim=64, state_size=128, n_groups=8, expand=2, conv_kernel=4, layer_norm_epsilon=1e-5,
        use_conv_bias=True, use_bias=False, tie_word_embeddings=False,
        time_step_limit=[0.0, float("inf")]),
}


def preset(name: str, *, num_layers: int | None = None, dtype=None, max_prompt_len: int = 128) -> LMConfig:
  """The LMConfig of a released architecture (see the module docstring for the names).

  Args:
    name: a key of ``CONFIGS``.
    num_layers: keep only the first ``num_layers`` layers (None: all); the layer pattern is kept
      from the start (e.g. 12 layers of qwen3-next-80b-a3b: GDN ×3 + attention, 3 times).
    dtype: parameter / activation dtype (default bfloat16, as the checkpoints ship).
    max_prompt_len: longest prompt ``generate`` and the serving engine accept.
  """
  import jax.numpy as jnp
  if name not in CONFIGS:
    raise ValueError(f"name={name!r}; expected one of {sorted(CONFIGS)}")
  hf = dict(CONFIGS[name])
  if num_layers is not None:
    total = len(hf["hybrid_override_pattern"]) if "hybrid_override_pattern" in hf else hf["num_hidden_layers"]
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers <= total:
      raise ValueError(f"num_layers={num_layers!r}; expected an int in [1, {total}] for {name}")
    if "hybrid_override_pattern" in hf:
      hf["hybrid_override_pattern"] = hf["hybrid_override_pattern"][:num_layers]
    else:
      hf["num_hidden_layers"] = num_layers
  _, config = _plan(hf, dtype=jnp.bfloat16 if dtype is None else jnp.dtype(dtype),
                    max_prompt_len=max_prompt_len)
  return config
