"""GPU-only checks of the compiled Pallas GDN verify kernels (marker ``gpu``; skipped on CPU): Triton,
and the Mosaic GPU reconstruct kernel.

At the Qwen3.5-4B geometry (Hk 16, Hv 32, K = V = 128), ``replay_verify`` and ``verify_conventional``
(implementation="pallas_triton") run plan → verify → commit with random accepted counts over
several flushes, against the independent float64 oracle: outputs of every real lane, the
materialized state and the conventional stack state after each commit. A TF32 dot anywhere would
show errors near 1e-3; f32 stays below 5e-5. Also: a donated verify step copies no state pool.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from tests.helpers import GEOMETRIES, gdn_step_f64, max_err, set_mosaic_rows
from tests.test_gdn_verify import FIELDS, _token, _tokens

pytestmark = pytest.mark.gpu

HK, HV, KD, VD = GEOMETRIES["qwen35_4b"]
SLOTS = np.array([5, -1, 2, 7], np.int32)   # a padding row in the middle
IMPL = "pallas_triton"


def _run(num_tokens, buffer_len, state_dtype, steps, seed=0, impl=IMPL):
  """``replay_verify`` and ``materialize`` run under ``impl``; the conventional verify is Triton's."""
  rng = np.random.default_rng(seed)
  n, t = 8, num_tokens
  cursor = rs.ReplayCursor.create(n, buffer_len=buffer_len, max_draft=t - 1)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, state_dtype=state_dtype, ring_dtype=jnp.float32)
  live = SLOTS >= 0
  S0 = rng.normal(size=(len(SLOTS), HV, VD, KD)) * 0.05
  S0 = np.asarray(jnp.asarray(S0, state_dtype).astype(jnp.float32), np.float64)   # as stored
  slots = jnp.asarray(SLOTS)
  bufs, cursor = rs.gdn.write_state(bufs, cursor, slots, jnp.asarray(S0, jnp.float32))
  stack = jnp.zeros((n, t, HV, VD, KD), state_dtype).at[jnp.asarray(SLOTS[live]), 0].set(
      jnp.asarray(S0[live], state_dtype))
  read_index = np.zeros(len(SLOTS), np.int32)
  oracle = {int(s): S0[r] for r, s in enumerate(SLOTS) if s >= 0}
  errs = {"replay": 0.0, "conv": 0.0, "state": 0.0, "conv_state": 0.0}
  flushes = 0
  for _ in range(steps):
    lengths = np.where(rng.random(len(SLOTS)) < 0.25, rng.integers(1, t + 1, size=len(SLOTS)), t)
    acc = rng.integers(1, lengths + 1).astype(np.int32)
    lanes = live[:, None] & (np.arange(t)[None, :] < lengths[:, None])
    clean = _tokens(rng, len(SLOTS), t, (HK, HV, KD, VD))
    x = [jnp.asarray(getattr(clean, f), jnp.float32) for f in FIELDS]
    lens = jnp.asarray(lengths, jnp.int32)
    plan = cursor.plan(slots, num_tokens=t)
    flushes += int(np.sum(np.asarray(plan.flush)))
    o, bufs = rs.gdn.replay_verify(*x, bufs, plan, lengths=lens, implementation=impl)
    oc, stack = rs.gdn.verify_conventional(*x, stack, slots, jnp.asarray(read_index), lengths=lens,
                                           implementation=IMPL)
    cursor = cursor.commit(plan, jnp.asarray(acc))
    o, oc = np.asarray(o, np.float64), np.asarray(oc, np.float64)
    assert np.all(o[~lanes] == 0) and np.all(oc[~lanes] == 0)
    idx = np.flatnonzero(live)
    S = np.stack([oracle[int(SLOTS[r])] for r in idx])
    states = []
    for i in range(t):
      o64, S = gdn_step_f64(S, _token(clean, i, idx).rounded())
      states.append(S)
      real = lanes[idx, i]
      if real.any():
        errs["replay"] = max(errs["replay"], max_err(o[idx[real], i], o64[real]))
        errs["conv"] = max(errs["conv"], max_err(oc[idx[real], i], o64[real]))
    for j, r in enumerate(idx):
      oracle[int(SLOTS[r])] = states[acc[r] - 1][j]
    read_index[live] = acc[live] - 1
    want = np.stack([oracle[int(SLOTS[r])] for r in idx])
    M = np.asarray(rs.gdn.materialize(bufs, cursor, slots, implementation=impl), np.float64)
    errs["state"] = max(errs["state"], max_err(M[idx], want))
    got = np.asarray(stack.astype(jnp.float32), np.float64)[SLOTS[idx], read_index[idx]]
    errs["conv_state"] = max(errs["conv_state"], max_err(got, want))
  assert flushes >= 2, flushes
  return errs


