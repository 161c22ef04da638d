"""Public Mamba2 decode ops: validation, then dispatch to an implementation.

Shapes (decode, one token per row): x, z [B, H, P]; dt [B, H]; A, D, dt_bias [H]; B, C [B, G, N]
with H a multiple of G (head h reads group ``h // (H // G)``); pool / checkpoint [N, H, P, N];
slots int32[B] (negative = padding row); output [B, H, P] in x's dtype.

Implementations: "xla" (mamba2/xla.py), "pallas_triton" (pallas/mamba2_triton.py, verify ops in
pallas/mamba2_verify_triton.py; interpreted on CPU) and, for ``decode`` and ``replay_decode``
(reconstruct route), "pallas_mosaic" (pallas/mamba2_mosaic.py; Hopper, interpreted on CPU).
``implementation=None`` picks the fastest available and falls back to XLA where a kernel cannot
handle the input (NotImplementedError).
"""
import jax
import jax.numpy as jnp

from replayssm_jax import _checks
from replayssm_jax import config as config_lib
from replayssm_jax import _dispatch
from replayssm_jax import _slots
from replayssm_jax.pallas import common as pallas_common
from replayssm_jax.mamba2 import reference
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
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic".

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

  def run_triton():
    from replayssm_jax.pallas import mamba2_triton
    return mamba2_triton.decode(x, dt, A, B, C, pool, slots, D=D, z=z, dt_bias=dt_bias,
                                dt_softplus=softplus)

  def run_mosaic():
    from replayssm_jax.pallas import mamba2_mosaic
    return mamba2_mosaic.decode(x, dt, A, B, C, pool, slots, D=D, z=z, dt_bias=dt_bias,
                                dt_softplus=softplus)

  return _dispatch.run("mamba2.decode", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic})


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
      S_{t-1}) or "auto" ("pallas_mosaic" implements the reconstruct route only). Buffers with a
      read copy (``ReplayBuffers.read_copy``) read it instead of the checkpoint, on the
      output_only route.
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic".

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
  if bufs.read_copy is not None and route == "reconstruct":
    raise NotImplementedError("mamba2.replay_decode: route='reconstruct' with a read copy (the step "
                              "reads the copy on the output_only route only)")
  softplus = _check_softplus(dt_softplus)

  def run_xla():
    r = "output_only" if route == "auto" else route
    return _jit_xla_replay(x, dt, A, B, C, bufs, plan, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus,
                           route=r)

  def run_triton():
    from replayssm_jax.pallas import mamba2_triton
    return mamba2_triton.replay_decode(x, dt, A, B, C, bufs, plan, D=D, z=z, dt_bias=dt_bias,
                                       dt_softplus=softplus, route=route)

  def run_mosaic():
    _slots.without_read_copy("mamba2.replay_decode[pallas_mosaic]", bufs)
    from replayssm_jax.pallas import mamba2_mosaic
    return mamba2_mosaic.replay_decode(x, dt, A, B, C, bufs, plan, D=D, z=z, dt_bias=dt_bias,
                                       dt_softplus=softplus, route=route)

  return _dispatch.run("mamba2.replay_decode", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic})


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
  def run_triton():
    from replayssm_jax.pallas import mamba2_triton
    return mamba2_triton.materialize(bufs, slots, base, count)

  return _dispatch.run("mamba2.materialize", implementation,
                       {"xla": lambda: _jit_xla_materialize(bufs, slots, base, count),
                        "pallas_triton": run_triton})


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


# ------------------------------------------------------------------------------------------------
# Speculative verify: T tokens per row (token 0 = the emitted token, then T - 1 drafts).
# Mamba2 has no fold choice: its ring holds raw inputs (Δx, B, ΔA), so every flush is the exact
# recurrence (GDN's fold="u" / "exact" exists because GDN caches corrected values).


def _check_verify_inputs(x, dt, A, B, C, D, z, dt_bias, *, num_heads, head_dim, state_dim,
                         num_groups=None):
  """Shapes [B, T, ...] of a verify step against the state geometry; returns B."""
  reference._check_inputs(x, dt, A, B, C, D, z, dt_bias, None)
  b, _, h, p = x.shape
  g, n = B.shape[2:]
  expected = {"heads (x.shape[2])": (h, num_heads), "P (x.shape[3])": (p, head_dim),
              "N (B.shape[3])": (n, state_dim), "groups (B.shape[2])": (g, num_groups)}
  for what, (got, want) in expected.items():
    if want is not None and got != want:
      raise ValueError(f"{what} is {got}; the state has {want} (x [B, T, H, P]; B, C [B, T, G, N])")
  return b


