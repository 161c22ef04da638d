"""``replay_verify(implementation=None)`` on an H200: the config rule that puts the Mosaic verify
kernels first where they were measured faster, the dispatch order it feeds, and what compiles."""
import jax.numpy as jnp
import numpy as np
import pytest

import replayssm_jax as rs
from replayssm_jax import _dispatch
from replayssm_jax import config as config_lib
from tests.helpers import lower_for_h200

H200 = "NVIDIA H200"


@pytest.mark.parametrize("family,state_dtype,tokens,batch,expected", [
    ("gdn", jnp.float32, 4, 32, ("pallas_mosaic",)),
    ("gdn", jnp.float32, 8, 256, ("pallas_mosaic",)),
    ("gdn", jnp.float32, 2, 256, ()),            # a tie at T = 2: Triton stays first
    ("gdn", jnp.float32, 4, 8, ("pallas_mosaic",)),   # B = 1 and 8 measured (2026-11-30)
    ("gdn", jnp.float32, 8, 1, ("pallas_mosaic",)),
    ("gdn", jnp.float32, 2, 1, ("pallas_mosaic",)),   # T = 2: Mosaic at B = 1, a tie from B = 8
    ("gdn", jnp.float32, 2, 8, ()),
    ("mamba2", jnp.float32, 4, 1, ("pallas_mosaic",)),
    ("gdn", jnp.bfloat16, 4, 128, ()),           # bf16 measured at B = 256 only
    ("gdn", jnp.bfloat16, 4, 256, ("pallas_mosaic",)),
    ("mamba2", jnp.float32, 2, 32, ("pallas_mosaic",)),
    ("mamba2", jnp.bfloat16, 4, 256, ()),        # unmeasured
])
def test_verify_rule(family, state_dtype, tokens, batch, expected):
  assert config_lib.verify_implementations(device_kind=H200, family=family, state_dtype=state_dtype,
                                           num_tokens=tokens, batch=batch) == expected


@pytest.mark.parametrize("family,state_dtype,tokens,batch,expected", [
    ("gdn", jnp.float32, 4, 32, ("pallas_mosaic",)),
    ("gdn", jnp.float32, 8, 8, ("pallas_mosaic",)),
    ("gdn", jnp.float32, 2, 256, ()),            # within 3 % both ways at T = 2: Triton stays first
    ("gdn", jnp.float32, 2, 1, ()),              # unlike the H200, T = 2 B = 8 favoured Triton
    ("mamba2", jnp.float32, 4, 256, ("pallas_mosaic",)),
    ("mamba2", jnp.float32, 2, 256, ()),         # unmeasured on the H100
    ("gdn", jnp.bfloat16, 4, 256, ()),           # unmeasured on the H100
])
def test_verify_rule_h100(family, state_dtype, tokens, batch, expected):
  assert config_lib.verify_implementations(device_kind="NVIDIA H100 80GB HBM3", family=family,
                                           state_dtype=state_dtype, num_tokens=tokens,
                                           batch=batch) == expected


def test_verify_rule_other_devices_and_bad_family():
  for kind in ("cpu", "NVIDIA A100-SXM4-80GB"):
    assert config_lib.verify_implementations(device_kind=kind, family="gdn", state_dtype=jnp.float32,
                                             num_tokens=4, batch=256) == ()
  with pytest.raises(ValueError, match="family='rwkv'"):
    config_lib.verify_implementations(device_kind=H200, family="rwkv", state_dtype=jnp.float32,
                                      num_tokens=4, batch=256)


def test_dispatch_tries_the_preference_first_then_falls_through(monkeypatch):
  calls = []

  def impl(name, fail=False):
    def run():
      calls.append(name)
      if fail:
        raise NotImplementedError(f"{name} cannot")
      return name
    return run

  monkeypatch.setattr(_dispatch, "_auto_order", lambda: ("pallas_triton", "xla"))
  table = {"xla": impl("xla"), "pallas_triton": impl("pallas_triton"), "pallas_mosaic": impl("pallas_mosaic")}
  assert _dispatch.run("op", None, table, prefer=("pallas_mosaic",)) == "pallas_mosaic"
  table["pallas_mosaic"] = impl("pallas_mosaic", fail=True)
  calls.clear()
  assert _dispatch.run("op", None, table, prefer=("pallas_mosaic",)) == "pallas_triton"
  assert calls == ["pallas_mosaic", "pallas_triton"]
  assert _dispatch.run("op", "xla", table, prefer=("pallas_mosaic",)) == "xla"   # named: no rule
  monkeypatch.setattr(_dispatch, "_auto_order", lambda: ("xla",))                  # CPU: no rule
  assert _dispatch.run("op", None, table, prefer=("pallas_mosaic",)) == "xla"


def _gdn_verify_lowering(tokens):
  b, hk, hv, kd, vd, n = 32, 16, 32, 128, 128, 40
  bf16 = jnp.bfloat16
  cursor = rs.ReplayCursor.create(n, buffer_len=8, max_draft=tokens - 1)
  bufs = rs.gdn.ReplayBuffers.create(n, cursor, num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                                     head_v_dim=vd, state_dtype=jnp.float32, ring_dtype=bf16)
  x = (jnp.zeros((b, tokens, hk, kd), bf16), jnp.zeros((b, tokens, hk, kd), bf16),
       jnp.zeros((b, tokens, hv, vd), bf16), jnp.zeros((b, tokens, hv), bf16),
       jnp.zeros((b, tokens, hv), bf16))
  slots = jnp.asarray(np.arange(b), jnp.int32)
  return lower_for_h200(lambda bb, p, *xs: rs.gdn.replay_verify(*xs, bb, p), (0,), bufs,
                        cursor.plan(slots, num_tokens=tokens), *x)


def test_none_compiles_the_rules_kernel_for_an_h200(monkeypatch):
  """implementation=None lowered for an abstract H200 (GPU dispatch order): the Mosaic kernel at
  T = 4, B = 32; Triton's at T = 2."""
  monkeypatch.setattr(_dispatch, "_auto_order", lambda: ("pallas_triton", "xla"))
  text = _gdn_verify_lowering(4)
  assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
  text = _gdn_verify_lowering(2)
  assert "mosaic_gpu" not in text and "__gpu$xla.gpu.triton" in text
