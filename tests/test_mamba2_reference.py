"""Mamba2 references (``mamba2.recurrent``, ``mamba2.chunked``) against an independent float64 loop.

Outputs and final states are compared by max-abs error at unit scale; 2e-5 for float32 math,
which a single TF32 dot (~5e-4 relative) would fail.
"""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import mamba2
from tests.helpers import max_err, round_to_tf32, tolerance

TOL = tolerance("float32", "float32")
BT = 2
# (H, G, P, N): P ≠ N so a transposed state cannot pass.
SMALL = (4, 2, 8, 16)
MHA = (4, 4, 8, 16)
NEMOTRON_SLICE = (8, 2, 80, 128)   # Nemotron-3-Nano-4B head dim 80, d_state 128, 2 of its 8 groups
OPTIONS = ("D", "z", "dt_bias", "initial_state")


def make_inputs(seed, t, geometry=SMALL, *, decay="normal"):
  """float64 inputs as in the peers' Mamba2 tests (A = −rand−1, dt_bias = rand−4).

  ``decay``: "normal" (A·Δ ≈ −0.1), "strong" (A·Δ ≈ −30: underflows within a chunk) or
  "slow" (A·Δ ≈ −1e-4: the state integrates the whole sequence).
  """
  h, g, p, n = geometry
  rng = np.random.default_rng(seed)
  A = -(rng.uniform(size=h) + 1)
  dt_bias = rng.uniform(size=h) - 4
  if decay == "strong":
    A, dt_bias = 15 * A, dt_bias + 5.5
  elif decay == "slow":
    A = 1e-3 * A
  return dict(x=rng.normal(size=(BT, t, h, p)), dt=rng.normal(size=(BT, t, h)), A=A,
              B=rng.normal(size=(BT, t, g, n)), C=rng.normal(size=(BT, t, g, n)),
              D=rng.normal(size=h), z=rng.normal(size=(BT, t, h, p)), dt_bias=dt_bias,
              initial_state=0.5 * rng.normal(size=(BT, h, p, n)))


def mamba2_f64(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, initial_state=None):
  """Float64 oracle, one exact step per token: (y [Bt, T, H, P], S_T [Bt, H, P, N])."""
  b, t, h, p = x.shape
  g, n = B.shape[2:]
  group = np.arange(h) // (h // g)
  delta = dt + (0 if dt_bias is None else dt_bias)
  if dt_softplus:
    delta = np.logaddexp(0, delta)
  S = np.zeros((b, h, p, n)) if initial_state is None else np.array(initial_state)
  y = np.zeros((b, t, h, p))
  for i in range(t):
    d = delta[:, i]                                                   # [Bt, H]
    B_i, C_i = B[:, i][:, group], C[:, i][:, group]                   # [Bt, H, N]
    S = np.exp(d * A)[..., None, None] * S + (d[..., None] * x[:, i])[..., None] * B_i[:, :, None]
    y[:, i] = np.einsum("bhpn,bhn->bhp", S, C_i)
    if D is not None:
      y[:, i] += D[:, None] * x[:, i]
    if z is not None:
      y[:, i] *= z[:, i] / (1 + np.exp(-z[:, i]))
  return y, S


def rounded(inputs, dtype):
  """float64 copies of the inputs as the references see them after casting to ``dtype``."""
  return {k: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32), np.float64)
          for k, v in inputs.items()}


def assert_close(got, want, tol=TOL, what=""):
  """Max-abs error within ``tol`` at unit scale, i.e. tol · max(1, max|want|)."""
  got = np.asarray(got, np.float64)
  assert np.isfinite(got).all(), f"{what}: non-finite values"
  err, bound = max_err(got, want), tol * max(1.0, float(np.max(np.abs(want))))
  assert err <= bound, f"{what}: max-abs error {err:.3g} > {bound:.3g}"


def check_all(inputs, *, chunk_size, options=OPTIONS, dt_softplus=True, dtype=jnp.float32,
              tol=TOL):
  """recurrent and chunked vs the float64 oracle (outputs and states), using ``options``."""
  names = ("x", "dt", "A", "B", "C") + tuple(options)
  used = {k: inputs[k] for k in names}
  want_y, want_S = mamba2_f64(**(rounded(used, dtype) if dtype != jnp.float32 else used),
                              dt_softplus=dt_softplus)
  args = {k: jnp.asarray(v, dtype) for k, v in used.items()}
  pos = [args.pop(k) for k in ("x", "dt", "A", "B", "C")]
  for name, (y, S) in (
      ("recurrent", mamba2.recurrent(*pos, **args, dt_softplus=dt_softplus)),
      ("chunked", mamba2.chunked(*pos, **args, dt_softplus=dt_softplus, chunk_size=chunk_size))):
    assert y.shape == want_y.shape and y.dtype == dtype, (name, y.shape, y.dtype)
    assert S.shape == want_S.shape and S.dtype == jnp.float32, (name, S.shape, S.dtype)
    assert_close(y, want_y, tol, f"{name} y")
    # The state is float32 math on the (rounded) inputs: exact to float32 for every dtype.
    assert_close(S, want_S, TOL, f"{name} S")


@pytest.mark.parametrize("geometry", [SMALL, MHA], ids=["g2", "g4"])
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
@pytest.mark.parametrize("t", [1, 5, 64, 100])
def test_matches_float64(t, chunk_size, geometry):
  inputs = make_inputs(t, t, geometry)
  check_all(inputs, chunk_size=chunk_size, options=())
  check_all(inputs, chunk_size=chunk_size)


