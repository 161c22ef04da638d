"""A hybrid language model of GatedDeltaNet, Mamba2 and attention layers (functional NNX,
explicit cache pytree).

    h = embed(tokens) · embedding_multiplier
    N × { h = h + r · Mixer_i(rmsnorm(h));  h = h + r · MLP_i(rmsnorm(h)) }     r = residual_multiplier
    logits = head(rmsnorm(h)) / logits_scaling

Mixer_i is a GatedDeltaNet, a Mamba2 or a softmax-attention layer, chosen per layer by
``LMConfig.layer_types`` (default: all GatedDeltaNet), or a "parallel" mixer (Falcon-H1): a Mamba2
and an attention layer on the same normed input, Mixer_i(x) = Mamba2_i(x) + Attention_i(x).
Qwen3-Next / Qwen3.5, Granite 4.0, Bamba and Falcon-H1 blocks carry a mixer and an MLP
(``mixer_mlp=True``; ``mlp_types`` picks a dense SwiGLU or a mixture of experts per layer); Mamba2 /
Nemotron-H checkpoints have mixer-only blocks (``mixer_mlp=False``) and separate MLP-only (``"mlp"``)
or MoE-only (``"moe"``) blocks. Dense MLPs are SwiGLU (Qwen, Granite, Bamba, Falcon-H1) or relu²
(Nemotron-H, ``mlp_act="relu2"``). The three multipliers are 1 except in Granite 4.0 checkpoints
and, the embedding's, Falcon-H1's (muP scalings; Falcon-H1's others are folded into its weights).

The cache (``LMCache``) holds one cache per *mixer*, in block order (``GdnLayerCache``,
``Mamba2LayerCache`` or ``AttentionLayerCache``; a parallel block has two consecutive entries, its
Mamba2 cache then its KV cache: ``LM.mixers`` lists the mixer of each entry), the *one*
``ReplayCursor`` shared by all recurrent layers (their rings all have size ``buffer_len``: every
decode step makes one plan, runs all layers with it and commits once; conventional mode leaves the
windows empty) and the per-slot sequence lengths ``positions`` that every attention layer's KV
cache is indexed by.

Speculative decoding: ``logits, step = lm.verify(tokens [B, T], cache, slots)`` runs T tokens per
row (the emitted token, then T-1 drafts) through every layer with one ``num_tokens=T`` plan and
returns a ``VerifyStep`` (the cache with the drafts in the rings and KV caches, the plan, the conv
windows); ``cache = lm.commit(step, num_accepted)`` keeps each row's accepted prefix: the cursor
commit (the ring rollback), the conv-state rewind of every recurrent layer and the position
advance (the KV rollback: entries past a slot's position are never read).

Multi-token prediction (Qwen3.5 / Qwen3-Next checkpoints, ``LMConfig.mtp_layers``): ``lm.mtp``
is the checkpoint's MTP head (``models.mtp``); ``init_cache(mtp_drafts=k)`` adds its KV cache, k
pending drafts and the last hidden state per slot (``LMCache.mtp``), ``prefill`` / ``verify``
return the final-normed hidden states it reads (``return_hidden``), and ``mtp_draft`` writes its
entries for a step's covered positions and chains k greedy drafts.

Conventional speculative verify (the baseline): a cache made with ``init_cache(verify_stacks=True)``
keeps each recurrent layer's state in a stack ``[N, T_max, ...]`` (``LMCache.stacks``, T_max =
max_draft + 1) and ``LMCache.read_index[n]`` names the entry that holds slot n's state;
``lm.verify(..., replay=False)`` steps that state through the T tokens and writes the state after
token i to entry i (``gdn.verify_conventional`` / ``mamba2.verify_conventional``), ``commit`` sets
``read_index = num_accepted - 1`` (the rollback) and leaves the cursor alone. Such a cache only runs
``prefill``, ``verify(replay=False)``, ``commit`` and ``copy_slots``.
"""
import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import _checks, _dispatch, _slots
from replayssm_jax import config as config_lib
from replayssm_jax import gdn
from replayssm_jax import mamba2
from replayssm_jax.cursor import ReplayCursor, ReplayPlan
from replayssm_jax.models.attention import Attention, AttentionConfig, AttentionLayerCache
from replayssm_jax.models import _conv
from replayssm_jax.models import _stack_verify
from replayssm_jax.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, GdnLayerCache
from replayssm_jax.models.mamba2 import Mamba2, Mamba2Config, Mamba2LayerCache
from replayssm_jax.models.moe import MoE, MoEConfig
from replayssm_jax.models.mtp import MTPCache, MTPHead
from replayssm_jax.pallas import common as pallas_common

