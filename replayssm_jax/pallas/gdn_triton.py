"""Gated DeltaNet decode kernels in Pallas with the Triton lowering (interpreted on CPU).

Kernels, each ``kernel → builder → public wrapper`` (the wrappers are what gdn/ops.py calls):

* ``decode``: the conventional step. Grid (B, Hv, V/BV); a program reads the [BV, K] state tile
  of its row's slot, steps it once and writes it back in place.
* ``replay_decode``: two passes over the batch.
  (a) the step kernel, identical on every live row (no flush branch): grid (B, Hk, V/BV); one
      program serves the r = Hv/Hk value heads of a key head, so q, k and the key ring are loaded
      once. It reads the checkpoint tile, replays the window ``[base, base + count)`` of the ring,
      writes o and appends (k, u, g) at ring index ``base + count``.
  (b) the fold pass (pallas/fold_triton.py, shared with Mamba2): the flushing rows, compacted,
      fold window plus the token (a) just appended, ``S = e^G S_c + Σ_j w_j u_j k_jᵀ``, into the
      checkpoint.
  With ``plan.flush_all`` (every live row flushes: the small-batch policy) one fold-and-step
  kernel, grid (V/BV, Hv, B), replaces both passes: the conventional decode plus the window fold.
  Route ``reconstruct``: one launch, grid (V/BV, Hv, B), shared with ``replay_verify``
  (``reconstruct``, T tokens): the checkpoint tile is replayed through the window into registers
  (``S ← e^{g_j} S + u_j k_jᵀ`` over the live entries), stepped by the delta rule, and stored on
  flushing rows after token 0, so no fold pass follows.
* ``materialize``: the fold kernel again, writing every row's state to a fresh f32 output.

Everything is float32 inside and matrix-vector products are multiply-and-reduce, never ``dot``
(Triton f32 dots are TF32), so CPU interpret mode and the GPU agree to f32 rounding. Ring entries
outside a window may be stale or NaN: they are masked away at load time, never multiplied by 0.
Padding rows (slot < 0) produce zero output and touch neither checkpoint nor ring.
Shapes: q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv]; state [N, Hv, V, K];
ring_k [N, Hk, R, K]; ring_u [N, Hv, R, V]; ring_g [N, Hv, R].
"""
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from replayssm_jax import config as config_lib
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.gdn.buffers import ReplayBuffers
from replayssm_jax.pallas import common, fold_triton
from replayssm_jax.replay import window_decays, window_offsets

f32 = jnp.float32
ROUTES = ("auto", "output_only", "reconstruct")


# ----------------------------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------------------------

def _decode_kernel(slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref,
                   o_ref, pool_out_ref, *, scale, group, block_v):
  vt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)

  @pl.when(s < 0)
  def _():
    o_ref[b, h, tile] = jnp.zeros((block_v,), o_ref.dtype)

  @pl.when(s >= 0)
  def _():
    hk = h // group
    S = pool_ref[s, h, tile, :].astype(f32)                       # [BV, K]
    S, o, _ = _delta_rule_step(S, k_ref[b, hk, :], q_ref[b, hk, :], v_ref[b, h, tile],
                               g_ref[b, h], beta_ref[b, h], scale)
    o_ref[b, h, tile] = o.astype(o_ref.dtype)
    pool_out_ref[s, h, tile, :] = S.astype(pool_out_ref.dtype)


def zero_tokens(o_ref, b, h, tile, num_tokens):
  """A padding row's outputs o[b, i, h, tile] = 0 for its T tokens."""
  for i in range(num_tokens):
    o_ref[b, i, h, tile] = jnp.zeros((tile.size,), o_ref.dtype)


def _scalar(ref, idx, live):
  """A per-token scalar (g or β) as float32; 0 on a padded lane (a select: NaN cannot leak)."""
  return jnp.where(live, ref[idx].astype(f32), 0.0)


def _delta_rule_step(S, k, q, v, g, beta, scale):
  """One gated delta-rule step of a [BV, K] state tile in f32: u = β (v − α S k),
  S' = α S + u kᵀ, o = S' (scale·q). Returns (S', o, u)."""
  k = k.astype(f32)
  alpha = jnp.exp(g.astype(f32))
  u = beta.astype(f32) * (v.astype(f32) - alpha * jnp.sum(S * k[None, :], axis=1))
  S = alpha * S + u[:, None] * k[None, :]
  return S, jnp.sum(S * (q.astype(f32) * scale)[None, :], axis=1), u


