"""Gated DeltaNet decode kernels in Pallas Mosaic GPU (``plgpu.kernel``; Hopper+, interpreted on CPU).

Same op semantics as gdn_triton.py; four kernels, each ``kernel → builder → public wrapper``.
A program of ``decode``, ``replay_decode`` or ``replay_verify`` takes ``rows`` batch rows (grid
axis B / rows; ``_pipeline_rows``): with rows ≥ 2 its SMEM buffers are doubled and row i + 1 is
staged by TMA while row i computes.

* ``decode``: the conventional step. Grid (V/BV, Hv, B); a program TMA-gathers the [BV, K]
  checkpoint tile of its row's slot into SMEM, steps it once and TMA-writes it back in place
  (the pool is a written Ref: aliased, never copied).
* ``replay_decode``: one kernel, grid (V/BV, Hk, B); a program serves the r = Hv/Hk value heads of
  a key head (q, k and the key ring read once). It TMA-stages the r checkpoint tiles and the
  row's ring tiles into SMEM, replays the window ``[base, base + count)`` on the output-only route
  (``S x = e^G S_c x + Σ_j w_j (k_j·x) u_j``, never building S), writes o and appends (k, u, g) at
  ring index ``base + count``. Flushing rows then fold window and token 0 into the checkpoint in
  the same program: unlike the Triton kernels (a separate fold pass over compacted rows, because a
  fused fold branch cost ~20 % on every row there), the checkpoint tile and the window already sit
  in SMEM here, so the fused fold re-reads nothing from HBM and needs no second launch.
  H200, one row per program, 2026-11-30: 1.42x over conventional at B=256, L=16, f32, against
  Triton's two passes 1.50x; 2026-12-01: 1.45x against 1.55x (bench/RESULTS.md, GDN layer decode).
* ``materialize``: the same fold body on every row, into a fresh f32 [B, Hv, V, K].
* ``replay_verify``: speculative verify of T tokens per row, the reconstruct route of the Triton
  kernels (gdn_triton ``_reconstruct_kernel``). Grid (V/BV, Hv, B); for each of its rows a
  program TMA-stages the checkpoint tile, the row's ring and the T tokens' q, k, v, replays the
  committed window into the tile (``_fold_window``), steps the T tokens by the delta rule in a
  loop (outputs, ring appends past the window; the per-token g and β, loaded before the window,
  picked by index), and a flushing row stores the tile after token 0 in place: committed history
  only, one launch.

Ring windows are walked entry by entry (``lax.fori_loop`` over ``count`` entries at ring indices
``(base + j) mod R``), so entries outside a window (stale or NaN) are staged into SMEM but never
read. The decay weights ``w_j = exp(Σ_{i>j} g_i)`` come from the recurrence
``acc ← e^{g_j} acc + (…)_j`` (the products of e^{g} instead of one exp of the sum: equal to f32
rounding). Everything is float32 multiply-and-reduce, never wgmma (Mosaic f32 wgmma is TF32).
Padding rows (slot < 0) produce zero output and touch neither checkpoint nor ring.

Layouts (lowering only; the interpreter does not check them): [BV, K] tiles use
``Layout.WGMMA``, K vectors ``WGMMA.reduce(0)``, V vectors ``WGMMA.reduce(1)``; so BV must be a
multiple of 64 and K of 64 when compiling (``_require_lowerable``).
Shapes: q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv] (verify: [B, T, ...]); state [N, Hv, V, K];
ring_k [N, Hk, R, K]; ring_u [N, Hv, R, V]; ring_g [N, Hv, R].
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from replayssm_jax import config as config_lib
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.gdn.buffers import ReplayBuffers
from replayssm_jax.pallas import common

f32 = jnp.float32
_TILE = plgpu.Layout.WGMMA            # [BV, K] state tile
_ROW_K = plgpu.Layout.WGMMA.reduce(0)  # [K] vector, broadcast over the tile's rows
_COL_V = plgpu.Layout.WGMMA.reduce(1)  # [BV] vector, broadcast over the tile's columns
# H200: 228 KiB SMEM per SM; keep a margin for Mosaic's own scratch.
_SMEM_BUDGET = 192 * 1024
_HAS_STORE = hasattr(plgpu, "store")   # JAX >= 0.12 (see _store)


def _vec(ref, layout):
  """float32 vector load (GMEM or SMEM) in a fixed layout."""
  return plgpu.load(ref, layout=layout, optimized=False).astype(f32)


def _store(ref, value):
  """``ref[...] = value`` for a vector or tile (GMEM or SMEM), without Mosaic's optimized-transfer
  requirement. JAX 0.11 stored untiled arrays unoptimized; JAX 0.12 asks for an optimized
  transfer by default, which refuses a GMEM store under 4 bytes per thread, such as a bf16 [BV]
  vector in ``_COL_V`` (each thread holds rows 8 apart, one 2-byte element per transfer).
  ``plgpu.store(optimized=False)`` (JAX 0.12) keeps JAX 0.11's transfer."""
  if _HAS_STORE:
    plgpu.store(ref, value, optimized=False)
  else:
    ref[...] = value