f32 = jnp.float32
RECURRENT_TYPES = ("gdn", "mamba2")                 # mixers with a ReplaySSM state
LAYER_TYPES = RECURRENT_TYPES + ("attention", "parallel")   # mixer layer types (parallel: Mamba2 + attention)
BLOCK_TYPES = LAYER_TYPES + ("mlp", "moe")          # every value layer_types accepts (MLP / MoE-only blocks)
MLP_TYPES = ("dense", "moe")                        # the MLP of a mixer block (mixer_mlp=True)
MLP_ACTS = ("swiglu", "relu2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
  """Shape of the LM.

  Attributes:
    vocab_size: token vocabulary.
    hidden_size: D.
    num_layers: number of (mixer, MLP) blocks.
    num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel: GatedDeltaNet shape.
    layer_types: one of "gdn" / "mamba2" / "attention" / "parallel" / "mlp" / "moe" per layer
      (None = all "gdn"); "parallel" is a Mamba2 and an attention mixer side by side, their outputs
      added (Falcon-H1); "mlp" and "moe" are MLP-only blocks (h + MLP(rmsnorm(h)), no cache) with a
      dense MLP or a mixture of experts.
    mamba2_num_heads, mamba2_head_dim, mamba2_num_groups, mamba2_state_dim: Mamba2 shape (H, P,
      G, N; the conv kernel is ``conv_kernel``), used by "mamba2" layers.
    mamba2_dt_limit: (lo, hi) clip of the Mamba2 step size Δ (``Mamba2Config.dt_limit``).
    mamba2_norm: the Mamba2 output norm (``Mamba2Config.norm``; Falcon-H1 checkpoints may differ).
    intermediate_size: SwiGLU hidden width.
    max_prompt_len: longest prompt ``generate`` accepts (prompts are padded to it, so every
      prompt length shares one compilation).
    rms_eps: RMSNorm epsilon.
    dtype: activation / parameter dtype.
    mixer_mlp: mixer blocks carry their own MLP (Qwen-style block). False: mixer-only blocks
      (Mamba2 / Nemotron-H), MLPs come from "mlp" layers.
    mlp_act: "swiglu" (gate, up, down) or "relu2" (up, down; down(relu(up(x))²), Nemotron-H).
    norm_offset: the block and final RMSNorms scale by ``norm_offset + w`` (1.0 for the
      zero-centred norms of Qwen3-Next / Qwen3.5 checkpoints; 0.0 = plain ``w``).
    attention: the AttentionConfig of every "attention" and "parallel" layer (required when there
      is one).
    moe: the MoEConfig of every mixture-of-experts MLP (required when there is one; its
      hidden_size and dtype must be the model's).
    mlp_types: with ``mixer_mlp``, "dense" or "moe" per layer (None = all "dense"); entries of
      layers without a mixer are ignored.
    embedding_multiplier: scales the token embeddings (Granite 4.0's ``embedding_multiplier``).
    residual_multiplier: scales every mixer and MLP output before its residual add (Granite).
    logits_scaling: the logits are the head's output divided by it (Granite).
    mtp_layers: 0, or 1 for a multi-token-prediction head (``models.mtp``; Qwen3.5 / Qwen3-Next
      ``mtp_num_hidden_layers``): one attention block with the model's MLP kind, which needs
      ``attention``.
  """
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_k_heads: int
  num_v_heads: int
  head_k_dim: int
  head_v_dim: int
  intermediate_size: int
  conv_kernel: int = 4
  max_prompt_len: int = 128
  rms_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  layer_types: tuple | None = None
  mamba2_num_heads: int = 8
  mamba2_head_dim: int = 16
  mamba2_num_groups: int = 1
  mamba2_state_dim: int = 16
  mamba2_dt_limit: tuple = (0.0, math.inf)
  mamba2_norm: str = "gate_then_norm"
  mixer_mlp: bool = True
  mlp_act: str = "swiglu"
  norm_offset: float = 0.0
  attention: AttentionConfig | None = None
  moe: MoEConfig | None = None
  mlp_types: tuple | None = None
  embedding_multiplier: float = 1.0
  residual_multiplier: float = 1.0
  logits_scaling: float = 1.0
  mtp_layers: int = 0

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "intermediate_size", "max_prompt_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    types = ("gdn",) * self.num_layers if self.layer_types is None else self.layer_types
    if isinstance(types, str) or not isinstance(types, (tuple, list)):
      raise ValueError(f"layer_types={types!r}; expected a tuple of {BLOCK_TYPES}")
    types = tuple(types)
    if len(types) != self.num_layers or any(t not in BLOCK_TYPES for t in types):
      raise ValueError(f"layer_types={types!r}; expected {self.num_layers} entries, each one of "
                       f"{BLOCK_TYPES}")
    if not isinstance(self.mixer_mlp, bool):
      raise ValueError(f"mixer_mlp={self.mixer_mlp!r}; expected a bool")
    if self.mlp_act not in MLP_ACTS:
      raise ValueError(f"mlp_act={self.mlp_act!r}; expected one of {MLP_ACTS}")
    if isinstance(self.norm_offset, bool) or not isinstance(self.norm_offset, (int, float)):
      raise ValueError(f"norm_offset={self.norm_offset!r}; expected a float (0.0 or 1.0)")
    for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}={value!r}; expected a finite float > 0 (1.0 = no scaling)")
      object.__setattr__(self, name, float(value))
    object.__setattr__(self, "layer_types", types)
    object.__setattr__(self, "dtype", self.mixer().dtype)  # validates the mixer fields too
    if "mamba2" in types or "parallel" in types:
      self.mamba2_mixer()  # validates the Mamba2 fields
    if self.has_attention and not isinstance(self.attention, AttentionConfig):
      raise ValueError(f"layer_types has 'attention' or 'parallel' layers but attention={self.attention!r}; "
                       f"expected an AttentionConfig")
    if self.attention is not None and not isinstance(self.attention, AttentionConfig):
      raise ValueError(f"attention={self.attention!r}; expected None or an AttentionConfig")
    mlps = ("dense",) * self.num_layers if self.mlp_types is None else self.mlp_types
    if (isinstance(mlps, str) or not isinstance(mlps, (tuple, list)) or len(mlps) != self.num_layers
        or any(m not in MLP_TYPES for m in mlps)):
      raise ValueError(f"mlp_types={self.mlp_types!r}; expected None or {self.num_layers} entries, "
                       f"each one of {MLP_TYPES}")
    object.__setattr__(self, "mlp_types", tuple(mlps))
    if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
      raise ValueError(f"mtp_layers={self.mtp_layers!r}; expected an int >= 0")
    if self.mtp_layers > 1:
      raise NotImplementedError(f"mtp_layers={self.mtp_layers}: a multi-token-prediction head of "
                                f"more than one layer (released Qwen3.5 / Qwen3-Next checkpoints have one)")
    if self.mtp_layers and not isinstance(self.attention, AttentionConfig):
      raise ValueError(f"mtp_layers={self.mtp_layers} with attention={self.attention!r}; expected an "
                       f"AttentionConfig (the head's block is a full-attention layer)")
    uses_moe = any(self.block_mlp(i) == "moe" for i in range(self.num_layers))
    if uses_moe and not isinstance(self.moe, MoEConfig):
      raise ValueError(f"the model has mixture-of-experts MLPs (layer_types / mlp_types) but "
                       f"moe={self.moe!r}; expected a MoEConfig")
    if self.moe is not None:
      if not isinstance(self.moe, MoEConfig):
        raise ValueError(f"moe={self.moe!r}; expected None or a MoEConfig")
      if self.moe.hidden_size != self.hidden_size or self.moe.dtype != self.dtype:
        raise ValueError(f"moe has hidden_size={self.moe.hidden_size}, dtype={self.moe.dtype}; "
                         f"expected the model's hidden_size={self.hidden_size}, dtype={self.dtype}")

  @classmethod
  def tiny(cls, **overrides) -> "LMConfig":
    """A CPU-sized default: vocab 256, D 64, 2 layers, Hk 2, Hv 4, K = V = 16, MLP 128."""
    fields = dict(vocab_size=256, hidden_size=64, num_layers=2, num_k_heads=2, num_v_heads=4,
                  head_k_dim=16, head_v_dim=16, intermediate_size=128, max_prompt_len=64)
    fields.update(overrides)
    return cls(**fields)

  @classmethod
  def tiny_mamba2(cls, **overrides) -> "LMConfig":
    """``tiny()`` with every layer Mamba2: H 8, P 16, G 2, N 16."""
    fields = dict(mamba2_num_heads=8, mamba2_head_dim=16, mamba2_num_groups=2, mamba2_state_dim=16)
    fields.update(overrides)
    fields.setdefault("layer_types", ("mamba2",) * fields.get("num_layers", 2))
    return cls.tiny(**fields)

  @classmethod
  def tiny_hybrid(cls, **overrides) -> "LMConfig":
    """``tiny_mamba2()`` with alternating layers: GatedDeltaNet, Mamba2, GatedDeltaNet, ..."""
    overrides.setdefault("layer_types", tuple(LAYER_TYPES[i % 2] for i in range(overrides.get("num_layers", 2))))
    return cls.tiny_mamba2(**overrides)

  def to_dict(self) -> dict:
    """JSON-ready fields (``from_dict`` inverts it)."""
    d = dataclasses.asdict(self)
    d["dtype"] = jnp.dtype(self.dtype).name
    if self.moe is not None:
      d["moe"]["dtype"] = jnp.dtype(self.moe.dtype).name
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "LMConfig":
    """The LMConfig of ``to_dict`` output (e.g. a preempted engine's ``engine.json``)."""
    d = dict(d)
    d["dtype"] = jnp.dtype(d["dtype"])
    for name in ("layer_types", "mlp_types", "mamba2_dt_limit"):
      if d.get(name) is not None:
        d[name] = tuple(d[name])
    if d.get("attention") is not None:
      d["attention"] = AttentionConfig(**d["attention"])
    if d.get("moe") is not None:
      d["moe"] = MoEConfig(**(d["moe"] | {"dtype": jnp.dtype(d["moe"]["dtype"])}))
    return cls(**d)

  def block_mlp(self, i: int) -> str | None:
    """The MLP of block i: "dense", "moe" or None (a mixer-only block)."""
    kind = self.layer_types[i]
    if kind in ("mlp", "moe"):
      return "dense" if kind == "mlp" else "moe"
    return self.mlp_types[i] if self.mixer_mlp else None

  @property
  def mtp_mlp(self) -> str:
    """The MLP of the MTP head's block: a mixture of experts where the model has them."""
    return "moe" if "moe" in (self.block_mlp(i) for i in range(self.num_layers)) else "dense"

  @property
  def has_attention(self) -> bool:
    return "attention" in self.layer_types or "parallel" in self.layer_types

  def mixer(self) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(hidden_size=self.hidden_size, num_k_heads=self.num_k_heads,
                               num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
                               head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel,
                               rms_eps=self.rms_eps, dtype=self.dtype)

  def mamba2_mixer(self) -> Mamba2Config:
    return Mamba2Config(hidden_size=self.hidden_size, num_heads=self.mamba2_num_heads,
                        head_dim=self.mamba2_head_dim, num_groups=self.mamba2_num_groups,
                        state_dim=self.mamba2_state_dim, conv_kernel=self.conv_kernel,
                        rms_eps=self.rms_eps, dt_limit=self.mamba2_dt_limit, norm=self.mamba2_norm,
                        dtype=self.dtype)


