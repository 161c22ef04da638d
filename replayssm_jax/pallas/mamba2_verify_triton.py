"""Mamba2 speculative-verify kernels in Pallas with the Triton lowering (interpreted on CPU).

Two kernels, each ``kernel → builder → public wrapper`` (the wrappers are what mamba2/ops.py
calls), built from the pieces of pallas/mamba2_triton.py:

* ``replay_verify``: ReplaySSM verify of T ≤ 8 tokens per row (Mamba2 Alg. 4): the step launch, grid
  (P/BP, H/heads, B), then the fold pass over the flushing rows; a step program serves ``heads``
  heads of one group. With S_h = checkpoint ⊕ committed window ``[base, base + count)`` and
  L_i = Σ_{j≤i} Δ_j A over the tokens::

      y_i = e^{L_i} (S_h C_i) + Σ_{j≤i} e^{L_i − L_j} (B_j·C_i) Δx_j           (then D skip, gate)
      S_h C_i = e^G (S_c C_i) + Σ_w w_w (B_w·C_i) Δx_w                        (output-only read)

  S is never built for the outputs: the window products B_w·C_i and the token products B_j·C_i
  are computed once per program and shared by its heads. Every real token i is appended as
  (Δx, B, ΔA) at ring index ``base + count + i``; then the fold pass (pallas/fold_triton.py, as in
  ``mamba2_triton.replay_decode``'s output-only route) folds the window and token 0 only
  (``plan.fold_length()`` entries) of the flushing rows into the checkpoint. With T = 1 this is
  that route, operation for operation.
  Reconstruct route (``route="reconstruct"``, grid (P/BP, H, B)): the checkpoint tile is replayed
  through the window into registers (live entries only), stepped through the tokens like the
  conventional verify, and stored after token 0 on flushing rows.
* ``verify_conventional``: the baseline engines run without ReplaySSM. Grid (P/BP, H, B); a program
  reads its [BP, N] tile of ``stack[slot, read_index]``, steps it through the T tokens and writes
  the tile after token i to ``stack[slot, i]`` in place.

Lanes i ≥ ``lengths[b]`` are padding: zero output and no ring or stack write. Their inputs are
loaded (in bounds) but only ever reach padded lanes' values, which are selected away, so NaN there
cannot leak (lanes are a prefix: real lane i reads lanes j ≤ i only). Padding rows (slot < 0)
output zeros and write nothing. float32 inside, multiply-and-reduce and rank-one FMAs, never
``dot`` (Triton f32 dots are TF32). Shapes: x, z [B, T, H, P]; dt [B, T, H]; A, D, dt_bias [H];
B, C [B, T, G, N]; lengths int32[B]; state [Ns, H, P, N]; ring_x [Ns, H, R, P];
ring_B [Ns, G, R, N]; ring_a [Ns, H, R]; stack [Ns, T_max, H, P, N].
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
from replayssm_jax.pallas import common
from replayssm_jax.pallas import fold_triton
from replayssm_jax.pallas.mamba2_triton import (_check_sizes, _decode_step, _finish, _fit, _pallas,
                                                _step_inputs, _token, _window, fold_flushing_rows,
                                                step_buffers, step_fields, with_step_buffers)
from replayssm_jax.replay import window_offsets

f32 = jnp.float32
MAX_TOKENS = 8  # tokens are unrolled in the kernel body; longer verifies run in XLA


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------

def _store_if(ref, value, cond):
  """``ref[...] = value`` (cast to the ref's dtype) where the scalar ``cond`` holds: a masked store,
  not a branch."""
  plt.store(ref, value.astype(ref.dtype), mask=jnp.broadcast_to(cond, ref.shape))


def _zero_outputs(r, b, h0, heads, tile, block_p, tokens):
  """Padding row: y = 0 on every token of heads h0 .. h0 + heads - 1."""
  for i in range(tokens):
    for k in range(heads):
      r["y_out"][b, i, h0 + k, tile] = jnp.zeros((block_p,), r["y_out"].dtype)


def _verify_kernel(*refs, names, group, heads, block_p, ring_size, tokens, softplus):
  r = dict(zip(names, refs))
  pt, hb, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)
  h0 = hb * heads                       # this program's heads h0 .. h0 + heads - 1, one group
  g = h0 // group

  @pl.when(s < 0)
  def _():
    _zero_outputs(r, b, h0, heads, tile, block_p, tokens)

  @pl.when(s >= 0)
  def _():
    base, count, length = r["base"][b], r["count"][b], r["lengths"][b]
    real = [length > i for i in range(tokens)]                      # token 0 is always real
    put = [(base + count + i) % ring_size for i in range(tokens)]   # token i's ring index
    Bs = [r["B"][b, i, g, :].astype(f32) for i in range(tokens)]
    Cs = [r["C"][b, i, g, :].astype(f32) for i in range(tokens)]
    # Shared by the program's heads: B_w·C_i over the window [R] and B_j·C_i for j ≤ i.
    _, inside = window_offsets((ring_size,), base, count, ring_size)
    rB = common.load_window(r["ring_B"].at[s, g, :, :], inside)    # [R, N]
    rBC = [jnp.sum(rB * C[None, :], axis=1) for C in Cs]
    BC = [[jnp.sum(Bs[j] * Cs[i]) for j in range(i + 1)] for i in range(tokens)]
    for k in range(heads):
      h = h0 + k
      weights, total, inside = _window(r, s, h, base, count, ring_size)
      Sc = r["state"][s, h, tile, :].astype(f32)                    # [BP, N]
      rx = common.load_window(r["ring_x"].at[s, h, :, tile], inside)   # [R, BP]
      dAs, dxs = zip(*(_token(r, (b, i), h, tile, softplus) for i in range(tokens)))
      L = [dAs[0]]                                                  # L_i = Σ_{j≤i} ΔA_j
      for dA in dAs[1:]:
        L.append(L[-1] + dA)
      for i in range(tokens):
        ShC = (jnp.exp(total) * jnp.sum(Sc * Cs[i][None, :], axis=1)
               + jnp.sum((weights * rBC[i])[:, None] * rx, axis=0))
        y = jnp.exp(L[i]) * ShC
        for j in range(i + 1):                                      # causal mask: j ≤ i
          y = y + jnp.exp(L[i] - L[j]) * BC[i][j] * dxs[j]
        y = _finish(r, y, (b, i), h, tile)
        r["y_out"][b, i, h, tile] = jnp.where(real[i], y, jnp.zeros((), y.dtype))
        _store_if(r["ring_x_out"].at[s, h, put[i], tile], dxs[i], real[i])
        # ΔA is per head, not per P tile: one program appends it.
        _store_if(r["ring_a_out"].at[s, h, put[i]], dAs[i], real[i] & (pt == 0))

    for i in range(tokens):  # B is per group: its first program appends it
      _store_if(r["ring_B_out"].at[s, g, put[i], :], Bs[i], real[i] & (pt == 0) & (h0 % group == 0))


def _reconstruct_kernel(*refs, names, group, block_p, ring_size, tokens, softplus):
  """Reconstruct route, grid (P/BP, H, B): the [BP, N] checkpoint tile is brought through the
  committed window by ``S ← e^{ΔA_w} S + Δx_w B_wᵀ`` (a loop over the live entries only), then
  stepped through the tokens like the conventional verify; a flushing row stores the tile after
  token 0 (window + token 0). No [R, BP] reductions and no T×T products."""
  r = dict(zip(names, refs))
  pt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)
  g = h // group

  @pl.when(s < 0)
  def _():
    _zero_outputs(r, b, h, 1, tile, block_p, tokens)

  @pl.when(s >= 0)
  def _():
    base, count, length = r["base"][b], r["count"][b], r["lengths"][b]

    def replay(w, S):
      at = (base + w) % ring_size
      dx = r["ring_x"][s, h, at, tile].astype(f32)
      Bw = r["ring_B"][s, g, at, :].astype(f32)
      return jnp.exp(r["ring_a"][s, h, at].astype(f32)) * S + dx[:, None] * Bw[None, :]

    S = lax.fori_loop(0, count, replay, r["state"][s, h, tile, :].astype(f32))    # [BP, N]
    for i in range(tokens):
      # Padded lanes form a suffix: what they compute (NaN inputs included) reaches only their
      # own outputs, which are selected away, and no store.
      real, put = length > i, (base + count + i) % ring_size
      dA, dx = _token(r, (b, i), h, tile, softplus)
      S, y = _decode_step(r, (b, i), g, S, dA, dx)
      y = _finish(r, y, (b, i), h, tile)
      r["y_out"][b, i, h, tile] = jnp.where(real, y, jnp.zeros((), y.dtype))
      if i == 0:
        @pl.when(r["flush"][b] != 0)   # checkpoint ← window + token 0; drafts are never folded
        def _():
          r["state_out"][s, h, tile, :] = S.astype(r["state_out"].dtype)
          if "read_copy_out" in r:
            r["read_copy_out"][s, h, tile, :] = S.astype(r["read_copy_out"].dtype)
      _store_if(r["ring_x_out"].at[s, h, put, tile], dx, real)
      _store_if(r["ring_a_out"].at[s, h, put], dA, real & (pt == 0))
      _store_if(r["ring_B_out"].at[s, g, put, :], r["B"][b, i, g, :].astype(f32),
                real & (pt == 0) & (h % group == 0))


def _conventional_kernel(*refs, names, group, block_p, tokens, softplus):
  r = dict(zip(names, refs))
  pt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = r["slots"][b]
  tile = pl.ds(pt * block_p, block_p)

  @pl.when(s < 0)
  def _():
    _zero_outputs(r, b, h, 1, tile, block_p, tokens)

  @pl.when(s >= 0)
  def _():
    length = r["lengths"][b]
    S = r["stack"][s, r["read_index"][b], h, tile, :].astype(f32)   # [BP, N], read before writes
    for i in range(tokens):
      dA, dx = _token(r, (b, i), h, tile, softplus)
      S, y = _decode_step(r, (b, i), h // group, S, dA, dx)
      y = _finish(r, y, (b, i), h, tile)
      r["y_out"][b, i, h, tile] = jnp.where(length > i, y, jnp.zeros((), y.dtype))
      # An array index: interpret mode cannot discharge a Python int in a masked store.
      _store_if(r["stack_out"].at[s, jnp.int32(i), h, tile, :], S, length > i)


# ----------------------------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _replay_verify(x, dt, A, B, C, bufs, plan, lengths, D, z, dt_bias, *, dt_softplus, cfg,
                   interpret):
  batch, t, h, p = x.shape
  step = cfg.step
  if cfg.route == "reconstruct":
    kernel = functools.partial(_reconstruct_kernel, group=h // bufs.num_groups, block_p=step.block_p,
                               ring_size=bufs.ring_size, tokens=t, softplus=dt_softplus)
    grid = (p // step.block_p, h, batch)
  else:
    kernel = functools.partial(_verify_kernel, group=h // bufs.num_groups, heads=step.heads,
                               block_p=step.block_p, ring_size=bufs.ring_size, tokens=t,
                               softplus=dt_softplus)
    grid = (p // step.block_p, h // step.heads, batch)
  fields = step_fields(bufs, verify=True, route=cfg.route)
  buffers = step_buffers(bufs, fields)
  out = _pallas(kernel,
                {"slots": plan.slots, "base": plan.base, "count": plan.count,
                 "flush": plan.flush.astype(jnp.int32), "lengths": lengths,
                 **_step_inputs(x, dt, A, B, C, D, z, dt_bias), **buffers},
                {"y_out": x, **{k + "_out": v for k, v in buffers.items()}},
                {k: k + "_out" for k in buffers},
                grid=grid, cfg=step, name=f"replayssm_mamba2_replay_verify_{cfg.route}",
                interpret=interpret)
  # Output-only: flushing rows fold window + token 0 (drafts are never folded) in the fold pass.
  return out["y_out"], fold_flushing_rows(with_step_buffers(bufs, out, fields), plan, cfg=cfg,
                                          interpret=interpret)


@functools.partial(jax.jit, static_argnames=("dt_softplus", "cfg", "interpret"))
def _verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths, D, z, dt_bias, *,
                         dt_softplus, cfg, interpret):
  batch, t, h, p = x.shape
  kernel = functools.partial(_conventional_kernel, group=h // B.shape[2], block_p=cfg.block_p,
                             tokens=t, softplus=dt_softplus)
  out = _pallas(kernel,
                {"slots": slots, "read_index": read_index, "lengths": lengths,
                 **_step_inputs(x, dt, A, B, C, D, z, dt_bias), "stack": stack},
                {"y_out": x, "stack_out": stack}, {"stack": "stack_out"},
                grid=(p // cfg.block_p, h, batch), cfg=cfg,
                name="replayssm_mamba2_verify_conventional", interpret=interpret)
  return out["y_out"], out["stack_out"]


# ----------------------------------------------------------------------------------------------
# Public wrappers (called from mamba2/ops.py; inputs already validated there).
# ----------------------------------------------------------------------------------------------

def _check_tokens(op, t):
  if t > MAX_TOKENS:
    raise NotImplementedError(f"{op}: T={t} tokens per row; this kernel unrolls at most "
                              f"{MAX_TOKENS} (use implementation='xla', or None to fall back "
                              f"automatically)")


def verify_cfg(op, bufs: ReplayBuffers, plan: ReplayPlan, batch, *, route=None, block_p=None,
               block_n=None, heads=None, num_warps=None,
               num_stages=None) -> config_lib.Mamba2ReplayConfig:
  """The config's Mamba2ReplayConfig for this shape with the keyword overrides applied."""
  _check_tokens(op, plan.num_tokens)
  h, p, n, g = bufs.num_heads, bufs.head_dim, bufs.state_dim, bufs.num_groups
  _check_sizes(op, p, n)
  cfg = config_lib.mamba2_verify_config(
      device_kind=common.device_kind(), state_dtype=bufs.state.dtype, head_dim=p, state_dim=n,
      num_heads=h, num_groups=g, batch=batch, buffer_len=plan.buffer_len,
      ring_size=bufs.ring_size, num_tokens=plan.num_tokens, route=route)
  step = _fit(op, cfg.step, p, n, h // g, block_p=block_p, block_n=block_n, heads=heads,
              num_warps=num_warps, num_stages=num_stages)
  fold = {} if cfg.fold is None else {"fold": cfg.fold.override(block_k=block_n).fit(p & -p, n)}
  return dataclasses.replace(cfg, step=step, **fold)


def replay_verify(x, dt, A, B, C, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, D, z, dt_bias,
                  dt_softplus, route=None, block_p=None, block_n=None, heads=None, num_warps=None,
                  num_stages=None):
  """ReplaySSM Mamba2 verify of T = ``plan.num_tokens`` tokens per row.

  Args:
    x: [B, T, H, P]; dt: [B, T, H]; A: [H]; B, C: [B, T, G, N]; D, dt_bias: [H] or None;
      z: [B, T, H, P] or None; dt_softplus: bool.
    bufs: mamba2.ReplayBuffers (aliased in place); plan: ReplayPlan with num_tokens = T.
    lengths: int32[B] real tokens per row in [1, T].
    route: None (the config's), "output_only" or "reconstruct" (the window replayed into the
      tile; one head per program). A read copy is not read: verify reads the float32
      checkpoint and writes the copy wherever it writes the checkpoint.
    block_p (P rows per program), heads (heads per program), num_warps, num_stages: the step's
      config overrides; block_n: the N tile of the output-only route's fold pass.

  Returns:
    (y [B, T, H, P] in x's dtype, bufs).
  """
  op = "mamba2.replay_verify[pallas_triton]"
  cfg = verify_cfg(op, bufs, plan, x.shape[0], route=route, block_p=block_p, block_n=block_n,
                   heads=heads, num_warps=num_warps, num_stages=num_stages)
  return _replay_verify(x, dt, A, B, C, bufs, plan, lengths, D, z, dt_bias, dt_softplus=dt_softplus,
                        cfg=cfg, interpret=common.interpret_mode())


def verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths, *, D, z, dt_bias,
                        dt_softplus, block_p=None, num_warps=None, num_stages=None):
  """Conventional Mamba2 verify: state ``stack[slot, read_index]`` stepped through T tokens, the
  state after token i written to ``stack[slot, i]`` (real lanes only).

  Args:
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, lengths: as in ``replay_verify``.
    stack: [Ns, T_max, H, P, N] (aliased in place); slots, read_index: int32[B].
    block_p, num_warps, num_stages: config overrides.

  Returns:
    (y [B, T, H, P] in x's dtype, stack).
  """
  op = "mamba2.verify_conventional[pallas_triton]"
  t = x.shape[1]
  _check_tokens(op, t)
  p, n = stack.shape[3:]
  _check_sizes(op, p, n)
  cfg = config_lib.mamba2_verify_conventional_config(
      device_kind=common.device_kind(), state_dtype=stack.dtype, head_dim=p, state_dim=n,
      batch=x.shape[0], num_tokens=t)
  cfg = _fit(op, cfg, p, n, block_p=block_p, num_warps=num_warps, num_stages=num_stages)
  return _verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths, D, z, dt_bias,
                              dt_softplus=dt_softplus, cfg=cfg, interpret=common.interpret_mode())
