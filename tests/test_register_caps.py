"""Register caps (replayssm_jax.pallas.register_caps): each lowered Triton module gets exactly the
cap named for it, the library's caps follow the jaxlib version, and bad caps are refused.

Lowered for an abstract H200 on CPU (tests/helpers.lower_for_h200). A spy above the library's
wrapper of Pallas' module lowering reads the attribute off each module it returns.
"""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxlib
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering

from bench import register_cap
from replayssm_jax import gdn, mamba2
from replayssm_jax.cursor import ReplayCursor
from replayssm_jax.pallas import register_caps
from tests.helpers import lower_for_h200

B, D = 4, 16


@pytest.fixture
def lowered_caps(monkeypatch):
  """lowered_caps(fn, *args) → {kernel name: its ttg.maxnreg, or None} over fn's Triton kernels."""
  seen = {}
  inner = lowering.lower_jaxpr_to_triton_module

  def spy(*args, **kwargs):
    result = inner(*args, **kwargs)
    attrs = result.module.operation.attributes
    name = ir.StringAttr(attrs["sym_name"]).value
    seen[name] = ir.IntegerAttr(attrs[register_caps.ATTRIBUTE]).value if register_caps.ATTRIBUTE in attrs else None
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", spy)

  def run(fn, *args):
    seen.clear()
    jax.clear_caches()   # JAX reuses an inner jit's lowering, even under a new outer jit
    lower_for_h200(fn, (), *args)
    return dict(seen)
  return run


def _gdn_step_args():
  cursor = ReplayCursor.create(B, buffer_len=4)
  bufs = gdn.ReplayBuffers.create(B, cursor, num_k_heads=1, num_v_heads=2, head_k_dim=D, head_v_dim=D,
                                  ring_dtype=jnp.bfloat16)
  qk = jnp.zeros((B, 1, D), jnp.bfloat16)
  g = jnp.zeros((B, 2), jnp.float32)
  return qk, qk, jnp.zeros((B, 2, D), jnp.bfloat16), g, g, bufs, cursor.plan(jnp.arange(B, dtype=jnp.int32))


def _gdn_step(q, k, v, g, beta, bufs, plan):
  return gdn.replay_decode(q, k, v, g, beta, bufs, plan, implementation="pallas_triton")


def _mamba2_caps(lowered_caps, route):
  cursor = ReplayCursor.create(B, buffer_len=4)
  bufs = mamba2.ReplayBuffers.create(B, cursor, num_heads=2, head_dim=D, num_groups=1, state_dim=D)
  x = jnp.zeros((B, 2, D), jnp.bfloat16)
  bc = jnp.zeros((B, 1, D), jnp.bfloat16)
  dt, a = jnp.zeros((B, 2), jnp.float32), -jnp.ones((2,), jnp.float32)

  def step(x, dt, bc, bufs, plan):
    return mamba2.replay_decode(x, dt, a, bc, bc, bufs, plan, route=route, implementation="pallas_triton")
  return lowered_caps(step, x, dt, bc, bufs, cursor.plan(jnp.arange(B, dtype=jnp.int32)))


def test_library_caps_follow_the_jaxlib_version(lowered_caps):
  version = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
  capped = version >= (0, 12)   # the jaxlib whose register counts grew (bench/RESULTS.md)
  assert register_caps.active_caps() == (register_caps.CAPS if capped else {})
  got = lowered_caps(_gdn_step, *_gdn_step_args())
  assert got == {"replayssm_gdn_replay_step": 128 if capped else None,
                 "replayssm_gdn_fold": 128 if capped else None}


def test_caps_reach_exactly_the_kernels_named(lowered_caps):
  args = _gdn_step_args()
  with register_caps.use_caps({"replayssm_gdn_fold": 96}):
    assert lowered_caps(_gdn_step, *args) == {"replayssm_gdn_replay_step": None, "replayssm_gdn_fold": 96}
  with register_caps.use_caps({}):
    assert lowered_caps(_gdn_step, *args) == {"replayssm_gdn_replay_step": None, "replayssm_gdn_fold": None}
  with register_caps.use_caps({"replayssm_gdn_replay": 64}):   # a part of a name is not a name
    assert set(lowered_caps(_gdn_step, *args).values()) == {None}
  before = register_caps.active_caps()
  with register_caps.use_caps(register_caps.CAPS):
    assert register_caps.active_caps() == register_caps.CAPS
  assert register_caps.active_caps() == before


def test_mamba2_caps_cover_the_output_only_route_only(lowered_caps):
  with register_caps.use_caps(register_caps.CAPS):
    assert _mamba2_caps(lowered_caps, "output_only") == {"replayssm_mamba2_replay_step": 128,
                                                          "replayssm_mamba2_fold": 128}
    # The reconstruct route (stores rebuilt states itself, no fold pass) was not measured capped.
    assert _mamba2_caps(lowered_caps, "reconstruct") == {"replayssm_mamba2_reconstruct": None}


@pytest.mark.parametrize("caps, match", [
    ([("replayssm_gdn_fold", 128)], "expected a mapping"),
    ({"": 128}, "kernel names are this library's pallas_call names"),
    ({"gdn_replay_step": 128}, r"replayssm_<family>_<kernel>; got 'gdn_replay_step'"),
    ({"replayssm_gdn_fold": 0}, r"caps\['replayssm_gdn_fold'\] = 0; expected an int in \[1, 255\]"),
    ({"replayssm_gdn_fold": 256}, r"= 256; expected"),
    ({"replayssm_gdn_fold": True}, r"= True; expected"),
    ({"replayssm_gdn_fold": 128.0}, r"= 128.0; expected"),
])
def test_bad_caps_are_refused(caps, match):
  before = register_caps.active_caps()
  with pytest.raises(ValueError, match=match):
    with register_caps.use_caps(caps):
      pass
  assert register_caps.active_caps() == before


def test_environment_turns_the_caps_off():
  code = "from replayssm_jax.pallas import register_caps as r; print(r.active_caps())"
  env = {**os.environ, register_caps.ENV: "0"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "{}"


def test_caps_cite_their_results():
  results = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
  assert [f for f in register_caps.SOURCE if not (results / f).is_file()] == []


def test_bench_parse_caps():
  assert register_cap.parse_caps("replayssm_gdn_replay_step=128,replayssm_gdn_fold=96") == {
      "replayssm_gdn_replay_step": 128, "replayssm_gdn_fold": 96}
  assert register_cap.parse_caps("none") == {}
  for bad in ("replayssm_gdn_fold", "replayssm_gdn_fold=0", "=128", "replayssm_gdn_fold=x"):
    with pytest.raises(ValueError, match="expected NAME=N"):
      register_cap.parse_caps(bad)