def _flush_decode_kernel(slots_ref, base_ref, count_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                         state_ref, ring_k_ref, ring_u_ref, ring_g_ref, o_ref, state_out,
                         *, scale, group, block_v, ring_size):
  """Every live row flushes (``plan.flush_all``): fold the window into the [BV, K] checkpoint tile,
  step it with token 0 and write it back. After one such step every window is empty (the commit
  moves base past token 0, which is therefore never appended to the ring), so the steady state is
  the conventional decode's pass; only a row that arrives with a window runs the fold branch."""
  vt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  hk, base, count = h // group, base_ref[b], count_ref[b]

  def step_and_write(S):
    S, o, _ = _delta_rule_step(S, k_ref[b, hk, :], q_ref[b, hk, :], v_ref[b, h, tile],
                               g_ref[b, h], beta_ref[b, h], scale)
    o_ref[b, h, tile] = o.astype(o_ref.dtype)
    state_out[s, h, tile, :] = S.astype(state_out.dtype)

  @pl.when(s < 0)
  def _():
    o_ref[b, h, tile] = jnp.zeros((block_v,), o_ref.dtype)

  @pl.when((s >= 0) & (count == 0))
  def _():
    step_and_write(state_ref[s, h, tile, :].astype(f32))

  @pl.when((s >= 0) & (count > 0))
  def _():
    _, inside = window_offsets((ring_size,), base, count, ring_size)
    rg = plt.load(ring_g_ref.at[s, h, :], mask=inside, other=jnp.zeros((), f32))
    w, total = window_decays(rg, base, count, ring_size)
    step_and_write(fold_triton.accumulate_window(
        jnp.exp(total) * state_ref[s, h, tile, :].astype(f32), w, inside,
        lambda rows: ring_k_ref.at[s, hk, rows, :], lambda rows: ring_u_ref.at[s, h, rows, tile],
        ring_size))


def _reconstruct_kernel(slots_ref, base_ref, count_ref, flush_ref, lengths_ref, q_ref, k_ref, v_ref,
                        g_ref, beta_ref, state_ref, ring_k_ref, ring_u_ref, ring_g_ref, *refs,
                        scale, group, block_v, ring_size, num_tokens):
  """Reconstruct route of ``replay_decode`` (T = 1) and ``replay_verify``, grid (V/BV, Hv, B): one
  launch for the whole step. Inputs are [B, T, ...] as in verify.

  The [BV, K] checkpoint tile is brought through the committed window by the recurrence
  ``S ← e^{g_j} S + u_j k_jᵀ`` (the ring holds corrected values u, so the window needs no delta
  rule: ``count`` rank-one FMAs, a loop over the live entries only), then stepped through the T
  tokens by the delta rule, writing o_i and appending (k_i, u_i, g_i). A flushing row stores the
  tile after token 0 (window + token 0: the fold, without a second pass over the batch), and its
  rounding into the read copy when the buffers have one (``refs``: [read_copy_ref,] o_ref,
  state_out, ring outputs[, copy_out]). No reductions beyond the 2T of the delta rule itself.
  """
  with_copy = len(refs) == 7
  if with_copy:
    _, o_ref, state_out, ring_k_out, ring_u_out, ring_g_out, copy_out = refs
  else:
    o_ref, state_out, ring_k_out, ring_u_out, ring_g_out = refs
  vt, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  pl.when(s < 0)(lambda: zero_tokens(o_ref, b, h, tile, num_tokens))

  @pl.when(s >= 0)
  def _():
    hk, base, count, n = h // group, base_ref[b], count_ref[b], lengths_ref[b]

    def replay(j, S):
      at = (base + j) % ring_size
      u = ring_u_ref[s, h, at, tile].astype(f32)
      kj = ring_k_ref[s, hk, at, :].astype(f32)
      return jnp.exp(ring_g_ref[s, h, at].astype(f32)) * S + u[:, None] * kj[None, :]

    S = lax.fori_loop(0, count, replay, state_ref[s, h, tile, :].astype(f32))     # [BV, K]
    for i in range(num_tokens):
      live, at = n > i, jnp.int32(i)   # an array index for the masked loads (interpret mode)
      put = (base + count + i) % ring_size
      k = common.load_entry(k_ref.at[b, at, hk, :], live).astype(f32)
      g = _scalar(g_ref, (b, i, h), live)      # padded lane: g = β = 0, so S is unchanged
      S, o, u = _delta_rule_step(
          S, k, common.load_entry(q_ref.at[b, at, hk, :], live),
          common.load_entry(v_ref.at[b, at, h, tile], live), g, _scalar(beta_ref, (b, i, h), live),
          scale)
      o_ref[b, i, h, tile] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
      if i == 0:
        @pl.when(flush_ref[b] != 0)
        def _():
          state_out[s, h, tile, :] = S.astype(state_out.dtype)
          if with_copy:
            copy_out[s, h, tile, :] = S.astype(copy_out.dtype)

      @pl.when(live)
      def _():
        ring_u_out[s, h, put, tile] = u.astype(ring_u_out.dtype)

        @pl.when(vt == 0)  # g is per head, k per key head: one program appends each
        def _():
          ring_g_out[s, h, put] = g

          @pl.when(h % group == 0)
          def _():
            ring_k_out[s, hk, put, :] = k.astype(ring_k_out.dtype)


