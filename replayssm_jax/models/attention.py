"""Softmax attention mixer with a slot-pool KV cache (Qwen3-Next / Qwen3.5, Nemotron-H, Granite 4.0 and
Bamba layers).

Per token x ∈ R^D at absolute position p (H query heads, Hkv key/value heads, head size Dh):

    q, gate = q_proj(x)               [H, Dh] each; with ``output_gate`` each head's q_proj rows
                                      hold [q_h | gate_h] (Qwen3-Next / Qwen3.5)
    k, v = k_proj(x), v_proj(x)       [Hkv, Dh]
    q, k = rmsnorm(q), rmsnorm(k)     per head over Dh, scale (offset + w) (``qk_norm``; Qwen)
    q, k = rope(q, p), rope(k, p)     the first ``rotary_dim`` channels, rotate-half pairs
                                      (i, i + rotary_dim/2), angle p · θ^(−2i/rotary_dim)
    o_h = softmax(scale · q_h · Kᵀ) V over the cached keys at positions ≤ p (head h reads kv head
          h // (H / Hkv))
    y = o_proj(o · sigmoid(gate))     (without ``output_gate``: o_proj(o))

Cache (``AttentionLayerCache``): keys (after rotary) and values ``[N, S, Hkv, Dh]`` per pool slot,
S = ``max_len``. The model keeps one ``positions`` int32[N] for every layer (``LMCache``): slot n
holds a sequence of ``positions[n]`` tokens at cache positions ``0 .. positions[n] - 1``; entries
past it get zero weight (a prefill of a new sequence zeroes the slot's row first, so they are
finite). Prefill, decode and speculative verify are the same step
(``step``): write the new tokens' k, v at ``start[b] + t``, then attend over the slot's cache row
with the causal mask ``j ≤ start[b] + t`` (on a GPU, for decode and verify, the Pallas-Triton kernel
``pallas.attention_triton`` reads each row's slot in place, up to its last position). Rollback after verify is only the caller's position
update (rejected drafts sit past the position and are overwritten later). Padding rows (slot < 0)
and padded lanes write nothing.
"""
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _checks, _dispatch, _slots

