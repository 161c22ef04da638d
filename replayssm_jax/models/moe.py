"""Mixture-of-experts MLPs of Qwen3-Next / Qwen3.5-MoE, Nemotron-H and Granite 4.0, as transformers 5.x defines them.

For tokens x [T, D] (any leading shape is flattened), E experts, top-k (``top_k``):

    logits = x · W_r                       [T, E]   float32 (router weights are float32)
    s      = softmax(logits)   router="softmax" (Qwen3-Next, Qwen3.5-MoE, Granite 4.0)
           | sigmoid(logits)   router="sigmoid" (Nemotron-H)
    c      = s + b             b = correction_bias (else 0): used to *choose* experts only
    c      = -inf outside the topk_group best of n_group groups (group score: sum of its top-2 c)
    idx    = top_k(c)                      [T, k]
    w      = s[idx]  (/ (Σ_k s[idx] + 1e-20) if norm_topk_prob)  · routed_scaling_factor
    y      = out(Σ_j w_j · expert_{idx_j}(in(x)))  +  shared(x) (· sigmoid(x · g) with a shared gate)

expert_e(h) = down_e(silu(gate_e(h)) · up_e(h)) (activation="swiglu") or down_e(relu(up_e(h))²)
("relu2"); the shared expert has the same activation. in / out are Nemotron-H's latent projections
(``latent_size``; identity otherwise). Routing and the weighted sum run in float32, the expert
matmuls in the model dtype (the second one accumulates in float32); the output has the model dtype.
Granite's router takes the softmax of the k largest logits, which is the renormalised softmax
(``norm_topk_prob``) up to rounding. Transformers' Qwen blocks round the router logits and the routing weights to the model dtype, so
at bfloat16 this module is slightly more exact than they are; at float32 the two agree.

Dispatch: the T·k (token, expert) pairs are sorted by expert (``argsort``), the tokens gathered in
that order and both expert projections run as grouped matmuls (``grouped_matmul``, group sizes =
tokens per expert, data, not shapes), then the rows are put back in pair order and summed per
token with their weights. Every shape is static (T·k rows), no [T, E, ·] intermediate exists, and
the matmul work follows k, not E. The grouped matmul is ``jax.lax.ragged_dot`` ("xla"; on CPU JAX
lowers it to a masked dense product over all groups, on GPU to XLA's ragged-dot instruction) or
the Pallas-Triton kernel of pallas/moe_triton.py, which streams each expert's weights once per
16-row tile ("pallas_triton", the GPU default).

Tensor parallelism: every computation is linear in the expert / shared intermediate dimension
after the activation, and nothing here reads its full size from the config (only from the
parameter shapes). A device holding a slice of every expert's intermediate columns (``gate_up``:
the matching columns of both halves, i.e. regrouped device-major with groups [I, I]; ``up``;
``down`` rows) and of the shared expert's, with the router, correction bias, shared gate and latent
projections replicated, returns its partial sum of ``y``; the ``psum`` over the slices is ``y``.

Checkpoint tensors (``hf_moe_params``), relative to the block prefix (Qwen ``model.layers.{i}.mlp.``
or ``model.language_model.layers.{i}.mlp.``; Nemotron-H ``backbone.layers.{i}.mixer.``); weights
are torch ``[out, in]``:

=================================================  ==========================================
HF tensor [shape]                                   MoE parameter
=================================================  ==========================================
``gate.weight`` [E, D]                              ``router`` [D, E] (float32)
``gate.e_score_correction_bias`` [E] (Nemotron-H)   ``correction_bias`` [E] (float32)
Qwen, fused (transformers 5.x):
``experts.gate_up_proj`` [E, 2I, D] (gate | up)     ``gate_up`` [E, D, 2I] (columns gate | up)
``experts.down_proj`` [E, D, I]                     ``down`` [E, I, D]
Qwen, per expert (Hub files), j < E:
``experts.{j}.{gate,up}_proj.weight`` [I, D]        ``gate_up[j]`` (gate | up)
``experts.{j}.down_proj.weight`` [D, I]             ``down[j]``
``shared_expert.{gate,up}_proj.weight`` [S, D]      ``shared_gate_up`` [D, 2S]
``shared_expert.down_proj.weight`` [D, S]           ``shared_down`` [S, D]
``shared_expert_gate.weight`` [1, D]                ``shared_expert_gate`` [D, 1]
Nemotron-H, fused / per expert (Din = L or D):
``experts.up_proj`` [E, I, Din]                     ``up`` [E, Din, I]
``experts.down_proj`` [E, Din, I]                   ``down`` [E, I, Din]
``experts.{j}.up_proj.weight`` [I, Din]             ``up[j]``
``experts.{j}.down_proj.weight`` [Din, I]           ``down[j]``
``shared_experts.up_proj.weight`` [S, D]            ``shared_up`` [D, S]
``shared_experts.down_proj.weight`` [D, S]          ``shared_down`` [S, D]
``fc1_latent_proj.weight`` [L, D]                   ``latent_in`` [D, L]
``fc2_latent_proj.weight`` [D, L]                   ``latent_out`` [L, D]
Granite 4.0 (``granite_moe_params``; relative to ``model.layers.{i}.``):
``block_sparse_moe.router.layer.weight`` [E, D]     ``router`` [D, E] (float32; or ``router.weight``)
``block_sparse_moe.input_linear.weight`` [E, 2I, D]  ``gate_up`` [E, D, 2I] (gate | up; or
                                                    ``experts.gate_up_proj``)
``block_sparse_moe.output_linear.weight`` [E, D, I]  ``down`` [E, I, D] (or ``experts.down_proj``)
``shared_mlp.input_linear.weight`` [2S, D]          ``shared_gate_up`` [D, 2S] (gate | up)
``shared_mlp.output_linear.weight`` [D, S]          ``shared_down`` [S, D]
=================================================  ==========================================

transformers 5.x ``save_pretrained`` writes the per-expert names by default (it reverts its
load-time merge, ``save_original_format=True``); the fused names appear with
``save_original_format=False`` and in checkpoints converted to the 5.x layout.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _dispatch

f32 = jnp.float32
ROUTERS = ("softmax", "sigmoid")
ACTIVATIONS = ("swiglu", "relu2")
QWEN_MOE_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
  """Shape and routing of one MoE MLP (see the module docstring for the math).

  Attributes:
    hidden_size: D.
    num_experts: E routed experts.
    top_k: experts per token (k).
    expert_intermediate_size: I, each routed expert's hidden width.
    shared_intermediate_size: S, the shared expert's hidden width (0 = no shared expert).
    router: "softmax" (Qwen3-Next / Qwen3.5-MoE) or "sigmoid" (Nemotron-H) scores.
    activation: "swiglu" (silu gate, up, down) or "relu2" (up, down), for routed and shared experts.
    norm_topk_prob: divide the k weights by their sum.
    shared_expert_gate: scale the shared expert by sigmoid(x · g) (Qwen).
    n_group, topk_group: experts split into n_group equal groups; only the topk_group groups with
      the largest sum of their two best choice scores are eligible (sigmoid router only).
    routed_scaling_factor: multiplies the routing weights.
    correction_bias: a per-expert bias added to the scores for choosing, not for weighting
      (Nemotron-H ``e_score_correction_bias``; sigmoid router only).
    latent_size: L, experts work on x · latent_in [.., L] and their sum is mapped back by
      latent_out (Nemotron-H ``moe_latent_size``); None = experts work on x.
    dtype: expert / shared parameter and activation dtype (float32, bfloat16 or float16);
      the router and correction bias are float32.
  """
  hidden_size: int
  num_experts: int
  top_k: int
  expert_intermediate_size: int
  shared_intermediate_size: int = 0
  router: str = "softmax"
  activation: str = "swiglu"
  norm_topk_prob: bool = True
  shared_expert_gate: bool = False
  n_group: int = 1
  topk_group: int = 1
  routed_scaling_factor: float = 1.0
  correction_bias: bool = False
  latent_size: int | None = None
  dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    def is_int(v):
      return isinstance(v, int) and not isinstance(v, bool)

    for name in ("hidden_size", "num_experts", "top_k", "expert_intermediate_size", "n_group", "topk_group"):
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    if not is_int(self.shared_intermediate_size) or self.shared_intermediate_size < 0:
      raise ValueError(f"shared_intermediate_size={self.shared_intermediate_size!r}; expected an int "
                       f">= 0 (0 = no shared expert)")
    if self.latent_size is not None and (not is_int(self.latent_size) or self.latent_size < 1):
      raise ValueError(f"latent_size={self.latent_size!r}; expected None or an int >= 1")
    if self.router not in ROUTERS:
      raise ValueError(f"router={self.router!r}; expected one of {ROUTERS}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r}; expected one of {ACTIVATIONS}")
    for name in ("norm_topk_prob", "shared_expert_gate", "correction_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected a bool")
    rsf = self.routed_scaling_factor
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not math.isfinite(rsf):
      raise ValueError(f"routed_scaling_factor={rsf!r}; expected a finite float")
    e, g = self.num_experts, self.n_group
    if self.top_k > e:
      raise ValueError(f"top_k={self.top_k}; expected <= num_experts={e}")
    if e % g:
      raise ValueError(f"n_group={g}; expected a divisor of num_experts={e}")
    if self.topk_group > g:
      raise ValueError(f"topk_group={self.topk_group}; expected <= n_group={g}")
    if self.top_k > self.topk_group * (e // g):
      raise ValueError(f"top_k={self.top_k}; expected <= topk_group · num_experts / n_group = "
                       f"{self.topk_group * (e // g)} (the experts of the eligible groups)")
    if self.shared_expert_gate and not self.shared_intermediate_size:
      raise ValueError("shared_expert_gate=True needs a shared expert (shared_intermediate_size >= 1)")
    if self.router == "softmax" and (g != 1 or self.correction_bias):
      raise NotImplementedError(f"router='softmax' with n_group={g}, correction_bias="
                                f"{self.correction_bias}: grouped selection and the correction bias "
                                f"are implemented for the sigmoid router (Nemotron-H) only")
    if self.router == "sigmoid" and e // g < 2:
      raise ValueError(f"num_experts / n_group = {e // g}; expected >= 2 (a group's score is the sum "
                       f"of its two best experts)")
    dtype = jnp.dtype(self.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype={dtype}; expected float32, bfloat16 or float16")
    object.__setattr__(self, "dtype", dtype)
    object.__setattr__(self, "routed_scaling_factor", float(rsf))

  @property
  def expert_dim(self) -> int:
    """Din, the width experts read and write: latent_size, else hidden_size."""
    return self.hidden_size if self.latent_size is None else self.latent_size

  @property
  def gated(self) -> bool:
    return self.activation == "swiglu"


def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None, implementation=None):
  """``jax.lax.ragged_dot(x, w, group_sizes)``: x [M, K] rows sorted by group, w [E, K, N],
  group_sizes int32[E] → [M, N] (``preferred_element_type``, default x.dtype). ``implementation``:
  None (GPU: the Pallas-Triton kernel, else XLA), "xla" or "pallas_triton" (``_dispatch``)."""
  def run_triton():
    from replayssm_jax.pallas import moe_triton  # noqa: PLC0415
    return moe_triton.grouped_matmul(x, w, group_sizes, preferred_element_type=preferred_element_type)
  return _dispatch.run("moe.grouped_matmul", implementation, {
      "xla": lambda: jax.lax.ragged_dot(x, w, group_sizes,
                                        preferred_element_type=preferred_element_type),
      "pallas_triton": run_triton})


def _act(h, gated: bool):
  """silu(gate) · up over the halves of the last axis (gated), else relu(h)²."""
  if gated:
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up
  return jnp.square(jax.nn.relu(h))


class MoE(nnx.Module):
  """``y = MoE(config, rngs=...)(x)``: x [..., D] → y [..., D] (see the module docstring).

  Parameters (Din = config.expert_dim):
    router [D, E] float32; correction_bias [E] float32 (if config.correction_bias);
    gate_up [E, Din, 2I] (swiglu, columns gate | up) or up [E, Din, I] (relu2); down [E, I, Din];
    shared_gate_up [D, 2S] or shared_up [D, S], shared_down [S, D] (if S > 0);
    shared_expert_gate [D, 1] (if config.shared_expert_gate); latent_in [D, L], latent_out [L, D]
    (if config.latent_size).
  """

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, MoEConfig):
      raise ValueError(f"config must be a MoEConfig; got {type(config).__name__}")
    self.config = c = config
    d, e, i, s, din = c.hidden_size, c.num_experts, c.expert_intermediate_size, c.shared_intermediate_size, c.expert_dim
    h = 2 if c.gated else 1
    self.w_in = "gate_up" if c.gated else "up"  # name of the input projections

    def param(shape, fan_in, dtype=c.dtype):
      return nnx.Param((jax.random.normal(rngs.params(), shape, f32) / math.sqrt(fan_in)).astype(dtype))

    self.router = param((d, e), d, f32)
    if c.correction_bias:
      self.correction_bias = nnx.Param(jnp.zeros((e,), f32))
    setattr(self, self.w_in, param((e, din, h * i), din))
    self.down = param((e, i, din), i)
    if s:
      setattr(self, "shared_" + self.w_in, param((d, h * s), d))
      self.shared_down = param((s, d), s)
    if c.shared_expert_gate:
      self.shared_expert_gate = param((d, 1), d)
    if c.latent_size is not None:
      self.latent_in = param((d, din), d)
      self.latent_out = param((din, d), din)

  def route(self, x):
    """Routing of x [T, D]: (weights [T, k] float32, expert ids [T, k] int32)."""
    c = self.config
    logits = jnp.dot(x.astype(f32), self.router[...])
    scores = jax.nn.softmax(logits, axis=-1) if c.router == "softmax" else jax.nn.sigmoid(logits)
    choice = scores + self.correction_bias[...] if c.correction_bias else scores
    if c.n_group > 1:
      grouped = choice.reshape(-1, c.n_group, c.num_experts // c.n_group)
      group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)                  # [T, G]
      _, groups = jax.lax.top_k(group_scores, c.topk_group)                # [T, topk_group]
      eligible = jnp.any(groups[..., None] == jnp.arange(c.n_group), axis=-2)  # [T, G]
      choice = jnp.where(eligible[..., None], grouped, -jnp.inf).reshape(choice.shape)
    _, idx = jax.lax.top_k(choice, c.top_k)
    weights = jnp.take_along_axis(scores, idx, axis=-1)                    # uncorrected scores
    if c.norm_topk_prob:
      # Nemotron-H's ε; a no-op for softmax, whose top-k sum is >= 1/E.
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, idx

  def __call__(self, x, *, implementation=None):
    """x [..., D] → y [..., D]; ``implementation`` picks the grouped matmul (``grouped_matmul``)."""
    c = self.config
    if x.ndim < 1 or x.shape[-1] != c.hidden_size:
      raise ValueError(f"x has shape {list(x.shape)}; expected [..., {c.hidden_size}] (hidden_size)")
    lead = x.shape[:-1]
    x = x.reshape(-1, c.hidden_size).astype(c.dtype)
    t, k = x.shape[0], c.top_k
    weights, idx = self.route(x)

    h = x @ self.latent_in[...] if c.latent_size is not None else x
    experts = idx.reshape(-1)                                              # [T·k] pair → expert
    order = jnp.argsort(experts, stable=True)                              # pairs sorted by expert
    sizes = jnp.bincount(experts, length=c.num_experts).astype(jnp.int32)  # [E] rows per expert
    a = _act(grouped_matmul(h[order // k], getattr(self, self.w_in)[...], sizes,
                            implementation=implementation), c.gated)                    # [T·k, I]
    y = grouped_matmul(a, self.down[...], sizes, preferred_element_type=f32,
                       implementation=implementation)                                  # [T·k, Din]
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=order.dtype))
    y = jnp.einsum("tkd,tk->td", y[unsort].reshape(t, k, -1), weights)     # [T, Din] float32
    if c.latent_size is not None:
      y = jnp.dot(y.astype(c.dtype), self.latent_out[...], preferred_element_type=f32)

    if c.shared_intermediate_size:
      w_in = getattr(self, "shared_" + self.w_in)[...]
      shared = jnp.dot(_act(x @ w_in, c.gated), self.shared_down[...], preferred_element_type=f32)
      if c.shared_expert_gate:
        shared = shared * jax.nn.sigmoid(jnp.dot(x, self.shared_expert_gate[...], preferred_element_type=f32))
      y = y + shared
    return y.astype(c.dtype).reshape(*lead, c.hidden_size)


# ---- transformers configs and checkpoints ----------------------------------------------------

def moe_config_from_hf(hf: dict, *, dtype=jnp.float32) -> MoEConfig:
  """The MoEConfig of the MoE layers of a transformers config dict (the text config for Qwen3.5).

  ``hf["model_type"]`` picks the family: qwen3_next, qwen3_5_moe(_text) (Qwen3.5-MoE always
  renormalises, as transformers does, whatever ``norm_topk_prob`` says), nemotron_h,
  granitemoehybrid (experts of width ``intermediate_size``, the shared MLP of width
  ``shared_intermediate_size`` as the ungated shared expert). Keys absent
  from the dict take transformers' defaults, except the sizes, which are required. Raises
  NotImplementedError for an activation other than silu (Qwen) / relu2 (Nemotron-H) and for
  Nemotron-H ``mlp_bias`` (biases on the shared expert and latent projections).
  """
  model_type = hf.get("model_type")

  def need(key):
    if key not in hf:
      raise ValueError(f"config.json has no {key!r}; expected it for a model_type={model_type!r} MoE layer")
    return hf[key]

  if model_type in QWEN_MOE_TYPES:
    if hf.get("hidden_act", "silu") != "silu":
      raise NotImplementedError(f"MoE experts with hidden_act={hf['hidden_act']!r}; only silu is implemented")
    return MoEConfig(
        hidden_size=need("hidden_size"), num_experts=need("num_experts"),
        top_k=need("num_experts_per_tok"), expert_intermediate_size=need("moe_intermediate_size"),
        shared_intermediate_size=need("shared_expert_intermediate_size"), router="softmax",
        activation="swiglu", shared_expert_gate=True, dtype=dtype,
        norm_topk_prob=model_type != "qwen3_next" or bool(hf.get("norm_topk_prob", True)))
  if model_type == "nemotron_h":
    if hf.get("mlp_hidden_act", "relu2") != "relu2":
      raise NotImplementedError(f"Nemotron-H MoE with mlp_hidden_act={hf['mlp_hidden_act']!r}; only "
                                f"relu2 is implemented")
    if hf.get("mlp_bias"):
      raise NotImplementedError("Nemotron-H MoE with mlp_bias=true (shared-expert and latent "
                                "projection biases) is not implemented")
    experts = hf["n_routed_experts"] if "n_routed_experts" in hf else need("num_local_experts")
    return MoEConfig(
        hidden_size=need("hidden_size"), num_experts=experts, top_k=need("num_experts_per_tok"),
        expert_intermediate_size=need("moe_intermediate_size"),
        shared_intermediate_size=need("moe_shared_expert_intermediate_size"), router="sigmoid",
        activation="relu2", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        n_group=hf.get("n_group", 1), topk_group=hf.get("topk_group", 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)), correction_bias=True,
        latent_size=hf.get("moe_latent_size"), dtype=dtype)
  if model_type == "granitemoehybrid":
    if hf.get("hidden_act", "silu") != "silu":
      raise NotImplementedError(f"Granite MoE with hidden_act={hf['hidden_act']!r}; only silu is implemented")
    # GraniteMoeHybridTopKRouter: softmax over the k largest logits, which is the softmax over all
    # experts renormalised over the chosen k (norm_topk_prob). The shared MLP has no gate.
    return MoEConfig(
        hidden_size=need("hidden_size"), num_experts=need("num_local_experts"),
        top_k=need("num_experts_per_tok"), expert_intermediate_size=need("intermediate_size"),
        shared_intermediate_size=need("shared_intermediate_size"), router="softmax",
        activation="swiglu", norm_topk_prob=True, dtype=dtype)
  raise NotImplementedError(f"MoE layers of model_type={model_type!r}; implemented: "
                            f"{', '.join(QWEN_MOE_TYPES)}, nemotron_h, granitemoehybrid")


def hf_moe_params(take, has, prefix: str, config: MoEConfig) -> dict:
  """{MoE parameter name: float32 array} from one block's checkpoint tensors (module docstring).

  Args:
    take: ``take(name, shape, what="")`` pops tensor ``name`` as a float32 numpy array, raising
      ValueError naming it when missing or of another shape (``models.hf._Tensors.take``).
    has: ``has(name)`` tells whether tensor ``name`` is present.
    prefix: the block's tensor prefix, e.g. ``"model.layers.3.mlp."``.
    config: the layer's MoEConfig (its fields pick the tensor names: gated experts and a shared
      gate are Qwen's, correction bias and latent projections Nemotron-H's).

  Fused (``experts.gate_up_proj`` / ``experts.up_proj``) and per-expert (``experts.{j}.…``)
  layouts are both read; the fused one is used when present.
  """
  c = config
  d, e, i, s, din = c.hidden_size, c.num_experts, c.expert_intermediate_size, c.shared_intermediate_size, c.expert_dim
  p = prefix
  out = {"router": take(p + "gate.weight", (e, d)).T}
  if c.correction_bias:
    out["correction_bias"] = take(p + "gate.e_score_correction_bias", (e,))
  names = ("gate", "up") if c.gated else ("up",)
  w_in = "gate_up" if c.gated else "up"
  if has(p + f"experts.{w_in}_proj"):
    what = "(experts, gate rows | up rows, in)" if c.gated else "(experts, out, in)"
    out[w_in] = take(p + f"experts.{w_in}_proj", (e, len(names) * i, din), what=what).transpose(0, 2, 1)
    out["down"] = take(p + "experts.down_proj", (e, din, i)).transpose(0, 2, 1)
  else:
    out[w_in] = np.stack([np.concatenate([take(p + f"experts.{j}.{n}_proj.weight", (i, din)) for n in names]).T
                          for j in range(e)])
    out["down"] = np.stack([take(p + f"experts.{j}.down_proj.weight", (din, i)).T for j in range(e)])
  if s:
    shared = "shared_expert." if c.router == "softmax" else "shared_experts."  # Qwen | Nemotron-H
    out["shared_" + w_in] = np.concatenate([take(p + f"{shared}{n}_proj.weight", (s, d)) for n in names]).T
    out["shared_down"] = take(p + f"{shared}down_proj.weight", (d, s)).T
  if c.shared_expert_gate:
    out["shared_expert_gate"] = take(p + "shared_expert_gate.weight", (1, d)).T
  if c.latent_size is not None:
    out["latent_in"] = take(p + "fc1_latent_proj.weight", (din, d)).T
    out["latent_out"] = take(p + "fc2_latent_proj.weight", (d, din)).T
  return out


def granite_moe_params(take, has, prefix: str, config: MoEConfig) -> dict:
  """{MoE parameter name: float32 array} of one Granite 4.0 block (``block_sparse_moe.*`` and the
  ``shared_mlp.*`` it adds; module docstring).

  Args:
    take, has: as for ``hf_moe_params``.
    prefix: the decoder layer's tensor prefix, e.g. ``"model.layers.3."``.
    config: the layer's MoEConfig (``moe_config_from_hf`` of a granitemoehybrid config).

  The Hub's names (``router.layer``, ``input_linear``, ``output_linear``, also what transformers
  5.x ``save_pretrained`` writes) and transformers' in-memory names (``router.weight``,
  ``experts.gate_up_proj``, ``experts.down_proj``) are both read.
  """
  c = config
  d, e, i, s = c.hidden_size, c.num_experts, c.expert_intermediate_size, c.shared_intermediate_size
  p = prefix + "block_sparse_moe."
  first = lambda *names: next((n for n in names if has(p + n)), names[0])
  return {
      "router": take(p + first("router.layer.weight", "router.weight"), (e, d)).T,
      "gate_up": take(p + first("input_linear.weight", "experts.gate_up_proj"), (e, 2 * i, d),
                      what="(experts, gate rows | up rows, in)").transpose(0, 2, 1),
      "down": take(p + first("output_linear.weight", "experts.down_proj"), (e, d, i)).transpose(0, 2, 1),
      "shared_gate_up": take(prefix + "shared_mlp.input_linear.weight", (2 * s, d), what="(gate rows | up rows)").T,
      "shared_down": take(prefix + "shared_mlp.output_linear.weight", (d, s)).T,
  }
