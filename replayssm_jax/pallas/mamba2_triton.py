"""Mamba2 decode kernels in Pallas with the Triton lowering (interpreted on CPU).

Three kernels, each ``kernel → builder → public wrapper`` (the wrappers are what mamba2/ops.py
calls):

* ``decode``: the conventional step (selective_state_update). Grid (P/BP, H, B); a program reads
  the [BP, N] state tile of its row's slot, steps it once and writes it back in place.
* ``replay_decode``: one launch, grid (P/BP, H/hp, B); a program serves ``hp`` heads of one group.
  It reads the checkpoint tile, replays the window ``[base, base + count)`` of the ring, writes y
  and appends (Δx, B, ΔA) at ring index ``base + count``. Routes:
    output_only  S_{t-1} C = e^G (S_c C) + Σ_j w_j (B_j·C) Δx_j; the products B_j·C are computed
                 once per program and shared by its heads; S is never built.
    reconstruct  S_{t-1} = e^G S_c + Σ_j w_j Δx_j B_jᵀ is rebuilt in [BP, block_n] chunks.
  Flushing rows (``plan.flush``) write S_t = a S_{t-1} + Δx_t B_tᵀ (window plus this token) to the
  checkpoint: the reconstruct route stores the chunks it builds anyway, in the same launch; the
  output-only route runs the fold pass of pallas/fold_triton.py (shared with GDN) over the
  flushing rows after the step, since a fold branch compiled into the step kernel would cost every
  program registers and occupancy.
  With ``plan.flush_all`` (every live row flushes: the small-batch policy) a fold-and-step kernel,
  grid (P/BP, H, B), replaces it: the conventional decode's pass once windows are empty.
* ``materialize``: the rebuild alone, into a fresh f32 array, for every row.

The kernel pieces (``_token``, ``_finish``, ``_decode_step``, ``_window``, the builders) also serve the speculative-verify kernels of pallas/mamba2_verify_triton.py.

Everything is float32 inside and products are multiply-and-reduce or rank-one FMAs, never
``dot`` (Triton f32 dots are TF32), so CPU interpret mode and the GPU agree to f32 rounding. Ring
entries outside a window may be stale or NaN: they are masked away at load time, never multiplied
by 0. Padding rows (slot < 0) produce zero output and touch neither checkpoint nor ring.
Shapes: x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]; state [Ns, H, P, N];
ring_x [Ns, H, R, P]; ring_B [Ns, G, R, N]; ring_a [Ns, H, R]. Head h reads group h // (H // G).
P needs a power-of-two divisor (P = 80 runs in tiles of 16); N must be a power of two.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import config as config_lib
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.mamba2.buffers import ReplayBuffers
from replayssm_jax.pallas import common, fold_triton
from replayssm_jax.replay import window_decays, window_offsets

f32 = jnp.float32
ROUTES = ("auto", "output_only", "reconstruct")
OPTIONAL = ("D", "dt_bias", "z")
# One name per route, as GDN's kernels have: register caps (pallas/register_caps.py) are per name.
_STEP_KERNEL_NAMES = {"output_only": "replayssm_mamba2_replay_step",
                      "reconstruct": "replayssm_mamba2_reconstruct"}


# ----------------------------------------------------------------------------------------------
# Kernel pieces. ``r`` maps argument names to refs (optional D, dt_bias, z are absent when None).
# ----------------------------------------------------------------------------------------------

def _token(r, at, h, tile, softplus):
  """(ΔA, Δx [BP]) of the token at ``at`` ((b,) in decode, (b, i) in verify), head h:
  Δ = softplus(dt + dt_bias), in float32."""
  dt = r["dt"][(*at, h)].astype(f32)
  if "dt_bias" in r:
    dt = dt + r["dt_bias"][h].astype(f32)
  delta = common.softplus(dt) if softplus else dt
  return delta * r["A"][h].astype(f32), delta * r["x"][(*at, h, tile)].astype(f32)


def _finish(r, y, at, h, tile):
  """(y + D x) · silu(z) of the token at ``at``, cast to the output dtype."""
  if "D" in r:
    y = y + r["D"][h].astype(f32) * r["x"][(*at, h, tile)].astype(f32)
  if "z" in r:
    y = common.silu_gate(y, r["z"][(*at, h, tile)].astype(f32))
  return y.astype(r["y_out"].dtype)


def _window(r, s, h, base, length, ring_size):
  """(weights [R], total log decay, inside [R]) of the window ``[base, base + length)``."""
  _, inside = window_offsets((ring_size,), base, length, ring_size)
  ra = plt.load(r["ring_a"].at[s, h, :], mask=inside, other=jnp.zeros((), f32))
  weights, total = window_decays(ra, base, length, ring_size)
  return weights, total, inside


def _rebuild(r, s, h, g, tile, cols, window, ring_size):
  """e^G S_c + Σ_j w_j Δx_j B_jᵀ on the [BP, len(cols)] chunk: R rank-one FMAs
  (``fold_triton.rank_one_window``; B is the key ring, Δx the value ring)."""
  weights, total, inside = window
  S = jnp.exp(total) * r["state"][s, h, tile, cols].astype(f32)
  return fold_triton.rank_one_window(S, weights, inside,
                                     lambda rows: r["ring_B"].at[s, g, rows, cols],
                                     lambda rows: r["ring_x"].at[s, h, rows, tile], ring_size)


def _step_chunk(r, at, s, h, g, tile, cols, window, dA, dx, ring_size):
  """S_t = a S_{t-1} + Δx_t B_tᵀ on one [BP, block_n] chunk, S_{t-1} rebuilt from the ring."""
  Bt = r["B"][(*at, g, cols)].astype(f32)
  return jnp.exp(dA) * _rebuild(r, s, h, g, tile, cols, window, ring_size) + dx[:, None] * Bt[None, :]


def _chunks(n, block_n, body, init):
  """``body(cols, carry)`` over the N chunks of width block_n (a loop: one copy of the code)."""
  return lax.fori_loop(0, n // block_n, lambda c, carry: body(pl.ds(c * block_n, block_n), carry),
                       init)


def _stepped_readout(r, b, s, h, g, tile, window, dA, dx, *, block_n, ring_size, store):
  """y = S_t C_t with S_t = a S_{t-1} + Δx_t B_tᵀ and S_{t-1} rebuilt from the window, walked in
  [BP, block_n] chunks; each chunk of S_t is written to the checkpoint where ``store`` (traced)."""
  def chunk(cols, y):
    S = _step_chunk(r, (b,), s, h, g, tile, cols, window, dA, dx, ring_size)

    @pl.when(store)
    def _():
      r["state_out"][s, h, tile, cols] = S.astype(r["state_out"].dtype)
    return y + jnp.sum(S * r["C"][b, g, cols].astype(f32)[None, :], axis=1)
  return _chunks(r["state"].shape[-1], block_n, chunk, jnp.zeros((tile.size,), f32))


def _decode_step(r, at, g, S, dA, dx):
  """(S_t = a S_{t-1} + Δx_t B_tᵀ, S_t C_t) on a [BP, N] tile, for the token at ``at``."""
  S = jnp.exp(dA) * S + dx[:, None] * r["B"][(*at, g, slice(None))].astype(f32)[None, :]
  return S, jnp.sum(S * r["C"][(*at, g, slice(None))].astype(f32)[None, :], axis=1)


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------

def _decode_kernel(*refs, names, group, block_p, softplus):
  r = dict(zip(names, refs))
  pt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)

  @pl.when(s < 0)
  def _():
    r["y_out"][b, h, tile] = jnp.zeros((block_p,), r["y_out"].dtype)

  @pl.when(s >= 0)
  def _():
    dA, dx = _token(r, (b,), h, tile, softplus)
    S, y = _decode_step(r, (b,), h // group, r["pool"][s, h, tile, :].astype(f32), dA, dx)
    r["y_out"][b, h, tile] = _finish(r, y, (b,), h, tile)
    r["pool_out"][s, h, tile, :] = S.astype(r["pool_out"].dtype)


def _replay_kernel(*refs, names, group, heads, block_p, block_n, ring_size, route, softplus):
  r = dict(zip(names, refs))
  pt, hb, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)
  h0 = hb * heads                       # this program's heads h0 .. h0 + heads - 1, one group
  g = h0 // group

  @pl.when(s < 0)
  def _():
    for i in range(heads):
      r["y_out"][b, h0 + i, tile] = jnp.zeros((block_p,), r["y_out"].dtype)

  @pl.when(s >= 0)
  def _():
    base, count, flush = r["base"][b], r["count"][b], r["flush"][b] != 0
    put = (base + count) % ring_size                                # this token's ring index
    C = r["C"][b, g, :].astype(f32)
    Bt = r["B"][b, g, :].astype(f32)
    if route == "output_only":
      # B_j·C for the window entries and B_t·C, shared by the program's heads.
      _, inside = window_offsets((ring_size,), base, count, ring_size)
      rBC = jnp.sum(common.load_window(r["ring_B"].at[s, g, :, :], inside) * C[None, :], axis=1)
      BtC = jnp.sum(Bt * C)
    for i in range(heads):
      h = h0 + i
      dA, dx = _token(r, (b,), h, tile, softplus)
      window = _window(r, s, h, base, count, ring_size)
      if route == "output_only":
        weights, total, inside = window
        ScC = jnp.sum(r["state"][s, h, tile, :].astype(f32) * C[None, :], axis=1)
        rx = common.load_window(r["ring_x"].at[s, h, :, tile], inside)    # [R, BP]
        SC = jnp.exp(total) * ScC + jnp.sum((weights * rBC)[:, None] * rx, axis=0)
        y = jnp.exp(dA) * SC + BtC * dx
      else:
        y = _stepped_readout(r, b, s, h, g, tile, window, dA, dx, block_n=block_n,
                             ring_size=ring_size, store=flush)
      r["y_out"][b, h, tile] = _finish(r, y, (b,), h, tile)
      r["ring_x_out"][s, h, put, tile] = dx.astype(r["ring_x_out"].dtype)

      @pl.when(pt == 0)  # ΔA is per head, not per P tile: one program appends it
      def _(h=h, dA=dA):
        r["ring_a_out"][s, h, put] = dA

    @pl.when((pt == 0) & (h0 % group == 0))  # B is per group: its first program appends it
    def _():
      r["ring_B_out"][s, g, put, :] = Bt.astype(r["ring_B_out"].dtype)


def _flush_decode_kernel(*refs, names, group, block_p, block_n, ring_size, softplus):
  """Every live row flushes (``plan.flush_all``, the small-batch policy), grid (P/BP, H, B): the
  checkpoint tile steps once and is written back. After one such step every window is empty (the
  commit moves base past the token, which is therefore never appended to the ring), so the steady
  state is the conventional decode; a row arriving with a window rebuilds S_{t-1} chunk by chunk."""
  r = dict(zip(names, refs))
  pt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s, count = r["slots"][b], r["count"][b]
  tile = pl.ds(pt * block_p, block_p)
  g = h // group

  @pl.when(s < 0)
  def _():
    r["y_out"][b, h, tile] = jnp.zeros((block_p,), r["y_out"].dtype)

  @pl.when((s >= 0) & (count == 0))
  def _():
    dA, dx = _token(r, (b,), h, tile, softplus)
    S, y = _decode_step(r, (b,), g, r["state"][s, h, tile, :].astype(f32), dA, dx)
    r["y_out"][b, h, tile] = _finish(r, y, (b,), h, tile)
    r["state_out"][s, h, tile, :] = S.astype(r["state_out"].dtype)

  @pl.when((s >= 0) & (count > 0))
  def _():
    dA, dx = _token(r, (b,), h, tile, softplus)
    window = _window(r, s, h, r["base"][b], count, ring_size)
    y = _stepped_readout(r, b, s, h, g, tile, window, dA, dx, block_n=block_n,
                         ring_size=ring_size, store=True)
    r["y_out"][b, h, tile] = _finish(r, y, (b,), h, tile)


def _materialize_kernel(*refs, names, group, block_p, block_n, ring_size):
  r = dict(zip(names, refs))
  pt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)
  n = r["state"].shape[-1]

  @pl.when(s < 0)
  def _():
    r["out"][b, h, tile, :] = jnp.zeros((block_p, n), f32)

  @pl.when(s >= 0)
  def _():
    window = _window(r, s, h, r["base"][b], r["length"][b], ring_size)

    def chunk(cols, carry):
      r["out"][b, h, tile, cols] = _rebuild(r, s, h, h // group, tile, cols, window, ring_size)
      return carry
    _chunks(n, block_n, chunk, 0)


# ----------------------------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------------------------

def _pallas(kernel, inputs: dict, outputs: dict, aliases: dict, *, grid, cfg, name, interpret):
  """pallas_call over named GMEM operands; ``aliases`` maps input names to output names."""
  in_names, out_names = list(inputs), list(outputs)
  fresh = {k: v for k, v in outputs.items() if k not in aliases.values()}
  common.require_triton_addressable(name, **{**inputs, **fresh})
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  outs = pl.pallas_call(
      functools.partial(kernel, names=tuple(in_names + out_names)), grid=grid,
      in_specs=[any_spec] * len(inputs), out_specs=[any_spec] * len(outputs),
      out_shape=[jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outputs.values()],
      input_output_aliases={in_names.index(i): out_names.index(o) for i, o in aliases.items()},
      name=name, interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
  )(*inputs.values())
  return dict(zip(out_names, outs))


def _step_inputs(x, dt, A, B, C, D, z, dt_bias) -> dict:
  given = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "dt_bias": dt_bias, "z": z}
  return {k: v for k, v in given.items() if v is not None}


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  batch, h, p = x.shape
  kernel = functools.partial(_decode_kernel, group=h // B.shape[1], block_p=cfg.block_p,
                             softplus=dt_softplus)
  out = _pallas(kernel, {"slots": slots, **_step_inputs(x, dt, A, B, C, D, z, dt_bias), "pool": pool},
                {"y_out": x, "pool_out": pool}, {"pool": "pool_out"},
                grid=(p // cfg.block_p, h, batch), cfg=cfg, name="replayssm_mamba2_decode",
                interpret=interpret)
  return out["y_out"], out["pool_out"]


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _replay_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  """The step launch; on the output-only route then the fold pass over the flushing rows."""
  batch, h, p = x.shape
  step = cfg.step
  kernel = functools.partial(_replay_kernel, group=h // bufs.num_groups, heads=step.heads,
                             block_p=step.block_p, block_n=step.block_n, ring_size=bufs.ring_size,
                             route=cfg.route, softplus=dt_softplus)
  fields = step_fields(bufs)
  buffers = step_buffers(bufs, fields)
  out = _pallas(kernel,
                {"slots": plan.slots, "base": plan.base, "count": plan.count,
                 "flush": plan.flush.astype(jnp.int32),
                 **_step_inputs(x, dt, A, B, C, D, z, dt_bias), **buffers},
                {"y_out": x, **{k + "_out": v for k, v in buffers.items()}},
                {k: k + "_out" for k in buffers},
                grid=(p // step.block_p, h // step.heads, batch), cfg=step,
                name=_STEP_KERNEL_NAMES[cfg.route], interpret=interpret)
  return out["y_out"], fold_flushing_rows(with_step_buffers(bufs, out, fields), plan, cfg=cfg,
                                          interpret=interpret)


def step_fields(bufs, *, verify: bool = False, route: str = "output_only") -> dict:
  """Kernel ref name → ``ReplayBuffers`` field of the buffers a step or verify launch takes,
  aliased in place. With a read copy, decode's output-only step reads the copy in the checkpoint's
  place (the fold pass writes both); verify reads the float32 checkpoint, and on the reconstruct
  route its kernel stores the copy (``read_copy``) where it stores the checkpoint."""
  fields = {"state": "state", "ring_x": "ring_x", "ring_B": "ring_B", "ring_a": "ring_a"}
  if bufs.read_copy is not None and not verify:
    fields["state"] = "read_copy"
  elif bufs.read_copy is not None and route == "reconstruct":
    fields["read_copy"] = "read_copy"
  return fields


def step_buffers(bufs, fields: dict) -> dict:
  """The arrays of ``step_fields``, by kernel ref name."""
  return {name: getattr(bufs, field) for name, field in fields.items()}


def with_step_buffers(bufs, out, fields: dict):
  """``bufs`` with a launch's aliased ``<name>_out`` outputs of ``step_fields`` put back."""
  return bufs.replace(**{field: out[name + "_out"] for name, field in fields.items()})