def _zeros(n):
  return plgpu.layout_cast(jnp.zeros((n,), f32), _COL_V)


def _pick(values, j):
  """``values[j]`` for a traced index j into a short static list (a chain of selects)."""
  out = values[0]
  for i in range(1, len(values)):
    out = jnp.where(j == i, values[i], out)
  return out


def _fold_window(S, rk_smem, ru_smem, rg_smem, base, length, ring_size):
  """S ← e^{g_j} S + u_j k_jᵀ for the ``length`` ring entries from ``base`` (float32 [BV, K]).

  Equals ``e^G S + Σ_j w_j u_j k_jᵀ`` of replay.py; entries outside the window are never read.
  """
  def entry(j, S):
    p = (base + j) % ring_size
    u = _vec(ru_smem.at[p], _COL_V)
    k = _vec(rk_smem.at[p], _ROW_K)
    return jnp.exp(rg_smem[p]) * S + u[:, None] * k[None, :]
  return lax.fori_loop(0, length, entry, S)


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------

def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref,
                   *, scale, group, block_v, rows, interpret, **scratch):
  """Program (vt, h, z) steps batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``: with
  rows ≥ 2 the next row's tile is staged while the current row computes)."""
  vt, h, z = lax.axis_index("vt"), lax.axis_index("h"), lax.axis_index("b")
  tile = pl.ds(vt * block_v, block_v)
  hk = h // group

  def stage(i, buf):
    # Padding rows gather slot 0 (harmless) and never write: one TMA/barrier path for every row.
    s = slots_ref[z * rows + i]
    plgpu.copy_gmem_to_smem(pool_ref.at[jnp.maximum(s, 0), h, tile], buf["S_smem"], buf["bar"])

  def step_row(i, buf):
    b = z * rows + i
    s = slots_ref[b]
    k = _vec(k_ref.at[b, hk], _ROW_K)
    q = _vec(q_ref.at[b, hk], _ROW_K) * scale
    v = _vec(v_ref.at[b, h, tile], _COL_V)
    alpha = jnp.exp(g_ref[b, h].astype(f32))
    beta = beta_ref[b, h].astype(f32)
    plgpu.barrier_wait(buf["bar"])
    S = plgpu.load(buf["S_smem"], layout=_TILE).astype(f32)          # [BV, K]
    u = beta * (v - alpha * jnp.sum(S * k[None, :], axis=1))
    S = alpha * S + u[:, None] * k[None, :]
    o = jnp.sum(S * q[None, :], axis=1)

    @pl.when(s >= 0)
    def _():
      _store(o_ref.at[b, h, tile], o.astype(o_ref.dtype))
      _store(buf["S_smem"], S.astype(buf["S_smem"].dtype))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buf["S_smem"], pool_ref.at[s, h, tile])

    @pl.when(s < 0)
    def _():
      _store(o_ref.at[b, h, tile], _zeros(block_v).astype(o_ref.dtype))

  _pipeline_rows(rows, _row_buffers(scratch, rows), stage, step_row, interpret=interpret)


def _stage_ring(ring_k_ref, ring_u_ref, ring_g_ref, s, hk, h0, heads, tile, rk_smem, ru_smem,
                rg_smem, bars):
  """TMA of the slot's key ring [R, K], the g rings [r, R] of value heads h0..h0+r-1 and, per value
  head i, its u tile [R, BV]. Barriers: 0 keys, 1 g, 2 + i the u tile of head i.

  Alignment (multi-dim TMA, which Mosaic uses for every GMEM -> SMEM copy): the SMEM destination
  must be 128-byte aligned, the GMEM strides and the innermost box row multiples of 16 bytes.
  Scratch buffers start 1024-byte aligned, but a sub-buffer ``rg_smem.at[i]`` starts at i·R·4
  bytes (16/32/64 for R = 4/8/16), so a per-head g TMA into it is misaligned for i > 0 (the likely
  cause of the CUDA_ERROR_MISALIGNED_ADDRESS first seen on the H200). The r heads of a key head
  are adjacent in ring_g [N, Hv, R], so one [r, R] box fills the whole (aligned) buffer.
  ``ru_smem.at[i]`` starts at i·R·BV·itemsize, a multiple of 128 bytes (checked in
  _require_lowerable).
  """
  plgpu.copy_gmem_to_smem(ring_k_ref.at[s, hk], rk_smem, bars.at[0])
  plgpu.copy_gmem_to_smem(ring_g_ref.at[s, pl.ds(h0, heads)], rg_smem, bars.at[1])
  for i in range(heads):
    plgpu.copy_gmem_to_smem(ring_u_ref.at[s, h0 + i, :, tile], ru_smem.at[i], bars.at[2 + i])


def _wait_all(bars, n):
  for i in range(n):
    plgpu.barrier_wait(bars.at[i])


def _stage_head(state_ref, ring_k_ref, ring_u_ref, ring_g_ref, s, hk, h, tile, S_smem, rk_smem,
                ru_smem, rg_smem, bars):
  """TMA of value head h's checkpoint tile (barrier 3) and the row's ring for that head (barriers
  0-2, ``_stage_ring``). Padding rows (s < 0) stage slot 0 (harmless) and must write nothing."""
  ss = jnp.maximum(s, 0)
  plgpu.copy_gmem_to_smem(state_ref.at[ss, h, tile], S_smem, bars.at[3])
  _stage_ring(ring_k_ref, ring_u_ref, ring_g_ref, ss, hk, h, 1, tile, rk_smem, ru_smem, rg_smem,
              bars)


