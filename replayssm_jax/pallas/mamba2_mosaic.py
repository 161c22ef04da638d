"""Mamba2 decode kernel in Pallas Mosaic GPU (``plgpu.kernel``; Hopper+, interpreted on CPU).

Same op semantics as mamba2_triton.py; ``kernel → builder → public wrapper``:

* ``decode``: the conventional step (selective_state_update). Grid (P/BP, H, B); a program
  TMA-gathers the [BP, N] state tile of its row's slot into SMEM, steps it once
  (``S ← e^{ΔA} S + Δx Bᵀ``, ``y = S C + D x``, gated by ``silu(z)``) and TMA-writes it back in
  place (the pool is a written Ref: aliased, never copied).

Everything is float32 multiply-and-reduce, never wgmma (Mosaic f32 wgmma is TF32). Padding rows
(slot < 0) gather slot 0 (harmless), produce zero output and write nothing.

Layouts (lowering only; the interpreter does not check them): the [BP, N] tile uses
``Layout.WGMMA``, N vectors (B, C) ``WGMMA.reduce(0)``, P vectors (x, z, y) ``WGMMA.reduce(1)``;
so BP must be a multiple of 64 and N of 64 when compiling (``gdn_mosaic._require_lowerable``).
Shapes: x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]; pool [Ns, H, P, N].
Head h reads group h // (H // G).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from replayssm_jax import config as config_lib
from replayssm_jax.pallas import common
from replayssm_jax.pallas.gdn_mosaic import (_COL_V, _ROW_K, _TILE, _fit, _interpret,
                                             _require_lowerable, _smem_bytes, _vec, _zeros)

f32 = jnp.float32
_ROW_N, _COL_P = _ROW_K, _COL_V   # the GDN [V, K] tile's layouts, read as Mamba2's [P, N]


def _decode_kernel(*refs, S_smem, bar, names, group, block_p, softplus):
  r = dict(zip(names, refs))
  pt, h, b = lax.axis_index("pt"), lax.axis_index("h"), lax.axis_index("b")
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)
  plgpu.copy_gmem_to_smem(r["pool"].at[jnp.maximum(s, 0), h, tile], S_smem, bar)
  g = h // group
  dt = r["dt"][b, h].astype(f32)
  if "dt_bias" in r:
    dt = dt + r["dt_bias"][h].astype(f32)
  delta = common.softplus(dt, log1p=common.log1p_from_log) if softplus else dt
  x = _vec(r["x"].at[b, h, tile], _COL_P)
  Bt = _vec(r["B"].at[b, g], _ROW_N)
  C = _vec(r["C"].at[b, g], _ROW_N)
  plgpu.barrier_wait(bar)
  S = plgpu.load(S_smem, layout=_TILE).astype(f32)                  # [BP, N]
  S = jnp.exp(delta * r["A"][h].astype(f32)) * S + (delta * x)[:, None] * Bt[None, :]
  y = jnp.sum(S * C[None, :], axis=1)
  if "D" in r:
    y = y + r["D"][h].astype(f32) * x
  if "z" in r:
    y = common.silu_gate(y, _vec(r["z"].at[b, h, tile], _COL_P))

  @pl.when(s >= 0)
  def _():
    r["y_out"][b, h, tile] = y.astype(r["y_out"].dtype)
    S_smem[...] = S.astype(S_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(S_smem, r["pool"].at[s, h, tile])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(s < 0)
  def _():
    r["y_out"][b, h, tile] = _zeros(block_p).astype(r["y_out"].dtype)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  batch, h, p = x.shape
  given = {"slots": slots, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z,
           "dt_bias": dt_bias}
  inputs = {k: v for k, v in given.items() if v is not None}
  pool_ref = jax.new_ref(pool)   # written Ref operand: updated in place (aliased under donation)
  kernel = functools.partial(_decode_kernel, names=(*inputs, "pool", "y_out"),
                             group=h // B.shape[1], block_p=cfg.block_v, softplus=dt_softplus)
  y = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(p // cfg.block_v, h, batch), grid_names=("pt", "h", "b"),
      scratch_types={"S_smem": plgpu.SMEM((cfg.block_v, pool.shape[-1]), pool.dtype),
                     "bar": plgpu.Barrier()},
      kernel_name="replayssm_mamba2_decode_mosaic", interpret=_interpret(interpret),
  )(*inputs.values(), pool_ref)
  return y, jax.freeze(pool_ref)


def decode(x, dt, A, B, C, pool, slots, *, D, z, dt_bias, dt_softplus, block_p=None):
  """Conventional Mamba2 decode step over a slot pool. Returns (y [B, H, P] in x.dtype, pool).

  ``block_p`` overrides the config's P tile (rows of the [BP, N] state tile per program).
  """
  _, _, p, n = pool.shape
  cfg = _fit(config_lib.mosaic_mamba2_decode_config(device_kind=common.device_kind(), head_dim=p),
             p, block_p)
  if p % cfg.block_v:
    raise NotImplementedError(f"mamba2.decode[pallas_mosaic]: P tile {cfg.block_v} does not "
                              f"divide P={p}")
  _require_lowerable("mamba2.decode[pallas_mosaic]", head_k_dim=n, head_v_dim=p,
                     block_v=cfg.block_v, ring_size=0, dims=("P", "N"),
                     smem=_smem_bytes(cfg.block_v, n, heads=1, state_dtype=pool.dtype))
  return _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, dt_softplus=dt_softplus, cfg=cfg,
                 interpret=common.interpret_mode())
