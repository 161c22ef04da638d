"""Peer arms: SGLang's GDN decode kernels, called through jax_triton inside the GDN harness.

    python -m bench.peer_sglang [--peer-dir DIR] [bench.gdn_decode options]

runs bench.gdn_decode with our best arms (conv-pallas, replay-pallas-oo) and these two
(``--arms`` picks others; ``python -m bench.gdn_decode --arms ...,peer-sglang-replay`` is the same):

* ``peer-sglang-replay``: ``fused_recurrent_linear_replayssm_decode_kernel``
  (``sglang/kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py``), SGLang's
  ReplaySSM decode, with its wrapper's launch (grid (V/BV, B, HV), BV = min(V, 64), K walked in
  nk = 2 chunks, 1 warp, 3 stages). Its ring is ours to the byte ([slots, HV, L, V] corrected
  deltas u, [slots, H, L, K] keys, [slots, HV, L] float32 log decays) but indexed from entry 0
  with ``write_pos`` = our cursor's count: its setup starts every cursor at base 0 (the ring size
  is L, so bases stay there). It flushes when write_pos = L - 1, as our plan does. Its
  reconstruction dot runs in the output dtype on tensor cores (bf16 here).
* ``peer-sglang-conv``: ``fused_recurrent_gated_delta_rule_packed_decode_kernel``
  (``sglang/kernels/ops/attention/fla/fused_recurrent.py``), SGLang's conventional packed decode
  (grid (V/32, B·HV), 1 warp, 3 stages): the state pool read and written every step.

Calling convention: q | k | v packed into one [B, 2·Hk·K + Hv·V] row (``mixed_qkv``), and the gates
as the kernels compute them, g = -exp(A_log)·softplus(a + dt_bias), β = sigmoid(b): with
A_log = dt_bias = 0, a = log(expm1(-g)) and b = logit(β) (float32) give our g and β. The packing
runs once per timed call, outside the loops (``Peer.prepare``), like our arms' operand slicing.

Source: the ``sglang`` package directory, from ``--peer-dir`` or an installed sglang 0.5.23
(``pip install --no-deps``); only the two kernel files are loaded, with a stub for the
``fla.op`` / ``fla.utils`` helpers the packed kernel imports (``exp = tl.exp``; ``input_guard``,
a decorator of torch wrappers we do not call).
"""
import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from bench import peer_common

_REPLAY = "sglang.kernels.ops.attention.linear.fused_recurrent_linear_replayssm"
_FLA = "sglang.kernels.ops.attention.fla"


def _load():
  peer_common.import_jax_triton()
  import triton.language as tl  # noqa: PLC0415  (present wherever jax_triton imports)
  replay, packed = peer_common.load_modules(
      "sglang", [_REPLAY, f"{_FLA}.fused_recurrent"],
      stubs={f"{_FLA}.op": {"exp": tl.exp}, f"{_FLA}.utils": {"input_guard": lambda fn: fn}})
  from bench import peer_kernels  # noqa: PLC0415
  peer_kernels.bind("SGLANG_REPLAY", replay.fused_recurrent_linear_replayssm_decode_kernel)
  peer_kernels.bind("SGLANG_PACKED", packed.fused_recurrent_gated_delta_rule_packed_decode_kernel)
  return peer_kernels


def _prepare(kernels, case, inputs, params):
  """(mixed_qkv [B, 2·Hk·K + Hv·V], a, b [B, Hv] float32, A_log, dt_bias [Hv] zeros) from one
  input set (q, k [B, Hk, K], v [B, Hv, V], g, beta [B, Hv])."""
  q, k, v, g, beta = inputs
  B = q.shape[0]
  mixed_qkv = jnp.concatenate([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1).astype(q.dtype)], axis=1)
  a = jnp.log(jnp.expm1(-g.astype(jnp.float32)))          # softplus(a) = -g
  beta = beta.astype(jnp.float32)
  b = jnp.log(beta) - jnp.log1p(-beta)                     # sigmoid(b) = beta
  zeros = jnp.zeros((g.shape[1],), jnp.float32)
  return mixed_qkv, a, b, zeros, zeros