def _tile_after_window(S_smem, rk_smem, ru_smem, rg_smem, bars, base, length, ring_size):
  """The tile staged by ``_stage_head`` brought through ``length`` ring entries from ``base``
  (float32 [BV, K])."""
  _wait_all(bars, 4)
  S = plgpu.load(S_smem, layout=_TILE).astype(f32)
  return _fold_window(S, rk_smem, ru_smem.at[0], rg_smem.at[0], base, length, ring_size)


def _num_buffers(rows: int) -> int:
  """SMEM buffer sets of a program taking ``rows`` batch rows: two (one row staged while another
  computes) when rows ≥ 2."""
  return 2 if rows > 1 else 1


def _with_rows(cfg, rows, batch: int):
  """``cfg`` with ``rows`` batch rows per program (None: the config's; validated by MosaicConfig: a
  power of two), reduced to one that divides ``batch``."""
  if rows is not None:
    cfg = dataclasses.replace(cfg, rows=rows)
  return dataclasses.replace(cfg, rows=math.gcd(cfg.rows, batch))


def _buffered_scratch(one: dict, rows: int) -> dict:
  """The scratch of one row in flight, once per buffer set (names suffixed 0, 1). Each buffer is
  its own allocation, so every TMA destination keeps its alignment (see ``_stage_ring``)."""
  return {f"{name}{i}": shape for i in range(_num_buffers(rows)) for name, shape in one.items()}


def _row_buffers(scratch: dict, rows: int) -> list[dict]:
  """``_buffered_scratch``'s refs as one dict per buffer set, keyed by the unsuffixed names."""
  return [{name[:-1]: ref for name, ref in scratch.items() if name.endswith(str(i))}
          for i in range(_num_buffers(rows))]


def _drain_stores(interpret: bool, *, read_only: bool = False):
  """Waits until this program's SMEM → GMEM copies have read SMEM (``read_only``) or landed.
  Compiled only: the interpreter completes a copy when it is issued, so its wait would only be
  one more host callback (each calls JAX; see ``common.mosaic_interpret_mode`` for the deadlock
  that makes every such callback a risk under CPU async dispatch)."""
  if not interpret:
    plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)


