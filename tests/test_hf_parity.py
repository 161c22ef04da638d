"""Parity with transformers on real checkpoint layouts (``tests/data/hf``, written by transformers'
``save_pretrained``; see tests/data/README.md for the versions and the script that made them).

For each family — Qwen3.5 (dense, attention every 4th layer), its multimodal wrapper, Qwen3-Next
(attention + MoE), Qwen3.5-MoE, Nemotron-H (Mamba2, attention, MoE and MLP layers), Mamba2 and
Granite 4.0 (Mamba2 + attention with MoE and shared MLP, muP multipliers; and its dense variant with
rotary attention), Bamba (Mamba2 + attention with partial rotary, SwiGLU MLPs) and Falcon-H1 (Mamba2
and attention in parallel in every layer, muP multipliers; without and with the Mamba2 norm) — the
directory loads through ``load_pretrained`` and gives transformers' prefill logits (relative
L2 <= 1e-5, float32, matmul precision highest) and its 32 greedy tokens, token for token, with
ReplaySSM, conventional and speculative (3 n-gram drafts) decoding. No torch needed.
"""
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.models import generate, load_pretrained

ROOT_DIR = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT_DIR / "tests" / "data" / "hf"
FAMILIES = ("qwen3_5", "qwen3_5_vl", "qwen3_next", "qwen3_5_moe", "nemotron_h", "mamba2", "granitemoehybrid",
            "granitemoehybrid_dense_rope", "bamba", "falcon_h1", "falcon_h1_rms_norm", "qwen3_5_mtp",
            "qwen3_next_mtp")
MAX_PROMPT = 16


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def _reference(name):
  return np.load(DATA / name / "reference.npz")


def _prompts(ref):
  """int32 prompts [2, MAX_PROMPT] (right-padded) and their lengths."""
  rows = [ref["prompt_0"], ref["prompt_1"]]
  prompts = np.zeros((2, MAX_PROMPT), np.int32)
  for b, p in enumerate(rows):
    prompts[b, :len(p)] = p
  return prompts, np.array([len(p) for p in rows], np.int32)


def _prefill_logits(model, prompts, lengths):
  cache = model.init_cache(4, max_len=MAX_PROMPT)
  logits, _ = model.prefill(jnp.asarray(prompts), cache, jnp.array([3, 1], jnp.int32), jnp.asarray(lengths))
  return np.asarray(logits)


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  model, config = load_pretrained(DATA / request.param, max_prompt_len=MAX_PROMPT)
  return request.param, model, config, _reference(request.param)


def test_prefill_logits_match_transformers(family):
  name, model, _, ref = family
  prompts, lengths = _prompts(ref)
  logits = _prefill_logits(model, prompts, lengths)
  for b, n in enumerate(lengths):
    assert _rel(logits[b, :n], ref[f"prefill_logits_{b}"].reshape(n, -1)) <= 1e-5, (name, b)


@pytest.mark.parametrize("mode", ["replay", "conventional", "speculative"])
def test_greedy_tokens_match_transformers(family, mode):
  name, model, _, ref = family
  prompts, lengths = _prompts(ref)
  tokens, num = generate(model, prompts, lengths, max_new_tokens=32, replay=mode != "conventional",
                         speculative=3 if mode == "speculative" else 0)
  assert np.asarray(num).tolist() == [32, 32]
  for b in range(2):
    np.testing.assert_array_equal(np.asarray(tokens[b]), ref[f"greedy_{b}"], err_msg=f"{name} {mode} row {b}")


