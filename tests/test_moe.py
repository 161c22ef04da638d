"""MoE MLPs (CPU, float32): Qwen3-Next / Qwen3.5-MoE and Nemotron-H routing against a dense oracle.

The oracle is float64 numpy written from transformers 5.24's modeling code
(``Qwen3NextTopKRouter`` / ``Qwen3NextSparseMoeBlock``, ``NemotronHTopkRouter`` / ``NemotronHMoE``)
on the checkpoint tensors in transformers' own layout: it runs every expert on every token and
weights the results by a dense [T, E] routing matrix, so it shares no dispatch code with the
module. The module is loaded from those tensors through ``hf_moe_params``, so the tests cover the
checkpoint mapping too. The random draws are checked to exercise what they claim (experts with
no tokens, experts with several, groups excluded, the correction bias changing the choice) and to
keep every top-k choice away from ties.
"""
import dataclasses
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replayssm_jax.models import hf as hf_lib
from replayssm_jax.models.moe import MoE, MoEConfig, hf_moe_params, moe_config_from_hf

D, E, K, I, S, L = 24, 16, 3, 20, 28, 12
CONFIGS = {
    "qwen": MoEConfig(hidden_size=D, num_experts=E, top_k=K, expert_intermediate_size=I,
                      shared_intermediate_size=S, router="softmax", activation="swiglu",
                      shared_expert_gate=True),
    "nemotron": MoEConfig(hidden_size=D, num_experts=E, top_k=K, expert_intermediate_size=I,
                          shared_intermediate_size=S, router="sigmoid", activation="relu2", n_group=4,
                          topk_group=2, routed_scaling_factor=2.5, correction_bias=True, latent_size=L),
    "nemotron_plain": MoEConfig(hidden_size=D, num_experts=E, top_k=K, expert_intermediate_size=I,
                                shared_intermediate_size=S, router="sigmoid", activation="relu2",
                                correction_bias=True),
}
PREFIX = {"qwen": "model.layers.3.mlp.", "nemotron": "backbone.layers.3.mixer.",
          "nemotron_plain": "backbone.layers.3.mixer."}
MARGIN = 1e-4  # least gap between the k-th and (k+1)-th choice score (and group score)
run = jax.jit(lambda model, x: model(x))
route = jax.jit(lambda model, x: model.route(x))


def hf_tensors(c: MoEConfig, prefix: str, seed: int = 0) -> dict:
  """Random checkpoint tensors in transformers 5.x's fused layout (torch [out, in] weights)."""
  rng = np.random.default_rng(seed)
  n = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
  din = c.expert_dim
  t = {"gate.weight": n(E, D, scale=0.8)}
  if c.correction_bias:
    t["gate.e_score_correction_bias"] = rng.uniform(-0.3, 0.3, E).astype(np.float32)
  if c.activation == "swiglu":
    t["experts.gate_up_proj"] = n(E, 2 * I, din, scale=din ** -0.5)
    t["shared_expert.gate_proj.weight"] = n(S, D, scale=D ** -0.5)
    t["shared_expert.up_proj.weight"] = n(S, D, scale=D ** -0.5)
    t["shared_expert.down_proj.weight"] = n(D, S, scale=S ** -0.5)
    t["shared_expert_gate.weight"] = n(1, D, scale=D ** -0.5)
  else:
    t["experts.up_proj"] = n(E, I, din, scale=din ** -0.5)
    t["shared_experts.up_proj.weight"] = n(S, D, scale=D ** -0.5)
    t["shared_experts.down_proj.weight"] = n(D, S, scale=S ** -0.5)
  t["experts.down_proj"] = n(E, din, I, scale=I ** -0.5)
  if c.latent_size is not None:
    t["fc1_latent_proj.weight"] = n(L, D, scale=D ** -0.5)
    t["fc2_latent_proj.weight"] = n(D, L, scale=L ** -0.5)
  return {prefix + name: value for name, value in t.items()}


def per_expert(tensors: dict, prefix: str) -> dict:
  """The same tensors in the Hub's per-expert layout (``experts.{j}.{gate,up,down}_proj.weight``)."""
  out = dict(tensors)
  fused = {"experts.gate_up_proj": ("gate", "up"), "experts.up_proj": ("up",), "experts.down_proj": ("down",)}
  for name, parts in fused.items():
    if prefix + name not in out:
      continue
    w = out.pop(prefix + name)
    for j in range(w.shape[0]):
      for part, rows in zip(parts, np.split(w[j], len(parts))):
        out[f"{prefix}experts.{j}.{part}_proj.weight"] = rows
  return out