def _pipeline_rows(rows: int, buffers: list[dict], stage, process, *, interpret: bool):
  """Runs ``process(i, buffer)`` for a program's rows i = 0 … rows − 1 after ``stage(i, buffer)``
  has issued row i's TMA into that buffer, then drains the stores. With two buffers, row i + 1 is
  staged before row i is processed, so its loads overlap row i's work; a buffer is staged again
  only after its last row's stores have left SMEM and its reads are committed."""
  stage(0, buffers[0])
  if rows == 1:
    process(0, buffers[0])
    _drain_stores(interpret)
    return

  def restage(i, buf):
    _drain_stores(interpret, read_only=True)
    plgpu.commit_smem()
    stage(i, buf)

  def pair(p, carry):
    restage(2 * p + 1, buffers[1])
    process(2 * p, buffers[0])
    pl.when(2 * p + 2 < rows)(lambda: restage(2 * p + 2, buffers[0]))
    process(2 * p + 1, buffers[1])
    return carry
  lax.fori_loop(0, rows // 2, pair, 0)
  _drain_stores(interpret)


def _replay_step_kernel(slots_ref, base_ref, count_ref, flush_ref, q_ref, k_ref, v_ref, g_ref,
                        beta_ref, state_ref, ring_k_ref, ring_u_ref, ring_g_ref, o_ref,
                        *, scale, group, block_v, ring_size, rows, interpret,
                        **scratch):
  """Program (vt, hk, z) steps batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``: with
  rows ≥ 2 the next row's staging overlaps the current row's work)."""
  vt, hk, z = lax.axis_index("vt"), lax.axis_index("hk"), lax.axis_index("b")
  tile = pl.ds(vt * block_v, block_v)
  heads = [hk * group + i for i in range(group)]
  nbar = 2 + group          # ring barriers (see _stage_ring); then one per checkpoint tile

  def stage(i, buf):
    ss = jnp.maximum(slots_ref[z * rows + i], 0)   # padding rows stage slot 0, write nothing
    for j, h in enumerate(heads):
      # S_smem.at[j] starts at j·BV·K·itemsize bytes: a multiple of 128 (BV, K multiples of 64).
      plgpu.copy_gmem_to_smem(state_ref.at[ss, h, tile], buf["S_smem"].at[j],
                              buf["bars"].at[nbar + j])
    _stage_ring(ring_k_ref, ring_u_ref, ring_g_ref, ss, hk, hk * group, group, tile,
                buf["rk_smem"], buf["ru_smem"], buf["rg_smem"], buf["bars"])

  def step_row(i, buf):
    b = z * rows + i
    s = slots_ref[b]
    S_smem, rk_smem, ru_smem, rg_smem, bars = (buf[name] for name in (
        "S_smem", "rk_smem", "ru_smem", "rg_smem", "bars"))
    base, count = base_ref[b], count_ref[b]
    put = (base + count) % ring_size                               # token 0's ring index
    k = _vec(k_ref.at[b, hk], _ROW_K)
    q = _vec(q_ref.at[b, hk], _ROW_K) * scale
    kq = jnp.sum(k * q)
    _wait_all(bars, nbar)

    # Window, output-only: acc_x ← e^{g_j} acc_x + (k_j·x) u_j per head; the key ring is read
    # once per key head for all r value heads. G = Σ_j g_j.
    def entry(j, carry):
      acc_k, acc_q, G = carry
      p = (base + j) % ring_size
      kj = _vec(rk_smem.at[p], _ROW_K)
      ck, cq = jnp.sum(kj * k), jnp.sum(kj * q)
      gj = [rg_smem[i, p] for i in range(group)]
      uj = [_vec(ru_smem.at[i, p], _COL_V) for i in range(group)]
      return (tuple(jnp.exp(g) * a + ck * u for g, a, u in zip(gj, acc_k, uj)),
              tuple(jnp.exp(g) * a + cq * u for g, a, u in zip(gj, acc_q, uj)),
              tuple(Gi + g for Gi, g in zip(G, gj)))
    zero = tuple(_zeros(block_v) for _ in range(group))
    acc_k, acc_q, G = lax.fori_loop(0, count, entry, (zero, zero, (jnp.float32(0.0),) * group))
    for j in range(group):
      plgpu.barrier_wait(bars.at[nbar + j])

    valid = s >= 0
    flush = valid & (flush_ref[b] != 0)
    rdt = ring_u_ref.dtype

    def head(i, h):  # value head h = hk·r + i
      Sc = plgpu.load(S_smem.at[i], layout=_TILE).astype(f32)        # [BV, K]
      decay = jnp.exp(G[i])
      Sk = decay * jnp.sum(Sc * k[None, :], axis=1) + acc_k[i]
      Sq = decay * jnp.sum(Sc * q[None, :], axis=1) + acc_q[i]
      g = g_ref[b, h].astype(f32)
      alpha = jnp.exp(g)
      u = beta_ref[b, h].astype(f32) * (_vec(v_ref.at[b, h, tile], _COL_V) - alpha * Sk)
      o = alpha * Sq + u * kq

      @pl.when(valid)
      def _():
        _store(o_ref.at[b, h, tile], o.astype(o_ref.dtype))
        _store(ring_u_ref.at[s, h, put, tile], u.astype(rdt))

        @pl.when(vt == 0)  # k and g are per head, not per V tile: one program appends them
        def _():
          ring_g_ref[s, h, put] = g

      @pl.when(~valid)
      def _():
        _store(o_ref.at[b, h, tile], _zeros(block_v).astype(o_ref.dtype))

      @pl.when(flush)
      def _():
        # Checkpoint ← fold(window) then token 0, with u and k rounded as the ring stores them.
        S = _fold_window(Sc, rk_smem, ru_smem.at[i], rg_smem.at[i], base, count, ring_size)
        kr = k.astype(ring_k_ref.dtype).astype(f32)
        S = alpha * S + u.astype(rdt).astype(f32)[:, None] * kr[None, :]
        _store(S_smem.at[i], S.astype(S_smem.dtype))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(S_smem.at[i], state_ref.at[s, h, tile])

    for i, h in enumerate(heads):
      head(i, h)

    @pl.when(valid & (vt == 0))
    def _():
      _store(ring_k_ref.at[s, hk, put], k.astype(ring_k_ref.dtype))

  _pipeline_rows(rows, _row_buffers(scratch, rows), stage, step_row, interpret=interpret)


def _materialize_kernel(slots_ref, base_ref, length_ref, state_ref, ring_k_ref, ring_u_ref,
                        ring_g_ref, out_ref, S_smem, out_smem, rk_smem, ru_smem, rg_smem, bars,
                        *, group, block_v, ring_size, interpret):
  vt, h, b = lax.axis_index("vt"), lax.axis_index("h"), lax.axis_index("b")
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  _stage_head(state_ref, ring_k_ref, ring_u_ref, ring_g_ref, s, h // group, h, tile, S_smem, rk_smem,
              ru_smem, rg_smem, bars)
  S = _tile_after_window(S_smem, rk_smem, ru_smem, rg_smem, bars, base_ref[b], length_ref[b],
                         ring_size)
  _store(out_smem, S)

  @pl.when(s < 0)  # padding rows: zeros (S · 0 would keep a NaN of slot 0)
  def _():
    _store(out_smem, plgpu.layout_cast(jnp.zeros(S.shape, f32), _TILE))

  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_ref.at[b, h, tile])
  _drain_stores(interpret)