@flax.struct.dataclass
class LMCache:
  """Decode cache of the LM: per-layer caches and the shared cursor.

  Attributes:
    layers: tuple with one cache per mixer (``LM.mixers``): GdnLayerCache, Mamba2LayerCache or
      AttentionLayerCache, by layer type; a parallel block's Mamba2 cache, then its KV cache.
    cursor: the ReplayCursor of every slot, shared by all recurrent layers.
    positions: int32[N] tokens in each slot's sequence (the position of its next token), shared
      by all attention layers: KV entries at positions >= positions[n] (rejected drafts, an
      earlier sequence's tail) are not part of the sequence and get zero attention weight.
    stacks: None, or (``init_cache(verify_stacks=True)``, conventional speculative verify) one
      entry per entry of ``layers``: the state stack [N, T_max, ...] of a recurrent layer (slot n's state
      is ``stacks[i][n, read_index[n]]``; the layer's ``bufs.state`` is then only prefill's
      output), None for attention.
    read_index: None, or int32[N] with ``stacks``: the stack entry holding each slot's state.
    mtp: None, or (``init_cache(mtp_drafts=k)``) the MTP head's ``MTPCache``: its KV cache
      (positions shared with the model's), each slot's k pending drafts and last hidden state.
  """
  layers: tuple
  cursor: ReplayCursor
  positions: jax.Array
  stacks: tuple | None = None
  read_index: jax.Array | None = None
  mtp: MTPCache | None = None


@flax.struct.dataclass
class VerifyStep:
  """A verified, not yet committed step of ``LM.verify``; ``LM.commit`` turns it into an LMCache.

  Attributes:
    cache: LMCache with the T tokens in every layer's ring and KV cache; cursor, positions and
      conv states unchanged.
    plan: the shared ``num_tokens=T`` ReplayPlan of the step.
    windows: tuple with one entry per entry of ``cache.layers``: the conv window [B, W-1+T, C] of a recurrent
      layer (its stored inputs, then the T tokens' pre-conv inputs), None for attention.
    replay: static; False for a conventional verify (the stacks hold the T states; commit moves
      ``read_index``, not the cursor).
    hidden: None, or (``verify(return_hidden=True)``) the final-normed hidden states [B, T, D]
      that the MTP head drafts from (``mtp_draft``).
  """
  cache: LMCache
  plan: ReplayPlan
  windows: tuple
  replay: bool = flax.struct.field(pytree_node=False, default=True)
  hidden: jax.Array | None = None


