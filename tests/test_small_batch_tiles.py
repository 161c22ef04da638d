"""The small-batch tiles of the conventional and flush-every-step kernels on an H200
(config.SMALL_TILE_MAX_BATCH; the H200 launch tables cite the sweep), and that the ops lower with
them."""
import jax.numpy as jnp
import pytest

import replayssm_jax as rs
from replayssm_jax import config as config_lib
from tests.helpers import lower_for_h200

H200 = "NVIDIA H200"
SMALL, LARGE = config_lib.SMALL_TILE_MAX_BATCH, config_lib.SMALL_TILE_MAX_BATCH + 1


def _tile(cfg):
  return (getattr(cfg, "block_v", None) or cfg.block_p, cfg.num_warps)


@pytest.mark.parametrize("state_dtype,batch,expected", [
    (jnp.float32, 1, (8, 1)), (jnp.float32, SMALL, (8, 1)), (jnp.float32, LARGE, (16, 2)),
    (jnp.bfloat16, 1, (32, 4)), (jnp.bfloat16, 256, (32, 4)),
])
def test_gdn_decode_tiles(state_dtype, batch, expected):
  cfg = config_lib.decode_config(device_kind=H200, state_dtype=state_dtype, head_k_dim=128,
                                 head_v_dim=128, batch=batch)
  assert _tile(cfg) == expected


@pytest.mark.parametrize("state_dtype,ring_size,batch,expected", [
    (jnp.float32, 16, 256, (8, 1)), (jnp.bfloat16, 32, 256, (8, 1)),
    (jnp.bfloat16, 16, 8, (8, 1)), (jnp.bfloat16, 16, SMALL, (8, 1)),
    (jnp.bfloat16, 16, LARGE, (32, 4)),
])
def test_gdn_flush_decode_tiles(state_dtype, ring_size, batch, expected):
  cfg = config_lib.flush_decode_config(device_kind=H200, state_dtype=state_dtype, head_k_dim=128,
                                       head_v_dim=128, ring_size=ring_size, batch=batch)
  assert _tile(cfg) == expected


@pytest.mark.parametrize("state_dtype,batch,expected", [
    (jnp.float32, 1, (16, 1)), (jnp.float32, SMALL, (16, 1)), (jnp.float32, LARGE, (16, 2)),
    (jnp.bfloat16, 8, (8, 1)), (jnp.bfloat16, LARGE, (32, 4)),
])
def test_mamba2_decode_and_flush_tiles(state_dtype, batch, expected):
  kw = dict(device_kind=H200, state_dtype=state_dtype, head_dim=64, state_dim=128, batch=batch)
  assert _tile(config_lib.mamba2_decode_config(**kw)) == expected
  flush = config_lib.mamba2_flush_decode_config(**kw)
  assert _tile(flush) == expected and flush.block_n == 32


def test_cpu_tiles_ignore_the_batch():
  """Interpret mode keeps its multi-tile CPU configs whatever the batch."""
  for batch in (1, 256):
    cfg = config_lib.decode_config(device_kind="cpu", state_dtype=jnp.float32, head_k_dim=128,
                                   head_v_dim=128, batch=batch)
    assert _tile(cfg) == (16, 4)


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_small_batch_tiles_lower_for_h200(family):
  """B = 1 decode and flush-every-step replay compile for an abstract H200 with those tiles."""
  b, L = 1, 8
  cursor = rs.ReplayCursor.create(b, buffer_len=L)
  slots = jnp.zeros((b,), jnp.int32)
  plan = cursor.plan(slots, flush_all=True)
  if family == "gdn":
    hk, hv, d = 2, 4, 128
    q = k = jnp.zeros((b, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, hv, d), jnp.bfloat16)
    g = beta = jnp.zeros((b, hv), jnp.float32)
    bufs = rs.gdn.ReplayBuffers.create(b, cursor, num_k_heads=hk, num_v_heads=hv, head_k_dim=d,
                                       head_v_dim=d)
    text = lower_for_h200(lambda pool, s: rs.gdn.decode(q, k, v, g, beta, pool, s,
                                                        implementation="pallas_triton"),
                          (0,), bufs.state, slots)
    text += lower_for_h200(lambda bf, p: rs.gdn.replay_decode(q, k, v, g, beta, bf, p,
                                                             implementation="pallas_triton"),
                           (0,), bufs, plan)
  else:
    h, p, n, grp = 8, 64, 128, 2
    x = jnp.zeros((b, h, p), jnp.bfloat16)
    dt = jnp.zeros((b, h), jnp.float32)
    A, D, dt_bias = -jnp.ones((h,)), jnp.ones((h,)), jnp.zeros((h,))
    B = C = jnp.zeros((b, grp, n), jnp.bfloat16)
    bufs = rs.mamba2.ReplayBuffers.create(b, cursor, num_heads=h, head_dim=p, state_dim=n,
                                          num_groups=grp)
    text = lower_for_h200(lambda pool, s: rs.mamba2.decode(x, dt, A, B, C, pool, s, D=D,
                                                          dt_bias=dt_bias,
                                                          implementation="pallas_triton"),
                          (0,), bufs.state, slots)
    text += lower_for_h200(lambda bf, pl_: rs.mamba2.replay_decode(x, dt, A, B, C, bf, pl_, D=D,
                                                                  dt_bias=dt_bias,
                                                                  implementation="pallas_triton"),
                           (0,), bufs, plan)
  assert text.count("__gpu$xla.gpu.triton") >= 2