def _verify_kernel(slots_ref, base_ref, count_ref, flush_ref, lengths_ref, q_ref, k_ref, v_ref,
                   g_ref, beta_ref, state_ref, ring_k_ref, ring_u_ref, ring_g_ref, *refs,
                   scale, group, block_v, ring_size, num_tokens, rows, interpret, **scratch):
  """Program (vt, h, z) verifies batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``: with
  rows ≥ 2 the next row's staging overlaps the current row's work). ``refs``: ([read_copy_ref,]
  o_ref); with a read copy a flushing row's stored tile is also rounded into it (scratch
  ``C_smem``)."""
  copy_ref, o_ref = refs if len(refs) == 2 else (None, refs[0])
  vt, h, z = lax.axis_index("vt"), lax.axis_index("h"), lax.axis_index("b")
  tile = pl.ds(vt * block_v, block_v)
  hk = h // group
  buffers = _row_buffers(scratch, rows)

  def stage(i, buf):
    """Issue the TMA of row z·rows + i's checkpoint tile, ring and T tokens into ``buf``."""
    b = z * rows + i
    _stage_head(state_ref, ring_k_ref, ring_u_ref, ring_g_ref, slots_ref[b], hk, h, tile,
                buf["S_smem"], buf["rk_smem"], buf["ru_smem"], buf["rg_smem"], buf["bars"])
    for j, (src, dst) in enumerate(((q_ref.at[b, :, hk], buf["q_smem"]),
                                    (k_ref.at[b, :, hk], buf["k_smem"]),
                                    (v_ref.at[b, :, h, tile], buf["v_smem"]))):
      plgpu.copy_gmem_to_smem(src, dst, buf["tok_bars"].at[j])

  def verify_row(i, buf):
    """Row z·rows + i, staged in ``buf``: window, then the T tokens (outputs, ring appends past
    the window); a flushing row stores the tile after token 0 (committed history only)."""
    b = z * rows + i
    s = slots_ref[b]
    gs = [g_ref[b, j, h] for j in range(num_tokens)]
    betas = [beta_ref[b, j, h] for j in range(num_tokens)]
    base, count, n = base_ref[b], count_ref[b], lengths_ref[b]
    valid = s >= 0
    S = _tile_after_window(buf["S_smem"], buf["rk_smem"], buf["ru_smem"], buf["rg_smem"],
                           buf["bars"], base, count, ring_size)
    _wait_all(buf["tok_bars"], 3)
    rdt = ring_u_ref.dtype

    def token(j, S):
      live = valid & (n > j)
      put = (base + count + j) % ring_size
      # A padded lane's inputs may be NaN and are never read: it reads token 0's vectors (real on
      # a live row) with g = β = 0, so u = 0 and S is unchanged exactly; its output is a stored 0.
      at = jnp.where(live, j, 0)
      k = _vec(buf["k_smem"].at[at], _ROW_K)
      v = _vec(buf["v_smem"].at[at], _COL_V)
      g = jnp.where(live, _pick(gs, j).astype(f32), 0.0)
      beta = jnp.where(live, _pick(betas, j).astype(f32), 0.0)
      alpha = jnp.exp(g)
      u = beta * (v - alpha * jnp.sum(S * k[None, :], axis=1))
      S = alpha * S + u[:, None] * k[None, :]
      # q is read where it is used, not with k and v: 2 % at T = 4, B = 256 (one H100; bench/
      # RESULTS.md "Mosaic kernels without Pallas' automatic barriers").
      q = _vec(buf["q_smem"].at[at], _ROW_K)
      o = jnp.sum(S * q[None, :], axis=1) * scale

      @pl.when(live)
      def _():
        _store(o_ref.at[b, j, h, tile], o.astype(o_ref.dtype))

      @pl.when(~live)
      def _():
        _store(o_ref.at[b, j, h, tile], _zeros(block_v).astype(o_ref.dtype))

      @pl.when(valid & (flush_ref[b] != 0) & (j == 0))
      def _():
        # Window + token 0: the committed history only; drafts (tokens ≥ 1) are never folded.
        _store(buf["S_smem"], S.astype(buf["S_smem"].dtype))
        if copy_ref is not None:
          _store(buf["C_smem"], S.astype(buf["C_smem"].dtype))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf["S_smem"], state_ref.at[s, h, tile])
        if copy_ref is not None:
          plgpu.copy_smem_to_gmem(buf["C_smem"], copy_ref.at[s, h, tile])

      @pl.when(live)
      def _():
        _store(ring_u_ref.at[s, h, put, tile], u.astype(rdt))

        @pl.when(vt == 0)  # g is per head, k per key head: one program appends each
        def _():
          ring_g_ref[s, h, put] = g

          @pl.when(h % group == 0)
          def _():
            _store(ring_k_ref.at[s, hk, put], k.astype(ring_k_ref.dtype))
      return S

    # A loop, not T unrolled copies: 2-19 % faster at every T and batch measured (one H100;
    # bench/RESULTS.md "Mosaic verify: the token loop"); Mamba2's kernel measured no gain.
    lax.fori_loop(0, num_tokens, token, S)

  _pipeline_rows(rows, buffers, stage, verify_row, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------------------------

# Pallas' automatic warpgroup barriers (around every vector store, before every TMA into SMEM) are
# dropped: in these kernels a thread rewrites only the tile elements it loaded itself (one layout
# both ways), and every SMEM hand-off between threads or to TMA passes an mbarrier (TMA in) or
# ``commit_smem``, whose warpgroup barrier Pallas keeps. Verify T = 4, B = 256, L = 8, f32, one
# H100: GDN 0.3689 → 0.3536 ms, Mamba2 0.6716 → 0.6661; decode 0.3-1 % (bench/RESULTS.md,
# "Mosaic kernels without Pallas' automatic barriers").
_COMPILER_PARAMS = plgpu.CompilerParams(unsafe_no_auto_barriers=True)


def _launch_options(interpret: bool) -> dict:
  """``plgpu.kernel`` keyword options of every kernel here and in mamba2_mosaic.py."""
  return dict(interpret=plgpu.InterpretGPUParams() if interpret else None,
              compiler_params=_COMPILER_PARAMS)


def _ring_scratch(bufs: ReplayBuffers, heads: int, block_v: int):
  """SMEM for one key ring [R, K] and ``heads`` u tiles [R, BV] and g vectors [R]."""
  r, kd = bufs.ring_size, bufs.head_k_dim
  return {"rk_smem": plgpu.SMEM((r, kd), bufs.ring_k.dtype),
          "ru_smem": plgpu.SMEM((heads, r, block_v), bufs.ring_u.dtype),
          "rg_smem": plgpu.SMEM((heads, r), f32)}


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _decode(q, k, v, g, beta, pool, slots, *, scale, cfg, interpret):
  batch, hv, vd = v.shape
  kernel = functools.partial(_decode_kernel, scale=scale, group=hv // q.shape[1],
                             block_v=cfg.block_v, rows=cfg.rows, interpret=interpret)
  pool_ref = jax.new_ref(pool)   # written Ref operand: updated in place (aliased under donation)
  one = {"S_smem": plgpu.SMEM((cfg.block_v, pool.shape[-1]), pool.dtype), "bar": plgpu.Barrier()}
  o = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype),
      grid=(vd // cfg.block_v, hv, batch // cfg.rows), grid_names=("vt", "h", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows),
      kernel_name="replayssm_gdn_decode_mosaic", **_launch_options(interpret),
  )(slots, q, k, v, g, beta, pool_ref)
  return o, jax.freeze(pool_ref)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _replay_decode(q, k, v, g, beta, bufs, plan, *, scale, cfg, interpret):
  batch, hk = q.shape[:2]
  hv, vd, kd = bufs.num_v_heads, bufs.head_v_dim, bufs.head_k_dim
  group, bv = hv // hk, cfg.block_v
  kernel = functools.partial(_replay_step_kernel, scale=scale, group=group, block_v=bv,
                             ring_size=bufs.ring_size, rows=cfg.rows, interpret=interpret)
  refs = [jax.new_ref(x) for x in (bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g)]
  one = dict(S_smem=plgpu.SMEM((group, bv, kd), bufs.state.dtype),
             **_ring_scratch(bufs, group, bv), bars=plgpu.Barrier(num_barriers=2 + 2 * group))
  o = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype),
      grid=(vd // bv, hk, batch // cfg.rows), grid_names=("vt", "hk", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows),
      kernel_name="replayssm_gdn_replay_mosaic", **_launch_options(interpret),
  )(plan.slots, plan.base, plan.count, plan.flush.astype(jnp.int32), q, k, v, g, beta, *refs)
  state, ring_k, ring_u, ring_g = (jax.freeze(r) for r in refs)
  return o, bufs.replace(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _replay_verify(q, k, v, g, beta, bufs, plan, lengths, *, scale, cfg, interpret):
  batch, t, hk = q.shape[:3]
  hv, vd, kd, bv = bufs.num_v_heads, bufs.head_v_dim, bufs.head_k_dim, cfg.block_v
  kernel = functools.partial(_verify_kernel, scale=scale, group=hv // hk, block_v=bv,
                             ring_size=bufs.ring_size, num_tokens=t, rows=cfg.rows,
                             interpret=interpret)
  written = [bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g]
  copy = {}
  if bufs.read_copy is not None:   # written where the checkpoint is, from the same tile
    written.append(bufs.read_copy)
    copy = {"C_smem": plgpu.SMEM((bv, kd), bufs.read_copy.dtype)}
  refs = [jax.new_ref(x) for x in written]   # written Refs: updated in place
  one = dict(S_smem=plgpu.SMEM((bv, kd), bufs.state.dtype), **copy, **_ring_scratch(bufs, 1, bv),
             q_smem=plgpu.SMEM((t, kd), q.dtype), k_smem=plgpu.SMEM((t, kd), k.dtype),
             v_smem=plgpu.SMEM((t, bv), v.dtype), bars=plgpu.Barrier(num_barriers=4),
             tok_bars=plgpu.Barrier(num_barriers=3))
  o = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype),
      grid=(vd // bv, hv, batch // cfg.rows), grid_names=("vt", "h", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows), kernel_name="replayssm_gdn_verify_mosaic",
      **_launch_options(interpret),
  )(plan.slots, plan.base, plan.count, plan.flush.astype(jnp.int32), lengths, q, k, v, g, beta,
    *refs)
  state, ring_k, ring_u, ring_g, *read_copy = (jax.freeze(r) for r in refs)
  return o, bufs.replace(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g,
                         **({"read_copy": read_copy[0]} if read_copy else {}))


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _materialize(bufs, slots, base, length, *, cfg, interpret):
  batch = slots.shape[0]
  hv, vd, kd, bv = bufs.num_v_heads, bufs.head_v_dim, bufs.head_k_dim, cfg.block_v
  kernel = functools.partial(_materialize_kernel, group=hv // bufs.num_k_heads, block_v=bv,
                             ring_size=bufs.ring_size, interpret=interpret)
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((batch, hv, vd, kd), f32),
      grid=(vd // bv, hv, batch), grid_names=("vt", "h", "b"),
      scratch_types=dict(S_smem=plgpu.SMEM((bv, kd), bufs.state.dtype),
                         out_smem=plgpu.SMEM((bv, kd), f32), **_ring_scratch(bufs, 1, bv),
                         bars=plgpu.Barrier(num_barriers=4)),
      kernel_name="replayssm_gdn_materialize_mosaic", **_launch_options(interpret),
  )(slots, base, length, bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g)