class RMSNorm(nnx.Module):
  """x · rsqrt(mean(x²) + ε) · (offset + w) over the last axis (in float32); w starts at 1 − offset."""

  def __init__(self, dim: int, *, eps: float, dtype, offset: float = 0.0):
    self.eps, self.dtype, self.offset = eps, dtype, float(offset)
    self.weight = nnx.Param(jnp.full((dim,), 1.0 - self.offset, dtype))

  def __call__(self, x):
    x32 = x.astype(f32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * (self.offset + self.weight[...].astype(f32))).astype(self.dtype)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) · up(x)), gate and up as one [D, 2·I] projection (columns gate | up).

  One matrix, not two: XLA merged two projections of the same x into one dot over concatenated
  weights and picked a slower kernel for it (B=256, D=2560, I=9216 bf16 on the H200: 126 µs per
  MLP call that way, 89 µs with the weights stored together, ``bench.model_parts``; bench/NOTES.md, Model level).
  """

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate_up, self.down = lin(dim, 2 * hidden), lin(hidden, dim)

  def __call__(self, x):
    gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
    return self.down(jax.nn.silu(gate) * up)


class ReluSquaredMLP(nnx.Module):
  """down(relu(up(x))²) (Nemotron-H)."""

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.up, self.down = lin(dim, hidden), lin(hidden, dim)

  def __call__(self, x):
    return self.down(jnp.square(jax.nn.relu(self.up(x))))


class ParallelMixer(nnx.Module):
  """Falcon-H1's mixer: a Mamba2 (``mamba2``) and an attention layer (``attention``) that read the
  same input; the block adds their outputs. Each keeps its own cache entry (``Block.mixers``)."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    c = config
    self.mamba2 = Mamba2(c.mamba2_mixer(), rngs=rngs)
    self.attention = Attention(c.attention, hidden_size=c.hidden_size, dtype=c.dtype, rms_eps=c.rms_eps,
                               rngs=rngs)


class Block(nnx.Module):
  """h + Mixer(norm(h)) (if the block has a mixer), then + MLP(norm(h)) (if it has an MLP).

  Mixer is GatedDeltaNet ("gdn"), Mamba2 ("mamba2"), Attention ("attention") or both of the last
  two side by side ("parallel", ``ParallelMixer``); "mlp" / "moe" blocks have no mixer and no cache.
  The MLP (``LMConfig.block_mlp``) is dense (SwiGLU or relu²) or a mixture of experts.
  """

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs, layer_type: str = "gdn",
               mlp_type: str | None = "dense"):
    c = config
    self.layer_type = layer_type
    self.has_mixer = layer_type in LAYER_TYPES
    self.has_mlp, self.mlp_type = mlp_type is not None, mlp_type
    norm = lambda: RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype, offset=c.norm_offset)
    if self.has_mixer:
      self.mixer_norm = norm()
      if layer_type == "mamba2":
        self.mixer = Mamba2(c.mamba2_mixer(), rngs=rngs)
      elif layer_type == "parallel":
        self.mixer = ParallelMixer(c, rngs=rngs)
      elif layer_type == "attention":
        self.mixer = Attention(c.attention, hidden_size=c.hidden_size, dtype=c.dtype,
                               rms_eps=c.rms_eps, rngs=rngs)
      else:
        self.mixer = GatedDeltaNet(c.mixer(), rngs=rngs)
    if mlp_type == "moe":
      self.mlp_norm, self.mlp = norm(), MoE(c.moe, rngs=rngs)
    elif mlp_type == "dense":
      mlp = SwiGLU if c.mlp_act == "swiglu" else ReluSquaredMLP
      self.mlp_norm = norm()
      self.mlp = mlp(c.hidden_size, c.intermediate_size, dtype=c.dtype, rngs=rngs)

  @property
  def mixers(self) -> tuple:
    """The mixer layers of the block, one per cache entry: (), (mixer,), or a parallel block's
    (Mamba2, Attention)."""
    if not self.has_mixer:
      return ()
    return (self.mixer.mamba2, self.mixer.attention) if self.layer_type == "parallel" else (self.mixer,)


