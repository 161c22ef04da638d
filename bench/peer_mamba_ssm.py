"""Peer arm: mamba_ssm's conventional Mamba2 decode kernel, through jax_triton in the Mamba2 harness.

``peer-mamba-ssm-conv``: ``_selective_scan_update_kernel``
(``mamba_ssm/ops/triton/selective_state_update.py``, the kernel of ``selective_state_update``):
one step reads and writes the state pool [slots, H, P, N], per head dt, A, dt_bias and D (its
``TIE_HDIM`` path, as a Mamba2 layer calls it), z gate, softplus, negative slots = padding rows.
Launch as its wrapper picks it for the state dim N: grid (P / BLOCK_SIZE_M, B, H), at N = 128
BLOCK_SIZE_M 4 with 4 warps.

Source: the ``mamba_ssm`` package directory (``--peer-dir``, e.g. a checkout of state-spaces/mamba,
or an installed mamba_ssm); mamba_ssm is released as a source distribution only, whose build compiles CUDA
extensions this arm does not need. Two files are loaded (the kernel and its ``softplus``).

Run it with ``python -m bench.peer_vllm`` (the Mamba2 peer run) or
``python -m bench.mamba2_decode --arms ...,peer-mamba-ssm-conv``.
"""
import types

import jax

from bench import harness
from bench import peer_common

# mamba_ssm's launch ladder on the state dim: (largest N, BLOCK_SIZE_M, warps); past it (4, 8).
_LAUNCH = ((16, 32, 4), (32, 16, 4), (64, 8, 4), (128, 4, 4))


def _load():
  peer_common.import_jax_triton()
  (kernel,) = peer_common.load_modules("mamba_ssm", ["mamba_ssm.ops.triton.selective_state_update"])
  from bench import peer_kernels  # noqa: PLC0415
  peer_kernels.bind("MAMBA_SSM_UPDATE", kernel._selective_scan_update_kernel)
  return types.SimpleNamespace(update=peer_kernels.mamba_ssm_update)


def _prepare(kernels, case, inputs, params):
  return inputs   # x, dt, B, C, z as the kernel takes them


def _step(kernels, case, inputs, params, pool, slots):
  """One conventional step: (y [B, H, P], pool)."""
  x, dt, B, C, z = inputs
  batch, H, P = x.shape
  G, N = B.shape[1:]
  block_m, warps = next(((m, w) for n, m, w in _LAUNCH if N <= n), (4, 8))
  pool, y = peer_common.triton_call(
      pool, x, dt, params["dt_bias"], params["A"], B, C, params["D"], z, slots, kernel=kernels.update,
      out_shape=[pool, jax.ShapeDtypeStruct(x.shape, x.dtype)], grid=(-(-P // block_m), batch, H),
      input_output_aliases={0: 0}, num_warps=warps, batch=batch, nheads=H, dim=P, dstate=N, ngroups=G,
      BLOCK_SIZE_M=block_m, BLOCK_SIZE_DSTATE=peer_common.pow2(N))
  return y, pool


CONV = peer_common.Peer("mamba_ssm", _load, _prepare, _step)
ARMS = (harness.Arm("peer-mamba-ssm-conv", "conv", "peer", peer=CONV),)
