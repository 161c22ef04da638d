"""Mamba2 decode kernel in Pallas Mosaic GPU (``plgpu.kernel``; Hopper+, interpreted on CPU).

Same op semantics as mamba2_triton.py; ``kernel → builder → public wrapper``. A program takes
``rows`` batch rows (grid axis B / rows; GDN's ``_pipeline_rows``): with rows ≥ 2 its SMEM
buffers are doubled and row i + 1 is staged by TMA while row i computes.

* ``decode``: the conventional step (selective_state_update). Grid (P/BP, H, B); a program
  TMA-gathers the [BP, N] state tile of its row's slot into SMEM, steps it once
  (``S ← e^{ΔA} S + Δx Bᵀ``, ``y = S C + D x``, gated by ``silu(z)``) and TMA-writes it back in
  place (the pool is a written Ref: aliased, never copied).
* ``replay_decode``: the reconstruct route, grid (P/BP, H, B). A program TMA-stages the
  checkpoint tile and the row's ring tiles (Δx [R, BP] of its head, B [R, N] of its group, ΔA
  [R]), replays the window ``[base, base + count)`` into the tile entry by entry
  (``S ← e^{ΔA_j} S + Δx_j B_jᵀ``, GDN's ``_fold_window``: the same recurrence), steps the token,
  writes y and appends (Δx, B, ΔA) at ring index ``base + count``; a flushing row TMA-writes the
  tile (window + token) into its checkpoint in the same program. Entries outside the window are
  staged but never read. The output-only route is not implemented here (NotImplementedError).
* ``replay_verify``: the same program for T tokens (speculative verify, reconstruct route): the
  tokens' x and z TMA-staged with the checkpoint, the window replayed, then T steps with their
  ring appends; a flushing row stores the tile after
  token 0 (committed history only), in the same launch.

Everything is float32 multiply-and-reduce, never wgmma (Mosaic f32 wgmma is TF32). Padding rows
(slot < 0) gather slot 0 (harmless), produce zero output and write nothing.

Layouts (lowering only; the interpreter does not check them): the [BP, N] tile uses
``Layout.WGMMA``, N vectors (B, C) ``WGMMA.reduce(0)``, P vectors (x, z, y) ``WGMMA.reduce(1)``;
so BP must be a multiple of 64 and N of 64 when compiling (``gdn_mosaic._require_lowerable``).
Shapes: x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]; pool [Ns, H, P, N].
Head h reads group h // (H // G).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from replayssm_jax import config as config_lib
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.mamba2.buffers import ReplayBuffers
from replayssm_jax.pallas import common
from replayssm_jax.pallas.gdn_mosaic import (_COL_V, _ROW_K, _TILE, _buffered_scratch, _fit,
                                             _launch_options, _num_buffers, _pipeline_rows,
                                             _require_lowerable, _row_buffers, _smem_bytes,
                                             _stage_head, _store, _tile_after_window, _vec,
                                             _wait_all, _with_rows, _zeros)

f32 = jnp.float32
_ROW_N, _COL_P = _ROW_K, _COL_V   # the GDN [V, K] tile's layouts, read as Mamba2's [P, N]
_P_VECTORS = ("x", "z")           # per-token vectors over P (the others, B and C, are over N)
# The verify kernel's token vectors copied to SMEM by TMA (``_stage_tokens``). Staging x and z
# beat staging all four, B and C only, or none (H200, 2026-11-30, B=256, L=8, T=2/4/8;
# git show 60b2ea2:bench/results/verify_2026-11-30_s8_staging_variants.log); B and C stay GMEM loads.
_STAGED = ("x", "z")


def _token_vectors(r, at, h, g, tile, staged=None):
  """One token's vectors at input index ``at`` ((b,) for decode, (b, i) for verify): name →
  float32 vector (x, z [BP] of head h; B, C [N] of group g), read from the SMEM copy
  ``staged[name + "_tok"]`` (``_stage_tokens``) where there is one, else from GMEM."""
  def vec(name):
    layout = _COL_P if name in _P_VECTORS else _ROW_N
    if staged is not None and f"{name}_tok" in staged:
      return _vec(staged[f"{name}_tok"].at[at[-1]], layout)
    return _vec(r[name].at[(*at, h, tile) if name in _P_VECTORS else (*at, g)], layout)
  return vec


def _token(r, dt, h, vec, softplus, live=True):
  """(ΔA, Δx [BP], x [BP]) of head h from its raw dt scalar and ``vec``: Δ = softplus(dt +
  dt_bias), float32. ``live`` False gives Δ = 0 (ΔA = 0, Δx = 0 exactly)."""
  dt = dt.astype(f32)
  if "dt_bias" in r:
    dt = dt + r["dt_bias"][h].astype(f32)
  delta = common.softplus(dt, log1p=common.log1p_from_log) if softplus else dt
  delta = jnp.where(live, delta, 0.0)
  x = vec("x")
  return delta * r["A"][h].astype(f32), delta * x, x


def _step(r, h, vec, S, dA, dx, x):
  """(S_t = e^{ΔA} S + Δx Bᵀ, (S_t C + D x) · silu(z)) on a float32 [BP, N] tile."""
  S = jnp.exp(dA) * S + dx[:, None] * vec("B")[None, :]
  y = jnp.sum(S * vec("C")[None, :], axis=1)
  if "D" in r:
    y = y + r["D"][h].astype(f32) * x
  if "z" in r:
    y = common.silu_gate(y, vec("z"))
  return S, y


def _step_inputs(slots, x, dt, A, B, C, D, z, dt_bias) -> dict:
  given = {"slots": slots, "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z,
           "dt_bias": dt_bias}
  return {k: v for k, v in given.items() if v is not None}


def _decode_kernel(*refs, names, group, block_p, softplus, rows, interpret, **scratch):
  """Program (pt, h, z) steps batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``: with
  rows ≥ 2 the next row's tile is staged while the current row computes)."""
  r = dict(zip(names, refs))
  pt, h, z = lax.axis_index("pt"), lax.axis_index("h"), lax.axis_index("b")
  tile = pl.ds(pt * block_p, block_p)

  def stage(i, buf):
    s = r["slots"][z * rows + i]
    plgpu.copy_gmem_to_smem(r["pool"].at[jnp.maximum(s, 0), h, tile], buf["S_smem"], buf["bar"])

  def step_row(i, buf):
    b = z * rows + i
    s = r["slots"][b]
    vec = _token_vectors(r, (b,), h, h // group, tile)
    dA, dx, x = _token(r, r["dt"][b, h], h, vec, softplus)
    plgpu.barrier_wait(buf["bar"])
    S, y = _step(r, h, vec, plgpu.load(buf["S_smem"], layout=_TILE).astype(f32), dA, dx, x)

    @pl.when(s >= 0)
    def _():
      _store(r["y_out"].at[b, h, tile], y.astype(r["y_out"].dtype))
      _store(buf["S_smem"], S.astype(buf["S_smem"].dtype))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buf["S_smem"], r["pool"].at[s, h, tile])

    @pl.when(s < 0)
    def _():
      _store(r["y_out"].at[b, h, tile], _zeros(block_p).astype(r["y_out"].dtype))

  _pipeline_rows(rows, _row_buffers(scratch, rows), stage, step_row, interpret=interpret)