# ----------------------------------------------------------------------------------------------
# Public wrappers (called from gdn/ops.py; inputs already validated there).
# ----------------------------------------------------------------------------------------------

def _smem_bytes(block_v, head_k_dim, *, heads, state_dtype, ring_size=0, ring_dtype=f32,
                out_f32=False):
  """SMEM of one program: ``heads`` checkpoint tiles, the staged ring (if any), an f32 out tile."""
  ri = jnp.dtype(ring_dtype).itemsize
  ring = ring_size * (head_k_dim * ri + heads * (block_v * ri + 4))   # keys, u tiles, g
  out = block_v * head_k_dim * 4 if out_f32 else 0
  return heads * block_v * head_k_dim * jnp.dtype(state_dtype).itemsize + ring + out


def _require_lowerable(op, *, head_k_dim, head_v_dim, block_v, ring_size, smem, ring_itemsize=4,
                       dims=("V", "K")):
  """NotImplementedError for shapes the Mosaic lowering cannot take (checked when compiling;
  the interpreter ignores layouts, so CPU tests may use smaller tiles). The state tile is
  [block_v, head_k_dim] of a [head_v_dim, head_k_dim] head; ``dims`` names its axes in messages
  (GDN V, K; Mamba2 P, N).

  TMA rules behind the checks: at most 256 elements per box dimension; GMEM strides and the
  innermost box row in multiples of 16 bytes; SMEM destinations 128-byte aligned (per-head
  sub-buffers ``S_smem.at[i]``, ``ru_smem.at[i]`` start at multiples of their tile bytes).
  """
  if common.interpret_mode():
    return
  rows, cols = dims
  problems = []
  if block_v % 64 or head_v_dim % block_v or block_v > 256:
    problems.append(f"{rows} tile {block_v} of {rows}={head_v_dim} (the WGMMA layout needs "
                    f"64-row tiles)")
  if head_k_dim % 64 or head_k_dim > 256:
    problems.append(f"{cols}={head_k_dim} (needs a multiple of 64, at most 256: layout and TMA box)")
  if ring_size and (ring_size < 4 or ring_size > 256):
    problems.append(f"ring size R={ring_size} (the TMA of the [R] decay ring needs >= 16 bytes, "
                    f"a TMA box at most 256 rows)")
  if ring_size and (ring_size * block_v * ring_itemsize) % 128:
    problems.append(f"ring u tile of {ring_size * block_v * ring_itemsize} bytes (per-head SMEM "
                    f"TMA destinations must stay 128-byte aligned)")
  if smem > _SMEM_BUDGET:
    problems.append(f"{smem} bytes of SMEM per program (budget {_SMEM_BUDGET})")
  if problems:
    raise NotImplementedError(f"{op}: pallas_mosaic cannot lower " + "; ".join(problems)
                              + " (use implementation='pallas_triton' or 'xla', or None)")