def test_the_fixtures_exercise_what_they_claim(family):
  """The layer kinds are what the family is about, the Mamba2 step sizes of Nemotron-H and Mamba2
  fall on both sides of transformers' Nemotron-H clamp (so the clamp semantics change the
  outputs), and Granite's multipliers and positional encoding are the ones the fixture names."""
  name, _, config, ref = family
  kinds = set(config.layer_types) | {config.block_mlp(i) for i in range(config.num_layers)}
  expected = {"qwen3_5": {"gdn", "attention", "dense"}, "qwen3_5_vl": {"gdn", "attention", "dense"},
              "qwen3_5_mtp": {"gdn", "attention", "dense"}, "qwen3_next_mtp": {"gdn", "attention", "moe", "dense"},
              "qwen3_next": {"gdn", "attention", "moe", "dense"}, "qwen3_5_moe": {"gdn", "attention", "moe"},
              "nemotron_h": {"mamba2", "attention", "moe", "mlp", "dense", None},
              "mamba2": {"mamba2", None}, "granitemoehybrid": {"mamba2", "attention", "moe"},
              "granitemoehybrid_dense_rope": {"mamba2", "attention", "dense"},
              "bamba": {"mamba2", "attention", "dense"}, "falcon_h1": {"parallel", "dense"},
              "falcon_h1_rms_norm": {"parallel", "dense"}}[name]
  assert kinds == expected
  assert config.mtp_layers == name.endswith("_mtp")
  if name in ("nemotron_h", "mamba2"):
    for b in range(2):
      assert 0.2 <= float(ref[f"dt_below_min_{b}"]) <= 0.8
  granite = name.startswith("granitemoehybrid")
  multipliers = (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling)
  falcon = name.startswith("falcon_h1")
  assert multipliers == ((12.0, 0.22, 8.0) if granite else (5.656854249492381, 1.0, 1.0) if falcon else (1.0, 1.0, 1.0))
  if granite:
    a = config.attention
    assert a.logit_scale != a.head_dim ** -0.5
    assert a.rotary_dim == (a.head_dim if name.endswith("rope") else 0)
    assert config.moe is None or not config.moe.shared_expert_gate
  if name == "bamba":
    assert config.attention.rotary_dim == config.attention.head_dim // 2
  if falcon:   # the whole head turns; head_dim and the Mamba2 width as the config says, not derived
    a = config.attention
    assert a.rotary_dim == a.head_dim == (24 if name == "falcon_h1" else 16)
    assert config.mamba2_num_heads * config.mamba2_head_dim == (96 if name == "falcon_h1" else 64)
    assert config.mamba2_norm == ("none" if name == "falcon_h1" else "norm_then_gate")


def test_nemotron_h_clips_dt_to_time_step_limit_not_at_time_step_min(tmp_path):
  """The library clips Δ to time_step_limit = (0, ∞), as NVIDIA's reference does, not at
  time_step_min (transformers' Nemotron-H did that in its prefill up to 5.24; from 5.25 it follows
  time_step_limit too). 36-38 % of the fixture's Δ lie below time_step_min, so such a clamp is
  visible: with time_step_limit rewritten to (time_step_min, ∞) the logits leave the reference by
  more than 1e-3."""
  ref = _reference("nemotron_h")
  prompts, lengths = _prompts(ref)

  def distances(path):
    model, _ = load_pretrained(path, max_prompt_len=MAX_PROMPT)
    logits = _prefill_logits(model, prompts, lengths)
    return [_rel(logits[b, :n], ref[f"prefill_logits_{b}"].reshape(n, -1)) for b, n in enumerate(lengths)]

  assert max(distances(DATA / "nemotron_h")) <= 1e-5
  clamped = _rewrite(tmp_path, "nemotron_h",
                     lambda cfg: cfg.update(time_step_limit=[cfg["time_step_min"], 1e30]))
  assert min(distances(clamped)) > 1e-3


def _rewrite(tmp_path, name, edit):
  shutil.copytree(DATA / name, tmp_path / name)
  cfg = json.loads((tmp_path / name / "config.json").read_text())
  text = edit(cfg)
  (tmp_path / name / "config.json").write_text(text if isinstance(text, str) else json.dumps(cfg))
  return tmp_path / name


def test_older_hub_config_layouts_load_the_same_model(tmp_path):
  """Nemotron-H with num_hidden_layers + hybrid_override_pattern + legacy mamba_* keys and a bare
  Infinity; Qwen3-Next with top-level rope_theta / partial_rotary_factor and
  full_attention_interval instead of layer_types and rope_parameters."""
  def old_nemotron(cfg):
    kinds = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}
    cfg["hybrid_override_pattern"] = "".join(kinds[k] for k in cfg.pop("layers_block_type"))
    cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    cfg["mamba_n_groups"] = cfg.pop("n_groups")
    cfg["mamba_d_conv"] = cfg.pop("conv_kernel")
    cfg.pop("time_step_limit")
    return json.dumps(cfg)[:-1] + ', "mamba_dt_limit": [0.0, Infinity]}'

  def old_qwen(cfg):
    rope = cfg.pop("rope_parameters")
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
               rope_scaling=None, full_attention_interval=4)
    cfg.pop("layer_types")

  for name, edit in (("nemotron_h", old_nemotron), ("qwen3_next", old_qwen)):
    new, new_config = load_pretrained(DATA / name, max_prompt_len=MAX_PROMPT)
    old, old_config = load_pretrained(_rewrite(tmp_path, name, edit), max_prompt_len=MAX_PROMPT)
    assert old_config == new_config
    prompts, lengths = _prompts(_reference(name))
    np.testing.assert_array_equal(_prefill_logits(old, prompts, lengths), _prefill_logits(new, prompts, lengths))


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c.update(layers_block_type=["linear_attention", "sliding_attention"]), NotImplementedError,
     r"layer 1 is 'sliding_attention' \(layers_block_type\)"),
    (lambda c: c.update(mlp_hidden_act="gelu"), NotImplementedError, "mlp_hidden_act='gelu'"),
    (lambda c: c.update(use_bias=True), NotImplementedError, "use_bias=true"),
    (lambda c: c.update(num_hidden_layers=5), ValueError, "num_hidden_layers=5 but the layer kinds list 6"),
    (lambda c: c.pop("layers_block_type"), ValueError, "neither 'layers_block_type' nor 'hybrid_override_pattern'"),
    (lambda c: c.update(time_step_limit="wide"), ValueError, "time_step_limit='wide'"),
], ids=["layer-kind", "activation", "bias", "layer-count", "no-kinds", "limit"])
def test_nemotron_h_configs_the_library_cannot_load(tmp_path, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_rewrite(tmp_path, "nemotron_h", edit))


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), NotImplementedError, "rope_type='yarn'"),
    (lambda c: c.update(layer_types=c["layer_types"][:-1] + ["sliding_attention"]), NotImplementedError,
     r"layer 3 is 'sliding_attention'"),
    (lambda c: c.update(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
    (lambda c: c.pop("moe_intermediate_size"), ValueError, "no 'moe_intermediate_size'"),
    (lambda c: "{not json", ValueError, "is not valid JSON"),
], ids=["rope", "layer-kind", "activation", "moe-size", "json"])
def test_qwen_configs_the_library_cannot_load(tmp_path, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_rewrite(tmp_path, "qwen3_next", edit))