def _stage_row(r, buf, b, h, g, tile):
  """TMA of row b's checkpoint tile and ring (B of group g, ΔA and Δx of head h) into ``buf``, by
  GDN's ``_stage_head`` (the rings are the same recurrence)."""
  _stage_head(r["state"], r["ring_B"], r["ring_x"], r["ring_a"], r["slots"][b], g, h, tile,
              buf["S_smem"], buf["rB_smem"], buf["rx_smem"], buf["ra_smem"], buf["bars"])


def _after_window(smem, bars, base, count, ring_size):
  """The staged checkpoint tile brought through the window [base, base + count): S_{t-1} [BP, N]."""
  return _tile_after_window(smem["S_smem"], smem["rB_smem"], smem["rx_smem"], smem["ra_smem"], bars,
                            base, count, ring_size)


def _store_checkpoint(r, smem, S, s, h, tile):
  """Slot s's checkpoint tile ← S, by TMA from SMEM (waited for at the program's end); with a read
  copy (ref ``read_copy``, scratch ``C_smem``) its rounding too."""
  _store(smem["S_smem"], S.astype(smem["S_smem"].dtype))
  if "read_copy" in r:
    _store(smem["C_smem"], S.astype(smem["C_smem"].dtype))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem["S_smem"], r["state"].at[s, h, tile])
  if "read_copy" in r:
    plgpu.copy_smem_to_gmem(smem["C_smem"], r["read_copy"].at[s, h, tile])


