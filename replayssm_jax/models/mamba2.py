"""Mamba2 mixer (Mamba2 / Nemotron-H / Falcon-H1 style) as a functional NNX module.

Same structure and cache conventions as ``GatedDeltaNet``: the module owns the parameters; the
decode cache is an explicit pytree passed in and returned (``y, cache = layer.decode(x, cache,
plan)``), so a whole decode loop jits with the cache donated.

Per token x ∈ R^D (H heads of size P, G groups, state size N, I = H·P, C = I + 2·G·N):

    z, [x | B | C], dt = in_proj(x)                  one fused projection: I + C + H outputs
    [x | B | C] = silu(causal_depthwise_conv(x|B|C) + conv_bias)   kernel W over time, per channel
    A = −exp(A_log),  Δ = clip(softplus(dt + dt_bias), dt_limit)   (the softplus inside the
                                                     Mamba2 op when dt_limit is the default (0, ∞))
    y = Mamba2(x, Δ, A, B, C) + D·x                  mamba2.chunked (prefill) / replay_decode / decode
    y = out_proj(rmsnorm_g(y · silu(z)) · w)         gated RMSNorm, norm_before_gate=False

The gate is *not* applied inside the op: as in Mamba2 (``RMSNormGated(norm_before_gate=False,
group_size=I // G)``) and Nemotron-H, y is first multiplied by silu(z), then RMS-normalized over
each **group** of (H // G)·P channels (heads h with h // (H // G) = g), then scaled by w [I]
(``norm="gate_then_norm"``). Falcon-H1 checkpoints may instead normalize first,
``rmsnorm_g(y) · w · silu(z)`` (``"norm_then_gate"``, its ``mamba_norm_before_gate``), or have no
norm, ``out_proj(y · silu(z))`` (``"none"``, its ``mamba_rms_norm=false``; no ``norm_weight``).

Cache (``Mamba2LayerCache``): the rolling conv state ``[N, W-1, C]`` (the last W-1 pre-conv x|B|C
inputs of each slot) and the layer's ``mamba2.ReplayBuffers``. As for GatedDeltaNet, one state pool
serves both decode modes (``replay=False`` reads and writes ``bufs.state`` directly and never
touches the ring); the shared cursor lives in the model cache. Speculative steps use ``verify``
(T tokens through the conv and ``mamba2.replay_verify``) and ``commit`` (conv-state rewind to the
accepted tokens), as for GatedDeltaNet.
"""
import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import mamba2
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.models import _conv
from replayssm_jax.models import _mixer

