"""Peer arm: vLLM's Mamba2 ReplaySSM decode kernel, called through jax_triton inside the Mamba2 harness.

    python -m bench.peer_vllm [--peer-dir DIR] [bench.mamba2_decode options]

runs bench.mamba2_decode with our best arms (conv-pallas, replay-pallas-oo, replay-mosaic-rc), this
arm and mamba_ssm's conventional kernel (bench.peer_mamba_ssm); ``--arms`` picks others.

``peer-vllm-replay``: ``selective_state_update_replayssm_output_only``'s two launches
(``vllm/model_executor/layers/mamba/ops/selective_state_update_replayssm_output_only.py``, merged
in vLLM PR 48018, released in vLLM 0.33.0): ``_replayssm_output_only_precompute_kernel`` (the
window's k_j·q per group into a [B, G, L] float32 scratch, 2 warps, grid (B, G)), then
``_replayssm_output_only_kernel`` (non-flush rows: output only, from the checkpoint read at C and the
window; flush rows: the state rebuilt with a ``tl.dot`` in tf32x3 and written), with the launch
config vLLM's own ``get_replayssm_config`` returns for this device (on Hopper: 16 rows of P per
program, 1 warp, N tiles 64 / 128, 2 stages). ``write_pos`` = our cursor's count, ``is_flush`` =
our plan's flush flag; padding rows are slot -1 (its ``null_block_id``, a kernel argument; it
leaves their output unwritten where ours writes zeros: the benchmark has no padding rows).

Its ring holds the raw step inputs — x [slots, H, L, P] (activation dtype), Δ [slots, H, L]
float32, B [slots, G, L, N] — where ours holds Δ·x and Δ·A: the setup's buffers are ours converted
(x = Δx / Δ, Δ = ΔA / A), the same history; the gate converts them back. Cursors start at ring base
0 (its ring is indexed from 0).

Source: the ``vllm`` package directory (``--peer-dir`` or an installed vLLM); the four files the
kernel needs are loaded (``mamba_ssm.py`` for its ``softplus``, ``triton_helpers.py``,
``replayssm_config.py``, the kernel file), the vLLM runtime modules they import (platform, logger,
envs, custom ops) replaced by stubs.
"""
import logging
import types

import flax
import jax
import jax.numpy as jnp

from bench import harness
from bench import peer_common

_OPS = "vllm.model_executor.layers.mamba.ops"


@flax.struct.dataclass
class VllmRing:
  """vLLM's replay buffers (all P layers): state [N, H, P, N_s], x_cache [N, H, L, P], dt_cache
  [N, H, L] float32 (Δ), B_cache [N, G, L, N_s]."""
  state: jax.Array
  x_cache: jax.Array
  dt_cache: jax.Array
  B_cache: jax.Array


def _from_ours(bufs, params):
  delta = bufs.ring_a / params["A"][None, :, None]                       # Δ = (Δ·A) / A
  x = (bufs.ring_x.astype(jnp.float32) / delta[..., None]).astype(bufs.ring_x.dtype)
  return VllmRing(state=bufs.state, x_cache=x, dt_cache=delta, B_cache=bufs.ring_B)


def _to_ours(ring, params):
  from replayssm_jax.mamba2.buffers import ReplayBuffers  # noqa: PLC0415
  dx = (ring.x_cache.astype(jnp.float32) * ring.dt_cache[..., None]).astype(ring.x_cache.dtype)
  return ReplayBuffers(state=ring.state, ring_x=dx, ring_B=ring.B_cache,
                       ring_a=ring.dt_cache * params["A"][None, :, None])