def _replay_kernel(*refs, names, group, block_p, ring_size, softplus, rows, interpret,
                   **scratch):
  """Program (pt, h, z) steps batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``: with
  rows ≥ 2 the next row's staging overlaps the current row's work)."""
  r = dict(zip(names, refs))
  pt, h, z = lax.axis_index("pt"), lax.axis_index("h"), lax.axis_index("b")
  tile, g = pl.ds(pt * block_p, block_p), h // group

  def step_row(i, buf):
    b = z * rows + i
    s = r["slots"][b]
    base, count = r["base"][b], r["count"][b]
    put = (base + count) % ring_size                               # this token's ring index
    vec = _token_vectors(r, (b,), h, g, tile)
    dA, dx, x = _token(r, r["dt"][b, h], h, vec, softplus)        # loads overlap the TMA
    S = _after_window(buf, buf["bars"], base, count, ring_size)
    S, y = _step(r, h, vec, S, dA, dx, x)
    valid = s >= 0

    @pl.when(valid)
    def _():
      _store(r["y_out"].at[b, h, tile], y.astype(r["y_out"].dtype))
      _store(r["ring_x"].at[s, h, put, tile], dx.astype(r["ring_x"].dtype))

      @pl.when(pt == 0)  # ΔA is per head, B per group, not per P tile: one program appends each
      def _():
        r["ring_a"][s, h, put] = dA

        @pl.when(h % group == 0)
        def _():
          B = _vec(r["B"].at[b, g], _ROW_N)
          _store(r["ring_B"].at[s, g, put], B.astype(r["ring_B"].dtype))

    @pl.when(~valid)
    def _():
      _store(r["y_out"].at[b, h, tile], _zeros(block_p).astype(r["y_out"].dtype))

    # checkpoint ← window + this token
    pl.when(valid & (r["flush"][b] != 0))(lambda: _store_checkpoint(r, buf, S, s, h, tile))

  _pipeline_rows(rows, _row_buffers(scratch, rows),
                 lambda i, buf: _stage_row(r, buf, z * rows + i, h, g, tile), step_row,
                 interpret=interpret)


def _stage_tokens(r, smem, tok_bars, b, h, g, tile):
  """TMA of row b's T tokens' ``_STAGED`` vectors into SMEM (x, z [T, BP] of head h; B, C [T, N]
  of group g; one barrier each, in that order), issued with the checkpoint tile's, so they
  overlap the window replay instead of queueing behind it token by token."""
  for j, name in enumerate(n for n in _STAGED if n in r):
    src = r[name].at[b, :, h, tile] if name in _P_VECTORS else r[name].at[b, :, g]
    plgpu.copy_gmem_to_smem(src, smem[f"{name}_tok"], tok_bars.at[j])


