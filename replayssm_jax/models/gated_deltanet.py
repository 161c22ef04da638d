"""Gated DeltaNet mixer (Qwen3-Next / Qwen3.5 style) as a functional NNX module.

The module owns the parameters; the decode cache is an explicit pytree passed in and returned
(``y, cache = layer.decode(x, cache, plan)``), so a whole decode loop jits with the cache donated.

Per token x ∈ R^D (Hk key heads of size K, Hv value heads of size V, C = 2·Hk·K + Hv·V):

    [q | k | v], z, b, a = in_proj(x)               one fused projection: C + Hv·V + 2·Hv outputs
    [q | k | v] = silu(causal_depthwise_conv(q|k|v))  kernel W = conv_kernel over time, per channel
    q, k = q / sqrt(Σq² + 1e-6), k / sqrt(Σk² + 1e-6) per head (L2 norm)
    β = sigmoid(b),  g = −exp(A_log) · softplus(a + dt_bias)       (g ≤ 0: log decay)
    o = GDN(q, k, v, g, β)                          gdn.chunked (prefill) / replay_decode / decode
    y = out_proj(rmsnorm(o) · w · silu(z))          gated RMSNorm per value head, weight w [V]

Cache (``GdnLayerCache``): the rolling conv state ``[N, W-1, C]`` (the last W-1 pre-conv inputs of
each slot) and the layer's ``gdn.ReplayBuffers``. One state pool serves both decode modes:
with ``replay=True`` the checkpoint ``bufs.state`` plus the ring window (cursor) is the state;
with ``replay=False`` ``bufs.state`` *is* the conventional pool and the ring is never touched.
Callers that use conventional mode must not commit the cursor (the LM does not), so the windows
stay empty and ``gdn.materialize`` stays exact in both modes. The cursor itself is shared by
all layers of a model and lives in the model cache, not here.

Speculative steps: ``y, cache, window = layer.verify(x [B, T, D], cache, plan)`` runs T tokens
through the conv and ``gdn.replay_verify`` (drafts land in the ring past the window; the conv
state is left alone); ``cache = layer.commit(cache, window, plan, num_accepted)`` then sets the
conv state to the last W-1 inputs of the accepted tokens, and the caller's
``cursor.commit(plan, num_accepted)`` drops the rejected ring entries.
"""
import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import gdn
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.models import _conv
from replayssm_jax.models import _mixer