def _geometry(case, mixed_qkv):
  geo = case.setup.geo
  return geo.hk, geo.hv, geo.kd, geo.vd, mixed_qkv.shape[0]


def _replay_step(kernels, case, prepared, params, bufs, plan):
  """One ReplaySSM step of SGLang's kernel on our buffers (base 0): (o [B, Hv, V], buffers)."""
  peer_common.require_ring_is_buffer_len(case)
  mixed_qkv, a, b, A_log, dt_bias = prepared
  H, HV, K, V, B = _geometry(case, mixed_qkv)
  L = case.setup.buffer_len
  BK, BV, nk = peer_common.pow2(K), min(peer_common.pow2(V), 64), 2
  out_shape = [jax.ShapeDtypeStruct((B, 1, HV, V), mixed_qkv.dtype), bufs.state, bufs.ring_u, bufs.ring_k,
               bufs.ring_g]
  o, state, ring_u, ring_k, ring_g = peer_common.triton_call(
      mixed_qkv, a, b, A_log, dt_bias, bufs.state, bufs.ring_u, bufs.ring_k, bufs.ring_g, plan.slots,
      plan.count, np.float32(K ** -0.5),
      kernel=kernels.sglang_replay_decode, out_shape=out_shape, grid=(-(-V // BV), B, HV),
      input_output_aliases={5: 1, 6: 2, 7: 3, 8: 4}, num_warps=1, num_stages=3,
      STRIDE_QKV=mixed_qkv.shape[1], STRIDE_A=HV, STRIDE_B=HV, STRIDE_STATE=HV * V * K, H=H, HV=HV, K=K,
      V=V, BK=BK, BV=BV, BC=max(16, peer_common.pow2(L)), NK=nk, BKT=BK // nk, L=L)
  return o.reshape(B, HV, V), bufs.replace(state=state, ring_u=ring_u, ring_k=ring_k, ring_g=ring_g)


def _conv_step(kernels, case, prepared, params, pool, slots):
  """One step of SGLang's packed decode: (o [B, Hv, V], pool)."""
  mixed_qkv, a, b, A_log, dt_bias = prepared
  H, HV, K, V, B = _geometry(case, mixed_qkv)
  BV = min(peer_common.pow2(V), 32)
  o, pool = peer_common.triton_call(
      mixed_qkv, a, b, A_log, dt_bias, pool, slots, np.float32(K ** -0.5),
      kernel=kernels.sglang_packed_decode, out_shape=[jax.ShapeDtypeStruct((B, 1, HV, V), mixed_qkv.dtype), pool],
      grid=(-(-V // BV), B * HV), input_output_aliases={5: 1}, num_warps=1, num_stages=3,
      STRIDE_QKV=mixed_qkv.shape[1], STRIDE_A=HV, STRIDE_B=HV, STRIDE_STATE=HV * V * K, H=H, HV=HV, K=K,
      V=V, BK=peer_common.pow2(K), BV=BV)
  return o.reshape(B, HV, V), pool


# Our buffers unchanged; only the cursors start at ring base 0.
BASE_ZERO = peer_common.RingLayout("base0")
REPLAY = peer_common.Peer("sglang", _load, _prepare, _replay_step, layout=BASE_ZERO)
CONV = peer_common.Peer("sglang", _load, _prepare, _conv_step)
ARMS = (harness.Arm("peer-sglang-replay", "replay", "peer", peer=REPLAY),
        harness.Arm("peer-sglang-conv", "conv", "peer", peer=CONV))
DEFAULT_ARMS = ("conv-pallas", "replay-pallas-oo") + tuple(a.name for a in ARMS)


def main(argv=None) -> dict:
  """``python -m bench.peer_sglang``: bench.gdn_decode with our best arms and SGLang's (module doc)."""
  from bench import gdn_decode  # noqa: PLC0415
  return harness.main(gdn_decode.BENCH.with_peers("peer_sglang", DEFAULT_ARMS), argv)


if __name__ == "__main__":
  main()
