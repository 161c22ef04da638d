"""GDN references (``gdn.recurrent``, ``gdn.chunked``) against an independent float64 loop.

Outputs and final states are compared by max-abs error at unit scale; 2e-5 for float32 math,
which a single TF32 dot (~5e-4 relative) would fail.
"""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import gdn
from tests.helpers import GdnStep, gdn_step_f64, make_gdn_step, max_err, tolerance

TOL = tolerance("float32", "float32")
B = 2
# (Hk, Hv, K, V). MHA keeps GQA's Hv, K, V so both share the compiled references (fast tests).
GQA = (2, 4, 16, 8)
MHA = (4, 4, 16, 8)


def make_inputs(seed, t, geometry, *, decay=(0.02, 1.0), beta=None):
  """float64 (q, k, v, g, beta) [B, T, ...] from T realistic steps, and S_0 [B, Hv, V, K]."""
  hk, hv, kd, vd = geometry
  rng = np.random.default_rng(seed)
  steps = [make_gdn_step(rng, B, hk, hv, kd, vd, decay=decay) for _ in range(t)]
  q, k, v, g, b = (np.stack([getattr(s, f) for s in steps], axis=1)
                   for f in ("q", "k", "v", "g", "beta"))
  if beta is not None:
    b = rng.uniform(*beta, size=b.shape)
  return (q, k, v, g, b), 0.5 * rng.normal(size=(B, hv, vd, kd))


def gdn_f64(q, k, v, g, beta, S0=None, scale=None):
  """Float64 oracle, one exact step per token: (o [B, T, Hv, V], S_T [B, Hv, V, K])."""
  b, t, hv, vd = v.shape
  S = np.zeros((b, hv, vd, q.shape[-1])) if S0 is None else S0
  o = []
  for i in range(t):
    o_i, S = gdn_step_f64(S, GdnStep(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]), scale)
    o.append(o_i)
  return np.stack(o, axis=1), S


def as_jax(xs, dtype=jnp.float32):
  return tuple(jnp.asarray(x, dtype) for x in xs)


def rounded(xs, dtype):
  """float64 copies of xs as the references see them after casting to ``dtype``."""
  return tuple(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for x in xs)


def assert_close(got, want, tol=TOL, what=""):
  """Max-abs error within ``tol`` at unit scale, i.e. tol · max(1, max|want|)."""
  got = np.asarray(got, np.float64)
  finite = bool(np.isfinite(got).all())
  assert finite, f"{what}: non-finite values"
  err, bound = max_err(got, want), tol * max(1.0, float(np.max(np.abs(want))))
  assert err <= bound, f"{what}: max-abs error {err:.3g} > {bound:.3g}"


def check_all(inputs, S0, *, chunk_size, scale=None, tol=TOL):
  """recurrent and chunked vs the float64 oracle, and vs each other (outputs and states)."""
  o_ref, S_ref = gdn_f64(*inputs, S0, scale)
  init = None if S0 is None else jnp.asarray(S0, jnp.float32)
  o_r, S_r = gdn.recurrent(*as_jax(inputs), scale=scale, initial_state=init)
  o_c, S_c = gdn.chunked(*as_jax(inputs), scale=scale, initial_state=init, chunk_size=chunk_size)
  assert o_r.shape == o_c.shape == o_ref.shape and S_r.shape == S_c.shape == S_ref.shape
  assert S_r.dtype == S_c.dtype == jnp.float32
  assert_close(o_r, o_ref, tol, "recurrent o")
  assert_close(S_r, S_ref, tol, "recurrent S")
  assert_close(o_c, o_ref, tol, "chunked o")
  assert_close(S_c, S_ref, tol, "chunked S")
  assert_close(o_c, o_r, tol, "chunked vs recurrent o")
  assert_close(S_c, S_r, tol, "chunked vs recurrent S")