@pytest.mark.parametrize("options,dt_softplus", [
    (("D",), True), (("z",), True), (("dt_bias",), True), (("initial_state",), True),
    (("D", "z", "initial_state"), False),
], ids=["D", "z", "dt_bias", "initial_state", "no_softplus"])
def test_options(options, dt_softplus):
  inputs = make_inputs(6, 37, (4, 1, 8, 16))
  if not dt_softplus:
    inputs["dt"] = np.abs(inputs["dt"]) * 0.3                          # Δ = dt ≥ 0
  check_all(inputs, chunk_size=16, options=options, dt_softplus=dt_softplus)


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("decay", ["strong", "slow"])
def test_decay_extremes(decay, chunk_size):
  # Strong: L within a 64-chunk reaches ≈ −2000 (e^L = 0 in float32); must stay NaN-free.
  inputs = make_inputs(2, 100, decay=decay)
  h = inputs["A"].shape[0]
  delta = np.logaddexp(0, inputs["dt"] + inputs["dt_bias"])
  mean_log_decay = float(np.mean(delta * inputs["A"].reshape(1, 1, h)))
  assert (-60 < mean_log_decay < -15) if decay == "strong" else (-1e-3 < mean_log_decay < 0)
  check_all(inputs, chunk_size=chunk_size)


def test_bfloat16_inputs():
  # The math is float32 on the bf16-rounded inputs: states stay exact, outputs carry bf16 rounding.
  check_all(make_inputs(3, 100), chunk_size=16, dtype=jnp.bfloat16,
            tol=tolerance("float32", "bfloat16"))


@pytest.mark.parametrize("chunk_size", [8, 64])
def test_nemotron_head_slice(chunk_size):
  check_all(make_inputs(7, 20, NEMOTRON_SLICE), chunk_size=chunk_size)


@pytest.mark.parametrize("fn", [mamba2.recurrent, mamba2.chunked], ids=["recurrent", "chunked"])
@pytest.mark.parametrize("changes,match", [
    ({"x": np.zeros((BT, 3, 32))}, "x has shape [2, 3, 32]; expected [?, ?, ?, ?]"),
    ({"dt": np.zeros((BT, 4, 4))}, "dt has shape [2, 4, 4]; expected [2, 3, 4]"),
    ({"A": np.zeros((4, 1))}, "A has shape [4, 1]; expected [4]"),
    ({"B": np.zeros((BT, 4, 2, 16))}, "B has shape [2, 4, 2, 16]; expected [2, 3, ?, ?]"),
    ({"B": np.zeros((BT, 3, 3, 16)), "C": np.zeros((BT, 3, 3, 16))},
     "B has 3 groups and x has 4 heads; expected H a multiple of G"),
    ({"C": np.zeros((BT, 3, 2, 8))}, "C has shape [2, 3, 2, 8]; expected [2, 3, 2, 16]"),
    ({"D": np.zeros(2)}, "D has shape [2]; expected [4]"),
    ({"z": np.zeros((BT, 3, 4, 16))}, "z has shape [2, 3, 4, 16]; expected [2, 3, 4, 8]"),
    ({"dt_bias": np.zeros((BT, 4))}, "dt_bias has shape [2, 4]; expected [4]"),
    ({"initial_state": np.zeros((BT, 4, 16, 8))},
     "initial_state has shape [2, 4, 16, 8]; expected [2, 4, 8, 16]"),
    ({"x": np.zeros((BT, 3, 4, 8), np.int32)}, "x has dtype int32"),
    ({"A": np.zeros(4, np.int32)}, "A has dtype int32"),
    ({"initial_state": np.zeros((BT, 4, 8, 16), np.int32)}, "initial_state has dtype int32"),
], ids=["x_rank", "dt_time", "A_rank", "B_time", "group_ratio", "C_state", "D_heads", "z_dim",
        "dt_bias_rank", "state_transposed", "x_int", "A_int", "state_int"])
def test_bad_inputs_raise(fn, changes, match):
  args = make_inputs(4, 3) | changes
  args = {k: jnp.asarray(v) for k, v in args.items()}
  with pytest.raises(ValueError, match=re.escape(match)):
    fn(*[args.pop(k) for k in ("x", "dt", "A", "B", "C")], **args)


@pytest.mark.parametrize("chunk_size", [0, -2, 2.5, True])
def test_bad_chunk_size_raises(chunk_size):
  inputs = {k: jnp.asarray(v, jnp.float32) for k, v in make_inputs(5, 3).items()}
  with pytest.raises(ValueError, match=re.escape(f"chunk_size={chunk_size!r}")):
    mamba2.chunked(inputs.pop("x"), inputs.pop("dt"), inputs.pop("A"), inputs.pop("B"),
                   inputs.pop("C"), chunk_size=chunk_size)


def test_tolerance_catches_tf32():
  # A TF32 dot rounds its inputs to a 10-bit mantissa; doing that to x, B and C must fail TOL.
  inputs = make_inputs(8, 64)
  want_y, want_S = mamba2_f64(**inputs)
  tf32 = inputs | {k: round_to_tf32(inputs[k]) for k in ("x", "B", "C")}
  got_y, got_S = mamba2_f64(**tf32)
  for got, want in ((got_y, want_y), (got_S, want_S)):
    with pytest.raises(AssertionError, match="max-abs error"):
      assert_close(got, want)
