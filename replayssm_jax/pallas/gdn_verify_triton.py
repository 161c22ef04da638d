"""Gated DeltaNet speculative verify kernels in Pallas with the Triton lowering (interpreted on CPU).

Two ops, each ``kernel → builder → public wrapper`` (the wrappers are what gdn/ops.py calls):

* ``replay_verify``: T = ``plan.num_tokens`` tokens per row (token 0 emitted, 1..T-1 drafts).
  (a) the verify step kernel, grid (V/BV, Hk, B) like the replay step: one program serves the
      r = Hv/Hk value heads of a key head, so q, k and the key ring are loaded once. It reads the
      checkpoint tile once and reads the state after the committed window at the 2T vectors
      x ∈ {k_i, q_i} without building it (output-only): ``S_h x = e^G (S_c x) + Σ_j w_j (k_j·x) u_j``.
      The drafts then follow GDN Alg. 8 per V row (u is per V row, so each V tile solves its own
      rows). With G_i = Σ_{i'≤i} g_{i'}, the state before token i is
      ``S_{i-1} = e^{G_{i-1}} S_h + Σ_{j<i} e^{G_{i-1}-G_j} u_j k_jᵀ``, so
          u_i = β_i (v_i − α_i S_{i-1} k_i)
              = β_i (v_i − e^{G_i} (S_h k_i)) − β_i Σ_{j<i} e^{G_i−G_j} (k_i·k_j) u_j,
      a unit lower-triangular T×T system solved by forward substitution (T ≤ 8: unrolled), and
          o_i = S_i q_i = e^{G_i} (S_h q_i) + Σ_{j≤i} e^{G_i−G_j} (k_j·q_i) u_j.
      Every real token is appended at ``plan.write_index(i)`` as (k_i, u_i, g_i).
      Split route (``split=True``): a readout launch, grid (V/BV, Hv, B), shaped like the conventional
      decode, first writes the 2T readouts S_c·k_i, S_c·q_i as float32 [B, Hv, 2T, V]; the step
      kernel then reads them instead of the checkpoint tile (no state tile live next to the solve).
      Reconstruct route (``route="reconstruct"``, one launch, grid (V/BV, Hv, B)): the checkpoint
      tile is replayed through the committed window into registers (``S ← e^{g_j} S + u_j k_jᵀ``,
      live entries only), then stepped through the tokens by the delta rule; flushing rows store
      the tile after token 0, so no fold pass follows. Trades the output-only route's T² and
      [R, BV] reductions for ``count`` rank-one FMAs on the tile.
  (b) the replay fold pass (``gdn_triton.fold_flushing_rows``): flushing rows fold the committed
      window plus token 0 (``plan.fold_length()`` entries, token 0 just appended) — never drafts.
      Why a second launch and not a branch in (a): the pass runs on the flushing rows only (compacted;
      its grid is sized for them, it never walks the batch), and on the H200 a flush branch compiled
      into the step kernel cost every row ~20 % (notes/pallas-gpu.md "Calibration"); the fold is
      also the proven exact f32 kernel of ``replay_decode``. With T = 1 the buffers equal
      ``replay_decode``'s bitwise and the outputs to f32 rounding (XLA may contract a product into
      an FMA differently).
* ``verify_conventional``: the baseline engines run without ReplaySSM. Grid (V/BV, Hv, B); a program
  reads the [BV, K] tile of ``stack[slot, read_index]``, steps it through the T tokens in registers
  and writes the state after token i to ``stack[slot, i]`` (all reads precede the writes).

``lengths[b]`` real tokens per row: lanes past it are padding — inputs never read (masked loads;
scalars selected away, so NaN cannot leak), zero output, no ring or stack write. Padding rows
(slot < 0) output zeros and write nothing. Exact float32 throughout: matrix-vector products are
multiply-and-reduce, never a (TF32) dot. Only the ``fold="u"`` ring layout is supported.
Shapes: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; lengths int32[B];
state [N, Hv, V, K]; ring_k [N, Hk, R, K]; ring_u [N, Hv, R, V]; ring_g [N, Hv, R];
stack [N, T_max, Hv, V, K]; o [B, T, Hv, V].
"""
import functools
import itertools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import config as config_lib
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.gdn.buffers import ReplayBuffers
from replayssm_jax.pallas import common
from replayssm_jax.pallas import gdn_triton
from replayssm_jax.replay import window_decays, window_offsets