def _fit(cfg, head_v_dim, block_v):
  return dataclasses.replace(cfg, block_v=min(cfg.block_v if block_v is None else int(block_v),
                                              head_v_dim))


def decode(q, k, v, g, beta, pool, slots, *, scale, block_v=None, rows=None):
  """Conventional GDN decode step over a slot pool. Returns (o [B, Hv, V] in v.dtype, pool).

  ``block_v`` overrides the config's V tile, ``rows`` its batch rows per program (a power of
  two; reduced to one that divides B).
  """
  _, _, vd, kd = pool.shape
  cfg = _fit(config_lib.mosaic_decode_config(device_kind=common.device_kind(),
                                             state_dtype=pool.dtype, head_v_dim=vd), vd, block_v)
  cfg = _with_rows(cfg, rows, q.shape[0])
  _require_lowerable("gdn.decode[pallas_mosaic]", head_k_dim=kd, head_v_dim=vd,
                     block_v=cfg.block_v, ring_size=0,
                     smem=_num_buffers(cfg.rows) * _smem_bytes(cfg.block_v, kd, heads=1,
                                                               state_dtype=pool.dtype))
  return _decode(q, k, v, g, beta, pool, slots, scale=float(scale), cfg=cfg,
                 interpret=common.mosaic_interpret_mode())