@pytest.mark.parametrize("geometry", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("t", [1, 5, 64, 100])
def test_matches_float64(t, chunk_size, geometry):
  inputs, S0 = make_inputs(t, t, geometry)
  check_all(inputs, None, chunk_size=chunk_size)
  check_all(inputs, S0, chunk_size=chunk_size)


def test_large_heads_custom_scale():
  inputs, S0 = make_inputs(1, 40, (2, 4, 128, 128))
  check_all(inputs, S0, chunk_size=16)
  check_all(inputs, S0, chunk_size=16, scale=0.3)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("decay,beta", [((5e-4, 1.5e-3), (0.99, 1.0)), ((19.0, 21.0), None)],
                         ids=["slow_decay_beta_1", "strong_decay_underflow"])
def test_decay_extremes(decay, beta, chunk_size):
  # Strong decay: e^{G} within a 64-chunk reaches e^-1300 (0 in float32); must stay NaN-free.
  inputs, S0 = make_inputs(2, 100, GQA, decay=decay, beta=beta)
  check_all(inputs, S0, chunk_size=chunk_size)


def test_bfloat16_inputs():
  inputs, S0 = make_inputs(3, 100, GQA)
  xs = as_jax(inputs, jnp.bfloat16)
  init = jnp.asarray(S0, jnp.bfloat16)
  # The math is float32 on the bf16-rounded inputs: states stay exact, outputs carry bf16 rounding.
  o_ref, S_ref = gdn_f64(*rounded(inputs, jnp.bfloat16), *rounded((S0,), jnp.bfloat16))
  for o, S in (gdn.recurrent(*xs, initial_state=init),
               gdn.chunked(*xs, initial_state=init, chunk_size=16)):
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert_close(o, o_ref, tolerance("float32", "bfloat16"), "o")
    assert_close(S, S_ref, TOL, "S")


@pytest.mark.parametrize("fn", [gdn.recurrent, gdn.chunked], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("changes,match", [
    ({"q": np.zeros((B, 3, 16))}, "q has shape [2, 3, 16]; expected [?, ?, ?, ?]"),
    ({"k": np.zeros((B, 3, 2, 8))}, "k has shape [2, 3, 2, 8]; expected [2, 3, 2, 16]"),
    ({"v": np.zeros((B, 4, 4, 8))}, "v has shape [2, 4, 4, 8]; expected [2, 3, ?, ?]"),
    ({"v": np.zeros((B, 3, 3, 8))}, "q has 2 key heads and v has 3 value heads"),
    ({"g": np.zeros((B, 3, 2))}, "g has shape [2, 3, 2]; expected [2, 3, 4]"),
    ({"beta": np.zeros((B, 4, 3))}, "beta has shape [2, 4, 3]; expected [2, 3, 4]"),
    ({"initial_state": np.zeros((B, 4, 16, 8))},
     "initial_state has shape [2, 4, 16, 8]; expected [2, 4, 8, 16]"),
    ({"q": np.zeros((B, 3, 2, 16), np.int32)}, "q has dtype int32"),
    ({"initial_state": np.zeros((B, 4, 8, 16), np.int32)}, "initial_state has dtype int32"),
], ids=["q_rank", "k_dim", "v_time", "gqa_ratio", "g_heads", "beta_transposed",
        "state_transposed", "q_int", "state_int"])
def test_bad_inputs_raise(fn, changes, match):
  (q, k, v, g, beta), _ = make_inputs(4, 3, GQA)
  args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None) | changes
  args = {n: None if x is None else jnp.asarray(x) for n, x in args.items()}
  init = args.pop("initial_state")
  with pytest.raises(ValueError, match=re.escape(match)):
    fn(*args.values(), initial_state=init)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.5, True])
def test_bad_chunk_size_raises(chunk_size):
  inputs, _ = make_inputs(5, 3, GQA)
  with pytest.raises(ValueError, match=re.escape(f"chunk_size={chunk_size!r}")):
    gdn.chunked(*as_jax(inputs), chunk_size=chunk_size)