f32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
  """Shape and numerics of one attention mixer (the model width and dtype come from the LM).

  Attributes:
    num_heads: H query heads.
    num_kv_heads: Hkv key/value heads (H a multiple of Hkv: grouped-query attention).
    head_dim: Dh.
    rotary_dim: channels of each head that rotary embedding turns (even, <= Dh; Qwen3.5 / Qwen3-Next
      rotate ``partial_rotary_factor · Dh``); 0 = no positional encoding (Nemotron-H).
    rope_theta: rotary base θ.
    qk_norm: RMSNorm q and k per head before the rotary embedding (Qwen3-Next / Qwen3.5).
    norm_offset: the q/k norms scale by ``norm_offset + w`` (1.0 for zero-centred weights).
    output_gate: q_proj also yields a per-channel gate, ``o_proj(o · sigmoid(gate))``.
    bias: q/k/v/o projections carry biases (``attention_bias``).
    scale: logit scale; None = Dh^-1/2 (Granite 4.0: its ``attention_multiplier``).
  """
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rotary_dim: int = 0
  rope_theta: float = 10000.0
  qk_norm: bool = False
  norm_offset: float = 0.0
  output_gate: bool = False
  bias: bool = False
  scale: float | None = None

  def __post_init__(self):
    for name in ("num_heads", "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                       f"{self.num_kv_heads} (grouped-query attention needs H = r·Hkv)")
    r = self.rotary_dim
    if not isinstance(r, int) or isinstance(r, bool) or r < 0 or r % 2 or r > self.head_dim:
      raise ValueError(f"rotary_dim={r!r}; expected an even int in [0, head_dim={self.head_dim}]")
    if r and not self.rope_theta > 0:
      raise ValueError(f"rope_theta={self.rope_theta!r}; expected > 0")
    for name in ("qk_norm", "output_gate", "bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}; expected a bool")
    if self.scale is not None and not self.scale > 0:
      raise ValueError(f"scale={self.scale!r}; expected None or > 0")

  @property
  def logit_scale(self) -> float:
    return self.head_dim ** -0.5 if self.scale is None else float(self.scale)


@flax.struct.dataclass
class AttentionLayerCache:
  """KV cache of one attention layer over a pool of N slots.

  Attributes:
    k: [N, S, Hkv, Dh] keys after the rotary embedding, S = max_len tokens per slot.
    v: [N, S, Hkv, Dh] values.
  """
  k: jax.Array
  v: jax.Array

  @property
  def max_len(self) -> int:
    return self.k.shape[1]


def rotary(x, positions, rotary_dim: int, theta: float):
  """Rotate-half rotary embedding of the first ``rotary_dim`` channels: x [B, T, H, Dh] at
  positions int32[B, T] → float32 [B, T, H, Dh]. Pair (i, i + r/2) turns by p · θ^(−2i/r)."""
  x = x.astype(f32)
  if not rotary_dim:
    return x
  half = rotary_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=f32) / rotary_dim))    # [r/2]
  angle = positions.astype(f32)[..., None] * inv_freq                                  # [B, T, r/2]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
  x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attend_xla(q, k_pool, v_pool, slots, pos, *, scale):
  """Causal attention of q [B, T, H, Dh] over the slots' KV rows [N, S, Hkv, Dh] with XLA: lane t
  of row b attends positions ``<= pos[b, t]``. In the cache dtype with float32 logits and softmax
  (grouped heads, no KV copy per head). Returns float32 [B, T, H, Dh] (padding rows: garbage)."""
  bsz, s = q.shape[0], k_pool.shape[1]
  mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]                 # [B, T, S]

  def attend(keys, values):                                                                # [B, S, Hkv, Dh]
    return jax.nn.dot_product_attention(q.astype(keys.dtype), keys, values, mask=mask[:, None],
                                        scale=scale)

  gathered = lambda: attend(_slots.gather(k_pool, slots), _slots.gather(v_pool, slots))
  if k_pool.shape[0] == bsz:
    # Row b on slot b (a generate loop, a pool the size of the batch): read the pool in place.
    # The slot gather copies every row first, and that copy cost 4x the attention itself
    # (H200, Qwen3.5-4B attention layer, B = 256, 1040 tokens: 1.46 ms gather, 0.37 ms attention).
    identity = jnp.all(slots == jnp.arange(bsz, dtype=slots.dtype))
    o = jax.lax.cond(identity, lambda: attend(k_pool, v_pool), gathered)
  else:
    o = gathered()
  return o.astype(f32)