class LM(nnx.Module):
  """embedding → blocks → final RMSNorm → head. ``prefill`` / ``decode`` take and return ``LMCache``."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, LMConfig):
      raise ValueError(f"config must be an LMConfig; got {type(config).__name__}")
    self.config = c = config
    self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs=rngs, layer_type=t, mlp_type=c.block_mlp(i))
                            for i, t in enumerate(c.layer_types)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype, offset=c.norm_offset)
    self.head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=c.dtype,
                           param_dtype=c.dtype, rngs=rngs)
    self.mtp = MTPHead(c, rngs=rngs) if c.mtp_layers else None
    # Mesh axis over which mixer outputs are partial sums (set on the per-device model that
    # ``shard_model`` builds: its mixers hold the local heads, so out_proj gives partial sums).
    self.tp_axis = None

  @property
  def mixer_blocks(self) -> list:
    """The blocks that have a mixer, in order."""
    return [b for b in self.blocks if b.has_mixer]

  @property
  def mixers(self) -> list:
    """The mixer layers in cache order: ``cache.layers[i]`` is ``mixers[i]``'s cache."""
    return [m for b in self.blocks for m in b.mixers]

  def init_cache(self, num_slots: int, *, buffer_len: int = 16, max_draft: int = 0,
                 state_dtype=jnp.float32, ring_dtype=None, read_copy_dtype=None,
                 max_len: int | None = None, kv_dtype=None, verify_stacks: bool = False,
                 mtp_drafts: int = 0) -> LMCache:
    """Zeroed cache for ``num_slots`` slots.

    Args:
      num_slots: pool size N.
      buffer_len: ReplaySSM buffer length L of the recurrent layers.
      max_draft: rings sized for ``verify`` steps of up to ``max_draft`` drafts
        (``num_tokens <= max_draft + 1``).
      state_dtype, ring_dtype: recurrent checkpoint and ring dtypes (``ReplayBuffers.create``).
      read_copy_dtype: None, or bfloat16 / float16 for a 16-bit read copy of every float32
        checkpoint, which ReplaySSM decode steps read instead; verify steps read the checkpoint
        and write the copy with it (``gdn.ReplayBuffers.read_copy``; ``replay=False`` refuses such
        a cache).
      max_len: KV capacity in tokens per slot (prompt + generated + drafts); required when the
        model has attention layers.
      kv_dtype: KV cache dtype (default: the model dtype).
      verify_stacks: also allocate the state stacks [N, max_draft + 1, ...] (state_dtype) of
        conventional speculative verify (``verify(replay=False)``).
      mtp_drafts: k >= 1 allocates the MTP head's cache (``LMCache.mtp``): its KV cache of
        ``max_len + k`` tokens per slot and k pending drafts per slot (needs ``mtp_layers``).
    """
    if self.config.has_attention and max_len is None:
      raise ValueError("max_len=None but the model has attention layers; expected the KV cache "
                       "capacity in tokens per slot (prompt + generated tokens + drafts)")
    cursor = ReplayCursor.create(num_slots, buffer_len=buffer_len, max_draft=max_draft)
    layers = []
    for m in self.mixers:
      if isinstance(m, Attention):
        layers.append(m.init_cache(num_slots, max_len, dtype=kv_dtype))
      else:
        layers.append(m.init_cache(num_slots, cursor, state_dtype=state_dtype, ring_dtype=ring_dtype,
                                   read_copy_dtype=read_copy_dtype))
    positions = jnp.zeros((num_slots,), jnp.int32)
    mtp = None
    if not isinstance(mtp_drafts, int) or isinstance(mtp_drafts, bool) or mtp_drafts < 0:
      raise ValueError(f"mtp_drafts={mtp_drafts!r}; expected an int >= 0")
    if mtp_drafts:
      if self.mtp is None:
        raise ValueError(f"mtp_drafts={mtp_drafts} but the model has no MTP head "
                         f"(LMConfig.mtp_layers=0)")
      mtp = MTPCache(kv=self.mtp.block.mixer.init_cache(num_slots, max_len + mtp_drafts, dtype=kv_dtype),
                     drafts=jnp.zeros((num_slots, mtp_drafts), jnp.int32),
                     last_hidden=jnp.zeros((num_slots, self.config.hidden_size), self.config.dtype))
    if not verify_stacks:
      return LMCache(layers=tuple(layers), cursor=cursor, positions=positions, mtp=mtp)
    stacks = tuple(None if isinstance(lc, AttentionLayerCache) else
                   jnp.zeros((num_slots, max_draft + 1) + lc.bufs.state.shape[1:], lc.bufs.state.dtype)
                   for lc in layers)
    return LMCache(layers=tuple(layers), cursor=cursor, positions=positions, stacks=stacks,
                   read_index=jnp.zeros((num_slots,), jnp.int32), mtp=mtp)

  def _check_tokens(self, name, tokens, ndim, what):
    _checks.expect_dtype(name, tokens, (jnp.int32,))
    _checks.expect_shape(name, tokens, (None,) * ndim, what)

  def _check_cache(self, cache):
    n = len(self.mixers)
    if not isinstance(cache, LMCache) or len(cache.layers) != n:
      raise ValueError(f"cache must be an LMCache with {n} layer caches, one per mixer "
                       f"(from init_cache)")

  def _mixed(self, y):
    """A mixer output; on a tensor-parallel shard, the sum of the devices' partial outputs."""
    return y if self.tp_axis is None else jax.lax.psum(y, self.tp_axis)

  def _run_blocks(self, h, cache, mixer_fn, implementation=None):
    """h through every block; ``mixer_fn(mixer, x, layer_cache) -> (y, layer_cache)`` runs one
    mixer layer (a parallel block calls it for its Mamba2, then its attention, and adds the two);
    ``implementation`` (a model-level name) picks the MoE layers' grouped matmul."""
    caches, layers, r = iter(cache.layers), [], self.config.residual_multiplier
    for block in self.blocks:
      if block.has_mixer:
        x, ys = block.mixer_norm(h), []
        for mixer in block.mixers:
          y, lc = mixer_fn(mixer, x, next(caches))
          ys.append(y)
          layers.append(lc)
        h = h + r * self._mixed(sum(ys[1:], ys[0]))
      if block.has_mlp:
        x = block.mlp_norm(h)
        y = (block.mlp(x, implementation=_dispatch.without_mosaic(implementation))
             if block.mlp_type == "moe" else block.mlp(x))
        # Experts are split over the tensor-parallel axis (partial sums); dense MLPs are replicated.
        h = h + r * (self._mixed(y) if block.mlp_type == "moe" else y)
    return h, tuple(layers)

  def _start(self, cache, slots):
    """int32[B]: each row's slot position (its sequence length so far); 0 on padding rows."""
    return jnp.where(slots >= 0, cache.positions[jnp.where(slots >= 0, slots, 0)], 0)

  def _advance(self, cache, slots, start, count):
    """positions[slots[b]] = start[b] + count[b] on live rows."""
    return _slots.scatter_rows(cache.positions, slots, start + count)

  def _embed(self, tokens):
    return self.embed(tokens) * self.config.embedding_multiplier

  def _head(self, h):
    return self._logits(self.final_norm(h))

  def _logits(self, normed):
    """The head over hidden states already normed (the final norm's, or the MTP head's)."""
    return self.head(normed).astype(f32) / self.config.logits_scaling

  def prefill(self, tokens, cache: LMCache, slots, lengths, *, resume=False, logits_at=None,
              return_hidden=False):
    """Right-padded prompts; writes the slots' caches and empties their windows.

    Args:
      tokens: int32[B, T]; row b's real tokens are ``tokens[b, :lengths[b]]``.
      cache: LMCache.
      slots: int32[B] pool slots (negative = padding row).
      lengths: int32[B] in [0, T].
      resume: False: every row starts from an empty state. True: row b continues its slot's
        current sequence (exact state = checkpoint ⊕ window, the stored conv inputs and the
        KV entries before the slot's position), e.g. the rest of a prompt after a prefix-cache hit.
      logits_at: optional int32[B] position per row in [0, T): only those positions go through
        the head (a serving prefill needs the last prompt position alone; the head of every
        position is B·T·vocab float32 logits).

      return_hidden: also return the final-normed hidden states [B, T, D] of every position
        (what the MTP head drafts from, ``mtp_draft``).

    Returns:
      (logits [B, T, vocab] float32 — only positions < lengths[b] are meaningful — or
      [B, vocab] at ``logits_at``; cache), and the hidden states with ``return_hidden``.
    """
    self._check_tokens("tokens", tokens, 2, "(int32[B, T])")
    self._check_cache(cache)
    self._check_capacity(cache, tokens.shape[1], resume)
    ops = {GdnLayerCache: gdn, Mamba2LayerCache: mamba2}
    real = _conv.real_positions(tokens[..., None], slots, lengths)           # [B, T]
    start = self._start(cache, slots) if resume else jnp.zeros_like(lengths)

    stacks = iter(cache.stacks or (None,) * len(cache.layers))

    def mixer_fn(mixer, x, lc):
      stack = next(stacks)
      if isinstance(lc, AttentionLayerCache):
        return mixer.step(x, lc, slots, start, real, fresh=not resume)
      S0 = None
      if resume:
        S0 = (ops[type(lc)].materialize(lc.bufs, cache.cursor, slots) if stack is None
              else _stack_verify.current_state(stack, cache.read_index, slots))
      return mixer.prefill(x, lc, slots, lengths, initial_state=S0)

    h, layers = self._run_blocks(self._embed(tokens), cache, mixer_fn)
    out = cache.replace(layers=layers, cursor=cache.cursor.reset(slots),
                        positions=self._advance(cache, slots, start, lengths))
    if cache.stacks is not None:   # the prefill state becomes stack entry 0
      out = out.replace(stacks=tuple(None if st is None else _stack_verify.put_state(st, slots, lc.bufs.state)
                                     for st, lc in zip(cache.stacks, layers)),
                        read_index=_slots.scatter_rows(cache.read_index, slots, jnp.zeros_like(slots)))
    normed = self.final_norm(h)
    at = normed
    if logits_at is not None:
      _checks.expect_shape("logits_at", logits_at, (tokens.shape[0],), "(int32[B])")
      at = jnp.take_along_axis(normed, logits_at[:, None, None], axis=1)[:, 0]
    if return_hidden:
      return self._logits(at), out, normed
    return self._logits(at), out

  def _check_capacity(self, cache, num_tokens, resume):
    for lc in cache.layers:
      if isinstance(lc, AttentionLayerCache) and not resume and num_tokens > lc.max_len:
        raise ValueError(f"tokens has {num_tokens} positions per row but the KV cache holds "
                         f"max_len={lc.max_len} tokens per slot (init_cache(max_len=))")

  def decode(self, tokens, cache: LMCache, slots, *, replay=True, implementation=None,
             force_flush=None, flush_all=None):
    """One token per row: one shared plan for all layers, one commit (replay mode only).

    Args:
      tokens: int32[B] current tokens.
      cache: LMCache.
      slots: int32[B] pool slots (negative = padding row: no cache change, logits meaningless).
      replay: ReplaySSM decode (True) or conventional decode on the checkpoint pool (False).
      implementation: forwarded to the GDN / Mamba2 ops, the attention and MoE layers
        (``_dispatch.without_mosaic``).
      force_flush: optional bool[B]: these rows fold their window into the checkpoint this step
        (e.g. at a prefix-cache block boundary), leaving an empty window. Replay mode only
        matters; conventional mode always writes the state.
      flush_all: every row flushes this step (static bool), one conventional-like pass per layer:
        the small-batch policy. None: on when the batch is below ``config.replay_min_batch`` of
        every mixer family for this device and state dtype (never on CPU).

    Returns:
      (logits [B, vocab] float32, cache).
    """
    self._check_tokens("tokens", tokens, 1, "(int32[B])")
    self._check_cache(cache)
    if cache.stacks is not None:
      raise ValueError("cache keeps its recurrent states in conventional verify stacks "
                       "(init_cache(verify_stacks=True)); step it with verify(..., replay=False)")
    if flush_all is None:
      flush_all = replay and self._small_batch(cache, tokens.shape[0])
    plan = cache.cursor.plan(slots, force_flush=force_flush, flush_all=bool(flush_all))
    start, live = self._start(cache, slots), slots >= 0

    def mixer_fn(mixer, x, lc):
      if isinstance(lc, AttentionLayerCache):
        y, lc = mixer.step(x[:, None], lc, slots, start, live[:, None],
                           implementation=_dispatch.without_mosaic(implementation))
        return y[:, 0], lc
      return mixer.decode(x, lc, plan, replay=replay, implementation=implementation)

    h, layers = self._run_blocks(self._embed(tokens), cache, mixer_fn, implementation)
    # Conventional mode never appends to the ring, so the windows stay empty and are not advanced.
    cursor = cache.cursor.commit(plan) if replay else cache.cursor
    return self._head(h), cache.replace(layers=layers, cursor=cursor,
                                        positions=self._advance(cache, slots, start, jnp.ones_like(start)))

  @staticmethod
  def _small_batch(cache: LMCache, batch: int) -> bool:
    """The flush-every-step policy: on below ``config.replay_min_batch`` of every recurrent
    family in the model (one plan serves all layers, so a hybrid flushes only where each family
    measured a loss for replay)."""
    families = {GdnLayerCache: "gdn", Mamba2LayerCache: "mamba2"}
    recurrent = [lc for lc in cache.layers if type(lc) in families]
    if not recurrent:
      return False
    threshold = min(config_lib.replay_min_batch(device_kind=pallas_common.device_kind(),
                                                state_dtype=lc.bufs.state.dtype,
                                                buffer_len=cache.cursor.buffer_len,
                                                family=families[type(lc)])
                    for lc in recurrent)
    return batch < threshold

  def verify(self, tokens, cache: LMCache, slots, *, lengths=None, replay=True, implementation=None,
             force_flush=None, return_hidden=False):
    """Speculative verify: T tokens per row through every layer in one step.

    Token 0 of a row is the token the model emitted last (not yet run), tokens 1..T-1 are
    drafts. ``logits[:, i]`` predicts the token after ``tokens[:, i]``, so draft i+1 is right
    under greedy decoding when it equals ``argmax(logits[:, i])``. Nothing is committed:
    pass the returned ``VerifyStep`` to ``commit`` with the accepted counts.

    Args:
      tokens: int32[B, T], 1 <= T <= ``cache.cursor.max_draft + 1`` (``init_cache(max_draft=)``).
      cache: LMCache.
      slots: int32[B] pool slots (negative = padding row: no cache change, logits meaningless).
      lengths: optional int32[B] real tokens per row in [1, T] (None: all T).
      replay: ReplaySSM verify (True: drafts in the rings) or conventional verify (False: the
        states after every token in the stacks of an ``init_cache(verify_stacks=True)`` cache).
      implementation: forwarded to ``gdn.replay_verify`` / ``mamba2.replay_verify`` (or their
        ``verify_conventional``), the attention and MoE layers (``_dispatch.without_mosaic``).
      force_flush: optional bool[B], as in ``decode`` (ReplaySSM only matters).
      return_hidden: keep the final-normed hidden states in ``VerifyStep.hidden`` (``mtp_draft``).

    Returns:
      (logits [B, T, vocab] float32, VerifyStep).
    """
    self._check_tokens("tokens", tokens, 2, "(int32[B, T])")
    self._check_cache(cache)
    if not isinstance(replay, bool):
      raise ValueError(f"replay={replay!r}; expected a bool")
    if replay == (cache.stacks is not None):
      raise ValueError(f"replay={replay} but the cache was made with verify_stacks="
                       f"{cache.stacks is not None}; conventional verify (replay=False) needs the "
                       f"stacks of init_cache(verify_stacks=True), ReplaySSM verify a cache without")
    t = tokens.shape[1]
    plan = cache.cursor.plan(slots, num_tokens=t, force_flush=force_flush)
    start = self._start(cache, slots)
    n_real = _slots.check_lengths(lengths, tokens.shape[0], t, slots)
    valid = (jnp.arange(t)[None, :] < n_real[:, None]) & (slots >= 0)[:, None]
    windows, stacks_in, stacks_out = [], iter(cache.stacks or (None,) * len(cache.layers)), []
    read = None if replay else _slots.gather(cache.read_index, slots)

    def mixer_fn(mixer, x, lc):
      stack = next(stacks_in)
      if isinstance(lc, AttentionLayerCache):
        windows.append(None)
        stacks_out.append(None)
        return mixer.step(x, lc, slots, start, valid,
                          implementation=_dispatch.without_mosaic(implementation))
      if replay:
        y, lc, window = mixer.verify(x, lc, plan, lengths=lengths, implementation=implementation)
      else:
        y, stack, window = _stack_verify.verify(mixer, x, lc, stack, slots, read, lengths=lengths,
                                                implementation=implementation)
      windows.append(window)
      stacks_out.append(stack)
      return y, lc

    h, layers = self._run_blocks(self._embed(tokens), cache, mixer_fn, implementation)
    out = cache.replace(layers=layers) if replay else cache.replace(layers=layers, stacks=tuple(stacks_out))
    normed = self.final_norm(h)
    return self._logits(normed), VerifyStep(cache=out, plan=plan, windows=tuple(windows), replay=replay,
                                            hidden=normed if return_hidden else None)

  def commit(self, step: VerifyStep, num_accepted) -> LMCache:
    """Keeps the first ``num_accepted[b]`` tokens of each row of a ``verify`` step (the rollback).

    The shared cursor advances by the accepted counts (rejected drafts stay unfolded past the
    window and are overwritten later) — or, after a conventional verify, each slot's
    ``read_index`` becomes ``num_accepted - 1`` (the stack entry after its last accepted token) —
    every recurrent layer's conv state rolls forward by the accepted tokens only, and each slot's
    position advances by its accepted count (rejected KV entries sit past it). Afterwards the cache
    equals one that decoded just the accepted tokens.

    Args:
      step: the VerifyStep of ``verify``.
      num_accepted: int32[B] in [1, T] (at most ``lengths``) on live rows; ignored on padding rows.

    Returns:
      LMCache.
    """
    if not isinstance(step, VerifyStep):
      raise ValueError(f"step must be the VerifyStep of LM.verify; got {type(step).__name__}")
    cache, plan = step.cache, step.plan
    layers = tuple(lc if w is None else m.commit(lc, w, plan, num_accepted)
                   for m, lc, w in zip(self.mixers, cache.layers, step.windows))
    start = self._start(cache, plan.slots)
    out = cache.replace(layers=layers, positions=self._advance(cache, plan.slots, start, num_accepted))
    if step.replay:
      return out.replace(cursor=cache.cursor.commit(plan, num_accepted))
    _checks.expect_dtype("num_accepted", num_accepted, (jnp.int32,))
    _checks.expect_shape("num_accepted", num_accepted, (plan.batch_size,), "(int32[B], in [1, T])")
    return out.replace(read_index=_slots.scatter_rows(cache.read_index, plan.slots, num_accepted - 1))

  def mtp_forward(self, hidden, next_tokens, cache: LMCache, slots, start, valid, *, fresh=False,
                  implementation=None):
    """The MTP head (``models.mtp``) at positions ``start[b] + t``: lane t reads the hidden state
    of its position and the token after it, writes its KV entry and guesses the token after that.

    Args:
      hidden: [B, T, D] final-normed hidden states g_p (``prefill`` / ``verify`` with
        ``return_hidden``) or the head's own outputs m (a chained draft).
      next_tokens: int32[B, T] the token at position p + 1 of each lane.
      cache: LMCache with ``mtp`` (``init_cache(mtp_drafts=)``).
      slots, start, valid: int32[B], int32[B], bool[B, T] (a prefix of lanes per row), as in
        ``Attention.step``; padding rows (slot < 0) write nothing.
      fresh: the rows start new sequences at position 0 (their KV rows are zeroed first).
      implementation: the head's attention and MoE implementation (``_dispatch.without_mosaic``).

    Returns:
      (logits [B, T, vocab] float32, m [B, T, D], cache).
    """
    m, cache = self._mtp_hidden(hidden, next_tokens, cache, slots, start, valid, fresh=fresh,
                                implementation=implementation)
    return self._logits(m), m, cache

  def _mtp_hidden(self, hidden, next_tokens, cache, slots, start, valid, *, fresh=False,
                  implementation=None):
    """``mtp_forward`` without the head: (m [B, T, D], cache)."""
    if cache.mtp is None:
      raise ValueError("cache has no MTP head cache; expected one from init_cache(mtp_drafts=k)")
    self._check_tokens("next_tokens", next_tokens, 2, "(int32[B, T])")
    m, kv = self.mtp(self._embed(next_tokens), hidden, cache.mtp.kv, slots, start, valid, fresh=fresh,
                     implementation=_dispatch.without_mosaic(implementation))
    return m, cache.replace(mtp=cache.mtp.replace(kv=kv))

  def mtp_draft(self, cache: LMCache, hidden, next_tokens, slots, start, count, *, fresh=False,
                implementation=None) -> LMCache:
    """The MTP head's k drafts after a step (k = ``cache.mtp.num_drafts``), greedy.

    The step covered positions ``start[b] .. start[b] + count[b] - 1`` of each row (a prefill, or
    a verify step's accepted tokens) with final-normed ``hidden`` [B, T, D], and ``next_tokens``
    int32[B, T] are the tokens after them (lane t: the token at ``start[b] + t + 1``: the prompt
    shifted by one and the sampled token; a verify step's emitted run). The head writes its KV
    entries for those positions, guesses d_1 at the last one, and chains k - 1 more positions on
    its own outputs (module docstring of ``models.mtp``). Drafts are argmax picks (a point-mass
    drafter keeps ``sampling.speculative_sample``'s rejection sampling exact).

    Returns:
      cache with ``mtp.drafts[slots[b]]`` and ``mtp.last_hidden[slots[b]]`` (the hidden state at
      the last covered position) set on live rows (count[b] >= 1).
    """
    t = hidden.shape[1]
    live = slots >= 0
    valid = (jnp.arange(t, dtype=jnp.int32)[None, :] < count[:, None]) & live[:, None]
    last = jnp.maximum(count - 1, 0)[:, None, None]
    last_hidden = _slots.scatter_rows(
        cache.mtp.last_hidden, slots,
        jnp.take_along_axis(hidden, last, axis=1)[:, 0].astype(cache.mtp.last_hidden.dtype))
    m, cache = self._mtp_hidden(hidden, next_tokens, cache, slots, start, valid, fresh=fresh,
                                implementation=implementation)
    # Only the last covered position drafts: the head (B·V·D) runs on that lane alone.
    m = jnp.take_along_axis(m, last, axis=1)                                          # [B, 1, D]
    draft = jnp.argmax(self._logits(m), axis=-1).astype(jnp.int32)                   # [B, 1]
    drafts = [draft]
    for j in range(1, cache.mtp.num_drafts):
      m, cache = self._mtp_hidden(m, draft, cache, slots, start + count + j - 1, live[:, None],
                                  implementation=implementation)
      draft = jnp.argmax(self._logits(m), axis=-1).astype(jnp.int32)
      drafts.append(draft)
    stored = _slots.scatter_rows(cache.mtp.drafts, slots, jnp.concatenate(drafts, axis=1))
    return cache.replace(mtp=cache.mtp.replace(drafts=stored, last_hidden=last_hidden))

  def mtp_draft_after_prefill(self, cache: LMCache, hidden, tokens, first, slots, lengths, *,
                              resume=False, implementation=None) -> LMCache:
    """``mtp_draft`` after ``prefill`` of right-padded ``tokens`` int32[B, T] (``lengths``, the
    cache the prefill returned): each prompt position with the prompt's next token, the last one
    with the sampled ``first`` int32[B].

    ``resume``: the prefill continued the slots' sequences (``prefill(resume=True)``, each slot
    covering at least one token before it). The head then starts one position earlier, at the
    slot's last covered position p, from ``mtp.last_hidden`` and the prompt's first token: the
    entry at p may have read another token (a prefix snapshot's sequence went on differently, a
    prompt block's prefill had only a sampled guess).
    """
    if resume:
      prev = _slots.gather(cache.mtp.last_hidden, slots)[:, None].astype(hidden.dtype)  # [B, 1, D]
      hidden = jnp.concatenate([prev, hidden], axis=1)
      tokens = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens], axis=1)
      lengths = lengths + 1
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    following = following.at[jnp.arange(tokens.shape[0]), jnp.maximum(lengths - 1, 0)].set(first)
    # Lane 0's position: the slot's position after the prefill less the lanes.
    start = jnp.where(slots >= 0, self._start(cache, slots) - lengths, 0)
    return self.mtp_draft(cache, hidden, following, slots, start, lengths, fresh=not resume,
                          implementation=implementation)

  def copy_slots(self, cache: LMCache, src, dst) -> LMCache:
    """Every layer's cache and the slot state of ``src[i]`` → ``dst[i]`` (prefix snapshots).

    Recurrent layers copy checkpoint, ring, window (``copy_slots`` of their family), conv state
    and (conventional verify caches) their state stack row and read index; attention layers copy
    the slot's KV row; the position is copied too, and the MTP head's KV row and drafts.

    Args:
      cache: LMCache.
      src, dst: int32[B] slots (negative entries in either: that pair is skipped).
    """
    self._check_cache(cache)
    _checks.expect_slots("src", src)
    _checks.expect_slots("dst", dst, src.shape[0])
    ops = {GdnLayerCache: gdn, Mamba2LayerCache: mamba2}
    live = (src >= 0) & (dst >= 0)
    take, put = jnp.where(live, src, 0), jnp.where(live, dst, -1)
    copy_rows = lambda x: _slots.scatter_rows(x, put, x[take])
    layers, cursor = [], cache.cursor
    for lc in cache.layers:
      if isinstance(lc, AttentionLayerCache):
        layers.append(AttentionLayerCache(k=copy_rows(lc.k), v=copy_rows(lc.v)))
        continue
      bufs, cursor = ops[type(lc)].copy_slots(lc.bufs, cache.cursor, src, dst)
      layers.append(lc.replace(bufs=bufs, conv_state=copy_rows(lc.conv_state)))
    out = cache.replace(layers=tuple(layers), cursor=cursor, positions=copy_rows(cache.positions))
    if cache.mtp is not None:
      kv = AttentionLayerCache(k=copy_rows(cache.mtp.kv.k), v=copy_rows(cache.mtp.kv.v))
      out = out.replace(mtp=MTPCache(kv=kv, drafts=copy_rows(cache.mtp.drafts),
                                     last_hidden=copy_rows(cache.mtp.last_hidden)))
    if cache.stacks is None:
      return out
    return out.replace(stacks=tuple(None if st is None else copy_rows(st) for st in cache.stacks),
                       read_index=copy_rows(cache.read_index))


def make_model(config: LMConfig | None = None, seed: int = 0) -> LM:
  """An LM with seeded random weights (``LMConfig.tiny()`` when ``config`` is None)."""
  return LM(LMConfig.tiny() if config is None else config, rngs=nnx.Rngs(seed))