def _verify_kernel(*refs, names, group, block_p, ring_size, softplus, num_tokens, rows,
                   interpret, **scratch):
  """The replay kernel for T tokens (reconstruct route of speculative verify): window replayed
  into the tile, then T steps, each token appended past the window; a flushing row stores the
  tile after token 0 (committed history only). The T tokens' ``_STAGED`` vectors are TMA-staged
  with the checkpoint tile and their dt scalars loaded before the window, so both overlap its
  replay. Program (pt, h, z) takes batch rows z·rows … z·rows + rows − 1 (``_pipeline_rows``:
  with rows ≥ 2 the next row's staging overlaps the current row's work).
  A padded lane reads token 0's vectors with Δ = 0, so S is unchanged exactly and its own
  vectors (NaN allowed) are never read."""
  r = dict(zip(names, refs))
  pt, h, z = lax.axis_index("pt"), lax.axis_index("h"), lax.axis_index("b")
  tile, g = pl.ds(pt * block_p, block_p), h // group
  buffers = _row_buffers(scratch, rows)

  def stage(i, buf):
    b = z * rows + i
    _stage_row(r, buf, b, h, g, tile)
    _stage_tokens(r, buf, buf.get("tok_bars"), b, h, g, tile)

  def verify_row(i, buf):
    b = z * rows + i
    s = r["slots"][b]
    base, count, n = r["base"][b], r["count"][b], r["lengths"][b]
    dts = [r["dt"][b, j, h] for j in range(num_tokens)]   # a padded lane's dt is masked by Δ = 0
    valid = s >= 0
    S = _after_window(buf, buf["bars"], base, count, ring_size)
    _wait_all(buf.get("tok_bars"), sum(name in r for name in _STAGED))
    for j in range(num_tokens):
      live = valid & (n > j)
      put = (base + count + j) % ring_size
      vec = _token_vectors(r, (b, jnp.where(live, j, 0)), h, g, tile, staged=buf)
      dA, dx, x = _token(r, dts[j], h, vec, softplus, live)
      S, y = _step(r, h, vec, S, dA, dx, x)

      @pl.when(live)
      def _():
        _store(r["y_out"].at[b, j, h, tile], y.astype(r["y_out"].dtype))
        _store(r["ring_x"].at[s, h, put, tile], dx.astype(r["ring_x"].dtype))

        @pl.when(pt == 0)  # ΔA is per head, B per group: one program appends each
        def _():
          r["ring_a"][s, h, put] = dA

          @pl.when(h % group == 0)
          def _():
            _store(r["ring_B"].at[s, g, put], vec("B").astype(r["ring_B"].dtype))

      @pl.when(~live)
      def _():
        _store(r["y_out"].at[b, j, h, tile], _zeros(block_p).astype(r["y_out"].dtype))

      if j == 0:
        # checkpoint ← window + token 0
        pl.when(valid & (r["flush"][b] != 0))(lambda: _store_checkpoint(r, buf, S, s, h, tile))

  _pipeline_rows(rows, buffers, stage, verify_row, interpret=interpret)


def _ring_scratch(bufs, block_p):
  r = bufs.ring_size
  return {"rB_smem": plgpu.SMEM((r, bufs.state_dim), bufs.ring_B.dtype),
          "rx_smem": plgpu.SMEM((1, r, block_p), bufs.ring_x.dtype),
          "ra_smem": plgpu.SMEM((1, r), f32)}