def _sum_chunks(parts):
  return functools.reduce(lambda a, b: a + b, parts)


def _replay_step_kernel(slots_ref, base_ref, count_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                        state_ref, ring_k_ref, ring_u_ref, ring_g_ref,
                        o_ref, ring_k_out, ring_u_out, ring_g_out,
                        *, scale, group, block_v, block_k, ring_size):
  """Output-only step: S_{t-1} x = e^G (S_c x) + Σ_j w_j (k_j·x) u_j for x ∈ {k, q}, never building S."""
  vt, hk, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  s = slots_ref[b]
  tile = pl.ds(vt * block_v, block_v)
  # K is walked in chunks of block_k (static loop) so only a [BV, block_k] tile is live at once.
  chunks = [pl.ds(c * block_k, block_k) for c in range(k_ref.shape[-1] // block_k)]

  @pl.when(s < 0)
  def _():
    for i in range(group):
      o_ref[b, hk * group + i, tile] = jnp.zeros((block_v,), o_ref.dtype)

  @pl.when(s >= 0)
  def _():
    base, count = base_ref[b], count_ref[b]
    put = (base + count) % ring_size                              # token 0's ring index
    ks = [k_ref[b, hk, c].astype(f32) for c in chunks]
    qs = [q_ref[b, hk, c].astype(f32) * scale for c in chunks]
    kq = _sum_chunks(jnp.sum(kc * qc) for kc, qc in zip(ks, qs))
    _, inside = window_offsets((ring_size,), base, count, ring_size)
    # Key ring read once per key head: (k_j·k) and (k_j·q) serve all r value heads.
    rk = [common.load_window(ring_k_ref.at[s, hk, :, c], inside) for c in chunks]   # [R, block_k]
    rkk = _sum_chunks(jnp.sum(r * kc[None, :], axis=1) for r, kc in zip(rk, ks))
    rkq = _sum_chunks(jnp.sum(r * qc[None, :], axis=1) for r, qc in zip(rk, qs))
    gs = []
    for i in range(group):
      h = hk * group + i
      rg = plt.load(ring_g_ref.at[s, h, :], mask=inside, other=jnp.zeros((), f32))
      w, total = window_decays(rg, base, count, ring_size)
      decay = jnp.exp(total)
      # S x = e^G (S_c x) + Σ_j w_j (k_j·x) u_j, never building S.
      Sck, Scq = 0.0, 0.0
      for c, kc, qc in zip(chunks, ks, qs):
        Sc = state_ref[s, h, tile, c].astype(f32)                 # [BV, block_k]
        Sck = Sck + jnp.sum(Sc * kc[None, :], axis=1)
        Scq = Scq + jnp.sum(Sc * qc[None, :], axis=1)
      ru = common.load_window(ring_u_ref.at[s, h, :, tile], inside)   # [R, BV]
      Sk = decay * Sck + jnp.sum((w * rkk)[:, None] * ru, axis=0)
      Sq = decay * Scq + jnp.sum((w * rkq)[:, None] * ru, axis=0)
      g = g_ref[b, h].astype(f32)
      alpha = jnp.exp(g)
      u = beta_ref[b, h].astype(f32) * (v_ref[b, h, tile].astype(f32) - alpha * Sk)
      o_ref[b, h, tile] = (alpha * Sq + u * kq).astype(o_ref.dtype)
      ring_u_out[s, h, put, tile] = u.astype(ring_u_out.dtype)
      gs.append(g)

    @pl.when(vt == 0)  # k and g are per head, not per V tile: one program appends them
    def _():
      for c, kc in zip(chunks, ks):
        ring_k_out[s, hk, put, c] = kc.astype(ring_k_out.dtype)
      for i, g in enumerate(gs):
        ring_g_out[s, hk * group + i, put] = g


# ----------------------------------------------------------------------------------------------
# Builders.
# ----------------------------------------------------------------------------------------------

def _pallas(kernel, args, *, grid, out_shape, aliases, cfg, name, interpret, refs=None):
  """pallas_call over whole GMEM operands; ``refs`` names them (inputs, then outputs), by default
  ``kernel``'s leading parameters (a partial's)."""
  if refs is None:
    refs = [r.removesuffix("_ref") for r in inspect.signature(getattr(kernel, "func", kernel)).parameters]
  fresh = [(refs[len(args) + i], o) for i, o in enumerate(out_shape) if i not in aliases.values()]
  common.require_triton_addressable(name, **dict(zip(refs, args)), **dict(fresh))
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[any_spec] * len(args), out_specs=[any_spec] * len(out_shape),
      out_shape=out_shape, input_output_aliases=aliases, name=name, interpret=interpret,
      compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
  )(*args)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _decode(q, k, v, g, beta, pool, slots, *, scale, cfg, interpret):
  batch, hv, vd = v.shape
  kernel = functools.partial(_decode_kernel, scale=scale, group=hv // q.shape[1],
                             block_v=cfg.block_v)
  o, pool = _pallas(kernel, (slots, q, k, v, g, beta, pool),
                    grid=(vd // cfg.block_v, hv, batch),
                    out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                               jax.ShapeDtypeStruct(pool.shape, pool.dtype)],
                    aliases={6: 1}, cfg=cfg, name="replayssm_gdn_decode", interpret=interpret)
  return o, pool


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _replay_decode(q, k, v, g, beta, bufs, plan, *, scale, cfg, interpret):
  batch, hk = q.shape[:2]
  hv, vd = bufs.num_v_heads, bufs.head_v_dim
  step = cfg.step
  if cfg.route == "reconstruct":
    # The verify kernel at T = 1: one launch, flushing rows stored in place (no fold pass).
    o, bufs = reconstruct(*(x[:, None] for x in (q, k, v, g, beta)), bufs, plan,
                          jnp.ones((batch,), jnp.int32), scale=scale, cfg=step, interpret=interpret)
    return o[:, 0], bufs
  kernel = functools.partial(_replay_step_kernel, scale=scale, group=hv // hk, block_v=step.block_v,
                             block_k=step.block_k, ring_size=bufs.ring_size)
  checkpoint = bufs.state if bufs.read_copy is None else bufs.read_copy   # what the step reads
  o, ring_k, ring_u, ring_g = _pallas(
      kernel, (plan.slots, plan.base, plan.count, q, k, v, g, beta,
               checkpoint, bufs.ring_k, bufs.ring_u, bufs.ring_g),
      grid=(vd // step.block_v, hk, batch),
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)]
      + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (bufs.ring_k, bufs.ring_u, bufs.ring_g)],
      aliases={9: 1, 10: 2, 11: 3}, cfg=step, name="replayssm_gdn_replay_step", interpret=interpret)
  bufs = bufs.replace(ring_k=ring_k, ring_u=ring_u, ring_g=ring_g)
  return o, fold_flushing_rows(bufs, plan, cfg=cfg, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "cfg", "interpret"))
