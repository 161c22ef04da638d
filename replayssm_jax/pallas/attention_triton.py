"""Decode / verify attention over a slot-pool KV cache in Pallas with the Triton lowering.

Row b of the batch reads its slot's KV row ``pool[slots[b]]`` in place (no gather copy), and only
the blocks that hold its positions. Lane t of row b attends cache positions ``0 .. start[b] + t``:

    o[b, t, h] = Σ_j softmax_j(scale · q[b, t, h] · k[s, j, h // G]) v[s, j, h // G],   s = slots[b]

Grid (B, Hkv, P). One program serves the G = H / Hkv query heads of a KV head and all T lanes:
its R = pow2(max(16, T·G)) query rows (lane-major, zero rows padding) stay in registers while it
streams ``block_kv``-token blocks of K and V with an online softmax (running max m, normalizer l,
unnormalized output acc, all float32). The trip count is dynamic: ``cdiv(start[b] + T, block_kv)``
blocks, of which split p of P takes a contiguous share (flash-decoding: with P > 1 each program
returns its (acc, m, l) and a jnp pass combines the splits, ``o = Σ_p e^{m_p − M} acc_p /
Σ_p e^{m_p − M} l_p``; with P = 1 the program normalizes and writes o itself).

Every load stays inside the pool: the last block of a row that would run past S starts at
S − block_kv instead, and the positions it re-reads (already counted by the previous block) are
masked out of the softmax like the positions past the lane's causal limit.

Numerics as ``jax.nn.dot_product_attention`` in the cache dtype: q cast to the cache dtype, q·kᵀ
and p·v on the tensor cores with float32 accumulation (p cast to the cache dtype for p·v),
float32 logits and softmax. A float32 cache uses IEEE float32 products (``Precision.HIGHEST``),
not TF32. Padding rows (slot < 0) read nothing and return zeros.

Shapes: q [B, T, H, Dh]; k_pool, v_pool [N, S, Hkv, Dh]; slots, start int32[B]; o float32
[B, T, H, Dh].
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import _checks, config
from replayssm_jax.pallas import common

f32 = jnp.float32
MIN_ROWS = 16          # the smallest M of a Triton tensor-core product
MAX_TOKENS = 16        # lanes per row this kernel is built for (decode and verify)
POOL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
OP = "attention.decode[pallas_triton]"


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _kernel(slots_ref, start_ref, q_ref, k_ref, v_ref, *out_refs, scale, group, num_tokens,
            block_kv, num_splits, precision):
  b, hk, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, dh = q_ref.shape[2], q_ref.shape[3]
  seq = k_ref.shape[1]
  s, first = slots_ref[b], start_ref[b]
  m0 = jnp.full((rows,), jnp.finfo(f32).min, f32)
  l0 = jnp.zeros((rows,), f32)
  acc0 = jnp.zeros((rows, dh), f32)

  def write(acc, m, l):
    if num_splits == 1:
      o_ref, = out_refs
      o_ref[b, hk, :, :] = acc / jnp.where(l > 0, l, 1.0)[:, None]
    else:
      acc_ref, m_ref, l_ref = out_refs
      acc_ref[b, hk, split, :, :] = acc
      m_ref[b, hk, split, :] = m
      l_ref[b, hk, split, :] = l

  pl.when(s < 0)(lambda: write(acc0, m0, l0))

  @pl.when(s >= 0)
  def _():
    # Row r is lane r // G (padding rows past T·G take the last lane's limit).
    lane = jnp.minimum(lax.broadcasted_iota(jnp.int32, (rows,), 0) // group, num_tokens - 1)
    limit = first + lane                                                  # [R] last position
    blocks = jnp.minimum(pl.cdiv(first + num_tokens, block_kv), pl.cdiv(seq, block_kv))
    share = pl.cdiv(blocks, num_splits)
    lo = jnp.minimum(split * share, blocks)
    hi = jnp.minimum(lo + share, blocks)
    q = q_ref[b, hk, :, :]                                                # [R, Dh]
    offsets = lax.broadcasted_iota(jnp.int32, (block_kv,), 0)

    def body(j, carry):
      acc, m, l = carry
      nominal = j * block_kv
      base = jnp.minimum(nominal, seq - block_kv)    # the last block ends at S, inside the pool
      span = pl.ds(base, block_kv)
      k = k_ref[s, span, hk, :]                                           # [BK, Dh]
      logits = plt.dot(q, k, trans_b=True, precision=precision) * scale   # [R, BK] float32
      pos = base + offsets
      keep = (pos[None, :] >= nominal) & (pos[None, :] <= limit[:, None])
      m_new = jnp.maximum(m, jnp.max(jnp.where(keep, logits, jnp.finfo(f32).min), axis=1))
      p = jnp.where(keep, jnp.exp(logits - m_new[:, None]), 0.0)
      alpha = jnp.exp(m - m_new)
      v = v_ref[s, span, hk, :]                                           # [BK, Dh]
      pv = plt.dot(p.astype(v.dtype), v, precision=precision)             # [R, Dh] float32
      return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    write(*lax.fori_loop(lo, hi, body, (acc0, m0, l0)))


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_splits", "num_warps",
                                             "num_stages", "interpret"))
def _decode_attention(q, k_pool, v_pool, slots, start, *, scale, block_kv, num_splits, num_warps,
                      num_stages, interpret):
  bsz, t, h, dh = q.shape
  hkv = k_pool.shape[2]
  group = h // hkv
  rows = _next_pow2(max(MIN_ROWS, t * group))
  # [B, T, Hkv·G, Dh] → [B, Hkv, T·G rows (lane-major), Dh], zero rows up to R.
  qr = q.astype(k_pool.dtype).reshape(bsz, t, hkv, group, dh).transpose(0, 2, 1, 3, 4)
  qr = jnp.pad(qr.reshape(bsz, hkv, t * group, dh), ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
  precision = lax.Precision.HIGHEST if k_pool.dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, scale=scale, group=group, num_tokens=t, block_kv=block_kv,
                             num_splits=num_splits, precision=precision)
  if num_splits == 1:
    out_shape = [jax.ShapeDtypeStruct((bsz, hkv, rows, dh), f32)]
  else:
    out_shape = [jax.ShapeDtypeStruct((bsz, hkv, num_splits, rows, dh), f32),
                 jax.ShapeDtypeStruct((bsz, hkv, num_splits, rows), f32),
                 jax.ShapeDtypeStruct((bsz, hkv, num_splits, rows), f32)]
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      kernel, grid=(bsz, hkv, num_splits), in_specs=[any_spec] * 5,
      out_specs=[any_spec] * len(out_shape), out_shape=out_shape, interpret=interpret,
      name="replayssm_decode_attention",
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(slots, start, qr, k_pool, v_pool)
  if num_splits == 1:
    o = outs[0]
  else:   # combine the splits' partial softmaxes (an empty split has m = min, l = 0: weight 0)
    acc, m, l = outs
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))                    # [B, Hkv, P, R]
    total = jnp.sum(w * l, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.where(total > 0, total, 1.0)[..., None]
  o = o[:, :, :t * group].reshape(bsz, hkv, t, group, dh).transpose(0, 2, 1, 3, 4)
  return o.reshape(bsz, t, h, dh)


def decode_attention(q, k_pool, v_pool, slots, start, *, scale, block_kv=None, num_splits=None,
                     num_warps=None, num_stages=None, interpret=None):
  """Causal attention of T new tokens per row over their slots' KV rows, read in place.

  Args:
    q: [B, T, H, Dh] queries (any float dtype; cast to the cache dtype), 1 <= T <= 16.
    k_pool, v_pool: [N, S, Hkv, Dh] the KV cache (bfloat16, float16 or float32; same dtype), H a
      multiple of Hkv. The T new tokens must already be written at ``start[b] + t``.
    slots: int32[B] pool slots; negative = padding row (zero output, nothing read).
    start: int32[B] >= 0, position of each row's first new token: lane t attends positions
      ``0 .. min(start[b] + t, S − 1)``.
    scale: logit scale.
    block_kv: tokens per K/V block (a power of two, 16 <= block_kv <= S); num_splits: programs
      per (row, KV head) splitting the row's blocks (a power of two); num_warps, num_stages:
      Triton launch options. None: the device's table (``config.attention_decode_config``).
    interpret: run in the Pallas interpreter; None = on CPU (``common.interpret_mode``).

  Returns:
    float32 [B, T, H, Dh].

  Raises:
    ValueError: bad shapes or dtypes. NotImplementedError: valid shapes this kernel cannot run
    (non-power-of-two Dh, T > 16, S < 16, 1-byte arrays past int32 element offsets).
  """
  for name, x, what in (("q", q, "[B, T, H, Dh]"), ("k_pool", k_pool, "[N, S, Hkv, Dh]"),
                        ("v_pool", v_pool, "[N, S, Hkv, Dh]")):
    _checks.expect_float(name, x)
    _checks.expect_shape(name, x, (None,) * 4, f"({what})")
  bsz, t, h, dh = q.shape
  n, seq, hkv, _ = k_pool.shape
  _checks.expect_shape("k_pool", k_pool, (None, None, None, dh), f"([N, S, Hkv, Dh] with Dh={dh} as q)")
  _checks.expect_shape("v_pool", v_pool, k_pool.shape, "(the shape of k_pool)")
  _checks.expect_dtype("k_pool", k_pool, POOL_DTYPES)
  if v_pool.dtype != k_pool.dtype:
    raise ValueError(f"v_pool has dtype {v_pool.dtype}; expected k_pool's dtype {k_pool.dtype}")
  if h % hkv:
    raise ValueError(f"q has shape {list(q.shape)}: H={h} query heads is not a multiple of "
                     f"Hkv={hkv} (k_pool shape {list(k_pool.shape)})")
  _checks.expect_slots("slots", slots, bsz)
  _checks.expect_dtype("start", start, (jnp.int32,))
  _checks.expect_shape("start", start, (bsz,), "(int32[B], position of each row's first new token)")
  _checks.check_slots("slots", slots, n)
  _checks.check_host(lambda st, sl: bool((st[sl >= 0] >= 0).all()),
                     lambda st, sl: f"start must be >= 0 on live rows; got {st.tolist()}", start, slots)
  if t > MAX_TOKENS:
    raise NotImplementedError(f"{OP}: T={t} tokens per row; the kernel serves decode and verify "
                              f"(T <= {MAX_TOKENS}); use implementation='xla'")
  cfg = dataclasses.asdict(config.attention_decode_config(
      device_kind=common.device_kind(), head_dim=dh, batch=bsz, num_kv_heads=hkv, seq_len=seq))
  for name, value in (("block_kv", block_kv), ("num_splits", num_splits), ("num_warps", num_warps),
                      ("num_stages", num_stages)):
    if value is not None:
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}; expected None or an int >= 1")
      cfg[name] = value
  common.require_pow2(OP, Dh=dh, block_kv=cfg["block_kv"], num_splits=cfg["num_splits"])
  if not MIN_ROWS <= cfg["block_kv"] <= seq:
    if block_kv is not None or seq < MIN_ROWS:
      raise NotImplementedError(f"{OP}: block_kv={cfg['block_kv']} with S={seq}; the kernel needs "
                                f"{MIN_ROWS} <= block_kv <= S")
    cfg["block_kv"] = 1 << (seq.bit_length() - 1)   # the default block, shrunk to fit a short S
  if dh < MIN_ROWS:
    raise NotImplementedError(f"{OP}: Dh={dh}; Triton tensor-core products need Dh >= {MIN_ROWS}")
  common.require_triton_addressable(OP, k_pool=k_pool, v_pool=v_pool)
  if interpret is None:
    interpret = common.interpret_mode()
  return _decode_attention(q, k_pool, v_pool, slots, start, scale=float(scale),
                           interpret=bool(interpret), **cfg)
