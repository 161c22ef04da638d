"""The window fold in Pallas with the Triton lowering, shared by GDN and Mamba2 (interpreted on CPU).

Both families keep a ring whose entries (g_j, u_j, k_j) replay the recurrence ``S ← e^{g_j} S +
u_j k_jᵀ`` on a checkpoint: GDN stores (g, corrected value u, key k), Mamba2 (ΔA, Δx, B). Folding
``length`` entries from ``base`` is therefore one formula for both::

    S = e^G S_c + Σ_j w_j u_j k_jᵀ,      w_j = e^{G − G_j}  (``replay.window_decays``)

Names follow GDN: ``state`` [Ns, H, V, K] (Mamba2: [Ns, H, P, N]), ``ring_u`` [Ns, H, R, V]
(ring_x), ``ring_k`` [Ns, Hk, R, K] (ring_B, one per group of H / Hk heads), ``ring_g`` [Ns, H, R]
(ring_a). The flush pass (``fold_flushing_rows``) runs after a step kernel has appended its token,
on the flushing rows only, compacted so the grid is sized for the rows that work; ``fold`` also
serves materialize (every row, into a fresh f32 array).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.pallas import common
from replayssm_jax.replay import window_decays, window_offsets

f32 = jnp.float32


def accumulate_window(S, weights, inside, k_at, u_at, ring_size):
  """S + Σ_p w_p u_p k_pᵀ over the ring positions p inside the window, in float32.

  ``k_at(rows)`` / ``u_at(rows)`` index the key [.., BK] / value [.., BV] ring of the row's head
  with ``rows`` a slice (all R entries) or one entry, in a single indexer (Triton lowers no
  chained indexers). Entries outside the window are never read (masked loads give zeros; they may
  be stale or NaN). With R ≥ 16 (Triton's smallest dot) and a tile of at most 32×128 the sum is one
  matrix product ``(w∘U)ᵀ K`` (``_window_product``); otherwise R rank-one FMAs are unrolled, their
  loads independent so they issue together.
  """
  if ring_size >= 16 and S.shape[0] * S.shape[1] <= 32 * 128:
    U = common.load_window(u_at(slice(None)), inside)                   # [R, BV]
    k_ring = k_at(slice(None))
    Kr = common.load_window(k_ring, inside)                             # [R, BK]
    return S + _window_product((weights[:, None] * U).T, Kr, k_ring.dtype)
  return rank_one_window(S, weights, inside, k_at, u_at, ring_size)


def rank_one_window(S, weights, inside, k_at, u_at, ring_size):
  """``accumulate_window`` as R unrolled rank-one FMAs, one per ring position, each entry's two
  loads masked (zeros) outside the window; the loads are independent so they issue together."""
  pos = lax.broadcasted_iota(jnp.int32, (ring_size,), 0)
  for p in range(ring_size):
    at_p = pos == p
    w = jnp.sum(jnp.where(at_p, weights, 0.0))
    live = jnp.sum(jnp.where(at_p & inside, 1, 0)) > 0
    i = jnp.int32(p)  # an array index: interpret mode cannot discharge a Python int in a masked load
    u = common.load_entry(u_at(i), live).astype(f32)
    k = common.load_entry(k_at(i), live).astype(f32)
    S = S + (w * u)[:, None] * k[None, :]
  return S


def _window_product(A, K, key_dtype):
  """A [BV, R] @ K [R, BK] in float32 accuracy, never TF32.

  Key ring in bf16 and every dimension ≥ 16: K is exact in bf16, so A is split into three bf16
  terms A = a₁ + a₂ + a₃ (8 mantissa bits each: A to ~2⁻²⁴ relative) and the sum is three bf16
  tensor-core products with f32 accumulation, each product exact. Otherwise one IEEE-f32 dot at
  HIGHEST precision, which Triton runs on FMA units holding whole operand rows per thread (H200,
  GDN B=256 L=16: 255 registers per thread, 12.5 % occupancy in the fold pass; a [64, 128] tile
  spilled: 7.2 ms).
  """
  if jnp.dtype(key_dtype) != jnp.dtype(jnp.bfloat16) or min(*A.shape, K.shape[1]) < 16:
    return jnp.dot(A, K, precision=lax.Precision.HIGHEST)
  bf16 = jnp.bfloat16
  Kb = K.astype(bf16)
  a1 = A.astype(bf16)
  rest = A - a1.astype(f32)
  a2 = rest.astype(bf16)
  a3 = (rest - a2.astype(f32)).astype(bf16)
  return (jnp.dot(a1, Kb, preferred_element_type=f32) + jnp.dot(a2, Kb, preferred_element_type=f32)
          + jnp.dot(a3, Kb, preferred_element_type=f32))


def _fold_kernel(rows_ref, num_rows_ref, slots_ref, base_ref, length_ref, state_ref, ring_k_ref,
                 ring_u_ref, ring_g_ref, *out_refs, group, block_v, block_k, ring_size, row_slots,
                 into_checkpoint, tiles_per_program):
  """out = e^G S_c + Σ_j w_j u_j k_jᵀ over ``length`` entries from ``base``, for listed rows.

  ``out_refs``: (out,), or (read copy, out, read copy out) when the checkpoint has a read copy
  (``into_checkpoint`` only), which gets the same tiles rounded to its dtype.

  Grid (V/BV · K/BK / tiles_per_program, H, row_slots): program (t, h, z) folds
  ``tiles_per_program`` [BV, BK] tiles of batch rows ``rows[z], rows[z + row_slots], …`` below
  ``num_rows`` (the flushing rows, compacted, so the grid is sized for the rows that work rather
  than the batch); the row's slot, window and decays are loaded once for all its tiles.
  into_checkpoint: out is the (aliased) checkpoint, indexed by slot. Otherwise out is a fresh
  [B, H, V, K] f32 array indexed by row; padding rows get zeros.
  """
  out_ref, copy_ref = (out_refs[0], None) if len(out_refs) == 1 else out_refs[1:]
  t0, h, z = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_k_tiles = state_ref.shape[-1] // block_k
  tiles = []   # (rows, columns) of this program's tiles
  for j in range(tiles_per_program):
    t = t0 * tiles_per_program + j
    tiles.append((pl.ds((t // num_k_tiles) * block_v, block_v),
                  pl.ds((t % num_k_tiles) * block_k, block_k)))
  hk = h // group

  def fold_row(i, carry):
    b = rows_ref[z + i * row_slots]
    s = slots_ref[b]

    @pl.when(s >= 0)
    def _():
      base, length = base_ref[b], length_ref[b]
      _, inside = window_offsets((ring_size,), base, length, ring_size)
      rg = plt.load(ring_g_ref.at[s, h, :], mask=inside, other=jnp.zeros((), f32))
      w, total = window_decays(rg, base, length, ring_size)
      decay = jnp.exp(total)
      for tile, tile_k in tiles:
        S = accumulate_window(decay * state_ref[s, h, tile, tile_k].astype(f32), w, inside,
                              lambda rows, tile_k=tile_k: ring_k_ref.at[s, hk, rows, tile_k],
                              lambda rows, tile=tile: ring_u_ref.at[s, h, rows, tile], ring_size)
        out_ref[s if into_checkpoint else b, h, tile, tile_k] = S.astype(out_ref.dtype)
        if copy_ref is not None:
          copy_ref[s, h, tile, tile_k] = S.astype(copy_ref.dtype)

    if not into_checkpoint:
      @pl.when(s < 0)
      def _():
        for tile, tile_k in tiles:
          out_ref[b, h, tile, tile_k] = jnp.zeros((block_v, block_k), out_ref.dtype)
    return carry

  # Rows z, z + row_slots, … below num_rows: ceil((num_rows - z) / row_slots) of them (≤ 0: none).
  lax.fori_loop(0, (num_rows_ref[0] - z + row_slots - 1) // row_slots, fold_row, 0)


def fold(state, ring_k, ring_u, ring_g, slots, base, length, rows, num_rows, *, cfg, row_slots,
         interpret, into_checkpoint, name, tiles_per_program=1, read_copy=None):
  """The fold kernel over ``rows[:num_rows]`` of the batch: into the checkpoint ``state`` (aliased)
  or into a fresh f32 array [B, H, V, K]. ``cfg`` a KernelConfig: the [block_v, block_k] tile;
  ``tiles_per_program`` (a power of two) of them per program, reduced to the largest power of two
  that divides a head's tile count (Mamba2's P = 80 has 5 row tiles), so every tile is folded.
  ``read_copy`` (into the checkpoint only): the checkpoint's 16-bit read copy, written with it
  (aliased); then returns (state, read_copy)."""
  _, h, vd, kd = state.shape
  batch = slots.shape[0]
  tiles = (vd // cfg.block_v) * (kd // cfg.block_k)
  tiles_per_program = math.gcd(tiles_per_program, tiles)
  kernel = functools.partial(_fold_kernel, group=h // ring_k.shape[1], block_v=cfg.block_v,
                             block_k=cfg.block_k, ring_size=ring_g.shape[-1], row_slots=row_slots,
                             into_checkpoint=into_checkpoint, tiles_per_program=tiles_per_program)
  if into_checkpoint:
    out, aliases = [jax.ShapeDtypeStruct(state.shape, state.dtype)], {5: 0}
  else:
    out, aliases = [jax.ShapeDtypeStruct((batch, h, vd, kd), f32)], {}
  args = (rows, jnp.reshape(num_rows, (1,)).astype(jnp.int32), slots, base, length, state,
          ring_k, ring_u, ring_g)
  if read_copy is not None:
    if not into_checkpoint:
      raise ValueError("fold: a read copy is written with the checkpoint only (into_checkpoint=True)")
    out, aliases, args = out + [jax.ShapeDtypeStruct(read_copy.shape, read_copy.dtype)], {5: 0, 9: 1}, args + (read_copy,)
  common.require_triton_addressable(name, state=state, ring_k=ring_k, ring_u=ring_u, out=out[0])
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  result = pl.pallas_call(
      kernel, grid=(tiles // tiles_per_program, h, row_slots), in_specs=[any_spec] * len(args),
      out_specs=[any_spec] * len(out),
      out_shape=out, input_output_aliases=aliases, name=name, interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
  )(*args)
  return result[0] if read_copy is None else tuple(result)


def compact_rows(flags):
  """The indices of the True entries of bool[B] in ascending order, then zeros: int32[B].

  ``jnp.nonzero(flags, size=B)`` computed as ranks (True entries before each row: one [B, B]
  compare-and-sum) and a unique scatter, not a cumulative sum: XLA ran that sum as a 10 µs
  reduce-window kernel per model step on the H200 (``python -m bench.model_trace``, 2026-11-29;
  git show 60b2ea2:bench/results/model_trace_gdn_2026-11-29_s7_before.json).
  """
  b = flags.shape[0]
  idx = jnp.arange(b, dtype=jnp.int32)
  before = jnp.sum((flags[None, :] & (idx[None, :] < idx[:, None])).astype(jnp.int32), axis=1)
  pos = jnp.where(flags, before, b + idx)
  return jnp.zeros((b,), jnp.int32).at[pos].set(idx, mode="drop", unique_indices=True)


def fold_flushing_rows(state, ring_k, ring_u, ring_g, plan: ReplayPlan, *, cfg, row_slots,
                       interpret, name, tiles_per_program=1, read_copy=None):
  """The flush pass after a step kernel appended token 0: flushing rows fold
  ``plan.fold_length()`` entries (window + token 0) into their checkpoint; returns the state, or
  (state, read copy) when given the checkpoint's ``read_copy``."""
  # Compact the flushing rows to the front so the fold grid is sized for them, not for the batch.
  rows = compact_rows(plan.flush)
  return fold(state, ring_k, ring_u, ring_g, plan.slots, plan.base, plan.fold_length(), rows,
              jnp.sum(plan.flush), cfg=cfg, row_slots=row_slots, interpret=interpret,
              into_checkpoint=True, name=name, tiles_per_program=tiles_per_program,
              read_copy=read_copy)


def replace_folded(bufs, folded):
  """``bufs`` (either family) with what ``fold_flushing_rows`` returned: the state, or the state and
  the read copy."""
  if bufs.read_copy is None:
    return bufs.replace(state=folded)
  return bufs.replace(state=folded[0], read_copy=folded[1])


def read_copy_route(op: str, bufs, route: str, plan: ReplayPlan):
  """(route, plan) for a replay decode step over ``bufs``: with a read copy the step reads the copy
  and the fold pass writes it with the checkpoint, so the output-only route, also for plans where
  every row flushes (no fold-and-step pass). The reconstruct route replays the window into the
  float32 checkpoint's tile, which would not read the copy: refused. (Verify reads the checkpoint
  on either route; see ``replay_verify``.)"""
  if bufs.read_copy is None:
    return route, plan
  if route == "reconstruct":
    raise NotImplementedError(f"{op}: route='reconstruct' with a read copy")
  return "output_only", plan.replace(flush_all=False)