def group_masked(choice, c: MoEConfig):
  """choice [T, E] with -inf outside each token's topk_group best groups (group score: sum of its
  top-2 choice scores)."""
  if c.n_group == 1:
    return choice
  grouped = choice.reshape(len(choice), c.n_group, -1)
  group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)
  ranked = np.sort(group_scores, -1)[:, ::-1]
  assert np.all(ranked[:, c.topk_group - 1] - ranked[:, c.topk_group] > MARGIN), "group score tie"
  kept = np.argsort(-group_scores, -1)[:, :c.topk_group]
  mask = np.zeros(grouped.shape[:2], bool)
  mask[np.arange(len(choice))[:, None], kept] = True
  return np.where(mask[..., None], grouped, -np.inf).reshape(choice.shape)


def reference(x, tensors: dict, prefix: str, c: MoEConfig):
  """float64 dense oracle (transformers' math): (y like x, chosen experts [T, k], choice scores)."""
  g = lambda name: tensors[prefix + name].astype(np.float64)
  x = np.asarray(x, np.float64).reshape(-1, D)
  t = len(x)
  logits = x @ g("gate.weight").T
  if c.router == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + np.exp(-logits))
  biased = scores + (g("gate.e_score_correction_bias") if c.correction_bias else 0.0)
  choice = group_masked(biased, c)
  ranked = np.sort(choice, -1)[:, ::-1]
  assert np.all(ranked[:, K - 1] - ranked[:, K] > MARGIN), "top-k choice tie"
  idx = np.argsort(-choice, -1)[:, :K]
  w = np.take_along_axis(scores, idx, -1)
  if c.norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + 1e-20)
  w = w * c.routed_scaling_factor
  dense = np.zeros((t, E))
  dense[np.arange(t)[:, None], idx] = w

  h = x @ g("fc1_latent_proj.weight").T if c.latent_size is not None else x
  silu = lambda v: v / (1 + np.exp(-v))
  if c.activation == "swiglu":
    gate, up = np.split(np.einsum("td,eod->teo", h, g("experts.gate_up_proj")), 2, axis=-1)
    a = silu(gate) * up                                                  # [T, E, I]: every expert
  else:
    a = np.maximum(np.einsum("td,eod->teo", h, g("experts.up_proj")), 0) ** 2
  routed = np.einsum("te,ted->td", dense, np.einsum("tei,edi->ted", a, g("experts.down_proj")))
  if c.latent_size is not None:
    routed = routed @ g("fc2_latent_proj.weight").T
  if c.activation == "swiglu":
    a = silu(x @ g("shared_expert.gate_proj.weight").T) * (x @ g("shared_expert.up_proj.weight").T)
    shared = a @ g("shared_expert.down_proj.weight").T
    shared = shared / (1 + np.exp(-(x @ g("shared_expert_gate.weight").T)))
  else:
    shared = (np.maximum(x @ g("shared_experts.up_proj.weight").T, 0) ** 2) @ g("shared_experts.down_proj.weight").T
  return routed + shared, idx, biased


def load(c: MoEConfig, tensors: dict, prefix: str) -> MoE:
  """A MoE whose parameters come from ``tensors`` through ``hf_moe_params`` (all tensors used)."""
  model = nnx.eval_shape(lambda: MoE(c, rngs=nnx.Rngs(0)))
  for name, value in load_params(c, tensors, prefix).items():
    var = getattr(model, name)
    assert var.shape == value.shape, name
    var.set_value(jnp.asarray(value, var.dtype))
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert all(isinstance(v, jax.Array) for v in leaves), "a parameter was left unset"
  return model


def load_params(c, tensors, prefix):
  t = hf_lib._Tensors(tensors)
  params = hf_moe_params(t.take, t.has, prefix, c)
  t.finish()
  return params


def rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def inputs(shape, seed=1):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape, norm", [((2, 5, D), True), ((7, D), False)], ids=["BTD-norm", "BD-no_norm"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_matches_dense_reference(family, shape, norm):
  c = dataclasses.replace(CONFIGS[family], norm_topk_prob=norm)
  tensors = hf_tensors(c, PREFIX[family])
  x = inputs(shape)
  want, idx, choice = reference(x, tensors, PREFIX[family], c)
  counts = np.bincount(idx.ravel(), minlength=E)
  assert counts.min() == 0 and counts.max() >= 2, counts  # idle experts and shared experts
  if c.correction_bias:  # the bias changes some token's choice (among the eligible groups)
    scores = choice - tensors[PREFIX[family] + "gate.e_score_correction_bias"]
    unbiased = np.where(np.isfinite(group_masked(choice, c)), scores, -np.inf)
    assert any(set(a) != set(b) for a, b in zip(np.argsort(-unbiased)[:, :K], idx))
  if c.n_group > 1:  # the group restriction changes some token's choice
    assert any(set(a) != set(b) for a, b in zip(np.argsort(-choice)[:, :K], idx))
  got = run(load(c, tensors, PREFIX[family]), jnp.asarray(x))
  assert got.shape == shape and got.dtype == jnp.float32
  assert rel_l2(got.reshape(-1, D), want) < 1e-5
  np.testing.assert_allclose(np.asarray(got).reshape(-1, D), want, atol=1e-5)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_route_weights_and_experts(family):
  """route(): the chosen experts and their weights (uncorrected scores, renormalised, scaled)."""
  c = CONFIGS[family]
  tensors = hf_tensors(c, PREFIX[family])
  x = inputs((9, D))
  _, want_idx, choice = reference(x, tensors, PREFIX[family], c)
  scores = choice - (tensors[PREFIX[family] + "gate.e_score_correction_bias"] if c.correction_bias else 0)
  want_w = np.take_along_axis(scores, want_idx, -1)
  want_w = want_w / want_w.sum(-1, keepdims=True) * c.routed_scaling_factor
  w, idx = route(load(c, tensors, PREFIX[family]), jnp.asarray(x))
  order, want_order = np.argsort(idx, -1), np.argsort(want_idx, -1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                np.take_along_axis(want_idx, want_order, -1))
  np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                             np.take_along_axis(want_w, want_order, -1), rtol=1e-6)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_checkpoint_layouts_agree(family):
  """Fused (transformers 5.x) and per-expert (Hub) tensors give the same parameters."""
  c, prefix = CONFIGS[family], PREFIX[family]
  fused = load_params(c, hf_tensors(c, prefix), prefix)
  split = load_params(c, per_expert(hf_tensors(c, prefix), prefix), prefix)
  assert fused.keys() == split.keys()
  for name in fused:
    np.testing.assert_array_equal(fused[name], split[name], err_msg=name)


def test_checkpoint_errors():
  c, prefix = CONFIGS["qwen"], PREFIX["qwen"]
  tensors = hf_tensors(c, prefix)
  tensors[prefix + "experts.down_proj"] = tensors[prefix + "experts.down_proj"][:, :, :-1]
  with pytest.raises(ValueError, match=r"experts\.down_proj.*expected \[16, 24, 20\]"):
    load_params(c, tensors, prefix)
  tensors = per_expert(hf_tensors(c, prefix), prefix)
  del tensors[prefix + "experts.7.up_proj.weight"]
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.3\.mlp\.experts\.7\.up_proj\.weight'"):
    load_params(c, tensors, prefix)


@pytest.mark.parametrize("family", ["qwen", "nemotron"])
def test_bfloat16_params_float32_router(family):
  base = CONFIGS[family]
  c = dataclasses.replace(base, dtype=jnp.bfloat16)
  prefix = PREFIX[family]
  tensors = hf_tensors(c, prefix)
  router = (prefix + "gate.weight", prefix + "gate.e_score_correction_bias")
  rounded = {n: v if n in router else np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)
             for n, v in tensors.items()}
  x = np.asarray(jnp.asarray(inputs((2, 5, D)), jnp.bfloat16), np.float32)
  want, want_idx, _ = reference(x, rounded, prefix, c)
  model = load(c, tensors, prefix)
  assert model.router.dtype == jnp.float32 and model.down.dtype == jnp.bfloat16
  _, idx = route(model, jnp.asarray(x, jnp.bfloat16).reshape(-1, D))
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(want_idx, -1))  # same choice
  got = run(model, jnp.asarray(x, jnp.bfloat16))
  assert got.dtype == jnp.bfloat16
  assert rel_l2(got.reshape(-1, D), want) < 2e-2


