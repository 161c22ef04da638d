"""Grouped matmul for mixture-of-experts layers in Pallas with the Triton lowering (interpreted on
CPU): ``jax.lax.ragged_dot`` semantics, one expert's weights streamed once per row tile.

For rows x [M, K] sorted by group and w [E, K, N]: rows ``[o_g, o_g + s_g)`` of the output are
``x[o_g : o_g + s_g] @ w[g]``, with s = ``group_sizes`` [E] and o its exclusive cumulative sum;
rows past Σ s are zeros.

The grid is (row tiles, N / BN). Each group's rows are split into tiles of BM rows starting at its
first row, so a tile never spans two groups; a tile reads its group's [K, BN] weight columns in
[BK, BN] blocks and accumulates x_tile · w_block in float32 (tensor cores for bf16 / f16 inputs;
IEEE float32 for float32 inputs, never TF32). The number of row tiles is data, so the grid has
the static bound ceil(M / BM) + min(E, M) (every non-empty group adds at most one partial tile)
and the tiles past the real count return at once. A tile's BM rows are read from
``min(first row, M − BM)`` so no read leaves the array (nothing is clamped behind the kernel's
back in interpret mode either), and only the rows of its own group are stored.

Decode makes this kernel weight-bound: at B = 256 with top-10 of 512 experts every expert holds
about five rows, so each expert's weights are read once per call, against XLA's lowering of
``ragged_dot`` on the H200, which made the MoE layers dominate the Qwen3-Next step
(bench/RESULTS.md, "End-to-end: real architectures").
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common

f32 = jnp.float32
MIN_DOT = 16   # Triton's smallest dot dimension


def _inclusive_sums(values):
  """[n] → [n] running sums Σ_{j ≤ i} values[j], as one masked [n, n] reduction (a prefix scan
  or ``jnp.cumsum`` is a separate reduce-window kernel per call on the GPU)."""
  i = jnp.arange(values.shape[0])
  return jnp.sum(jnp.where(i[:, None] >= i[None, :], values[None, :], 0), axis=1)


def tile_schedule(group_sizes, num_rows: int, block_m: int):
  """(group int32[T], first row int32[T], end row int32[T]) of the row tiles, T = the static bound
  ceil(num_rows / block_m) + min(E, num_rows); tiles past the real count have group E.

  Loop-free (masked sums and compares over [E, E] and [T, E]): in decode this runs once per MoE
  matmul, where ``jnp.searchsorted``'s binary search was a while loop of ~40 tiny kernels per
  layer (bench/RESULTS.md, "MoE grouped matmul")."""
  e = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  ends = _inclusive_sums(sizes)
  tiles = (sizes + block_m - 1) // block_m
  tile_ends = _inclusive_sums(tiles)
  bound = -(-num_rows // block_m) + min(e, num_rows)
  t = jnp.arange(bound, dtype=jnp.int32)
  group = jnp.sum(tile_ends[None, :] <= t[:, None], axis=1, dtype=jnp.int32)   # E: no such tile
  g = jnp.minimum(group, e - 1)
  first = ends[g] - sizes[g] + (t - (tile_ends[g] - tiles[g])) * block_m
  return group, first, jnp.minimum(first + block_m, ends[g])


def _kernel(group_ref, first_ref, end_ref, x_ref, w_ref, out_ref, *, num_groups, block_m, block_n,
            block_k, precision):
  t, n = pl.program_id(0), pl.program_id(1)
  g, first, end = group_ref[t], first_ref[t], end_ref[t]

  @pl.when(g < num_groups)
  def _():
    start = jnp.minimum(first, x_ref.shape[0] - block_m)          # the tile's rows stay in x
    rows = pl.ds(start, block_m)
    cols = pl.ds(n * block_n, block_n)

    def step(i, acc):
      ks = pl.ds(i * block_k, block_k)
      return acc + jnp.dot(x_ref[rows, ks], w_ref[g, ks, cols], preferred_element_type=f32,
                           precision=precision)
    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((block_m, block_n), f32))
    row = start + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    plt.store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), mask=(row >= first) & (row < end))


@functools.partial(jax.jit, static_argnames=("out_dtype", "cfg", "interpret"))
def _grouped_matmul(x, w, group_sizes, *, out_dtype, cfg, interpret):
  m, k = x.shape
  e, _, n = w.shape
  rows = max(m, cfg.block_m)          # fewer rows than a tile: pad to one (tiny batches)
  xp = jnp.pad(x, ((0, rows - m), (0, 0))) if rows > m else x
  group, first, end = tile_schedule(group_sizes, rows, cfg.block_m)
  precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
  kernel = functools.partial(_kernel, num_groups=e, block_m=cfg.block_m, block_n=cfg.block_n,
                             block_k=cfg.block_k, precision=precision)
  common.require_triton_addressable("moe.grouped_matmul[pallas_triton]", x=xp, w=w)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      kernel, grid=(group.shape[0], n // cfg.block_n), in_specs=[any_spec] * 5,
      out_specs=any_spec, out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype),
      name="replayssm_moe_grouped_matmul", interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
  )(group, first, end, xp, w)
  # No tile stores the rows past Σ sizes (nor the padding): their buffer values are undefined.
  covered = jnp.arange(rows) < jnp.sum(group_sizes.astype(jnp.int32))
  return jnp.where(covered[:, None], out, jnp.zeros((), out_dtype))[:m]


def grouped_matmul(x, w, group_sizes, *, preferred_element_type=None, block_m=None, block_n=None,
                   block_k=None, num_warps=None, num_stages=None):
  """``jax.lax.ragged_dot(x, w, group_sizes)``: x [M, K] (rows sorted by group), w [E, K, N],
  group_sizes int[E] (non-negative, Σ ≤ M) → [M, N] in ``preferred_element_type`` (default
  x.dtype), accumulated in float32. ``block_m`` / ``block_n`` / ``block_k`` (powers of two ≥ 16),
  ``num_warps`` and ``num_stages`` override the launch table. Raises NotImplementedError where the
  kernel cannot tile the shapes (K or N not a multiple of 16, mixed input dtypes), so
  ``implementation=None`` falls back to XLA."""
  op = "moe.grouped_matmul[pallas_triton]"
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"x {list(x.shape)}, w {list(w.shape)}; expected x [M, K] and w [E, K, N]")
  if group_sizes.shape != (w.shape[0],):
    raise ValueError(f"group_sizes has shape {list(group_sizes.shape)}; expected [{w.shape[0]}] "
                     f"(one per group of w)")
  if x.dtype != w.dtype:
    raise NotImplementedError(f"{op}: x is {x.dtype}, w is {w.dtype}; expected one dtype")
  k, n = x.shape[1], w.shape[2]
  if k % MIN_DOT or n % MIN_DOT:
    raise NotImplementedError(f"{op}: K={k}, N={n}; expected multiples of {MIN_DOT} (Triton's "
                              f"smallest dot)")
  common.require_pow2(op, **{name: v for name, v in (("block_m", block_m), ("block_n", block_n),
                                                     ("block_k", block_k)) if v is not None})
  cfg = config_lib.grouped_matmul_config(device_kind=common.device_kind(), rows=x.shape[0])
  cfg = cfg.override(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages).fit(k, n)
  out_dtype = jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)
  return _grouped_matmul(x, w, group_sizes, out_dtype=out_dtype, cfg=cfg,
                         interpret=common.interpret_mode())
