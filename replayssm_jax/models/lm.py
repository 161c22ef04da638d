"""A small GatedDeltaNet / Mamba2 language model (functional NNX, explicit cache pytree).

    h = embed(tokens)
    N × { h = h + Mixer_i(rmsnorm(h));  h = h + SwiGLU(rmsnorm(h)) }
    logits = head(rmsnorm(h))

Mixer_i is a GatedDeltaNet or a Mamba2 layer, chosen per layer by ``LMConfig.layer_types``
(default: all GatedDeltaNet). The cache (``LMCache``) holds each layer's own cache
(``GdnLayerCache`` or ``Mamba2LayerCache``) and the *one* ``ReplayCursor`` shared by all layers
(their rings all have size ``buffer_len``): every decode step makes one plan, runs all layers
with it and commits once (replay mode only; conventional mode leaves the cursor windows empty).
"""
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax import _checks
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig
from replayssm_jax.models.mamba2 import Mamba2, Mamba2Config

f32 = jnp.float32
LAYER_TYPES = ("gdn", "mamba2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
  """Shape of the LM.

  Attributes:
    vocab_size: token vocabulary.
    hidden_size: D.
    num_layers: number of (mixer, MLP) blocks.
    num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel: GatedDeltaNet shape.
    layer_types: one of "gdn" / "mamba2" per layer (None = all "gdn").
    mamba2_num_heads, mamba2_head_dim, mamba2_num_groups, mamba2_state_dim: Mamba2 shape (H, P,
      G, N; the conv kernel is ``conv_kernel``), used by "mamba2" layers.
    intermediate_size: SwiGLU hidden width.
    max_prompt_len: longest prompt ``generate`` accepts (prompts are padded to it, so every
      prompt length shares one compilation).
    rms_eps: RMSNorm epsilon.
    dtype: activation / parameter dtype.
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

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "intermediate_size", "max_prompt_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    types = ("gdn",) * self.num_layers if self.layer_types is None else self.layer_types
    if isinstance(types, str) or not isinstance(types, (tuple, list)):
      raise ValueError(f"layer_types={types!r}; expected a tuple of {LAYER_TYPES}")
    types = tuple(types)
    if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
      raise ValueError(f"layer_types={types!r}; expected {self.num_layers} entries, each one of "
                       f"{LAYER_TYPES}")
    object.__setattr__(self, "layer_types", types)
    object.__setattr__(self, "dtype", self.mixer().dtype)  # validates the mixer fields too
    if "mamba2" in types:
      self.mamba2_mixer()  # validates the Mamba2 fields

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

  def mixer(self) -> GatedDeltaNetConfig:
    return GatedDeltaNetConfig(hidden_size=self.hidden_size, num_k_heads=self.num_k_heads,
                               num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
                               head_v_dim=self.head_v_dim, conv_kernel=self.conv_kernel,
                               rms_eps=self.rms_eps, dtype=self.dtype)

  def mamba2_mixer(self) -> Mamba2Config:
    return Mamba2Config(hidden_size=self.hidden_size, num_heads=self.mamba2_num_heads,
                        head_dim=self.mamba2_head_dim, num_groups=self.mamba2_num_groups,
                        state_dim=self.mamba2_state_dim, conv_kernel=self.conv_kernel,
                        rms_eps=self.rms_eps, dtype=self.dtype)


@flax.struct.dataclass
class LMCache:
  """Decode cache of the LM: per-layer caches and the shared cursor.

  Attributes:
    layers: tuple with one cache per layer (GdnLayerCache or Mamba2LayerCache, by layer type).
    cursor: the ReplayCursor of every slot, shared by all layers.
  """
  layers: tuple
  cursor: ReplayCursor


class RMSNorm(nnx.Module):
  """x · rsqrt(mean(x²) + ε) · w over the last axis (in float32)."""

  def __init__(self, dim: int, *, eps: float, dtype):
    self.eps, self.dtype = eps, dtype
    self.weight = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x):
    x32 = x.astype(f32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.weight[...].astype(f32)).astype(self.dtype)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) · up(x))."""

  def __init__(self, dim: int, hidden: int, *, dtype, rngs: nnx.Rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate, self.up, self.down = lin(dim, hidden), lin(dim, hidden), lin(hidden, dim)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  """h + Mixer(norm(h)), then + SwiGLU(norm(h)); Mixer is GatedDeltaNet ("gdn") or Mamba2."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs, layer_type: str = "gdn"):
    c = config
    self.mixer_norm = RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype)
    if layer_type == "mamba2":
      self.mixer = Mamba2(c.mamba2_mixer(), rngs=rngs)
    else:
      self.mixer = GatedDeltaNet(c.mixer(), rngs=rngs)
    self.mlp_norm = RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype)
    self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, dtype=c.dtype, rngs=rngs)


class LM(nnx.Module):
  """embedding → blocks → final RMSNorm → head. ``prefill`` / ``decode`` take and return ``LMCache``."""

  def __init__(self, config: LMConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, LMConfig):
      raise ValueError(f"config must be an LMConfig; got {type(config).__name__}")
    self.config = c = config
    self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs=rngs, layer_type=t) for t in c.layer_types])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype)
    self.head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, dtype=c.dtype,
                           param_dtype=c.dtype, rngs=rngs)

  def init_cache(self, num_slots: int, *, buffer_len: int = 16, state_dtype=jnp.float32,
                 ring_dtype=None) -> LMCache:
    """Zeroed cache for ``num_slots`` slots with ReplaySSM buffer length ``buffer_len``."""
    cursor = ReplayCursor.create(num_slots, buffer_len=buffer_len)
    layers = tuple(b.mixer.init_cache(num_slots, cursor, state_dtype=state_dtype, ring_dtype=ring_dtype)
                   for b in self.blocks)
    return LMCache(layers=layers, cursor=cursor)

  def _check_tokens(self, name, tokens, ndim, what):
    _checks.expect_dtype(name, tokens, (jnp.int32,))
    _checks.expect_shape(name, tokens, (None,) * ndim, what)

  def _check_cache(self, cache):
    if not isinstance(cache, LMCache) or len(cache.layers) != len(self.blocks):
      raise ValueError(f"cache must be an LMCache with {len(self.blocks)} layers (from init_cache)")

  def prefill(self, tokens, cache: LMCache, slots, lengths):
    """Right-padded prompts from an empty state; writes the slots' caches and empties their windows.

    Args:
      tokens: int32[B, T]; row b's real tokens are ``tokens[b, :lengths[b]]``.
      cache: LMCache.
      slots: int32[B] pool slots (negative = padding row).
      lengths: int32[B] in [0, T].

    Returns:
      (logits [B, T, vocab] float32 — only positions < lengths[b] are meaningful; cache).
    """
    self._check_tokens("tokens", tokens, 2, "(int32[B, T])")
    self._check_cache(cache)
    h = self.embed(tokens)
    layers = []
    for block, lc in zip(self.blocks, cache.layers):
      y, lc = block.mixer.prefill(block.mixer_norm(h), lc, slots, lengths)
      h = h + y
      h = h + block.mlp(block.mlp_norm(h))
      layers.append(lc)
    logits = self.head(self.final_norm(h)).astype(f32)
    return logits, LMCache(layers=tuple(layers), cursor=cache.cursor.reset(slots))

  def decode(self, tokens, cache: LMCache, slots, *, replay=True, implementation=None):
    """One token per row: one shared plan for all layers, one commit (replay mode only).

    Args:
      tokens: int32[B] current tokens.
      cache: LMCache.
      slots: int32[B] pool slots (negative = padding row: no cache change, logits meaningless).
      replay: ReplaySSM decode (True) or conventional decode on the checkpoint pool (False).
      implementation: forwarded to the GDN / Mamba2 ops.

    Returns:
      (logits [B, vocab] float32, cache).
    """
    self._check_tokens("tokens", tokens, 1, "(int32[B])")
    self._check_cache(cache)
    plan = cache.cursor.plan(slots)
    h = self.embed(tokens)
    layers = []
    for block, lc in zip(self.blocks, cache.layers):
      y, lc = block.mixer.decode(block.mixer_norm(h), lc, plan, replay=replay, implementation=implementation)
      h = h + y
      h = h + block.mlp(block.mlp_norm(h))
      layers.append(lc)
    logits = self.head(self.final_norm(h)).astype(f32)
    # Conventional mode never appends to the ring, so the windows stay empty and are not advanced.
    cursor = cache.cursor.commit(plan) if replay else cache.cursor
    return logits, LMCache(layers=tuple(layers), cursor=cursor)


def make_model(config: LMConfig | None = None, seed: int = 0) -> LM:
  """An LM with seeded random weights (``LMConfig.tiny()`` when ``config`` is None)."""
  return LM(LMConfig.tiny() if config is None else config, rngs=nnx.Rngs(seed))
