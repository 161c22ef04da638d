"""GPU-only checks of the compiled Pallas Mamba2 verify kernels (marker ``gpu``): Triton, and the
Mosaic GPU reconstruct kernel.

At Nemotron-3-Super geometry (H 128, P 64, N 128, G 8) the compiled ``replay_verify`` and
``verify_conventional`` run steps with random accepted counts, short rows and a padding row, across
natural and forced flushes, against the independent float64 oracle (a TF32 product anywhere would
show errors near 1e-3); donated steps must not copy the checkpoint pool or the state stack.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from tests.helpers import max_err, set_mosaic_rows
from tests.test_mamba2_ops import make_params, mamba2_step_f64
from tests.test_mamba2_verify import _token, _tokens

pytestmark = pytest.mark.gpu

SUPER = (128, 8, 64, 128)                      # (H, G, P, N)
SLOTS = np.array([5, -1, 2, 7], np.int32)      # a padding row in the middle
IMPL = "pallas_triton"


def _run(state_dtype, num_tokens, buffer_len, steps, seed=0, impl=IMPL):
  """``replay_verify`` runs under ``impl``; the conventional verify and materialize are Triton's."""
  h, g, p, n = SUPER
  rng = np.random.default_rng(seed)
  params = make_params(rng, h)
  jp = {k: jnp.asarray(getattr(params, k), jnp.float32) for k in ("A", "D", "dt_bias")}
  cursor = rs.ReplayCursor.create(8, buffer_len=buffer_len, max_draft=num_tokens - 1)
  bufs = rs.mamba2.ReplayBuffers.create(8, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n, state_dtype=state_dtype, ring_dtype=jnp.float32)
  live = SLOTS >= 0
  S = np.asarray(jnp.asarray(0.1 * rng.normal(size=(len(SLOTS), h, p, n)), state_dtype)
                 .astype(jnp.float32), np.float64)   # as stored
  slots = jnp.asarray(SLOTS)
  bufs, cursor = rs.mamba2.write_state(bufs, cursor, slots, jnp.asarray(S, jnp.float32))
  stack = jnp.zeros((8, num_tokens, h, p, n), state_dtype).at[SLOTS[live], 0].set(
      jnp.asarray(S[live], state_dtype))
  read = np.zeros(len(SLOTS), np.int32)
  errs = {"replay": 0.0, "state": 0.0, "conv": 0.0}
  flushes = 0
  for t in range(steps):
    lengths = np.where(rng.random(len(SLOTS)) < 0.3, rng.integers(1, num_tokens + 1, len(SLOTS)),
                       num_tokens).astype(np.int32)
    acc = rng.integers(1, lengths + 1).astype(np.int32)
    step = _tokens(rng, len(SLOTS), num_tokens, SUPER)
    a = step.as_jax()
    plan = cursor.plan(slots, num_tokens=num_tokens, force_flush=jnp.asarray(SLOTS == 2) & (t == 1))
    flushes += int(np.sum(np.asarray(plan.flush)))
    kw = dict(D=jp["D"], z=a["z"], dt_bias=jp["dt_bias"], lengths=jnp.asarray(lengths),
              implementation=IMPL)
    y, bufs = rs.mamba2.replay_verify(a["x"], a["dt"], jp["A"], a["B"], a["C"], bufs, plan,
                                      **{**kw, "implementation": impl})
    yc, stack = rs.mamba2.verify_conventional(a["x"], a["dt"], jp["A"], a["B"], a["C"], stack, slots,
                                              jnp.asarray(read), **kw)
    cursor = cursor.commit(plan, jnp.asarray(acc))
    y, yc = np.asarray(y, np.float64), np.asarray(yc, np.float64)
    lanes = live[:, None] & (np.arange(num_tokens)[None, :] < lengths[:, None])
    assert np.all(y[~lanes] == 0) and np.all(yc[~lanes] == 0)
    states = []
    for i in range(num_tokens):
      y_ref, S_i = mamba2_step_f64(S if i == 0 else states[-1], _token(step, i, slice(None)).rounded(),
                                   params)
      states.append(S_i)
      real = lanes[:, i]
      scale = max(1.0, float(np.max(np.abs(y_ref[real])))) if real.any() else 1.0
      errs["replay"] = max(errs["replay"], max_err(y[real, i], y_ref[real]) / scale)
      errs["conv"] = max(errs["conv"], max_err(yc[real, i], y_ref[real]) / scale)
    S = np.stack([states[acc[r] - 1][r] for r in range(len(SLOTS))])
    read = np.where(live, acc - 1, 0).astype(np.int32)
    state = np.asarray(rs.mamba2.materialize(bufs, cursor, slots, implementation=IMPL))
    errs["state"] = max(errs["state"], max_err(state[live], S[live]))
  assert flushes >= 2
  return errs