@pytest.mark.parametrize("num_tokens,buffer_len", [(2, 8), (4, 16), (8, 16)])
def test_compiled_verify_f32_matches_float64_oracle(num_tokens, buffer_len):
  """The H200 default route (reconstruct)."""
  errs = _run(num_tokens, buffer_len, jnp.float32, steps=3 * buffer_len // num_tokens + 4)
  assert max(errs.values()) < 5e-5, errs


@pytest.mark.parametrize("num_tokens,buffer_len,state_dtype", [(4, 8, jnp.float32), (8, 16, jnp.float32),
                                                            (4, 8, jnp.bfloat16)])
def test_compiled_mosaic_verify_matches_float64_oracle(num_tokens, buffer_len, state_dtype):
  """implementation="pallas_mosaic" (reconstruct route, 64-row WGMMA tiles) against float64."""
  errs = _run(num_tokens, buffer_len, state_dtype, steps=3 * buffer_len // num_tokens + 4, seed=4,
              impl="pallas_mosaic")
  bound = 5e-5 if state_dtype == jnp.float32 else 5e-2
  assert errs["replay"] < bound and errs["state"] < bound, errs


@pytest.mark.parametrize("rows", [2, 4])
def test_compiled_mosaic_verify_rows_per_program(monkeypatch, rows):
  """The Mosaic verify with 2 or 4 batch rows per program (doubled SMEM buffers, the next row's
  TMA issued before the current row computes) against float64; the batch of 4 holds a padding
  row, so at 4 rows one program takes all four through two pairs."""
  set_mosaic_rows(monkeypatch, rows, "mosaic_verify_config")
  errs = _run(4, 8, jnp.float32, steps=10, seed=5, impl="pallas_mosaic")
  assert errs["replay"] < 5e-5 and errs["state"] < 5e-5, errs


def test_compiled_verify_split_route(monkeypatch):
  """The split output-only route (readout launch, then the step kernel on the readouts) against
  float64."""
  real = config_lib.verify_config
  monkeypatch.setattr(config_lib, "verify_config", lambda **kw: dataclasses.replace(
      real(**{**kw, "route": "output_only"}), split=True))
  errs = _run(4, 16, jnp.float32, steps=16, seed=2)
  assert max(errs.values()) < 5e-5, errs


@pytest.mark.parametrize("num_tokens,state_dtype", [(4, jnp.float32), (8, jnp.float32), (4, jnp.bfloat16)])
def test_compiled_verify_output_only_route(monkeypatch, num_tokens, state_dtype):
  """The output-only route (fused step kernel, then the fold pass), taken by name."""
  real = config_lib.verify_config
  monkeypatch.setattr(config_lib, "verify_config", lambda **kw: real(**{**kw, "route": "output_only"}))
  errs = _run(num_tokens, 16, state_dtype, steps=16, seed=3)
  bound = 5e-5 if state_dtype == jnp.float32 else 5e-2
  assert errs["replay"] < bound and errs["state"] < bound, errs


def test_compiled_verify_bf16_state():
  errs = _run(4, 16, jnp.bfloat16, steps=16, seed=1)
  assert errs["replay"] < 5e-2 and errs["state"] < 5e-2, errs


def test_donated_verify_does_not_copy_the_pool():
  n, b, t = 16, 8, 4
  cursor = rs.ReplayCursor.create(n, buffer_len=16, max_draft=t - 1)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=HK, num_v_heads=HV, head_k_dim=KD,
                                     head_v_dim=VD, ring_dtype=jnp.bfloat16)
  x = [jnp.asarray(getattr(_tokens(np.random.default_rng(0), b, t, (HK, HV, KD, VD)), f), jnp.bfloat16)
       for f in FIELDS]
  slots = jnp.arange(b, dtype=jnp.int32)

  def replay(bufs, cursor, *x):
    plan = cursor.plan(slots, num_tokens=t)
    o, bufs = rs.gdn.replay_verify(*x, bufs, plan, implementation=IMPL)
    return o, bufs, cursor.commit(plan)

  def conventional(stack, *x):
    return rs.gdn.verify_conventional(*x, stack, slots, jnp.zeros((b,), jnp.int32), implementation=IMPL)

  stack = jnp.zeros((n, t, HV, VD, KD), jnp.float32)
  for fn, args, shape in ((replay, (bufs, cursor), f"f32[{n},{HV},{VD},{KD}]"),
                          (conventional, (stack,), f"f32[{n},{t},{HV},{VD},{KD}]")):
    text = jax.jit(fn, donate_argnums=tuple(range(len(args)))).lower(*args, *x).compile().as_text()
    copies = [line for line in text.splitlines() if " copy(" in line and shape in line]
    assert not copies, copies