f32 = jnp.float32
# Raw dt at padded prompt positions: softplus(PAD_DT + dt_bias) is exactly 0 in float32, so the
# decay is exp(0·A) = 1 and (with x = B = 0) the state does not change.
PAD_DT = -1e4
NORMS = ("gate_then_norm", "norm_then_gate", "none")   # output norm of the mixer (Mamba2Config.norm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Config:
  """Shape and numerics of one Mamba2 mixer.

  Attributes:
    hidden_size: D, model width.
    num_heads: H.
    head_dim: P (inner width I = H·P).
    num_groups: G (H a multiple of G; head h reads B/C group h // (H // G); the gated RMSNorm
      normalizes each group separately).
    state_dim: N.
    conv_kernel: W, causal depthwise conv length (the conv state keeps W - 1 inputs).
    rms_eps: epsilon of the gated RMSNorm.
    dt_limit: (lo, hi): Δ is clipped to [lo, hi] after the softplus (NVIDIA's ``dt_limit``,
      transformers' ``time_step_limit``); the default (0, ∞) clips nothing.
    norm: the output norm: "gate_then_norm" (rmsnorm_g(y·silu(z))·w, Mamba2), "norm_then_gate"
      (rmsnorm_g(y)·w·silu(z)) or "none" (y·silu(z), no norm weight); the last two are Falcon-H1's.
    dtype: activation and parameter dtype (float32, bfloat16 or float16). Recurrence math is float32.
  """
  hidden_size: int
  num_heads: int
  head_dim: int
  num_groups: int = 1
  state_dim: int = 16
  conv_kernel: int = 4
  rms_eps: float = 1e-6
  dt_limit: tuple = (0.0, math.inf)
  norm: str = "gate_then_norm"
  dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    for name in ("hidden_size", "num_heads", "head_dim", "num_groups", "state_dim", "conv_kernel"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    if self.conv_kernel < 2:
      raise ValueError(f"conv_kernel={self.conv_kernel}; expected >= 2 (the conv state holds W - 1 inputs)")
    if self.num_heads % self.num_groups:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_groups="
                       f"{self.num_groups} (head h reads group h // (H // G))")
    if isinstance(self.rms_eps, bool) or not isinstance(self.rms_eps, (int, float)) or not self.rms_eps > 0:
      raise ValueError(f"rms_eps={self.rms_eps!r}; expected > 0")
    limit = tuple(self.dt_limit) if isinstance(self.dt_limit, (tuple, list)) else None
    if (limit is None or len(limit) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                for v in limit)
        or math.isnan(limit[0]) or math.isnan(limit[1]) or not 0 <= limit[0] <= limit[1]):
      raise ValueError(f"dt_limit={self.dt_limit!r}; expected (lo, hi) floats with 0 <= lo <= hi")
    object.__setattr__(self, "dt_limit", (float(limit[0]), float(limit[1])))
    if self.norm not in NORMS:
      raise ValueError(f"norm={self.norm!r}; expected one of {NORMS}")
    dtype = jnp.dtype(self.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
      raise ValueError(f"dtype={dtype}; expected float32, bfloat16 or float16")
    object.__setattr__(self, "dtype", dtype)

  @property
  def inner_dim(self) -> int:
    """I = H·P channels of x (and of z)."""
    return self.num_heads * self.head_dim

  @property
  def conv_dim(self) -> int:
    """C = I + 2·G·N channels that go through the conv (x | B | C)."""
    return self.inner_dim + 2 * self.num_groups * self.state_dim


@flax.struct.dataclass
class Mamba2LayerCache:
  """Decode cache of one Mamba2 layer over a pool of N slots.

  Attributes:
    conv_state: [N, W-1, C] the last W-1 pre-conv x|B|C inputs per slot, oldest first (dtype of
      the layer).
    bufs: mamba2.ReplayBuffers (checkpoint [N, H, P, N_state] + ring). In conventional mode
      (``replay=False``) ``bufs.state`` is the state pool and the ring is unused.
  """
  conv_state: jax.Array
  bufs: mamba2.ReplayBuffers


class Mamba2(_mixer.ConvMixer, nnx.Module):
  """Mamba2 mixer: ``[..., D] → [..., D]`` with an explicit decode cache.

  Parameters: ``in_proj`` (D → I + C + H, no bias; output order z | x | B | C | dt),
  ``conv_weight`` [W, C], ``conv_bias`` [C], ``A_log`` [H], ``D`` [H], ``dt_bias`` [H],
  ``norm_weight`` [I] (not with ``norm="none"``), ``out_proj`` (I → D, no bias).
  """

  cache_type = Mamba2LayerCache
  ops = mamba2

  def __init__(self, config: Mamba2Config, *, rngs: nnx.Rngs):
    if not isinstance(config, Mamba2Config):
      raise ValueError(f"config must be a Mamba2Config; got {type(config).__name__}")
    self.config = c = config
    h, w = c.num_heads, c.conv_kernel
    self.in_proj = nnx.Linear(c.hidden_size, c.inner_dim + c.conv_dim + h, use_bias=False,
                              dtype=c.dtype, param_dtype=c.dtype, rngs=rngs)
    # Depthwise conv1d init as in PyTorch (fan_in = W): U(-1/sqrt(W), 1/sqrt(W)), bias likewise.
    bound = 1.0 / math.sqrt(w)
    self.conv_weight = nnx.Param(
        jax.random.uniform(rngs.params(), (w, c.conv_dim), f32, -bound, bound).astype(c.dtype))
    self.conv_bias = nnx.Param(
        jax.random.uniform(rngs.params(), (c.conv_dim,), f32, -bound, bound).astype(c.dtype))
    # Mamba2 inits: A = exp(A_log) ∈ [1, 16], dt_bias = softplus⁻¹(dt), dt log-uniform in
    # [1e-3, 1e-1], D = 1.
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), f32, 1.0, 16.0)))
    dt = jnp.exp(jax.random.uniform(rngs.params(), (h,), f32, math.log(1e-3), math.log(1e-1)))
    self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))
    self.D = nnx.Param(jnp.ones((h,), f32))
    if c.norm != "none":
      self.norm_weight = nnx.Param(jnp.ones((c.inner_dim,), c.dtype))
    self.out_proj = nnx.Linear(c.inner_dim, c.hidden_size, use_bias=False, dtype=c.dtype,
                               param_dtype=c.dtype, rngs=rngs)

  # ---- cache -------------------------------------------------------------------------------

  def init_cache(self, num_slots: int, cursor: ReplayCursor, *, state_dtype=jnp.float32,
                 ring_dtype=None, read_copy_dtype=None) -> Mamba2LayerCache:
    """Zeroed cache for ``num_slots`` slots; the ring size comes from the (shared) ``cursor``;
    ``read_copy_dtype`` adds the checkpoint's 16-bit read copy (see ``mamba2.ReplayBuffers``)."""
    c = self.config
    bufs = mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=c.num_heads, head_dim=c.head_dim,
                                       num_groups=c.num_groups, state_dim=c.state_dim,
                                       state_dtype=state_dtype, ring_dtype=ring_dtype,
                                       read_copy_dtype=read_copy_dtype)
    conv_state = jnp.zeros((num_slots, c.conv_kernel - 1, c.conv_dim), c.dtype)
    return Mamba2LayerCache(conv_state=conv_state, bufs=bufs)

  # ---- shared pieces -----------------------------------------------------------------------

  def _project(self, x):
    """x [..., D] → (z [..., H, P], xBC [..., C] pre-conv, dt [..., H])."""
    c = self.config
    p = self.in_proj(x.astype(c.dtype))
    z, xbc, dt = jnp.split(p, np.cumsum([c.inner_dim, c.conv_dim]), axis=-1)
    return z.reshape(*z.shape[:-1], c.num_heads, c.head_dim), xbc, dt

  def _split(self, xbc):
    """Post-conv x|B|C [..., C] → (x [..., H, P], B, C [..., G, N]) in float32."""
    c = self.config
    gn = c.num_groups * c.state_dim
    xs, B, C = jnp.split(xbc.astype(f32), [c.inner_dim, c.inner_dim + gn], axis=-1)
    lead = xs.shape[:-1]
    return (xs.reshape(*lead, c.num_heads, c.head_dim), B.reshape(*lead, c.num_groups, c.state_dim),
            C.reshape(*lead, c.num_groups, c.state_dim))

  def _ssm_params(self, dt, real=None):
    """Raw dt [..., H] → the op's (A = −exp(A_log), D, dt, dt_bias, dt_softplus), float32.

    With the default dt_limit the op applies softplus(dt + dt_bias) itself; a clipping limit
    is applied here, Δ = clip(softplus(dt + dt_bias), lo, hi), and the op gets Δ. ``real``
    (bool[..]) marks real prompt positions: elsewhere Δ = 0, the inert padding of ``prefill``.
    """
    c = self.config
    A, D, dt_bias = (-jnp.exp(self.A_log[...].astype(f32)), self.D[...].astype(f32),
                     self.dt_bias[...].astype(f32))
    dt = dt.astype(f32)
    if c.dt_limit == (0.0, math.inf):         # softplus ≥ 0: nothing to clip
      if real is not None:
        dt = jnp.where(real[..., None], dt, PAD_DT)
      return A, D, dt, dt_bias, True
    delta = jnp.clip(jax.nn.softplus(dt + dt_bias), *c.dt_limit)
    if real is not None:
      delta = jnp.where(real[..., None], delta, 0.0)
    return A, D, delta, None, False

  def _output(self, y, z):
    """y, z [..., H, P] → out_proj(rmsnorm_per_group(y·silu(z))·w) [..., D] (in float32; the
    norm and gate as ``config.norm`` says)."""
    c = self.config
    lead = y.shape[:-2]
    g, gate = y.astype(f32).reshape(*lead, c.inner_dim), jax.nn.silu(z.astype(f32)).reshape(*lead, c.inner_dim)
    if c.norm != "norm_then_gate":
      g = g * gate
    if c.norm != "none":
      g = g.reshape(*lead, c.num_groups, c.inner_dim // c.num_groups)
      g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + c.rms_eps)
      g = g.reshape(*lead, c.inner_dim) * self.norm_weight[...].astype(f32)
    if c.norm == "norm_then_gate":
      g = g * gate
    return self.out_proj(g.astype(c.dtype))

  def _op_inputs(self, x, conv):
    """x [B, (T,) D] through the projections and ``conv(pre-conv x|B|C, weight, bias)`` (the conv
    step or verify, returning (output, its second result)) → ((x, dt, A, B, C), the op keywords
    D / dt_bias / dt_softplus, z, the conv's second result), the arguments of the ``mamba2`` ops."""
    z, xbc, dt = self._project(x)
    out, conv_aux = conv(xbc, self.conv_weight[...], self.conv_bias[...])
    xs, B, C = self._split(jax.nn.silu(out))
    A, D, dt, dt_bias, softplus = self._ssm_params(dt)
    return (xs, dt, A, B, C), dict(D=D, dt_bias=dt_bias, dt_softplus=softplus), z, conv_aux

  # ---- prefill -----------------------------------------------------------------------------

  def prefill(self, x, cache: Mamba2LayerCache, slots, lengths, *, chunk_size=64, initial_state=None):
    """Runs right-padded prompts (from an empty state, or continuing ``initial_state``) and
    writes their slots' cache.

    Row b holds ``lengths[b]`` real tokens followed by padding. Padding is made inert: from
    position ``lengths[b]`` on, the op inputs are x = B = C = 0 and Δ = 0 (raw dt = ``PAD_DT``
    (−1e4), so softplus(dt + dt_bias) = 0 exactly, or Δ = 0 set after a clipping dt_limit): the
    decay is e^{0·A} = 1 and Δ·x·Bᵀ = 0, so the final state equals the state after
    ``lengths[b]`` tokens. The conv only looks back, so padding
    never reaches a real position.

    The slots' conv state becomes the last W-1 real pre-conv inputs (zeros before the prompt
    start) and their checkpoint the final state (``mamba2.write_state``). The caller resets the
    shared cursor windows of ``slots`` (``LM.prefill`` does it once).

    Args:
      x: [B, T, D] activations.
      cache: this layer's Mamba2LayerCache.
      slots: int32[B] pool slot per row (negative = padding row: nothing written).
      lengths: int32[B] real tokens per row, in [0, T].
      chunk_size: chunk length of ``mamba2.chunked``.
      initial_state: None (start from an empty state) or float32 [B, H, P, N]: continue each row
        from this state and from its slot's stored conv inputs (a prompt that extends the
        slot's sequence, e.g. after a prefix-cache hit; ``LM.prefill(..., resume=True)``).

    Returns:
      (y [B, T, D] in the layer dtype, zeros at padded positions and on padding rows; cache).
    """
    self._check_x("x", x, 3, "([B, T, D])")
    self._check_cache(cache)
    real = _conv.real_positions(x, slots, lengths)                          # [B, T]

    z, xbc, dt = self._project(x)
    conv, conv_state = _conv.prefill(xbc, self.conv_weight[...], self.conv_bias[...],
                                     cache.conv_state, slots, lengths,
                                     resume=initial_state is not None)

    xs, B, C = self._split(jax.nn.silu(conv))
    mask = lambda u: jnp.where(real.reshape(real.shape + (1,) * (u.ndim - 2)), u, 0)
    xs, B, C = map(mask, (xs, B, C))
    A, D, dt, dt_bias, softplus = self._ssm_params(dt, real)
    y, S = mamba2.chunked(xs, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=softplus,
                          chunk_size=chunk_size, initial_state=initial_state)  # y [B, T, H, P]
    y = jnp.where(real[..., None], self._output(y, z), 0)

    bufs, _ = mamba2.write_state(cache.bufs, _conv.stand_in_cursor(cache.bufs), slots, S)
    return y, Mamba2LayerCache(conv_state=conv_state, bufs=bufs)