def _platform():
  """The few ``current_platform`` queries the kernel files make, answered for this CUDA device."""
  major = peer_common.compute_capability()[0]
  return types.SimpleNamespace(is_rocm=lambda: False, is_xpu=lambda: False, is_cpu=lambda: False,
                               is_device_capability_family=lambda cap: major == cap // 10)


def _load():
  peer_common.import_jax_triton()
  import triton  # noqa: PLC0415
  import triton.language as tl  # noqa: PLC0415
  stubs = {
      "vllm.envs": {}, "vllm._custom_ops": {}, "vllm.logger": {"init_logger": logging.getLogger},
      "vllm.platforms": {"current_platform": _platform()},
      "vllm.triton_utils": {"HAS_TRITON": True, "tl": tl, "triton": triton},
      "vllm.utils.platform_utils": {"get_device_name_as_file_name": lambda: "unused"},
      "vllm.v1.attention.backends.utils": {"NULL_BLOCK_ID": 0},
  }
  config, kernel = peer_common.load_modules(
      "vllm", [f"{_OPS}.replayssm_config", f"{_OPS}.selective_state_update_replayssm_output_only"],
      stubs=stubs)
  from bench import peer_kernels  # noqa: PLC0415
  peer_kernels.bind("VLLM_PRECOMPUTE", kernel._replayssm_output_only_precompute_kernel)
  peer_kernels.bind("VLLM_REPLAY", kernel._replayssm_output_only_kernel)
  return types.SimpleNamespace(precompute=peer_kernels.vllm_precompute, replay=peer_kernels.vllm_replay_output_only,
                               config=config.get_replayssm_config)


def _prepare(kernels, case, inputs, params):
  return inputs   # x, dt, B, C, z as the kernel takes them


def _step(kernels, case, inputs, params, ring, plan):
  """One ReplaySSM step of vLLM's kernels: (y [B, H, P], ring)."""
  peer_common.require_ring_is_buffer_len(case)
  x, dt, B, C, z = inputs
  batch, H, P = x.shape
  G, N = B.shape[1:]
  L = case.setup.buffer_len
  block_m, warps, nf_tile, fl_tile, stages = kernels.config("mamba2_output_only", dstate=N, L=L)
  bs_n, k_cache = peer_common.pow2(N), max(1, peer_common.pow2(L))
  nf, fl = max(16, min(nf_tile, bs_n)), max(16, min(fl_tile, bs_n))
  write_pos, is_flush = plan.count, plan.flush.astype(jnp.int8)
  bc_pre = peer_common.triton_call(
      B, C, ring.B_cache, write_pos, is_flush, plan.slots, kernel=kernels.precompute,
      out_shape=jax.ShapeDtypeStruct((batch, G, L), jnp.float32), grid=(batch, G), num_warps=2,
      batch=batch, ngroups=G, dstate=N, L=L, BLOCK_SIZE_K=k_cache, BLOCK_SIZE_DSTATE=bs_n)
  y, state, x_cache, dt_cache, B_cache = peer_common.triton_call(
      ring.state, jnp.zeros((1,), jnp.uint32), x, dt, params["dt_bias"], params["A"], B, C, params["D"], z,
      ring.x_cache, ring.dt_cache, ring.B_cache, bc_pre, write_pos, is_flush, plan.slots,
      kernel=kernels.replay,
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), ring.state, ring.x_cache, ring.dt_cache, ring.B_cache],
      grid=(-(-P // block_m), batch, H), input_output_aliases={0: 1, 10: 2, 11: 3, 12: 4},
      num_warps=warps, num_stages=stages,
      batch=batch, nheads=H, dim=P, dstate=N, ngroups=G, L=L, BLOCK_SIZE_M=block_m,
      BLOCK_SIZE_K_CACHE=k_cache, BLOCK_SIZE_K_DOT=max(16, k_cache), NF_DSTATE_TILE=nf,
      NF_NDS=-(-bs_n // nf), FL_DSTATE_TILE=fl, FL_NDS=-(-bs_n // fl), BLOCK_SIZE_DSTATE=bs_n)
  return y, ring.replace(state=state, x_cache=x_cache, dt_cache=dt_cache, B_cache=B_cache)


LAYOUT = peer_common.RingLayout("vllm", from_ours=_from_ours, to_ours=_to_ours)
REPLAY = peer_common.Peer("vllm", _load, _prepare, _step, layout=LAYOUT)
ARMS = (harness.Arm("peer-vllm-replay", "replay", "peer", peer=REPLAY),)
DEFAULT_ARMS = ("conv-pallas", "replay-pallas-oo", "replay-mosaic-rc", "peer-vllm-replay", "peer-mamba-ssm-conv")


def main(argv=None) -> dict:
  """``python -m bench.peer_vllm``: bench.mamba2_decode with our best arms and the peers' (module doc)."""
  from bench import mamba2_decode  # noqa: PLC0415
  return harness.main(mamba2_decode.BENCH.with_peers("peer_vllm", DEFAULT_ARMS), argv)


if __name__ == "__main__":
  main()