f32 = jnp.float32
L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatedDeltaNetConfig:
  """Shape and numerics of one GatedDeltaNet mixer.

  Attributes:
    hidden_size: D, model width.
    num_k_heads: Hk, query/key heads.
    num_v_heads: Hv, value heads (a multiple of Hk; value head h reads key head h // (Hv // Hk)).
    head_k_dim: K.
    head_v_dim: V.
    conv_kernel: W, causal depthwise conv length (the conv state keeps W - 1 inputs).
    rms_eps: epsilon of the gated RMSNorm.
    dtype: activation and parameter dtype (float32, bfloat16 or float16). Recurrence math is float32.
  """
  hidden_size: int
  num_k_heads: int
  num_v_heads: int
  head_k_dim: int
  head_v_dim: int
  conv_kernel: int = 4
  rms_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    for name in ("hidden_size", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    if self.conv_kernel < 2:
      raise ValueError(f"conv_kernel={self.conv_kernel}; expected >= 2 (the conv state holds W - 1 inputs)")
    if self.num_v_heads % self.num_k_heads:
      raise ValueError(f"num_v_heads={self.num_v_heads} is not a multiple of num_k_heads="
                       f"{self.num_k_heads} (GQA needs Hv = r·Hk)")
    if not self.rms_eps > 0:
      raise ValueError(f"rms_eps={self.rms_eps!r}; expected > 0")
    dtype = jnp.dtype(self.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype={dtype}; expected float32, bfloat16 or float16")
    object.__setattr__(self, "dtype", dtype)

  @property
  def key_dim(self) -> int:
    """Hk·K channels of q (and of k)."""
    return self.num_k_heads * self.head_k_dim

  @property
  def value_dim(self) -> int:
    """Hv·V channels of v (and of z)."""
    return self.num_v_heads * self.head_v_dim

  @property
  def conv_dim(self) -> int:
    """C = 2·Hk·K + Hv·V channels that go through the conv (q | k | v)."""
    return 2 * self.key_dim + self.value_dim


@flax.struct.dataclass
class GdnLayerCache:
  """Decode cache of one GatedDeltaNet layer over a pool of N slots.

  Attributes:
    conv_state: [N, W-1, C] the last W-1 pre-conv q|k|v inputs per slot, oldest first (dtype of
      the layer).
    bufs: gdn.ReplayBuffers (checkpoint [N, Hv, V, K] + ring). In conventional mode
      (``replay=False``) ``bufs.state`` is the state pool and the ring is unused.
  """
  conv_state: jax.Array
  bufs: gdn.ReplayBuffers


class GatedDeltaNet(_mixer.ConvMixer, nnx.Module):
  """Qwen3-Next GatedDeltaNet mixer: ``[..., D] → [..., D]`` with an explicit decode cache.

  Parameters: ``in_proj`` (D → C + Hv·V + 2·Hv, no bias; output order q | k | v | z | b | a),
  ``conv_weight`` [W, C], ``A_log`` [Hv], ``dt_bias`` [Hv], ``norm_weight`` [V], ``out_proj``
  (Hv·V → D, no bias).
  """

  cache_type = GdnLayerCache
  ops = gdn

  def __init__(self, config: GatedDeltaNetConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, GatedDeltaNetConfig):
      raise ValueError(f"config must be a GatedDeltaNetConfig; got {type(config).__name__}")
    self.config = c = config
    hv, w = c.num_v_heads, c.conv_kernel
    self.in_proj = nnx.Linear(c.hidden_size, c.conv_dim + c.value_dim + 2 * hv, use_bias=False,
                              dtype=c.dtype, param_dtype=c.dtype, rngs=rngs)
    # Depthwise conv1d init as in PyTorch (fan_in = W): U(-1/sqrt(W), 1/sqrt(W)).
    bound = 1.0 / math.sqrt(w)
    self.conv_weight = nnx.Param(
        jax.random.uniform(rngs.params(), (w, c.conv_dim), f32, -bound, bound).astype(c.dtype))
    # A = exp(A_log) ∈ [1, 16] and dt_bias = softplus⁻¹(dt) with dt log-uniform in [1e-3, 1e-1]
    # (Mamba2 / Qwen3-Next inits): decay rates spread over several time scales.
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), f32, 1.0, 16.0)))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (hv,), f32, math.log(1e-3), math.log(1e-1)))
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # softplus⁻¹(dt) = dt + log(1 − e^−dt)
    self.norm_weight = nnx.Param(jnp.ones((c.head_v_dim,), c.dtype))
    self.out_proj = nnx.Linear(c.value_dim, c.hidden_size, use_bias=False, dtype=c.dtype,
                               param_dtype=c.dtype, rngs=rngs)

  # ---- cache -------------------------------------------------------------------------------

  def init_cache(self, num_slots: int, cursor: ReplayCursor, *, state_dtype=jnp.float32,
                 ring_dtype=None, read_copy_dtype=None) -> GdnLayerCache:
    """Zeroed cache for ``num_slots`` slots; the ring size comes from the (shared) ``cursor``.

    ``ring_dtype=None`` stores the ring in the state dtype; ``read_copy_dtype`` adds the
    checkpoint's 16-bit read copy (see ``gdn.ReplayBuffers``).
    """
    c = self.config
    bufs = gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=c.num_k_heads,
                                    num_v_heads=c.num_v_heads, head_k_dim=c.head_k_dim,
                                    head_v_dim=c.head_v_dim, state_dtype=state_dtype,
                                    ring_dtype=ring_dtype, read_copy_dtype=read_copy_dtype)
    conv_state = jnp.zeros((num_slots, c.conv_kernel - 1, c.conv_dim), c.dtype)
    return GdnLayerCache(conv_state=conv_state, bufs=bufs)

  # ---- shared pieces -----------------------------------------------------------------------

  def _project(self, x):
    """x [..., D] → (qkv [..., C] pre-conv, z [..., Hv, V], b [..., Hv], a [..., Hv])."""
    c = self.config
    p = self.in_proj(x.astype(c.dtype))
    qkv, z, b, a = jnp.split(p, np.cumsum([c.conv_dim, c.value_dim, c.num_v_heads]), axis=-1)
    return qkv, z.reshape(*z.shape[:-1], c.num_v_heads, c.head_v_dim), b, a

  def _heads(self, qkv, b, a):
    """Post-conv q|k|v [..., C] and gates → (q, k [..., Hk, K] L2-normed, v [..., Hv, V], g, β [..., Hv])."""
    c = self.config
    q, k, v = jnp.split(qkv.astype(f32), [c.key_dim, 2 * c.key_dim], axis=-1)
    q = q.reshape(*q.shape[:-1], c.num_k_heads, c.head_k_dim)
    k = k.reshape(*k.shape[:-1], c.num_k_heads, c.head_k_dim)
    v = v.reshape(*v.shape[:-1], c.num_v_heads, c.head_v_dim)
    # L2 norm per head: x / sqrt(Σx² + ε), so |k| ≈ 1 and the delta rule stays contractive.
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2_EPS)
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2_EPS)
    beta = jax.nn.sigmoid(b.astype(f32))
    # g = −A·Δ with A = exp(A_log) > 0 and Δ = softplus(a + dt_bias) > 0, so g ≤ 0 (α = e^g ≤ 1).
    g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(a.astype(f32) + self.dt_bias[...].astype(f32))
    return q, k, v, g, beta

  def _output(self, o, z):
    """o, z [..., Hv, V] → out_proj(rmsnorm(o)·w·silu(z)) [..., D] (norm over V, per head, in f32)."""
    c = self.config
    o = o.astype(f32)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + c.rms_eps)
    o = o * self.norm_weight[...].astype(f32) * jax.nn.silu(z.astype(f32))
    return self.out_proj(o.reshape(*o.shape[:-2], c.value_dim).astype(c.dtype))

  def _op_inputs(self, x, conv):
    """x [B, (T,) D] through the projections and ``conv(pre-conv q|k|v, weight, bias)`` (the conv
    step or verify, returning (output, its second result)) → ((q, k, v, g, β), {}, z, the conv's
    second result), the arguments of the ``gdn`` ops."""
    qkv, z, b, a = self._project(x)
    out, conv_aux = conv(qkv, self.conv_weight[...], None)
    return self._heads(jax.nn.silu(out), b, a), {}, z, conv_aux

  # ---- prefill -----------------------------------------------------------------------------

  def prefill(self, x, cache: GdnLayerCache, slots, lengths, *, chunk_size=64, initial_state=None):
    """Runs right-padded prompts (from an empty state, or continuing ``initial_state``) and
    writes their slots' cache.

    Row b holds ``lengths[b]`` real tokens followed by padding. Padding is made inert: from
    position ``lengths[b]`` on, the GDN inputs are g = 0, β = 0 and q = k = v = 0, so the state
    stops changing (u = β(...) = 0 and α = e^0 = 1) and the final state equals the state after
    ``lengths[b]`` tokens. The conv only looks back, so padding never reaches a real position.

    The slots' conv state becomes the last W-1 real pre-conv inputs (zeros before the prompt
    start) and their checkpoint the final state (``gdn.write_state``). The caller resets the
    shared cursor windows of ``slots`` (``cursor.reset(slots)``; ``LM.prefill`` does it once).

    Args:
      x: [B, T, D] activations.
      cache: this layer's GdnLayerCache.
      slots: int32[B] pool slot per row (negative = padding row: nothing written).
      lengths: int32[B] real tokens per row, in [0, T].
      chunk_size: chunk length of ``gdn.chunked``.
      initial_state: None (start from an empty state) or float32 [B, Hv, V, K]: continue each row
        from this state and from its slot's stored conv inputs (a prompt that extends the
        slot's sequence, e.g. after a prefix-cache hit; ``LM.prefill(..., resume=True)``).

    Returns:
      (y [B, T, D] in the layer dtype, zeros at padded positions and on padding rows; cache).
    """
    self._check_x("x", x, 3, "([B, T, D])")
    self._check_cache(cache)
    real = _conv.real_positions(x, slots, lengths)                          # [B, T]

    qkv, z, b, a = self._project(x)
    conv, conv_state = _conv.prefill(qkv, self.conv_weight[...], None, cache.conv_state, slots,
                                     lengths, resume=initial_state is not None)
    qkv = jax.nn.silu(conv)

    q, k, v, g, beta = self._heads(qkv, b, a)
    mask = lambda u: jnp.where(real.reshape(real.shape + (1,) * (u.ndim - 2)), u, 0)
    q, k, v, g, beta = map(mask, (q, k, v, g, beta))
    o, S = gdn.chunked(q, k, v, g, beta, chunk_size=chunk_size,
                       initial_state=initial_state)                   # o [B, T, Hv, V], S f32
    y = jnp.where(real[..., None], self._output(o, z), 0)

    bufs, _ = gdn.write_state(cache.bufs, _conv.stand_in_cursor(cache.bufs), slots, S)
    return y, GdnLayerCache(conv_state=conv_state, bufs=bufs)