class Attention(nnx.Module):
  """Softmax attention mixer: ``[B, T, D] → [B, T, D]`` over a slot-pool KV cache.

  Parameters: ``q_proj`` (D → H·Dh, or H·2Dh with ``output_gate``: per head [q | gate]),
  ``k_proj``, ``v_proj`` (D → Hkv·Dh), ``o_proj`` (H·Dh → D), and with ``qk_norm`` the per-head
  norm weights ``q_norm``, ``k_norm`` [Dh].
  """

  def __init__(self, config: AttentionConfig, *, hidden_size: int, dtype, rms_eps: float,
               rngs: nnx.Rngs):
    if not isinstance(config, AttentionConfig):
      raise ValueError(f"config must be an AttentionConfig; got {type(config).__name__}")
    self.config = c = config
    self.hidden_size, self.dtype, self.rms_eps = hidden_size, jnp.dtype(dtype), rms_eps
    lin = lambda i, o: nnx.Linear(i, o, use_bias=c.bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
    q_width = c.num_heads * c.head_dim * (2 if c.output_gate else 1)
    self.q_proj = lin(hidden_size, q_width)
    self.k_proj = lin(hidden_size, c.num_kv_heads * c.head_dim)
    self.v_proj = lin(hidden_size, c.num_kv_heads * c.head_dim)
    self.o_proj = lin(c.num_heads * c.head_dim, hidden_size)
    if c.qk_norm:
      self.q_norm = nnx.Param(jnp.full((c.head_dim,), 1.0 - c.norm_offset, dtype))
      self.k_norm = nnx.Param(jnp.full((c.head_dim,), 1.0 - c.norm_offset, dtype))

  def init_cache(self, num_slots: int, max_len: int, *, dtype=None) -> AttentionLayerCache:
    """Zeroed KV cache: ``num_slots`` slots of ``max_len`` tokens, in ``dtype`` (default: the layer's)."""
    for name, value in (("num_slots", num_slots), ("max_len", max_len)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    c = self.config
    shape = (num_slots, max_len, c.num_kv_heads, c.head_dim)
    dtype = self.dtype if dtype is None else jnp.dtype(dtype)
    return AttentionLayerCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

  def _norm(self, x, weight):
    x = x.astype(f32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.rms_eps)
    return x * (self.config.norm_offset + weight[...].astype(f32))

  def step(self, x, cache: AttentionLayerCache, slots, start, valid, *, fresh=False,
           implementation=None):
    """T tokens per row at positions ``start[b] + t``: write their k, v, attend causally.

    Args:
      x: [B, T, D] activations.
      cache: this layer's AttentionLayerCache.
      slots: int32[B] pool slots (negative = padding row: nothing written, zero output).
      start: int32[B] position of each row's first token (the slot's sequence length so far).
      valid: bool[B, T], True on the real tokens: a prefix of each row's lanes (right padding).
        Only valid lanes are written; outputs of other lanes are zero.
      fresh: the rows start new sequences (a prefill from position 0): their slots' KV rows are
        zeroed first, so nothing an earlier sequence left past the new position (even a
        non-finite value) can reach a weighted sum through a zero weight.
      implementation: the attention over the cache (``_dispatch``): "pallas_triton" reads each
        row's slot in place with ``pallas.attention_triton`` (T <= 16), "xla" runs
        ``jax.nn.dot_product_attention`` over the whole row; None = the kernel on a GPU where it
        handles the shapes, else XLA.

    Returns:
      (y [B, T, D] in the layer dtype, cache).
    """
    c = self.config
    if not isinstance(cache, AttentionLayerCache):
      raise ValueError(f"cache must be an AttentionLayerCache (from init_cache); got {type(cache).__name__}")
    _checks.expect_float("x", x)
    _checks.expect_shape("x", x, (None, None, self.hidden_size), "([B, T, D])")
    bsz, t = x.shape[:2]
    n, s = cache.k.shape[:2]
    _checks.check_host(
        lambda st, ok, sl: bool(((st[:, None] + np.arange(t)[None, :]) < s)[(sl >= 0)[:, None] & ok].all()),
        lambda st, ok, sl: (f"KV cache overflow: a row writes a token at a position >= max_len={s} "
                            f"(start={st.tolist()}, tokens per row={ok.sum(1).tolist()})"),
        start, valid, slots)
    x = x.astype(self.dtype)
    q = self.q_proj(x).reshape(bsz, t, c.num_heads, -1)
    if c.output_gate:
      q, gate = jnp.split(q, 2, axis=-1)
    k = self.k_proj(x).reshape(bsz, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(bsz, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]                        # [B, T]
    q = rotary(q, pos, c.rotary_dim, c.rope_theta)
    k = rotary(k, pos, c.rotary_dim, c.rope_theta).astype(cache.k.dtype)
    v = v.astype(cache.v.dtype)

    # Scatter the valid lanes; padding rows and padded lanes point past the pool (row n + b, so
    # every index stays unique) and drop.
    live = (slots >= 0)[:, None] & valid
    row = jnp.where(live, slots[:, None], n + jnp.arange(bsz, dtype=jnp.int32)[:, None])
    kc, vc = cache.k, cache.v
    if fresh:
      kc, vc = (_slots.scatter_rows(a, slots, jnp.zeros((bsz,) + a.shape[1:], a.dtype)) for a in (kc, vc))
    kc = kc.at[row, pos].set(k, mode="drop", unique_indices=True)
    vc = vc.at[row, pos].set(v, mode="drop", unique_indices=True)

    def run_triton():
      from replayssm_jax.pallas import attention_triton
      return attention_triton.decode_attention(q, kc, vc, slots, start, scale=c.logit_scale)

    o = _dispatch.run("attention.step", implementation,                                  # [B, T, H, Dh]
                      {"xla": lambda: attend_xla(q, kc, vc, slots, pos, scale=c.logit_scale),
                       "pallas_triton": run_triton})
    if c.output_gate:
      o = o * jax.nn.sigmoid(gate.astype(f32))
    y = self.o_proj(o.reshape(bsz, t, c.num_heads * c.head_dim).astype(self.dtype))
    y = jnp.where(live[..., None], y, 0)
    return y, AttentionLayerCache(k=kc, v=vc)