def fold_flushing_rows(bufs, plan: ReplayPlan, *, cfg, interpret):
  """Output-only route: flushing rows fold window + token 0 (``plan.fold_length()`` entries, the
  token already appended) into their checkpoint (``fold_triton.fold_flushing_rows``; ring_B is the
  key ring, ring_x the value ring, ring_a the log decays; the read copy, if any, written with the
  checkpoint). The reconstruct route stored them."""
  if cfg.route == "reconstruct":
    return bufs
  folded = fold_triton.fold_flushing_rows(
      bufs.state, bufs.ring_B, bufs.ring_x, bufs.ring_a, plan, cfg=cfg.fold,
      row_slots=cfg.fold_rows, interpret=interpret, name="replayssm_mamba2_fold",
      tiles_per_program=cfg.fold_tiles, read_copy=bufs.read_copy)
  return fold_triton.replace_folded(bufs, folded)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _flush_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, *, dt_softplus, cfg, interpret):
  batch, h, p = x.shape
  kernel = functools.partial(_flush_decode_kernel, group=h // bufs.num_groups, block_p=cfg.block_p,
                             block_n=cfg.block_n, ring_size=bufs.ring_size, softplus=dt_softplus)
  out = _pallas(kernel,
                {"slots": plan.slots, "base": plan.base, "count": plan.count,
                 **_step_inputs(x, dt, A, B, C, D, z, dt_bias), "state": bufs.state,
                 "ring_x": bufs.ring_x, "ring_B": bufs.ring_B, "ring_a": bufs.ring_a},
                {"y_out": x, "state_out": bufs.state}, {"state": "state_out"},
                grid=(p // cfg.block_p, h, batch), cfg=cfg, name="replayssm_mamba2_flush_decode",
                interpret=interpret)
  return out["y_out"], bufs.replace(state=out["state_out"])


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _materialize(bufs, slots, base, length, *, cfg, interpret):
  batch = slots.shape[0]
  _, h, p, n = bufs.state.shape
  kernel = functools.partial(_materialize_kernel, group=h // bufs.num_groups, block_p=cfg.block_p,
                             block_n=cfg.block_n, ring_size=bufs.ring_size)
  out = _pallas(kernel,
                {"slots": slots, "base": base, "length": length, "state": bufs.state,
                 "ring_x": bufs.ring_x, "ring_B": bufs.ring_B, "ring_a": bufs.ring_a},
                {"out": jax.ShapeDtypeStruct((batch, h, p, n), f32)}, {},
                grid=(p // cfg.block_p, h, batch), cfg=cfg, name="replayssm_mamba2_materialize",
                interpret=interpret)
  return out["out"]


# ----------------------------------------------------------------------------------------------
# Public wrappers (called from mamba2/ops.py; inputs already validated there).
# ----------------------------------------------------------------------------------------------

def _check_sizes(op, head_dim, state_dim):
  """Sizes Triton cannot tile are NotImplementedError, so implementation=None falls back to XLA:
  N not a power of two, P without a power-of-two divisor of at least min(P, 8) rows."""
  common.require_pow2(op, N=state_dim)
  if head_dim & -head_dim < min(head_dim, 8):
    raise NotImplementedError(f"{op}: head_dim P={head_dim} has no power-of-two tile of at least 8 "
                              f"rows (use implementation='xla', or None to fall back automatically)")


def _fit(op, cfg, head_dim, state_dim, heads_per_group=1, **knobs):
  """Applies the keyword overrides (a non-power-of-two tile is NotImplementedError) and clips the
  tiles to the head."""
  common.require_pow2(op, **{k: v for k, v in knobs.items()
                             if k in ("block_p", "block_n") and v is not None})
  return cfg.override(**knobs).fit(head_dim, state_dim, heads_per_group)


def decode(x, dt, A, B, C, pool, slots, *, D, z, dt_bias, dt_softplus, block_p=None,
           num_warps=None, num_stages=None):
  """Conventional Mamba2 decode step over a slot pool. Returns (y [B, H, P] in x.dtype, pool)."""
  op = "mamba2.decode[pallas_triton]"
  _, _, p, n = pool.shape
  _check_sizes(op, p, n)
  cfg = config_lib.mamba2_decode_config(device_kind=common.device_kind(), state_dtype=pool.dtype,
                                        head_dim=p, state_dim=n, batch=x.shape[0])
  cfg = _fit(op, cfg, p, n, block_p=block_p, num_warps=num_warps, num_stages=num_stages)
  return _decode(x, dt, A, B, C, pool, slots, D, z, dt_bias, dt_softplus=dt_softplus, cfg=cfg,
                 interpret=common.interpret_mode())


def replay_decode(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, *, D, z, dt_bias,
                  dt_softplus, route="auto", block_p=None, block_n=None, heads=None, num_warps=None,
                  num_stages=None, fold_block_p=None, fold_block_n=None, fold_num_warps=None,
                  fold_rows=None, fold_tiles=None):
  """ReplaySSM Mamba2 decode (one token per row): the step launch, then (output-only route) the
  fold pass over the flushing rows.

  ``block_p`` (P rows per program), ``block_n`` (N chunk of the rebuild), ``heads`` (heads per
  program), ``num_warps`` and ``num_stages`` override the step's config; ``fold_block_p`` /
  ``fold_block_n`` / ``fold_num_warps`` the fold pass's tile and warps, ``fold_rows`` its row
  slots, ``fold_tiles`` its tiles per program (a power of two). Returns (y [B, H, P], bufs).
  """
  op = "mamba2.replay_decode[pallas_triton]"
  if plan.num_tokens != 1:
    raise NotImplementedError(f"{op}: plans with num_tokens={plan.num_tokens} (verify) are not "
                              f"supported by this kernel")
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected one of {ROUTES}")
  if heads is not None and (not isinstance(heads, int) or heads < 1):
    raise ValueError(f"heads={heads!r}; expected an int >= 1")
  h, p, n = bufs.num_heads, bufs.head_dim, bufs.state_dim
  _check_sizes(op, p, n)
  route, plan = fold_triton.read_copy_route(op, bufs, route, plan)
  if plan.flush_all:
    # Every row flushes: one pass like the conventional decode (the routes differ only in how
    # they read S; ``heads`` has no meaning for this grid).
    cfg = config_lib.mamba2_flush_decode_config(device_kind=common.device_kind(),
                                                state_dtype=bufs.state.dtype, head_dim=p, state_dim=n,
                                                batch=x.shape[0])
    cfg = _fit(op, cfg, p, n, block_p=block_p, block_n=block_n, num_warps=num_warps,
               num_stages=num_stages)
    return _flush_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, dt_softplus=dt_softplus,
                         cfg=cfg, interpret=common.interpret_mode())
  cfg = config_lib.mamba2_replay_config(
      device_kind=common.device_kind(), state_dtype=bufs.state.dtype, head_dim=p, state_dim=n,
      num_heads=h, num_groups=bufs.num_groups, batch=x.shape[0], buffer_len=plan.buffer_len,
      ring_size=bufs.ring_size, route=route)
  step = _fit(op, cfg.step, p, n, h // bufs.num_groups, block_p=block_p, block_n=block_n,
              heads=heads, num_warps=num_warps, num_stages=num_stages)
  cfg = dataclasses.replace(cfg, step=step, **_fold_knobs(op, cfg, p, n, fold_block_p, fold_block_n,
                                                          fold_num_warps, fold_rows, fold_tiles))
  return _replay_decode(x, dt, A, B, C, bufs, plan, D, z, dt_bias, dt_softplus=dt_softplus,
                        cfg=cfg, interpret=common.interpret_mode())


def _fold_knobs(op, cfg, head_dim, state_dim, block_p, block_n, num_warps, rows, tiles) -> dict:
  """The fold pass's overrides as Mamba2ReplayConfig fields (none on the reconstruct route)."""
  if cfg.fold is None:
    return {}
  common.require_pow2(op, **{k: v for k, v in (("fold_block_p", block_p), ("fold_block_n", block_n))
                             if v is not None})
  fold = cfg.fold.override(block_v=block_p, block_k=block_n, num_warps=num_warps)
  fold = fold.fit(head_dim & -head_dim, state_dim)
  if rows is not None and (not isinstance(rows, int) or rows < 1):
    raise ValueError(f"fold_rows={rows!r}; expected an int >= 1")
  return {"fold": fold, "fold_rows": cfg.fold_rows if rows is None else rows,
          "fold_tiles": cfg.fold_tiles if tiles is None else tiles}


def materialize(bufs: ReplayBuffers, slots, base, length, *, block_p=None, block_n=None,
                num_warps=None, num_stages=None):
  """Exact state of each row (checkpoint ⊕ ``length`` entries from ``base``): f32 [B, H, P, N]."""
  op = "mamba2.materialize[pallas_triton]"
  p, n = bufs.head_dim, bufs.state_dim
  _check_sizes(op, p, n)
  cfg = config_lib.mamba2_materialize_config(device_kind=common.device_kind(), head_dim=p,
                                             state_dim=n)
  cfg = _fit(op, cfg, p, n, block_p=block_p, block_n=block_n, num_warps=num_warps,
             num_stages=num_stages)
  return _materialize(bufs, slots, base, length, cfg=cfg, interpret=common.interpret_mode())
