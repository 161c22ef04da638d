"""Public Gated DeltaNet decode ops: validation, then dispatch to an implementation.

Shapes (decode, one token per row): q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv];
pool / checkpoint [N, Hv, V, K]; slots int32[B] (negative = padding row); output [B, Hv, V].
Value head h reads key head ``h // (Hv // Hk)``. Verify ops (speculative, T tokens per row) put T
after B: q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; output [B, T, Hv, V].
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _checks
from replayssm_jax import config as config_lib
from replayssm_jax import _dispatch
from replayssm_jax import _slots
from replayssm_jax.pallas import common as pallas_common
from replayssm_jax.gdn import reference
from replayssm_jax.gdn import xla
from replayssm_jax.gdn.buffers import FOLDS, ReplayBuffers

ROUTES = ("auto", "reconstruct", "output_only")


def _check_step_inputs(q, k, v, g, beta, *, num_v_heads, head_k_dim, head_v_dim, batch=None):
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    _checks.expect_float(name, x)
  _checks.expect_shape("q", q, (batch, None, head_k_dim), "([B, Hk, K])")
  b, hk = q.shape[0], q.shape[1]
  _checks.expect_shape("k", k, (b, hk, head_k_dim), "([B, Hk, K], like q)")
  _checks.expect_shape("v", v, (b, num_v_heads, head_v_dim), "([B, Hv, V])")
  _checks.expect_shape("g", g, (b, num_v_heads), "([B, Hv])")
  _checks.expect_shape("beta", beta, (b, num_v_heads), "([B, Hv])")
  if num_v_heads % hk:
    raise ValueError(f"q has {hk} key heads; the state has {num_v_heads} value heads, "
                     f"which is not a multiple (GQA needs Hv = r·Hk)")
  return b, hk


def _resolve_scale(scale, head_k_dim):
  return head_k_dim ** -0.5 if scale is None else float(scale)


def decode(q, k, v, g, beta, pool, slots, *, scale=None, implementation=None):
  """Conventional GDN decode: read the state of each row's slot, step once, write it back.

  Args:
    q, k: [B, Hk, K]; v: [B, Hv, V]; g: [B, Hv] log decay (≤ 0); beta: [B, Hv].
    pool: [N, Hv, V, K] state pool (float32 / bfloat16 / float16), updated in place under donation.
    slots: int32[B]; negative = padding row (zero output, nothing written).
    scale: query scale, default K^-0.5.
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic".

  Returns:
    (o [B, Hv, V] in v's dtype, pool).
  """
  _checks.expect_shape("pool", pool, (None, None, None, None), "([N, Hv, V, K])")
  _checks.expect_dtype("pool", pool, (jnp.float32, jnp.bfloat16, jnp.float16))
  n, hv, vd, kd = pool.shape
  b, hk = _check_step_inputs(q, k, v, g, beta, num_v_heads=hv, head_k_dim=kd, head_v_dim=vd)
  _checks.expect_slots("slots", slots, b)
  _checks.check_slots("slots", slots, n)
  scale = _resolve_scale(scale, kd)

  def run_xla():
    return _jit_xla_decode(q, k, v, g, beta, pool, slots, scale=scale)

  def run_triton():
    from replayssm_jax.pallas import gdn_triton
    return gdn_triton.decode(q, k, v, g, beta, pool, slots, scale=scale)

  def run_mosaic():
    from replayssm_jax.pallas import gdn_mosaic
    return gdn_mosaic.decode(q, k, v, g, beta, pool, slots, scale=scale)

  return _dispatch.run("gdn.decode", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic})


_jit_xla_decode = jax.jit(xla.decode, static_argnames=("scale",))


def _check_buffers(bufs):
  if not isinstance(bufs, ReplayBuffers):
    raise ValueError(f"bufs must be gdn.ReplayBuffers; got {type(bufs).__name__}")


def _require_u_layout(op, bufs):
  """The Pallas kernels read the u ring only (auto falls back to XLA on this error)."""
  if bufs.fold != "u":
    raise NotImplementedError(f"{op}: the Pallas kernels support buffers with fold='u' only; these "
                              f"have fold={bufs.fold!r}")


def replay_decode(q, k, v, g, beta, bufs, plan, *, scale=None, route="auto", implementation=None):
  """ReplaySSM GDN decode, one token per row (``plan.num_tokens == 1``).

  Rows read their checkpoint and replay their ring window; non-flushing rows append
  (k, u, g) to the ring, flushing rows (``plan.flush``) fold window and token into the checkpoint.
  The cursor is advanced afterwards, once for all layers, by ``cursor.commit(plan)``.

  Args:
    q, k: [B, Hk, K]; v: [B, Hv, V]; g: [B, Hv] log decay; beta: [B, Hv].
    bufs: gdn.ReplayBuffers, updated in place under donation.
    plan: ReplayPlan from ``cursor.plan(slots)``.
    scale: query scale, default K^-0.5.
    route: "output_only" (read S·q and S·k from the checkpoint and the ring, never build S),
      "reconstruct" (replay the window into each state tile; the Pallas kernel also stores
      flushing rows in the same launch) or "auto" (the config's choice). Buffers with a read copy
      (``ReplayBuffers.read_copy``) read it instead of the checkpoint, on the output_only route.
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic"
      (output_only route only).

  Returns:
    (o [B, Hv, V] in v's dtype, bufs).
  """
  _check_buffers(bufs)
  b, hk = _check_step_inputs(q, k, v, g, beta, num_v_heads=bufs.num_v_heads,
                             head_k_dim=bufs.head_k_dim, head_v_dim=bufs.head_v_dim)
  if hk != bufs.num_k_heads:
    raise ValueError(f"q has {hk} key heads; bufs.ring_k has {bufs.num_k_heads}")
  _slots.check_plan(plan, bufs, b, "q")
  if plan.num_tokens != 1:
    raise ValueError(f"replay_decode takes plans with num_tokens=1; got num_tokens={plan.num_tokens} "
                     f"(use replay_verify for draft tokens)")
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected one of {ROUTES}")
  if bufs.read_copy is not None and route == "reconstruct":
    raise NotImplementedError("gdn.replay_decode: route='reconstruct' with a read copy (the step reads "
                              "the copy on the output_only route only)")
  scale = _resolve_scale(scale, bufs.head_k_dim)

  def run_xla():
    r = "output_only" if route == "auto" else route
    return _jit_xla_replay(q, k, v, g, beta, bufs, plan, scale=scale, route=r)

  def run_triton():
    _require_u_layout("gdn.replay_decode", bufs)
    from replayssm_jax.pallas import gdn_triton
    return gdn_triton.replay_decode(q, k, v, g, beta, bufs, plan, scale=scale, route=route)

  def run_mosaic():
    _require_u_layout("gdn.replay_decode", bufs)
    _slots.without_read_copy("gdn.replay_decode[pallas_mosaic]", bufs)
    from replayssm_jax.pallas import gdn_mosaic
    return gdn_mosaic.replay_decode(q, k, v, g, beta, bufs, plan, scale=scale, route=route)

  return _dispatch.run("gdn.replay_decode", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic})


_jit_xla_replay = jax.jit(xla.replay_decode, static_argnames=("scale", "route"))


_check_cursor = _slots.check_cursor


def materialize(bufs, cursor, slots, *, implementation=None):
  """Exact current state of each row: checkpoint ⊕ committed window.

  Returns float32 [B, Hv, V, K]; zeros on padding rows.
  """
  _check_buffers(bufs)
  _check_cursor(cursor, bufs)
  _checks.expect_slots("slots", slots)
  _checks.check_slots("slots", slots, bufs.num_slots)
  base, count = _slots.window_of(cursor, slots)

  def run_xla():
    return _jit_xla_materialize(bufs, slots, base, count)

  def run_triton():
    _require_u_layout("gdn.materialize", bufs)
    from replayssm_jax.pallas import gdn_triton
    return gdn_triton.materialize(bufs, slots, base, count)

  def run_mosaic():
    _require_u_layout("gdn.materialize", bufs)
    from replayssm_jax.pallas import gdn_mosaic
    return gdn_mosaic.materialize(bufs, slots, base, count)

  return _dispatch.run("gdn.materialize", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic})


_jit_xla_materialize = jax.jit(xla.materialize)


def write_state(bufs, cursor, slots, S, *, implementation=None):
  """Sets the checkpoint of ``slots`` to ``S`` [B, Hv, V, K] and empties their windows.

  Used after prefill (S = final state of the chunked scan) and to recycle a slot. Pure data
  movement: an in-place scatter under donation for every implementation.
  """
  _check_buffers(bufs)
  return _slots.write_state("gdn.write_state", bufs, cursor, slots, S, implementation, "([B, Hv, V, K])")


def copy_slots(bufs, cursor, src, dst, *, implementation=None):
  """Copies checkpoint, ring and cursor of ``src[i]`` into ``dst[i]`` (e.g. a prefix snapshot).

  The copy carries the pending window as well, so ``dst`` holds exactly ``src``'s current state,
  bit for bit, whether or not ``src`` was flushed. Rows where src or dst is negative are skipped.
  ``dst`` must not repeat and must not overlap ``src``. Pure data movement (in-place scatter).
  """
  _check_buffers(bufs)
  return _slots.copy_slots("gdn.copy_slots", bufs, cursor, src, dst, implementation)


# ------------------------------------------------------------------------------------------------
# Speculative verify: T tokens per row (token 0 = the emitted token, then T - 1 drafts).


def _check_verify_inputs(q, k, v, g, beta, *, num_k_heads, num_v_heads, head_k_dim, head_v_dim):
  """Shapes [B, T, ...] of a verify step against the state geometry (None: not checked); returns B."""
  b, hv, kd, vd = reference._check_inputs(q, k, v, g, beta, None)
  expected = {"key heads (q.shape[2])": (q.shape[2], num_k_heads), "K (q.shape[3])": (kd, head_k_dim),
              "value heads (v.shape[2])": (hv, num_v_heads), "V (v.shape[3])": (vd, head_v_dim)}
  for what, (got, want) in expected.items():
    if want is not None and got != want:
      raise ValueError(f"{what} is {got}; the state has {want} (q, k [B, T, Hk, K]; v [B, T, Hv, V])")
  return b


def replay_verify(q, k, v, g, beta, bufs, plan, *, lengths=None, scale=None, fold=None,
                  implementation=None):
  """ReplaySSM GDN speculative verify: T = ``plan.num_tokens`` tokens per row in one step.

  Token 0 is the token the model emitted (it always commits); tokens 1..T-1 are drafts. Outputs
  are replayed from the checkpoint through the committed window, then through the T tokens with
  one T×T unit lower-triangular solve for their corrected values (GDN Alg. 8). Every token is
  appended to the ring past the live window (``plan.write_index(i)``); flushing rows fold the
  committed window and token 0 only — drafts are never folded — in the same program. Afterwards
  ``cursor.commit(plan, num_accepted)`` keeps the accepted prefix; that is the whole rollback.
  With T = 1 this is ``replay_decode``.

  Args:
    q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g: [B, T, Hv] log decay; beta: [B, T, Hv].
    bufs: gdn.ReplayBuffers, updated in place under donation.
    plan: ReplayPlan from ``cursor.plan(slots, num_tokens=T)``.
    lengths: optional int32[B] real tokens per row in [1, T] (None: all T). Lanes past a row's
      length are padding: zero output, no ring write, their inputs (NaN included) never read.
      Commit at most ``lengths`` tokens per row.
    scale: query scale, default K^-0.5.
    fold: how flushing rows fold, "u" or "exact" (see ``ReplayBuffers``); None = ``bufs.fold``.
      "exact" needs buffers created with ``fold="exact"``; "u" works with both layouts.
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic" (the
      Pallas ones take fold="u" buffers only; None falls back to XLA for the exact layout).
      Buffers with a read copy (``ReplayBuffers.read_copy``): verify does not read it (the
      outputs and buffers are those of the same buffers without one, bit for bit); wherever it
      writes the checkpoint it writes the copy too. Only decode steps read the copy.

  Returns:
    (o [B, T, Hv, V] in v's dtype, zeros on padding rows and padded lanes; bufs).
  """
  _check_buffers(bufs)
  b = _check_verify_inputs(q, k, v, g, beta, num_k_heads=bufs.num_k_heads,
                           num_v_heads=bufs.num_v_heads, head_k_dim=bufs.head_k_dim,
                           head_v_dim=bufs.head_v_dim)
  _slots.check_plan(plan, bufs, b, "q")
  _slots.check_num_tokens("q", q, plan.num_tokens, "([B, T, Hk, K], T = plan.num_tokens)")
  fold = bufs.fold if fold is None else fold
  if fold not in FOLDS:
    raise ValueError(f"fold={fold!r}; expected None or one of {FOLDS}")
  if fold == "exact" and bufs.fold != "exact":
    raise ValueError("fold='exact' needs the raw inputs in the ring; these bufs have fold='u' "
                     "(create them with gdn.ReplayBuffers.create(..., fold='exact'))")
  lengths = _slots.check_lengths(lengths, b, plan.num_tokens, plan.slots)
  scale = _resolve_scale(scale, bufs.head_k_dim)

  def run_xla():
    return _jit_xla_verify(q, k, v, g, beta, bufs, plan, lengths, scale=scale, fold=fold)

  def run_triton():
    _require_u_layout("gdn.replay_verify", bufs)   # fold="exact" needs exact-layout buffers
    from replayssm_jax.pallas import gdn_verify_triton
    return gdn_verify_triton.replay_verify(q, k, v, g, beta, bufs, plan, lengths, scale=scale)

  def run_mosaic():
    _require_u_layout("gdn.replay_verify", bufs)
    from replayssm_jax.pallas import gdn_mosaic
    return gdn_mosaic.replay_verify(q, k, v, g, beta, bufs, plan, lengths, scale=scale)

  prefer = config_lib.verify_implementations(
      device_kind=pallas_common.device_kind(), family="gdn", state_dtype=bufs.state.dtype,
      num_tokens=plan.num_tokens, batch=b) if implementation is None else ()
  return _dispatch.run("gdn.replay_verify", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic},
                       prefer=prefer)


_jit_xla_verify = jax.jit(xla.replay_verify, static_argnames=("scale", "fold"))


def verify_conventional(q, k, v, g, beta, stack, slots, read_index, *, lengths=None, scale=None,
                        implementation=None):
  """Conventional speculative verify (the baseline engines run without ReplaySSM).

  Each row reads its current state ``stack[slot, read_index]``, steps it through its T tokens and
  writes the state after token i to ``stack[slot, i]``: T full states written per row and step.
  Rollback = choose the state at the accepted index: the next step reads
  ``read_index = num_accepted - 1``. After prefill, put the state at ``stack[slot, 0]`` with
  read index 0. Reading and writing the same stack is safe (all reads happen first).

  Args:
    q, k: [B, T, Hk, K]; v: [B, T, Hv, V]; g: [B, T, Hv] log decay; beta: [B, T, Hv].
    stack: [N, T_max, Hv, V, K] states per slot, T_max >= T (float32 / bfloat16 / float16),
      updated in place under donation.
    slots: int32[B]; negative = padding row (zero output, nothing written).
    read_index: int32[B] in [0, T_max): the stack entry holding each row's current state.
    lengths: optional int32[B] real tokens per row in [1, T] (None: all T); padded lanes output
      zeros and write no state.
    scale: query scale, default K^-0.5.
    implementation: None (fastest available), "xla" or "pallas_triton".

  Returns:
    (o [B, T, Hv, V] in v's dtype, stack).
  """
  _checks.expect_shape("q", q, (None,) * 4, "([B, T, Hk, K])")
  b, t = q.shape[:2]
  _slots.check_stack(stack, read_index, slots, b, t, "([N, T_max, Hv, V, K])")
  _, _, hv, vd, kd = stack.shape
  _check_verify_inputs(q, k, v, g, beta, num_k_heads=None, num_v_heads=hv,
                       head_k_dim=kd, head_v_dim=vd)
  lengths = _slots.check_lengths(lengths, b, t, slots)
  scale = _resolve_scale(scale, kd)

  def run_xla():
    return _jit_xla_verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths, scale=scale)

  def run_triton():
    from replayssm_jax.pallas import gdn_verify_triton
    return gdn_verify_triton.verify_conventional(q, k, v, g, beta, stack, slots, read_index, lengths,
                                                 scale=scale)

  return _dispatch.run("gdn.verify_conventional", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton})


_jit_xla_verify_conventional = jax.jit(xla.verify_conventional, static_argnames=("scale",))
