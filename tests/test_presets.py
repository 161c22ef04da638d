"""Architecture presets (``models.presets``): the published shapes map to the intended LMConfigs.

Parameter counts come from ``nnx.eval_shape`` (no weights are allocated) and are checked against
the released checkpoints' sizes (Nemotron-H-8B: 8,100,852,736 parameters; Mamba-Codestral-7B
7.3B), so a wrong head count, width or layer pattern fails.
"""
import jax
import pytest
from flax import nnx

from replayssm_jax.models import LM
from replayssm_jax.models.presets import CONFIGS, preset


def _params(config):
  model = nnx.eval_shape(lambda: LM(config, rngs=nnx.Rngs(0)))
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_presets_have_the_released_layer_patterns():
  q = preset("qwen3.5-4b")
  assert q.layer_types == ("gdn", "gdn", "gdn", "attention") * 8 and set(q.mlp_types) == {"dense"}
  assert (q.attention.num_heads, q.attention.num_kv_heads, q.attention.head_dim, q.attention.rotary_dim) == (16, 4, 256, 64)
  assert (q.num_k_heads, q.num_v_heads, q.head_k_dim, q.head_v_dim) == (16, 32, 128, 128)
  n = preset("qwen3-next-80b-a3b", num_layers=12)
  assert n.layer_types == ("gdn", "gdn", "gdn", "attention") * 3 and set(n.mlp_types) == {"moe"}
  assert (n.moe.num_experts, n.moe.top_k, n.moe.shared_intermediate_size) == (512, 10, 512)
  h = preset("nemotron-h-8b")
  assert [h.layer_types.count(k) for k in ("mamba2", "attention", "mlp")] == [24, 4, 24]
  assert h.attention.rotary_dim == 0 and (h.mamba2_num_heads, h.mamba2_head_dim, h.mamba2_num_groups) == (128, 64, 8)
  assert preset("mamba-codestral-7b").layer_types == ("mamba2",) * 64


def test_parameter_counts_match_the_released_checkpoints():
  assert _params(preset("nemotron-h-8b")) == 8_100_852_736
  assert 7.2e9 < _params(preset("mamba-codestral-7b")) < 7.4e9


def test_bad_preset_arguments():
  with pytest.raises(ValueError, match="name='qwen9'"):
    preset("qwen9")
  with pytest.raises(ValueError, match=r"num_layers=60; expected an int in \[1, 52\]"):
    preset("nemotron-h-8b", num_layers=60)
  assert sorted(CONFIGS) == ["mamba-codestral-7b", "nemotron-h-8b", "qwen3-next-80b-a3b", "qwen3.5-4b"]