def replay_decode(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, *, scale, route="auto",
                  block_v=None, rows=None):
  """ReplaySSM GDN decode (one token per row), flush fold fused. Returns (o [B, Hv, V], bufs).

  Output-only route only ("reconstruct" raises NotImplementedError). ``block_v`` overrides the
  config's V tile, ``rows`` its batch rows per program (a power of two; reduced to one that
  divides B).
  """
  op = "gdn.replay_decode[pallas_mosaic]"
  if plan.num_tokens != 1:
    raise NotImplementedError(f"{op}: plans with num_tokens={plan.num_tokens} (verify) are not "
                              f"supported by this kernel")
  if route == "reconstruct":
    raise NotImplementedError(f"{op}: only the output_only route is implemented")
  group = bufs.num_v_heads // bufs.num_k_heads
  cfg = _fit(config_lib.mosaic_replay_config(
      device_kind=common.device_kind(), state_dtype=bufs.state.dtype, head_v_dim=bufs.head_v_dim,
      num_k_heads=bufs.num_k_heads, group=group, batch=q.shape[0]), bufs.head_v_dim, block_v)
  cfg = _with_rows(cfg, rows, q.shape[0])
  smem = _num_buffers(cfg.rows) * _smem_bytes(
      cfg.block_v, bufs.head_k_dim, heads=group, state_dtype=bufs.state.dtype,
      ring_size=bufs.ring_size, ring_dtype=bufs.ring_u.dtype)
  _require_lowerable(op, head_k_dim=bufs.head_k_dim, head_v_dim=bufs.head_v_dim,
                     block_v=cfg.block_v, ring_size=bufs.ring_size, smem=smem,
                     ring_itemsize=jnp.dtype(bufs.ring_u.dtype).itemsize)
  return _replay_decode(q, k, v, g, beta, bufs, plan, scale=float(scale), cfg=cfg,
                        interpret=common.mosaic_interpret_mode())


def replay_verify(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, scale,
                  block_v=None, rows=None):
  """ReplaySSM GDN speculative verify, reconstruct route (one launch, flush stored in place).

  q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; lengths int32[B]. Returns
  (o [B, T, Hv, V] in v.dtype, bufs). ``block_v`` overrides the config's V tile, ``rows`` its
  batch rows per program (a power of two; reduced to one that divides B). A read copy is not
  read; a flushing row's stored tile is rounded into it.
  """
  cfg = _fit(config_lib.mosaic_verify_config(device_kind=common.device_kind(),
                                             head_v_dim=bufs.head_v_dim, batch=q.shape[0],
                                             num_tokens=q.shape[1]),
             bufs.head_v_dim, block_v)
  cfg = _with_rows(cfg, rows, q.shape[0])
  smem = _smem_bytes(cfg.block_v, bufs.head_k_dim, heads=1, state_dtype=bufs.state.dtype,
                     ring_size=bufs.ring_size, ring_dtype=bufs.ring_u.dtype)
  t = q.shape[1]   # the tokens' staged q, k [T, K] and v [T, BV]
  smem += t * (bufs.head_k_dim * (q.dtype.itemsize + k.dtype.itemsize)
               + cfg.block_v * v.dtype.itemsize)
  if bufs.read_copy is not None:   # the copy's tile, stored beside the checkpoint's
    smem += cfg.block_v * bufs.head_k_dim * bufs.read_copy.dtype.itemsize
  smem *= _num_buffers(cfg.rows)
  _require_lowerable("gdn.replay_verify[pallas_mosaic]", head_k_dim=bufs.head_k_dim,
                     head_v_dim=bufs.head_v_dim, block_v=cfg.block_v, ring_size=bufs.ring_size,
                     smem=smem, ring_itemsize=jnp.dtype(bufs.ring_u.dtype).itemsize)
  return _replay_verify(q, k, v, g, beta, bufs, plan, lengths, scale=float(scale), cfg=cfg,
                        interpret=common.mosaic_interpret_mode())


def materialize(bufs: ReplayBuffers, slots, base, length, *, block_v=None):
  """Exact state of each row (checkpoint ⊕ ``length`` entries from ``base``): f32 [B, Hv, V, K]."""
  cfg = _fit(config_lib.mosaic_materialize_config(device_kind=common.device_kind(),
                                                  head_v_dim=bufs.head_v_dim),
             bufs.head_v_dim, block_v)
  smem = _smem_bytes(cfg.block_v, bufs.head_k_dim, heads=1, state_dtype=bufs.state.dtype,
                     ring_size=bufs.ring_size, ring_dtype=bufs.ring_u.dtype, out_f32=True)
  _require_lowerable("gdn.materialize[pallas_mosaic]", head_k_dim=bufs.head_k_dim,
                     head_v_dim=bufs.head_v_dim, block_v=cfg.block_v, ring_size=bufs.ring_size,
                     smem=smem, ring_itemsize=jnp.dtype(bufs.ring_u.dtype).itemsize)
  return _materialize(bufs, slots, base, length, cfg=cfg, interpret=common.mosaic_interpret_mode())