def _flush_decode(q, k, v, g, beta, bufs, plan, *, scale, cfg, interpret):
  batch, hk = q.shape[:2]
  hv, vd = bufs.num_v_heads, bufs.head_v_dim
  kernel = functools.partial(_flush_decode_kernel, scale=scale, group=hv // hk, block_v=cfg.block_v,
                             ring_size=bufs.ring_size)
  o, state = _pallas(
      kernel, (plan.slots, plan.base, plan.count, q, k, v, g, beta,
               bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g),
      grid=(vd // cfg.block_v, hv, batch),
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype),
                 jax.ShapeDtypeStruct(bufs.state.shape, bufs.state.dtype)],
      aliases={8: 1}, cfg=cfg, name="replayssm_gdn_flush_decode", interpret=interpret)
  return o, bufs.replace(state=state)


def reconstruct(q, k, v, g, beta, bufs, plan, lengths, *, scale, cfg, interpret):
  """The reconstruct route's launch (``_reconstruct_kernel``): q, k [B, T, Hk, K]; v [B, T, Hv, V];
  g, beta [B, T, Hv]; lengths int32[B]; cfg the [BV, K] tile. Reads the float32 checkpoint; a read
  copy is written where the checkpoint is. Returns (o [B, T, Hv, V], bufs)."""
  batch, t, hk = q.shape[:3]
  hv, vd = bufs.num_v_heads, bufs.head_v_dim
  kernel = functools.partial(_reconstruct_kernel, scale=scale, group=hv // hk, block_v=cfg.block_v,
                             ring_size=bufs.ring_size, num_tokens=t)
  written = {"state": bufs.state, "ring_k": bufs.ring_k, "ring_u": bufs.ring_u, "ring_g": bufs.ring_g,
             **({} if bufs.read_copy is None else {"read_copy": bufs.read_copy})}
  inputs = ("slots", "base", "count", "flush", "lengths", "q", "k", "v", "g", "beta", *written)
  o, state, ring_k, ring_u, ring_g, *copy = _pallas(
      kernel, (plan.slots, plan.base, plan.count, plan.flush.astype(jnp.int32), lengths, q, k, v,
               g, beta, *written.values()),
      grid=(vd // cfg.block_v, hv, batch),
      out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype)]
      + [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in written.values()],
      aliases={10 + i: 1 + i for i in range(len(written))}, cfg=cfg, name="replayssm_gdn_reconstruct",
      interpret=interpret, refs=(*inputs, "o", *(f"{n}_out" for n in written)))
  return o, bufs.replace(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g,
                         **({"read_copy": copy[0]} if copy else {}))