def _token_scratch(inputs, num_tokens, block_p):
  """SMEM for the T tokens' given ``_STAGED`` vectors (``_stage_tokens``): x, z [T, BP];
  B, C [T, N]."""
  return {f"{name}_tok": plgpu.SMEM((num_tokens, block_p if name in _P_VECTORS else
                                     inputs[name].shape[-1]), inputs[name].dtype)
          for name in _STAGED if name in inputs}


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  batch, h, p = x.shape
  inputs = _step_inputs(slots, x, dt, A, B, C, D, z, dt_bias)
  pool_ref = jax.new_ref(pool)   # written Ref operand: updated in place (aliased under donation)
  kernel = functools.partial(_decode_kernel, names=(*inputs, "pool", "y_out"),
                             group=h // B.shape[1], block_p=cfg.block_v, softplus=dt_softplus,
                             rows=cfg.rows, interpret=interpret)
  one = {"S_smem": plgpu.SMEM((cfg.block_v, pool.shape[-1]), pool.dtype), "bar": plgpu.Barrier()}
  y = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(p // cfg.block_v, h, batch // cfg.rows), grid_names=("pt", "h", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows),
      kernel_name="replayssm_mamba2_decode_mosaic", **_launch_options(interpret),
  )(*inputs.values(), pool_ref)
  return y, jax.freeze(pool_ref)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _replay_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  batch, h, p = x.shape
  r, n, bp = bufs.ring_size, bufs.state_dim, cfg.block_v
  inputs = {**_step_inputs(plan.slots, x, dt, A, B, C, D, z, dt_bias), "base": plan.base,
            "count": plan.count, "flush": plan.flush.astype(jnp.int32)}
  names = ("state", "ring_x", "ring_B", "ring_a")
  refs = [jax.new_ref(getattr(bufs, k)) for k in names]   # written Refs: updated in place
  kernel = functools.partial(_replay_kernel, names=(*inputs, *names, "y_out"),
                             group=h // bufs.num_groups, block_p=bp, ring_size=r,
                             softplus=dt_softplus, rows=cfg.rows, interpret=interpret)
  one = {"S_smem": plgpu.SMEM((bp, n), bufs.state.dtype), **_ring_scratch(bufs, bp),
         "bars": plgpu.Barrier(num_barriers=4)}
  y = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(p // bp, h, batch // cfg.rows), grid_names=("pt", "h", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows),
      kernel_name="replayssm_mamba2_replay_mosaic", **_launch_options(interpret),
  )(*inputs.values(), *refs)
  return y, bufs.replace(**{k: jax.freeze(ref) for k, ref in zip(names, refs)})


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _replay_verify(x, dt, A, B, C, bufs, plan, lengths, D, z, dt_bias, *, dt_softplus, cfg,
                   interpret):
  batch, t, h, p = x.shape
  bp = cfg.block_v
  inputs = {**_step_inputs(plan.slots, x, dt, A, B, C, D, z, dt_bias), "base": plan.base,
            "count": plan.count, "flush": plan.flush.astype(jnp.int32), "lengths": lengths}
  names = ("state", "ring_x", "ring_B", "ring_a") + (() if bufs.read_copy is None else ("read_copy",))
  refs = [jax.new_ref(getattr(bufs, k)) for k in names]   # written Refs: updated in place
  tokens = _token_scratch(inputs, t, bp)
  copy = {} if bufs.read_copy is None else {"C_smem": plgpu.SMEM((bp, bufs.state_dim), bufs.read_copy.dtype)}
  kernel = functools.partial(_verify_kernel, names=(*inputs, *names, "y_out"),
                             group=h // bufs.num_groups, block_p=bp, ring_size=bufs.ring_size,
                             softplus=dt_softplus, num_tokens=t, rows=cfg.rows,
                             interpret=interpret)
  one = {"S_smem": plgpu.SMEM((bp, bufs.state_dim), bufs.state.dtype), **copy, **_ring_scratch(bufs, bp),
         **tokens, "bars": plgpu.Barrier(num_barriers=4),
         **({"tok_bars": plgpu.Barrier(num_barriers=len(tokens))} if tokens else {})}
  y = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(p // bp, h, batch // cfg.rows), grid_names=("pt", "h", "b"),
      scratch_types=_buffered_scratch(one, cfg.rows),
      kernel_name="replayssm_mamba2_verify_mosaic", **_launch_options(interpret),
  )(*inputs.values(), *refs)
  return y, bufs.replace(**{k: jax.freeze(ref) for k, ref in zip(names, refs)})


def _p_tile(op, config, head_dim, block_p):
  """The config's P tile (``block_p`` overrides it); NotImplementedError unless it divides P."""
  cfg = _fit(config(device_kind=common.device_kind(), head_dim=head_dim), head_dim, block_p)
  if head_dim % cfg.block_v:
    raise NotImplementedError(f"{op}: P tile {cfg.block_v} does not divide P={head_dim}")
  return cfg


def decode(x, dt, A, B, C, pool, slots, *, D, z, dt_bias, dt_softplus, block_p=None, rows=None):
  """Conventional Mamba2 decode step over a slot pool. Returns (y [B, H, P] in x.dtype, pool).

  ``block_p`` overrides the config's P tile (rows of the [BP, N] state tile per program),
  ``rows`` its batch rows per program (a power of two; reduced to one that divides B).
  """
  op = "mamba2.decode[pallas_mosaic]"
  _, _, p, n = pool.shape
  cfg = _with_rows(_p_tile(op, config_lib.mosaic_mamba2_decode_config, p, block_p), rows,
                   x.shape[0])
  _require_lowerable(op, head_k_dim=n, head_v_dim=p,
                     block_v=cfg.block_v, ring_size=0, dims=("P", "N"),
                     smem=_num_buffers(cfg.rows) * _smem_bytes(cfg.block_v, n, heads=1,
                                                               state_dtype=pool.dtype))
  return _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, dt_softplus=dt_softplus, cfg=cfg,
                 interpret=common.mosaic_interpret_mode())