f32 = jnp.float32
_sum_chunks = gdn_triton._sum_chunks
_scalar = gdn_triton._scalar


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------

def _readout_kernel(slots_ref, lengths_ref, q_ref, k_ref, state_ref, readout_ref,
                    *, scale, group, block_v, num_tokens):
  """readout[b, h, i] = S_c k_i and readout[b, h, T + i] = S_c q_i for one [BV, K] checkpoint tile:
  the split route's bytes-bound half (reductions only, shaped like the conventional decode)."""
  vt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)

  @pl.when(s >= 0)  # padding rows: nothing written (the step kernel never reads them)
  def _():
    hk, n = h // group, lengths_ref[b]
    S = state_ref[s, h, tile, :].astype(f32)                       # [BV, K]
    for i in range(num_tokens):
      live, at = n > i, jnp.int32(i)
      k = common.load_entry(k_ref.at[b, at, hk, :], live).astype(f32)
      q = common.load_entry(q_ref.at[b, at, hk, :], live).astype(f32) * scale
      readout_ref[b, h, i, tile] = jnp.sum(S * k[None, :], axis=1)
      readout_ref[b, h, num_tokens + i, tile] = jnp.sum(S * q[None, :], axis=1)


def _verify_step_kernel(slots_ref, base_ref, count_ref, lengths_ref, q_ref, k_ref, v_ref, g_ref,
                        beta_ref, source_ref, ring_k_ref, ring_u_ref, ring_g_ref,
                        o_ref, ring_k_out, ring_u_out, ring_g_out,
                        *, scale, group, block_v, block_k, ring_size, num_tokens, split):
  """``source_ref``: the checkpoint [N, Hv, V, K] (fused), or the readouts [B, Hv, 2T, V] of
  ``_readout_kernel`` (split)."""
  vt, hk, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  chunks = [pl.ds(c * block_k, block_k) for c in range(k_ref.shape[-1] // block_k)]
  tokens = range(num_tokens)

  @pl.when(s < 0)
  def _():
    for i in tokens:
      for r in range(group):
        o_ref[b, i, hk * group + r, tile] = jnp.zeros((block_v,), o_ref.dtype)

  @pl.when(s >= 0)
  def _():
    base, count, n = base_ref[b], count_ref[b], lengths_ref[b]
    lane = [n > i for i in tokens]                                  # real tokens of the row
    put = [(base + count + i) % ring_size for i in tokens]          # token i's ring index
    at = [jnp.int32(i) for i in tokens]  # array indices: interpret mode cannot discharge a Python int in a masked load
    ks = [[common.load_entry(k_ref.at[b, at[i], hk, c], lane[i]).astype(f32) for c in chunks]
          for i in tokens]
    qs = [[common.load_entry(q_ref.at[b, at[i], hk, c], lane[i]).astype(f32) * scale for c in chunks]
          for i in tokens]
    dot = lambda x, y: _sum_chunks(jnp.sum(xc * yc) for xc, yc in zip(x, y))
    kk = {(i, j): dot(ks[i], ks[j]) for i in tokens for j in range(i)}       # k_i·k_j, j < i
    qk = {(i, j): dot(ks[j], qs[i]) for i in tokens for j in range(i + 1)}   # k_j·q_i, j ≤ i
    _, inside = window_offsets((ring_size,), base, count, ring_size)
    # Key ring read once per key head: (k_j·k_i) and (k_j·q_i) serve all r value heads.
    rk = [common.load_window(ring_k_ref.at[s, hk, :, c], inside) for c in chunks]   # [R, block_k]
    rkk = [_sum_chunks(jnp.sum(r * kc[None, :], axis=1) for r, kc in zip(rk, ks[i])) for i in tokens]
    rkq = [_sum_chunks(jnp.sum(r * qc[None, :], axis=1) for r, qc in zip(rk, qs[i])) for i in tokens]
    heads_g = []
    for r in range(group):
      h = hk * group + r
      rg = plt.load(ring_g_ref.at[s, h, :], mask=inside, other=jnp.zeros((), f32))
      w, total = window_decays(rg, base, count, ring_size)
      decay = jnp.exp(total)
      if split:
        Sck = [source_ref[b, h, i, tile] for i in tokens]
        Scq = [source_ref[b, h, num_tokens + i, tile] for i in tokens]
      else:
        # S_c x for the 2T vectors, one pass over the checkpoint tile.
        Sck, Scq = [0.0] * num_tokens, [0.0] * num_tokens
        for ci, c in enumerate(chunks):
          Sc = source_ref[s, h, tile, c].astype(f32)               # [BV, block_k]
          for i in tokens:
            Sck[i] = Sck[i] + jnp.sum(Sc * ks[i][ci][None, :], axis=1)
            Scq[i] = Scq[i] + jnp.sum(Sc * qs[i][ci][None, :], axis=1)
      ru = common.load_window(ring_u_ref.at[s, h, :, tile], inside)   # [R, BV]
      Sk = [decay * Sck[i] + jnp.sum((w * rkk[i])[:, None] * ru, axis=0) for i in tokens]
      Sq = [decay * Scq[i] + jnp.sum((w * rkq[i])[:, None] * ru, axis=0) for i in tokens]
      g = [_scalar(g_ref, (b, i, h), lane[i]) for i in tokens]
      beta = [_scalar(beta_ref, (b, i, h), lane[i]) for i in tokens]
      G = list(itertools.accumulate(g))                            # G_i = g_0 + … + g_i
      u = []
      for i in tokens:
        # Forward substitution: u_i = β_i (v_i − e^{G_i} S_h k_i − Σ_{j<i} e^{G_i−G_j} (k_i·k_j) u_j).
        x = common.load_entry(v_ref.at[b, at[i], h, tile], lane[i]).astype(f32) - jnp.exp(G[i]) * Sk[i]
        for j in range(i):
          x = x - (jnp.exp(G[i] - G[j]) * kk[i, j]) * u[j]
        u.append(beta[i] * x)
      for i in tokens:
        # o_i = e^{G_i} S_h q_i + (k_i·q_i) u_i + Σ_{j<i} e^{G_i−G_j} (k_j·q_i) u_j
        o = jnp.exp(G[i]) * Sq[i] + u[i] * qk[i, i]
        for j in range(i):
          o = o + (jnp.exp(G[i] - G[j]) * qk[i, j]) * u[j]
        o_ref[b, i, h, tile] = jnp.where(lane[i], o, 0.0).astype(o_ref.dtype)

        @pl.when(lane[i])
        def _():
          ring_u_out[s, h, put[i], tile] = u[i].astype(ring_u_out.dtype)
      heads_g.append(g)

    for i in tokens:
      @pl.when((vt == 0) & lane[i])  # k and g are per head, not per V tile: one program appends
      def _():
        for c, kc in zip(chunks, ks[i]):
          ring_k_out[s, hk, put[i], c] = kc.astype(ring_k_out.dtype)
        for r, g in enumerate(heads_g):
          ring_g_out[s, hk * group + r, put[i]] = g[i]


def _conventional_kernel(slots_ref, read_ref, lengths_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                         stack_ref, o_ref, stack_out, *, scale, group, block_v, num_tokens):
  vt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  pl.when(s < 0)(lambda: gdn_triton.zero_tokens(o_ref, b, h, tile, num_tokens))

  @pl.when(s >= 0)
  def _():
    hk, n = h // group, lengths_ref[b]
    S = stack_ref[s, read_ref[b], h, tile, :].astype(f32)          # [BV, K], read before any write
    for i in range(num_tokens):
      live, at = n > i, jnp.int32(i)  # an array index for the masked loads (interpret mode)
      k = common.load_entry(k_ref.at[b, at, hk, :], live).astype(f32)
      q = common.load_entry(q_ref.at[b, at, hk, :], live).astype(f32) * scale
      v = common.load_entry(v_ref.at[b, at, h, tile], live).astype(f32)
      alpha = jnp.exp(_scalar(g_ref, (b, i, h), live))
      u = _scalar(beta_ref, (b, i, h), live) * (v - alpha * jnp.sum(S * k[None, :], axis=1))
      S = alpha * S + u[:, None] * k[None, :]                        # padded lane: S unchanged
      o_ref[b, i, h, tile] = jnp.where(live, jnp.sum(S * q[None, :], axis=1), 0.0).astype(o_ref.dtype)

      @pl.when(live)
      def _():
        stack_out[s, i, h, tile, :] = S.astype(stack_out.dtype)


# ----------------------------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------------------------

def _readout(q, k, state, slots, lengths, *, scale, cfg, interpret):
  """The split route's readout launch: float32 [B, Hv, 2T, V] (S_c·k_i, then S_c·q_i)."""
  batch, t, hk = q.shape[:3]
  _, hv, vd, _ = state.shape
  kernel = functools.partial(_readout_kernel, scale=scale, group=hv // hk, block_v=cfg.block_v,
                             num_tokens=t)
  (readout,) = gdn_triton._pallas(
      kernel, (slots, lengths, q, k, state), grid=(vd // cfg.block_v, hv, batch),
      out_shape=[jax.ShapeDtypeStruct((batch, hv, 2 * t, vd), jnp.float32)], aliases={}, cfg=cfg,
      name="replayssm_gdn_verify_readout", interpret=interpret)
  return readout


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _replay_verify(q, k, v, g, beta, bufs, plan, lengths, *, scale, cfg, interpret):
  batch, t, hk = q.shape[:3]
  hv, vd = bufs.num_v_heads, bufs.head_v_dim
  step = cfg.step
  if cfg.route == "reconstruct":
    return gdn_triton.reconstruct(q, k, v, g, beta, bufs, plan, lengths, scale=scale, cfg=step,
                                  interpret=interpret)
  source = _readout(q, k, bufs.state, plan.slots, lengths, scale=scale, cfg=cfg.readout,
                    interpret=interpret) if cfg.split else bufs.state
  kernel = functools.partial(_verify_step_kernel, scale=scale, group=hv // hk, block_v=step.block_v,
                             block_k=step.block_k, ring_size=bufs.ring_size, num_tokens=t,
                             split=cfg.split)
  o, ring_k, ring_u, ring_g = gdn_triton._pallas(
      kernel, (plan.slots, plan.base, plan.count, lengths, q, k, v, g, beta,
               source, bufs.ring_k, bufs.ring_u, bufs.ring_g),
      grid=(vd // step.block_v, hk, batch),
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)]
      + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (bufs.ring_k, bufs.ring_u, bufs.ring_g)],
      aliases={10: 1, 11: 2, 12: 3}, cfg=step, name="replayssm_gdn_verify_step", interpret=interpret)
  bufs = bufs.replace(ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)
  return o, gdn_triton.fold_flushing_rows(bufs, plan, cfg=cfg, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths, *, scale, cfg,
                         interpret):
  batch, t, hv, vd = v.shape
  kernel = functools.partial(_conventional_kernel, scale=scale, group=hv // q.shape[2],
                             block_v=cfg.block_v, num_tokens=t)
  return gdn_triton._pallas(
      kernel, (slots, read_index, lengths, q, k, v, g, beta, stack),
      grid=(vd // cfg.block_v, hv, batch),
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(stack.shape, stack.dtype)],
      aliases={8: 1}, cfg=cfg, name="replayssm_gdn_verify_conventional", interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Public wrappers (called from gdn/ops.py; inputs already validated there).
# ----------------------------------------------------------------------------------------------

def verify_cfg(op, bufs: ReplayBuffers, plan: ReplayPlan, batch, *, route=None, split=None, block_v=None,
               block_k=None, num_warps=None, num_stages=None, readout_block_v=None,
               readout_num_warps=None, fold_block_v=None, fold_block_k=None, fold_num_warps=None,
               fold_rows=None) -> config_lib.VerifyConfig:
  """The config's VerifyConfig for this shape with the keyword overrides applied."""
  common.require_pow2(op, K=bufs.head_k_dim, V=bufs.head_v_dim, R=bufs.ring_size)
  if route is not None and route not in config_lib.ROUTES:
    raise ValueError(f"route={route!r}; expected None or one of {config_lib.ROUTES}")
  kd, vd = bufs.head_k_dim, bufs.head_v_dim
  cfg = config_lib.verify_config(
      device_kind=common.device_kind(), state_dtype=bufs.state.dtype, head_k_dim=kd, head_v_dim=vd,
      num_k_heads=bufs.num_k_heads, batch=batch, buffer_len=plan.buffer_len,
      ring_size=bufs.ring_size, num_tokens=plan.num_tokens, route=route)
  step = gdn_triton._knobs(op, cfg.step, vd, kd, block_v=block_v, block_k=block_k,
                           num_warps=num_warps, num_stages=num_stages)
  readout = gdn_triton._knobs(op, cfg.readout, vd, None, block_v=readout_block_v,
                              num_warps=readout_num_warps)
  fold = gdn_triton._knobs(op, cfg.fold, vd, kd, block_v=fold_block_v, block_k=fold_block_k,
                           num_warps=fold_num_warps)
  return config_lib.VerifyConfig(step=step, readout=readout,
                                 split=cfg.split if split is None else bool(split), fold=fold,
                                 fold_rows=cfg.fold_rows if fold_rows is None else int(fold_rows),
                                 route=cfg.route)


def replay_verify(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, lengths, *, scale,
                  **knobs):
  """ReplaySSM GDN verify (T = plan.num_tokens tokens per row): [readout launch,] step kernel, then
  the fold pass.

  ``lengths`` int32[B] real tokens per row in [1, T]. Keyword knobs (``verify_cfg``): ``route``
  (None: the config's; "output_only" or "reconstruct", one launch), ``split`` (None: the
  config's) computes the output-only route's checkpoint readouts in their own launch; ``block_v``,
  ``block_k``, ``num_warps``, ``num_stages`` (step), ``readout_block_v``, ``readout_num_warps``,
  ``fold_block_v``, ``fold_block_k``, ``fold_num_warps``, ``fold_rows`` override the configs like
  ``gdn_triton.replay_decode``'s. A read copy (``bufs.read_copy``) is not read: the verify reads
  the float32 checkpoint and writes the copy wherever it writes the checkpoint.
  Returns (o [B, T, Hv, V] in v.dtype, bufs).
  """
  op = "gdn.replay_verify[pallas_triton]"
  if bufs.fold != "u":
    raise NotImplementedError(f"{op}: buffers with fold={bufs.fold!r}; only fold='u' is supported")
  cfg = verify_cfg(op, bufs, plan, q.shape[0], **knobs)
  return _replay_verify(q, k, v, g, beta, bufs, plan, lengths, scale=float(scale), cfg=cfg,
                        interpret=common.interpret_mode())


def verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths, *, scale,
                        block_v=None, num_warps=None, num_stages=None):
  """Conventional speculative verify over a state stack [N, T_max, Hv, V, K].

  Returns (o [B, T, Hv, V] in v.dtype, stack).
  """
  op = "gdn.verify_conventional[pallas_triton]"
  _, _, hv, vd, kd = stack.shape
  common.require_pow2(op, K=kd, V=vd)
  cfg = config_lib.verify_conventional_config(device_kind=common.device_kind(), state_dtype=stack.dtype,
                                              head_k_dim=kd, head_v_dim=vd, batch=q.shape[0])
  cfg = gdn_triton._knobs(op, cfg, vd, kd, block_v=block_v, num_warps=num_warps,
                          num_stages=num_stages)
  return _verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths,
                              scale=float(scale), cfg=cfg, interpret=common.interpret_mode())