def fold_flushing_rows(bufs, plan: ReplayPlan, *, cfg, interpret):
  """The flush pass after a step kernel appended token 0 (``fold_triton.fold_flushing_rows``):
  flushing rows fold ``plan.fold_length()`` entries (window + token 0) into their checkpoint,
  ``cfg.fold_tiles`` tiles per program, the read copy (if any) written with the checkpoint;
  returns the buffers."""
  folded = fold_triton.fold_flushing_rows(
      bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g, plan, cfg=cfg.fold,
      row_slots=cfg.fold_rows, interpret=interpret, name="replayssm_gdn_fold",
      tiles_per_program=cfg.fold_tiles, read_copy=bufs.read_copy)
  return fold_triton.replace_folded(bufs, folded)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def _materialize(bufs, slots, base, length, *, cfg, interpret):
  batch = slots.shape[0]
  return fold_triton.fold(bufs.state, bufs.ring_k, bufs.ring_u, bufs.ring_g, slots, base, length,
                          jnp.arange(batch, dtype=jnp.int32), batch, cfg=cfg, row_slots=batch,
                          interpret=interpret, into_checkpoint=False,
                          name="replayssm_gdn_materialize")


# ----------------------------------------------------------------------------------------------
# Public wrappers (called from gdn/ops.py; inputs already validated there).
# ----------------------------------------------------------------------------------------------

def _knobs(op, cfg, head_v_dim, head_k_dim, *, block_v=None, num_warps=None, num_stages=None,
           block_k=None):
  """Applies the keyword overrides; a non-power-of-two tile is NotImplementedError (Triton)."""
  tiles = {name: n for name, n in (("block_v", block_v), ("block_k", block_k)) if n is not None}
  common.require_pow2(op, **tiles)
  cfg = cfg.override(block_v=block_v, num_warps=num_warps, num_stages=num_stages, block_k=block_k)
  return cfg.fit(head_v_dim, head_k_dim)


def decode(q, k, v, g, beta, pool, slots, *, scale, block_v=None, num_warps=None, num_stages=None):
  """Conventional GDN decode step over a slot pool. Returns (o [B, Hv, V] in v.dtype, pool)."""
  _, hv, vd, kd = pool.shape
  common.require_pow2("gdn.decode[pallas_triton]", K=kd, V=vd)
  cfg = config_lib.decode_config(device_kind=common.device_kind(), state_dtype=pool.dtype,
                                 head_k_dim=kd, head_v_dim=vd, batch=q.shape[0])
  cfg = _knobs("gdn.decode[pallas_triton]", cfg, vd, kd, block_v=block_v, num_warps=num_warps,
               num_stages=num_stages)
  return _decode(q, k, v, g, beta, pool, slots, scale=float(scale), cfg=cfg,
                 interpret=common.interpret_mode())