@pytest.mark.parametrize("num_tokens,buffer_len", [(2, 8), (4, 16), (8, 16)])
def test_compiled_verify_f32_matches_float64_oracle(num_tokens, buffer_len):
  """The H200 default route (reconstruct)."""
  errs = _run(jnp.float32, num_tokens, buffer_len, steps=2 * buffer_len // num_tokens + 4)
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5 and errs["conv"] < 5e-5, errs


@pytest.mark.parametrize("num_tokens,state_dtype", [(4, jnp.float32), (8, jnp.float32), (4, jnp.bfloat16)])
def test_compiled_verify_output_only_route(monkeypatch, num_tokens, state_dtype):
  """The output-only route (T×T products, then the fold pass), taken by name."""
  real = config_lib.mamba2_verify_config
  monkeypatch.setattr(config_lib, "mamba2_verify_config", lambda **kw: real(**{**kw, "route": "output_only"}))
  errs = _run(state_dtype, num_tokens, 16, steps=12, seed=4)
  bound = 5e-5 if state_dtype == jnp.float32 else 5e-2
  assert errs["replay"] < bound and errs["state"] < bound, errs


@pytest.mark.parametrize("num_tokens,buffer_len,state_dtype", [(4, 8, jnp.float32), (8, 16, jnp.float32),
                                                            (4, 8, jnp.bfloat16)])
def test_compiled_mosaic_verify_matches_float64_oracle(num_tokens, buffer_len, state_dtype):
  """implementation="pallas_mosaic" (reconstruct route, 64-row WGMMA tiles) against float64."""
  errs = _run(state_dtype, num_tokens, buffer_len, steps=2 * buffer_len // num_tokens + 4, seed=5,
              impl="pallas_mosaic")
  bound = 5e-5 if state_dtype == jnp.float32 else 5e-2
  assert errs["replay"] < bound and errs["state"] < bound, errs


@pytest.mark.parametrize("rows", [2, 4])
def test_compiled_mosaic_verify_rows_per_program(monkeypatch, rows):
  """The Mosaic verify with 2 or 4 batch rows per program (doubled SMEM buffers, the next row's
  TMA issued before the current row computes) against float64; with 4 one program takes the
  whole batch, padding row included, through two pairs."""
  set_mosaic_rows(monkeypatch, rows, "mosaic_mamba2_verify_config")
  errs = _run(jnp.float32, 4, 8, steps=8, seed=6, impl="pallas_mosaic")
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs


def test_compiled_verify_bf16_state():
  errs = _run(jnp.bfloat16, 4, 16, steps=12)
  # The conventional stack rounds every state to bf16; the ReplaySSM checkpoint only at flushes.
  assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


def test_donated_verify_does_not_copy_the_pool_or_stack():
  h, g, p, n = SUPER
  num_slots, b, t = 16, 8, 4
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=16, max_draft=t - 1)
  bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=h, head_dim=p, num_groups=g,
                                        state_dim=n, ring_dtype=jnp.bfloat16)
  stack = jnp.zeros((num_slots, t, h, p, n), jnp.float32)
  a = _tokens(np.random.default_rng(0), b, t, SUPER).as_jax("bfloat16")
  A = jnp.full((h,), -1.0, jnp.float32)
  slots = jnp.arange(b, dtype=jnp.int32)

  def replay(bufs, cursor, x, dt, B, C, z):
    plan = cursor.plan(slots, num_tokens=t)
    y, bufs = rs.mamba2.replay_verify(x, dt, A, B, C, bufs, plan, z=z, implementation=IMPL)
    return y, bufs, cursor.commit(plan)

  def conventional(stack, x, dt, B, C, z):
    return rs.mamba2.verify_conventional(x, dt, A, B, C, stack, slots, jnp.zeros((b,), jnp.int32),
                                         z=z, implementation=IMPL)

  inputs = (a["x"], a["dt"], a["B"], a["C"], a["z"])
  for fn, args, shape in ((replay, (bufs, cursor), f"f32[{num_slots},{h},{p},{n}]"),
                          (conventional, (stack,), f"f32[{num_slots},{t},{h},{p},{n}]")):
    compiled = jax.jit(fn, donate_argnums=tuple(range(len(args)))).lower(*args, *inputs).compile()
    copies = [line for line in compiled.as_text().splitlines() if " copy(" in line and shape in line]
    assert not copies, copies
