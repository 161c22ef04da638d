"""Public Mamba2 decode ops: validation, then dispatch to an implementation.

Shapes (decode, one token per row): x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]
with H a multiple of G (head h reads group ``h // (H // G)``); pool / checkpoint [N, H, P, N];
slots int32[B] (negative = padding row); output [B, H, P] in x's dtype.

Only the XLA implementation exists so far; a named Pallas implementation raises
NotImplementedError (``implementation=None`` picks XLA).
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _checks
from replayssm_jax import _dispatch
from replayssm_jax import _slots
from replayssm_jax.mamba2 import xla
from replayssm_jax.mamba2.buffers import ReplayBuffers

ROUTES = ("auto", "reconstruct", "output_only")


def _check_step_inputs(x, dt, A, B, C, D, z, dt_bias, *, num_heads, head_dim, state_dim):
  """Eager shape/dtype checks of one decode step; returns (batch, groups)."""
  optional = (("D", D), ("z", z), ("dt_bias", dt_bias))
  for name, a in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)) + optional:
    if a is not None:
      _checks.expect_float(name, a)
  _checks.expect_shape("x", x, (None, num_heads, head_dim), "([B, H, P])")
  b = x.shape[0]
  _checks.expect_shape("dt", dt, (b, num_heads), "([B, H])")
  _checks.expect_shape("A", A, (num_heads,), "([H])")
  _checks.expect_shape("B", B, (b, None, state_dim), "([B, G, N])")
  g = B.shape[1]
  if g == 0 or num_heads % g:
    raise ValueError(f"B has {g} groups and the state has {num_heads} heads; expected H a multiple "
                     f"of G (head h reads group h // (H // G))")
  _checks.expect_shape("C", C, (b, g, state_dim), "([B, G, N], like B)")
  expected = {"D": ((num_heads,), "([H])"), "z": ((b, num_heads, head_dim), "([B, H, P], like x)"),
              "dt_bias": ((num_heads,), "([H])")}
  for name, a in optional:
    if a is not None:
      _checks.expect_shape(name, a, *expected[name])
  return b, g


def _check_softplus(dt_softplus) -> bool:
  if not isinstance(dt_softplus, bool):
    raise ValueError(f"dt_softplus={dt_softplus!r}; expected a bool")
  return dt_softplus


def decode(x, dt, A, B, C, pool, slots, *, D=None, z=None, dt_bias=None, dt_softplus=True,
           implementation=None):
  """Conventional Mamba2 decode (selective_state_update): read each row's state, step, write back.

  Args:
    x: [B, H, P]; dt: [B, H] raw step sizes; A: [H] (negative); B, C: [B, G, N].
    pool: [N, H, P, N] state pool (float32 / bfloat16 / float16), updated in place under donation.
    slots: int32[B]; negative = padding row (zero output, nothing written).
    D: [H] skip, or None. z: [B, H, P] gate (y · silu(z)), or None. dt_bias: [H], or None.
    dt_softplus: Δ = softplus(dt + dt_bias) if True, else dt + dt_bias.
    implementation: None (fastest available) or "xla".

  Returns:
    (y [B, H, P] in x's dtype, pool).
  """
  _checks.expect_shape("pool", pool, (None, None, None, None), "([N, H, P, N])")
  _checks.expect_dtype("pool", pool, (jnp.float32, jnp.bfloat16, jnp.float16))
  n, h, p, ns = pool.shape
  b, _ = _check_step_inputs(x, dt, A, B, C, D, z, dt_bias, num_heads=h, head_dim=p, state_dim=ns)
  _checks.expect_slots("slots", slots, b)
  _checks.check_slots("slots", slots, n)
  softplus = _check_softplus(dt_softplus)

  def run_xla():
    return _jit_xla_decode(x, dt, A, B, C, pool, slots, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus)

  return _dispatch.run("mamba2.decode", implementation, {"xla": run_xla})


_jit_xla_decode = jax.jit(xla.decode, static_argnames=("dt_softplus",))


def _check_buffers(bufs):
  if not isinstance(bufs, ReplayBuffers):
    raise ValueError(f"bufs must be mamba2.ReplayBuffers; got {type(bufs).__name__}")


def replay_decode(x, dt, A, B, C, bufs, plan, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                  route="auto", implementation=None):
  """ReplaySSM Mamba2 decode, one token per row (``plan.num_tokens == 1``).

  Rows read their checkpoint and replay their ring window; every live row appends
  (Δx, B, ΔA) at ``plan.write_index(0)``; flushing rows (``plan.flush``) also write S_t into the
  checkpoint. The cursor is advanced afterwards, once for all layers, by ``cursor.commit(plan)``.

  Args:
    x: [B, H, P]; dt: [B, H]; A: [H]; B, C: [B, G, N]; D, z, dt_bias, dt_softplus: as in ``decode``.
    bufs: mamba2.ReplayBuffers, updated in place under donation.
    plan: ReplayPlan from ``cursor.plan(slots)``.
    route: "output_only" (S_t·C from checkpoint and ring, never build S), "reconstruct" (rebuild
      S_{t-1}) or "auto".
    implementation: None (fastest available) or "xla".

  Returns:
    (y [B, H, P] in x's dtype, bufs).
  """
  _check_buffers(bufs)
  b, g = _check_step_inputs(x, dt, A, B, C, D, z, dt_bias, num_heads=bufs.num_heads,
                            head_dim=bufs.head_dim, state_dim=bufs.state_dim)
  if g != bufs.num_groups:
    raise ValueError(f"B has {g} groups; bufs.ring_B has {bufs.num_groups}")
  _slots.check_plan(plan, bufs, b, "x")
  if plan.num_tokens != 1:
    raise ValueError(f"replay_decode takes plans with num_tokens=1; got num_tokens={plan.num_tokens}")
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected one of {ROUTES}")
  softplus = _check_softplus(dt_softplus)

  def run_xla():
    r = "output_only" if route == "auto" else route
    return _jit_xla_replay(x, dt, A, B, C, bufs, plan, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus,
                           route=r)

  return _dispatch.run("mamba2.replay_decode", implementation, {"xla": run_xla})


_jit_xla_replay = jax.jit(xla.replay_decode, static_argnames=("dt_softplus", "route"))


def materialize(bufs, cursor, slots, *, implementation=None):
  """Exact current state of each row: checkpoint ⊕ committed window.

  Returns float32 [B, H, P, N]; zeros on padding rows.
  """
  _check_buffers(bufs)
  _slots.check_cursor(cursor, bufs)
  _checks.expect_slots("slots", slots)
  _checks.check_slots("slots", slots, bufs.num_slots)
  base, count = _slots.window_of(cursor, slots)
  return _dispatch.run("mamba2.materialize", implementation,
                       {"xla": lambda: _jit_xla_materialize(bufs, slots, base, count)})


_jit_xla_materialize = jax.jit(xla.materialize)


def write_state(bufs, cursor, slots, S, *, implementation=None):
  """Sets the checkpoint of ``slots`` to ``S`` [B, H, P, N] and empties their windows.

  Used after prefill (S = final state of ``chunked``) and to recycle a slot. Pure data movement.
  """
  _check_buffers(bufs)
  return _slots.write_state("mamba2.write_state", bufs, cursor, slots, S, implementation, "([B, H, P, N])")


def copy_slots(bufs, cursor, src, dst, *, implementation=None):
  """Copies checkpoint, ring and cursor of ``src[i]`` into ``dst[i]`` (e.g. a prefix snapshot).

  The pending window travels too, so ``dst`` holds exactly ``src``'s current state, bit for bit.
  Rows where src or dst is negative are skipped; ``dst`` must not repeat nor overlap ``src``.
  """
  _check_buffers(bufs)
  return _slots.copy_slots("mamba2.copy_slots", bufs, cursor, src, dst, implementation)