def slice_params(params: dict, tp: int, d: int) -> dict:
  """Device d's slice of a tp-way split of every intermediate dimension (gate_up: both halves)."""
  part = lambda w, axis: np.split(w, tp, axis=axis)[d]
  out = dict(params)
  for name in ("gate_up", "shared_gate_up"):
    if name in params:
      out[name] = np.concatenate([part(h, -1) for h in np.split(params[name], 2, axis=-1)], axis=-1)
  for name, axis in (("up", -1), ("shared_up", -1), ("down", 1), ("shared_down", 0)):
    if name in params:
      out[name] = part(params[name], axis)
  return out


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", ["qwen", "nemotron"])
def test_sliced_intermediate_partial_sums(family, tp):
  """Slices of the expert / shared intermediate dims give partial outputs that add up to y."""
  c, prefix = CONFIGS[family], PREFIX[family]
  tensors = hf_tensors(c, prefix)
  x = jnp.asarray(inputs((2, 5, D)))
  full = run(load(c, tensors, prefix), x)
  local = dataclasses.replace(c, expert_intermediate_size=I // tp, shared_intermediate_size=S // tp)
  params = load_params(c, tensors, prefix)
  total = 0
  for d in range(tp):
    model = nnx.eval_shape(lambda: MoE(local, rngs=nnx.Rngs(0)))
    for name, value in slice_params(params, tp, d).items():
      getattr(model, name).set_value(jnp.asarray(value))
    total = total + run(model, x)
  np.testing.assert_allclose(total, full, atol=1e-5, rtol=1e-5)


def _avals(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name, [v.aval for v in eqn.outvars]
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _avals(sub)


@pytest.mark.parametrize("family", ["qwen", "nemotron"])
def test_grouped_matmuls_no_dense_expert_product(family):
  """The traced program uses ragged_dot for both expert projections and never forms a tensor
  over (tokens, experts, features): every intermediate is smaller than T·E·min(I, Din)."""
  c = CONFIGS[family]
  graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(c, rngs=nnx.Rngs(0))))
  t = 10
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.zeros((t, D))).jaxpr
  found = list(_avals(jaxpr))
  assert [name for name, _ in found].count("ragged_dot_general") == 2
  bound = t * E * min(I, c.expert_dim)
  for name, avals in found:
    for aval in avals:
      shape = getattr(aval, "shape", ())
      assert int(np.prod(shape)) < bound, (name, shape)
      assert not (len(shape) >= 3 and E in shape and (t in shape or t * K in shape)), (name, shape)


def test_config_errors():
  base = dict(hidden_size=8, num_experts=8, top_k=2, expert_intermediate_size=4)
  cases = [
      (dict(top_k=9), ValueError, "top_k=9; expected <= num_experts=8"),
      (dict(router="sigmoid", n_group=3), ValueError, "n_group=3; expected a divisor"),
      (dict(router="sigmoid", n_group=4, topk_group=5), ValueError, "topk_group=5"),
      (dict(router="sigmoid", n_group=4, topk_group=1, top_k=3), ValueError, "top_k=3; expected <= topk_group"),
      (dict(router="sigmoid", n_group=8), ValueError, "num_experts / n_group = 1"),
      (dict(router="topk"), ValueError, "router='topk'"),
      (dict(activation="gelu"), ValueError, "activation='gelu'"),
      (dict(shared_expert_gate=True), ValueError, "shared_expert_gate=True needs a shared expert"),
      (dict(expert_intermediate_size=0), ValueError, "expert_intermediate_size=0"),
      (dict(norm_topk_prob=1), ValueError, "norm_topk_prob=1; expected a bool"),
      (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor=nan"),
      (dict(dtype=jnp.int32), ValueError, "dtype=int32"),
      (dict(n_group=2), NotImplementedError, "router='softmax' with n_group=2"),
      (dict(correction_bias=True), NotImplementedError, "correction_bias=True"),
  ]
  for override, error, message in cases:
    with pytest.raises(error, match=re.escape(message)):
      MoEConfig(**{**base, **override})
  model = nnx.eval_shape(lambda: MoE(MoEConfig(**base), rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"x has shape \[3, 7\]; expected \[\.\.\., 8\]"):
    model(jnp.zeros((3, 7)))


def test_config_from_hf():
  qwen = dict(model_type="qwen3_next", hidden_size=D, num_experts=E, num_experts_per_tok=K,
              moe_intermediate_size=I, shared_expert_intermediate_size=S, norm_topk_prob=False)
  assert moe_config_from_hf(qwen) == dataclasses.replace(CONFIGS["qwen"], norm_topk_prob=False)
  # Qwen3.5-MoE's router always renormalises (transformers ignores norm_topk_prob there).
  assert moe_config_from_hf(qwen | {"model_type": "qwen3_5_moe_text"}) == CONFIGS["qwen"]
  nemotron = dict(model_type="nemotron_h", hidden_size=D, n_routed_experts=E, num_experts_per_tok=K,
                  moe_intermediate_size=I, moe_shared_expert_intermediate_size=S, n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, moe_latent_size=L, mlp_hidden_act="relu2")
  assert moe_config_from_hf(nemotron) == CONFIGS["nemotron"]
  assert moe_config_from_hf(nemotron | {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                                        "moe_latent_size": None}) == CONFIGS["nemotron_plain"]
  with pytest.raises(NotImplementedError, match="mlp_bias=true"):
    moe_config_from_hf(nemotron | {"mlp_bias": True})
  with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):
    moe_config_from_hf(qwen | {"hidden_act": "gelu"})
  with pytest.raises(ValueError, match="config.json has no 'moe_intermediate_size'"):
    moe_config_from_hf({k: v for k, v in nemotron.items() if k != "moe_intermediate_size"})