def replay_verify(x, dt, A, B, C, bufs, plan, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                  lengths=None, implementation=None):
  """ReplaySSM Mamba2 speculative verify: T = ``plan.num_tokens`` tokens per row in one step.

  Token 0 is the token the model emitted (it always commits); tokens 1..T-1 are drafts. Outputs
  are replayed from the checkpoint through the committed window, then through the T tokens under
  a causal decay mask (Mamba2 Alg. 4). Every token is appended to the ring past the live window
  (``plan.write_index(i)``); flushing rows fold the committed window and token 0 only — drafts
  are never folded — in the same program. Afterwards ``cursor.commit(plan, num_accepted)`` keeps
  the accepted prefix; that is the whole rollback. With T = 1 this is ``replay_decode``.

  Args:
    x: [B, T, H, P]; dt: [B, T, H]; A: [H]; B, C: [B, T, G, N]; z: [B, T, H, P] or None;
      D, dt_bias, dt_softplus: as in ``decode``.
    bufs: mamba2.ReplayBuffers, updated in place under donation.
    plan: ReplayPlan from ``cursor.plan(slots, num_tokens=T)``.
    lengths: optional int32[B] real tokens per row in [1, T] (None: all T). Lanes past a row's
      length are padding: zero output, no ring write, their inputs (NaN included) never read.
      Commit at most ``lengths`` tokens per row.
    implementation: None (fastest available), "xla", "pallas_triton" or "pallas_mosaic".
      Buffers with a read copy (``ReplayBuffers.read_copy``): verify does not read it (the
      outputs and buffers are those of the same buffers without one, bit for bit); wherever it
      writes the checkpoint it writes the copy too. Only decode steps read the copy.

  Returns:
    (y [B, T, H, P] in x's dtype, zeros on padding rows and padded lanes; bufs).
  """
  _check_buffers(bufs)
  b = _check_verify_inputs(x, dt, A, B, C, D, z, dt_bias, num_heads=bufs.num_heads, head_dim=bufs.head_dim,
                           state_dim=bufs.state_dim, num_groups=bufs.num_groups)
  _slots.check_plan(plan, bufs, b, "x")
  _slots.check_num_tokens("x", x, plan.num_tokens, "([B, T, H, P], T = plan.num_tokens)")
  lengths = _slots.check_lengths(lengths, b, plan.num_tokens, plan.slots)
  softplus = _check_softplus(dt_softplus)

  def run_xla():
    return _jit_xla_verify(x, dt, A, B, C, bufs, plan, lengths, D=D, z=z, dt_bias=dt_bias,
                           dt_softplus=softplus)

  def run_triton():
    from replayssm_jax.pallas import mamba2_verify_triton
    return mamba2_verify_triton.replay_verify(x, dt, A, B, C, bufs, plan, lengths, D=D, z=z,
                                              dt_bias=dt_bias, dt_softplus=softplus)

  def run_mosaic():
    from replayssm_jax.pallas import mamba2_mosaic
    return mamba2_mosaic.replay_verify(x, dt, A, B, C, bufs, plan, lengths, D=D, z=z,
                                       dt_bias=dt_bias, dt_softplus=softplus)

  prefer = config_lib.verify_implementations(
      device_kind=pallas_common.device_kind(), family="mamba2", state_dtype=bufs.state.dtype,
      num_tokens=plan.num_tokens, batch=b) if implementation is None else ()
  return _dispatch.run("mamba2.replay_verify", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton, "pallas_mosaic": run_mosaic},
                       prefer=prefer)


_jit_xla_verify = jax.jit(xla.replay_verify, static_argnames=("dt_softplus",))


def verify_conventional(x, dt, A, B, C, stack, slots, read_index, *, D=None, z=None, dt_bias=None,
                        dt_softplus=True, lengths=None, implementation=None):
  """Conventional speculative verify (the baseline engines run without ReplaySSM).

  Each row reads its current state ``stack[slot, read_index]``, steps it through its T tokens and
  writes the state after token i to ``stack[slot, i]``: T full states written per row and step.
  Rollback = choose the state at the accepted index: the next step reads
  ``read_index = num_accepted - 1``. After prefill, put the state at ``stack[slot, 0]`` with
  read index 0. Reading and writing the same stack is safe (all reads happen first).

  Args:
    x: [B, T, H, P]; dt: [B, T, H]; A: [H]; B, C: [B, T, G, N]; z: [B, T, H, P] or None;
      D, dt_bias, dt_softplus: as in ``decode``.
    stack: [N, T_max, H, P, N] states per slot, T_max >= T (float32 / bfloat16 / float16),
      updated in place under donation.
    slots: int32[B]; negative = padding row (zero output, nothing written).
    read_index: int32[B] in [0, T_max): the stack entry holding each row's current state.
    lengths: optional int32[B] real tokens per row in [1, T] (None: all T); padded lanes output
      zeros and write no state.
    implementation: None (fastest available), "xla" or "pallas_triton".

  Returns:
    (y [B, T, H, P] in x's dtype, stack).
  """
  _checks.expect_shape("x", x, (None,) * 4, "([B, T, H, P])")
  b, t = x.shape[:2]
  _slots.check_stack(stack, read_index, slots, b, t, "([N, T_max, H, P, N])")
  _, _, h, p, n = stack.shape
  _check_verify_inputs(x, dt, A, B, C, D, z, dt_bias, num_heads=h, head_dim=p, state_dim=n)
  lengths = _slots.check_lengths(lengths, b, t, slots)
  softplus = _check_softplus(dt_softplus)

  def run_xla():
    return _jit_xla_verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths, D=D, z=z,
                                        dt_bias=dt_bias, dt_softplus=softplus)

  def run_triton():
    from replayssm_jax.pallas import mamba2_verify_triton
    return mamba2_verify_triton.verify_conventional(x, dt, A, B, C, stack, slots, read_index, lengths,
                                                    D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus)

  return _dispatch.run("mamba2.verify_conventional", implementation,
                       {"xla": run_xla, "pallas_triton": run_triton})


_jit_xla_verify_conventional = jax.jit(xla.verify_conventional, static_argnames=("dt_softplus",))