def replay_decode(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, *, D, z, dt_bias,
                  dt_softplus, route="auto", block_p=None, rows=None):
  """ReplaySSM Mamba2 decode (one token per row) on the reconstruct route, flush fused.

  ``route`` "auto" or "reconstruct" ("output_only" raises NotImplementedError); ``block_p``
  overrides the config's P tile, ``rows`` its batch rows per program (a power of two; reduced to
  one that divides B). Returns (y [B, H, P] in x.dtype, bufs).
  """
  op = "mamba2.replay_decode[pallas_mosaic]"
  if plan.num_tokens != 1:
    raise NotImplementedError(f"{op}: plans with num_tokens={plan.num_tokens} (verify) are not "
                              f"supported by this kernel")
  if route == "output_only":
    raise NotImplementedError(f"{op}: only the reconstruct route is implemented")
  cfg = _replay_tile(op, config_lib.mosaic_mamba2_replay_config, bufs, block_p, rows=rows,
                     batch=x.shape[0])
  return _replay_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, dt_softplus=dt_softplus,
                        cfg=cfg, interpret=common.mosaic_interpret_mode())


def replay_verify(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, D, z, dt_bias,
                  dt_softplus, block_p=None, rows=None):
  """ReplaySSM Mamba2 speculative verify, reconstruct route (one launch, flush stored in place).

  x, z [B, T, H, P]; dt [B, T, H]; B, C [B, T, G, N]; lengths int32[B]. Returns
  (y [B, T, H, P] in x.dtype, bufs). ``block_p`` overrides the config's P tile, ``rows`` its
  batch rows per program (a power of two; reduced to one that divides B). A read copy is not
  read; a flushing row's stored tile is rounded into it.
  """
  given = _step_inputs(None, x, dt, A, B, C, D, z, dt_bias)
  cfg = _replay_tile("mamba2.replay_verify[pallas_mosaic]", config_lib.mosaic_mamba2_verify_config,
                     bufs, block_p, tokens=lambda bp: _token_scratch(given, x.shape[1], bp),
                     rows=rows, batch=x.shape[0])
  return _replay_verify(x, dt, A, B, C, bufs, plan, lengths, D, z, dt_bias, dt_softplus=dt_softplus,
                        cfg=cfg, interpret=common.mosaic_interpret_mode())


def _replay_tile(op, config, bufs, block_p, tokens=None, rows=None, batch=None):
  """The P tile of a kernel that stages the checkpoint tile, the row's ring and (verify) the
  token scratch ``tokens(P tile)``, and its rows per program (``rows`` or the config's, reduced
  to a divisor of ``batch``); NotImplementedError where Mosaic cannot lower it."""
  p, n = bufs.head_dim, bufs.state_dim
  cfg = _p_tile(op, config, p, block_p)
  smem = _smem_bytes(cfg.block_v, n, heads=1, state_dtype=bufs.state.dtype,
                     ring_size=bufs.ring_size, ring_dtype=bufs.ring_x.dtype)
  if bufs.read_copy is not None:   # (verify only) the copy's tile, stored beside the checkpoint's
    smem += cfg.block_v * n * bufs.read_copy.dtype.itemsize
  if tokens is not None:
    smem += sum(math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
                for ref in tokens(cfg.block_v).values())
  if batch is not None:
    cfg = _with_rows(cfg, rows, batch)
    smem *= _num_buffers(cfg.rows)
  _require_lowerable(op, head_k_dim=n, head_v_dim=p, block_v=cfg.block_v,
                     ring_size=bufs.ring_size, smem=smem, dims=("P", "N"),
                     ring_itemsize=jnp.dtype(bufs.ring_x.dtype).itemsize)
  return cfg