def test_granite_hub_layouts_load_the_same_model(tmp_path):
  """The Hub's config.json (legacy layer names "mamba" / "attention", top-level rope_theta, no
  time_step_limit) and transformers' in-memory tensor names (``router.weight``,
  ``experts.gate_up_proj``, ``experts.down_proj``) give the model of the saved fixtures."""
  from safetensors.numpy import load_file, save_file

  def hub_config(cfg):
    legacy = {"linear_attention": "mamba", "full_attention": "attention"}
    cfg["layer_types"] = [legacy[k] for k in cfg["layer_types"]]
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None
    cfg.pop("time_step_limit")

  for name in ("granitemoehybrid", "granitemoehybrid_dense_rope"):
    path = _rewrite(tmp_path, name, hub_config)
    renames = {"router.layer.weight": "router.weight", "input_linear.weight": "experts.gate_up_proj",
               "output_linear.weight": "experts.down_proj"}
    tensors = {}
    for key, value in load_file(path / "model.safetensors").items():
      head, sep, tail = key.partition("block_sparse_moe.")
      tensors[head + sep + renames.get(tail, tail) if sep else key] = value
    save_file(tensors, path / "model.safetensors")
    new, new_config = load_pretrained(DATA / name, max_prompt_len=MAX_PROMPT)
    old, old_config = load_pretrained(path, max_prompt_len=MAX_PROMPT)
    assert old_config == new_config
    prompts, lengths = _prompts(_reference(name))
    np.testing.assert_array_equal(_prefill_logits(old, prompts, lengths), _prefill_logits(new, prompts, lengths))


