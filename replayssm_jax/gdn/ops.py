"""Public Gated DeltaNet decode ops: validation, then dispatch to an implementation.

Shapes (decode, one token per row): q, k [B, Hk, K]; v [B, Hv, V]; g, beta [B, Hv];
pool / checkpoint [N, Hv, V, K]; slots int32[B] (negative = padding row); output [B, Hv, V].
Value head h reads key head ``h // (Hv // Hk)``.
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _checks
from replayssm_jax import _dispatch
from replayssm_jax import _slots
from replayssm_jax.gdn import xla
from replayssm_jax.gdn.buffers import ReplayBuffers

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
    implementation: None (fastest available), "xla" or "pallas_triton".

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

  return _dispatch.run("gdn.decode", implementation, {"xla": run_xla, "pallas_triton": run_triton})


_jit_xla_decode = jax.jit(xla.decode, static_argnames=("scale",))


def _check_buffers(bufs):
  if not isinstance(bufs, ReplayBuffers):
    raise ValueError(f"bufs must be gdn.ReplayBuffers; got {type(bufs).__name__}")


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
      "reconstruct" (rebuild S_{t-1} tile by tile) or "auto" (the config's choice).
    implementation: None (fastest available), "xla" or "pallas_triton".

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
  scale = _resolve_scale(scale, bufs.head_k_dim)

  def run_xla():
    r = "output_only" if route == "auto" else route
    return _jit_xla_replay(q, k, v, g, beta, bufs, plan, scale=scale, route=r)

  def run_triton():
    from replayssm_jax.pallas import gdn_triton
    return gdn_triton.replay_decode(q, k, v, g, beta, bufs, plan, scale=scale, route=route)

  return _dispatch.run("gdn.replay_decode", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton})


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
    from replayssm_jax.pallas import gdn_triton
    return gdn_triton.materialize(bufs, slots, base, count)

  return _dispatch.run("gdn.materialize", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton})


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