def _replay_cfg(op, bufs: ReplayBuffers, batch, buffer_len, *, route="auto", block_v=None,
                block_k=None, num_warps=None, num_stages=None, fold_block_v=None,
                fold_block_k=None, fold_num_warps=None, fold_rows=None, fold_tiles=None):
  common.require_pow2(op, K=bufs.head_k_dim, V=bufs.head_v_dim, R=bufs.ring_size)
  cfg = config_lib.replay_config(
      device_kind=common.device_kind(), state_dtype=bufs.state.dtype, head_k_dim=bufs.head_k_dim,
      head_v_dim=bufs.head_v_dim, num_k_heads=bufs.num_k_heads, batch=batch, buffer_len=buffer_len,
      ring_size=bufs.ring_size, route=route)
  kd, vd = bufs.head_k_dim, bufs.head_v_dim
  step = _knobs(op, cfg.step, vd, kd, block_v=block_v, block_k=block_k, num_warps=num_warps,
                num_stages=num_stages)
  fold = _knobs(op, cfg.fold, vd, kd, block_v=fold_block_v, block_k=fold_block_k,
                num_warps=fold_num_warps)
  return config_lib.ReplayConfig(step=step, route=cfg.route, fold=fold,
                                 fold_rows=cfg.fold_rows if fold_rows is None else int(fold_rows),
                                 fold_tiles=cfg.fold_tiles if fold_tiles is None else fold_tiles)


def replay_decode(q, k, v, g, beta, bufs: ReplayBuffers, plan: ReplayPlan, *, scale, route="auto",
                  block_v=None, block_k=None, num_warps=None, num_stages=None, fold_block_v=None,
                  fold_block_k=None, fold_num_warps=None, fold_rows=None, fold_tiles=None):
  """ReplaySSM GDN decode (one token per row): step pass, then the flush-fold pass.

  ``block_v``/``block_k``/``num_warps``/``num_stages`` override the step kernel's config
  (``block_k``, the K chunk, applies to the output-only route), ``fold_block_v`` /
  ``fold_block_k`` / ``fold_num_warps`` the fold pass's, ``fold_rows`` its number of row slots,
  ``fold_tiles`` its [fold_block_v, fold_block_k] tiles per program (a power of two).
  Returns (o [B, Hv, V] in v.dtype, bufs).
  """
  op = "gdn.replay_decode[pallas_triton]"
  if plan.num_tokens != 1:
    raise NotImplementedError(f"{op}: plans with num_tokens={plan.num_tokens} (verify) are not "
                              f"supported by this kernel")
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected one of {ROUTES}")
  route, plan = fold_triton.read_copy_route(op, bufs, route, plan)
  if plan.flush_all:
    # Every row flushes: one fold-and-step pass (the routes differ only in how they read S).
    common.require_pow2(op, K=bufs.head_k_dim, V=bufs.head_v_dim, R=bufs.ring_size)
    cfg = config_lib.flush_decode_config(device_kind=common.device_kind(), state_dtype=bufs.state.dtype,
                                         head_k_dim=bufs.head_k_dim, head_v_dim=bufs.head_v_dim,
                                         ring_size=bufs.ring_size, batch=q.shape[0])
    cfg = _knobs(op, cfg, bufs.head_v_dim, None, block_v=block_v, num_warps=num_warps,
                 num_stages=num_stages)
    return _flush_decode(q, k, v, g, beta, bufs, plan, scale=float(scale), cfg=cfg,
                         interpret=common.interpret_mode())
  cfg = _replay_cfg(op, bufs, q.shape[0], plan.buffer_len, route=route, block_v=block_v,
                    block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                    fold_block_v=fold_block_v, fold_block_k=fold_block_k,
                    fold_num_warps=fold_num_warps, fold_rows=fold_rows, fold_tiles=fold_tiles)
  return _replay_decode(q, k, v, g, beta, bufs, plan, scale=float(scale), cfg=cfg,
                        interpret=common.interpret_mode())


def materialize(bufs: ReplayBuffers, slots, base, length, *, block_v=None, num_warps=None,
                num_stages=None):
  """Exact state of each row (checkpoint ⊕ ``length`` entries from ``base``): f32 [B, Hv, V, K]."""
  op = "gdn.materialize[pallas_triton]"
  common.require_pow2(op, K=bufs.head_k_dim, V=bufs.head_v_dim, R=bufs.ring_size)
  cfg = config_lib.materialize_config(device_kind=common.device_kind(), head_k_dim=bufs.head_k_dim,
                                      head_v_dim=bufs.head_v_dim, ring_size=bufs.ring_size)
  cfg = _knobs(op, cfg, bufs.head_v_dim, bufs.head_k_dim, block_v=block_v, num_warps=num_warps,
               num_stages=num_stages)
  return _materialize(bufs, slots, base, length, cfg=cfg, interpret=common.interpret_mode())