@pytest.mark.parametrize("name, edit, error, match", [
    ("granitemoehybrid", lambda c: c.update(layer_types=["mamba", "sliding_attention", "mamba", "mamba"]),
     NotImplementedError, r"layer 1 is 'sliding_attention' \(layer_types\)"),
    ("granitemoehybrid", lambda c: c.update(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
    ("granitemoehybrid", lambda c: c.update(mamba_proj_bias=True), NotImplementedError, "mamba_proj_bias=true"),
    ("granitemoehybrid", lambda c: c.update(position_embedding_type="alibi"), NotImplementedError,
     "position_embedding_type='alibi'"),
    ("granitemoehybrid_dense_rope", lambda c: c["rope_parameters"].update(rope_type="yarn"), NotImplementedError,
     "rope_type='yarn'"),
    ("granitemoehybrid", lambda c: c.update(num_hidden_layers=5), ValueError,
     "num_hidden_layers=5 but layer_types lists 4"),
    ("granitemoehybrid", lambda c: c.pop("layer_types"), ValueError, "layer_types=None"),
    ("granitemoehybrid", lambda c: c.update(mamba_d_head=12), ValueError, "mamba_d_head=12"),
    ("granitemoehybrid", lambda c: c.update(num_local_experts=-1), ValueError, "num_local_experts=-1"),
    ("granitemoehybrid", lambda c: c.pop("shared_intermediate_size"), ValueError, "no 'shared_intermediate_size'"),
    ("granitemoehybrid", lambda c: c.update(logits_scaling=0), ValueError, "logits_scaling=0"),
    ("granitemoehybrid", lambda c: c.update(embedding_multiplier="12"), ValueError, "embedding_multiplier='12'"),
    ("granitemoehybrid_dense_rope", lambda c: c.update(attention_multiplier=-0.1), ValueError,
     "attention_multiplier=-0.1"),
], ids=["layer-kind", "activation", "proj-bias", "position", "rope", "layer-count", "no-kinds", "head-dim",
        "experts", "shared-size", "logits-scaling", "multiplier-type", "attention-multiplier"])
def test_granite_configs_the_library_cannot_load(tmp_path, name, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_rewrite(tmp_path, name, edit))


def test_bamba_hub_config_loads_the_same_model(tmp_path):
  """The Hub's Bamba config.json: top-level rope_theta and no rope_parameters (transformers then
  rotates half of each head, as the saved ``partial_rotary_factor`` 0.5 says)."""
  def hub_config(cfg):
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_scaling"] = None

  new, new_config = load_pretrained(DATA / "bamba", max_prompt_len=MAX_PROMPT)
  old, old_config = load_pretrained(_rewrite(tmp_path, "bamba", hub_config), max_prompt_len=MAX_PROMPT)
  assert old_config == new_config


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c.update(attn_layer_indices=[4]), ValueError, r"attn_layer_indices=\[4\]; expected a list of "
     r"layer indices in \[0, 4\)"),
    (lambda c: c.update(mlp_bias=True), NotImplementedError, "mlp_bias=true"),
    (lambda c: c.update(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
    (lambda c: c.update(mamba_proj_bias=True), NotImplementedError, "mamba_proj_bias=true"),
    (lambda c: c["rope_parameters"].update(rope_type="dynamic"), NotImplementedError, "rope_type='dynamic'"),
], ids=["attention-index", "mlp-bias", "activation", "proj-bias", "rope"])
def test_bamba_configs_the_library_cannot_load(tmp_path, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_rewrite(tmp_path, "bamba", edit))


def test_vision_tower_is_skipped_with_a_warning(caplog):
  with caplog.at_level("WARNING"):
    load_pretrained(DATA / "qwen3_5_vl", max_prompt_len=MAX_PROMPT)
  assert "skipped the vision tower" in caplog.text


def test_falcon_h1_hub_config_loads_the_same_model(tmp_path):
  """The Hub's Falcon-H1 config.json: top-level rope_theta, no rope_parameters or time_step_limit,
  and keys transformers does not read (``attn_layer_indices``, ``mamba_use_mlp``)."""
  def hub_config(cfg):
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(rope_scaling=None, attn_layer_indices=None, mamba_use_mlp=True)
    cfg.pop("time_step_limit")

  for name in ("falcon_h1", "falcon_h1_rms_norm"):
    new, new_config = load_pretrained(DATA / name, max_prompt_len=MAX_PROMPT)
    old, old_config = load_pretrained(_rewrite(tmp_path, name, hub_config), max_prompt_len=MAX_PROMPT)
    assert old_config == new_config


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c.update(mamba_proj_bias=True), NotImplementedError, "mamba_proj_bias=true"),
    (lambda c: c.update(projectors_bias=True), NotImplementedError, "projectors_bias=true"),
    (lambda c: c.update(mlp_bias=True), NotImplementedError, "mlp_bias=true"),
    (lambda c: c.update(hidden_act="gelu"), NotImplementedError, "hidden_act='gelu'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), NotImplementedError, "rope_type='yarn'"),
    (lambda c: c.update(ssm_multipliers=[1.0, 1.0, 1.0, 1.0]), ValueError, r"ssm_multipliers=\[1.0, 1.0, 1.0, 1.0\]; "
     "expected a list of 5"),
    (lambda c: c.update(mlp_multipliers=[1.0, 0]), ValueError, "mlp_multipliers"),
    (lambda c: c.update(key_multiplier=-0.5), ValueError, "key_multiplier=-0.5"),
    (lambda c: c.update(lm_head_multiplier="0.04"), ValueError, "lm_head_multiplier='0.04'"),
    (lambda c: c.update(mamba_d_head=10), ValueError, "mamba_d_head=10"),
    (lambda c: c.pop("num_hidden_layers"), ValueError, "no 'num_hidden_layers'"),
], ids=["proj-bias", "projectors-bias", "mlp-bias", "activation", "rope", "ssm-multipliers", "mlp-multipliers",
        "key-multiplier", "multiplier-type", "head-dim", "layers"])
def test_falcon_h1_configs_the_library_cannot_load(tmp_path, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_rewrite(tmp_path, "falcon_h1", edit))
