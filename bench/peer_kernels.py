"""Thin Triton entry points around the peers' decode kernels, in jax_triton's argument order.

jax_triton passes a kernel its array and scalar inputs in call order, then one pointer per output
(an aliased output too), then the constexpr keywords. The peers' kernels take their pointers in
another order, so each entry point here takes jax_triton's order and calls the peer's kernel
(Triton inlines the call). Launch constants (strides of contiguous arrays, sizes, flags) are
constexprs. The peer kernels themselves are bound at run time by the bench.peer_* modules
(``bind``): this module holds no peer code.

Imports Triton: import it only where a peer arm runs.
"""
import triton
import triton.language as tl

# Bound by bench.peer_sglang / peer_vllm / peer_mamba_ssm from the peers' own files.
SGLANG_REPLAY = None      # sglang fused_recurrent_linear_replayssm_decode_kernel
SGLANG_PACKED = None      # sglang fused_recurrent_gated_delta_rule_packed_decode_kernel
VLLM_PRECOMPUTE = None    # vllm _replayssm_output_only_precompute_kernel
VLLM_REPLAY = None        # vllm _replayssm_output_only_kernel
MAMBA_SSM_UPDATE = None   # mamba_ssm _selective_scan_update_kernel


def bind(name: str, kernel) -> None:
  """Binds a peer kernel (a ``triton.jit`` function, possibly under ``triton.heuristics``) to ``name``."""
  while not isinstance(kernel, triton.JITFunction):
    kernel = kernel.fn   # a Heuristics wrapper: its constexprs are passed explicitly here
  globals()[name] = kernel


@triton.jit
def sglang_replay_decode(mixed_qkv, a, b, A_log, dt_bias, h0_in, d_in, k_in, g_in, slots, write_pos,
                         scale, o, h0, d_cache, k_cache, g_cache,
                         STRIDE_QKV: tl.constexpr, STRIDE_A: tl.constexpr, STRIDE_B: tl.constexpr,
                         STRIDE_STATE: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                         NK: tl.constexpr, BKT: tl.constexpr, L: tl.constexpr):
  # force_flush is off (HAS_FORCE_FLUSH False): write_pos stands in for its pointer.
  SGLANG_REPLAY(mixed_qkv, a, b, A_log, dt_bias, o, h0, h0, d_cache, k_cache, g_cache, slots, write_pos,
                write_pos, scale, STRIDE_QKV, STRIDE_A, STRIDE_B, STRIDE_STATE, STRIDE_STATE, 1,
                H, HV, K, V, BK, BV, BC, NK, BKT, L, 20.0, False, False, False)


@triton.jit
def sglang_packed_decode(mixed_qkv, a, b, A_log, dt_bias, h0_in, slots, scale, o, h0,
                         STRIDE_QKV: tl.constexpr, STRIDE_A: tl.constexpr, STRIDE_B: tl.constexpr,
                         STRIDE_STATE: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
  SGLANG_PACKED(mixed_qkv, a, b, A_log, dt_bias, o, h0, h0, slots, scale, STRIDE_QKV, STRIDE_A, STRIDE_B,
                STRIDE_STATE, STRIDE_STATE, 1, H, HV, K, V, BK, BV, 20.0, False)


@triton.jit
def vllm_precompute(B, C, B_cache, write_pos, is_flush, slots, bc_pre,
                    batch: tl.constexpr, ngroups: tl.constexpr, dstate: tl.constexpr, L: tl.constexpr,
                    BLOCK_SIZE_K: tl.constexpr, BLOCK_SIZE_DSTATE: tl.constexpr):
  # Padding rows carry slot -1 (null_block_id), as in our convention.
  VLLM_PRECOMPUTE(B, C, B_cache, write_pos, is_flush, bc_pre, slots, -1, batch, ngroups, dstate,
                  ngroups * dstate, dstate, 1,                        # B [batch, ngroups, dstate]
                  ngroups * dstate, dstate, 1,                        # C
                  ngroups * L * dstate, L * dstate, dstate, 1,        # B_cache [slots, ngroups, L, dstate]
                  ngroups * L, L, 1,                                  # bc_pre [batch, ngroups, L]
                  1, 0,                                               # slots [batch]
                  L, BLOCK_SIZE_K, BLOCK_SIZE_DSTATE, True)


@triton.jit
def vllm_replay_output_only(state_in, rand_seed, x, dt, dt_bias, A, B, C, D, z, x_cache_in, dt_cache_in,
                            B_cache_in, bc_pre, write_pos, is_flush, slots,
                            out, state, x_cache, dt_cache, B_cache,
                            batch: tl.constexpr, nheads: tl.constexpr, dim: tl.constexpr,
                            dstate: tl.constexpr, ngroups: tl.constexpr, L: tl.constexpr,
                            BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_K_CACHE: tl.constexpr,
                            BLOCK_SIZE_K_DOT: tl.constexpr, NF_DSTATE_TILE: tl.constexpr,
                            NF_NDS: tl.constexpr, FL_DSTATE_TILE: tl.constexpr, FL_NDS: tl.constexpr,
                            BLOCK_SIZE_DSTATE: tl.constexpr):
  # dt, A, dt_bias, D per head (TIE_HDIM: stride 0 over dim); stochastic rounding off.
  VLLM_REPLAY(state, rand_seed, x, dt, dt_bias, A, B, C, D, z, out, x_cache, dt_cache, B_cache, bc_pre,
              write_pos, is_flush, slots, -1, batch, nheads, dim, dstate, nheads // ngroups,
              nheads * dim * dstate, dim * dstate, dstate, 1,     # state [slots, nheads, dim, dstate]
              nheads * dim, dim, 1,                               # x [batch, nheads, dim]
              nheads, 1,                                          # dt [batch, nheads]
              1, 1,                                               # dt_bias, A [nheads]
              ngroups * dstate, dstate, 1,                        # B [batch, ngroups, dstate]
              ngroups * dstate, dstate, 1,                        # C
              1, 0,                                               # D [nheads]
              nheads * dim, dim, 1,                               # z
              nheads * dim, dim, 1,                               # out
              nheads * L * dim, L * dim, 1, dim,                  # x_cache [slots, nheads, L, dim]: (b, h, dim, pos)
              nheads * L, L, 1,                                   # dt_cache [slots, nheads, L]
              ngroups * L * dstate, L * dstate, dstate, 1,        # B_cache [slots, ngroups, L, dstate]
              ngroups * L, L, 1,                                  # bc_pre [batch, ngroups, L]
              1, 0,                                               # slots [batch]
              True, L, BLOCK_SIZE_M, BLOCK_SIZE_K_CACHE, BLOCK_SIZE_K_DOT, NF_DSTATE_TILE, NF_NDS,
              FL_DSTATE_TILE, FL_NDS, "tf32x3", False, 0, BLOCK_SIZE_DSTATE, True, True, True, True)


@triton.jit
def mamba_ssm_update(state_in, x, dt, dt_bias, A, B, C, D, z, slots, state, out,
                     batch: tl.constexpr, nheads: tl.constexpr, dim: tl.constexpr, dstate: tl.constexpr,
                     ngroups: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_DSTATE: tl.constexpr):
  # dt, A, dt_bias, D per head (TIE_HDIM); dt_softplus on.
  MAMBA_SSM_UPDATE(state, x, dt, dt_bias, A, B, C, D, z, out, slots, batch, nheads, dim, dstate,
                   nheads // ngroups,
                   nheads * dim * dstate, dim * dstate, dstate, 1,    # state [slots, nheads, dim, dstate]
                   nheads * dim, dim, 1,                              # x
                   nheads, 1, 0,                                      # dt [batch, nheads]
                   1, 0,                                              # dt_bias [nheads]
                   1, 0, 0,                                           # A [nheads]
                   ngroups * dstate, dstate, 1,                       # B
                   ngroups * dstate, dstate, 1,                       # C
                   1, 0,                                              # D [nheads]
                   nheads * dim, dim, 1,                              # z
                   nheads * dim, dim, 1,                              # out
                   True, True, BLOCK_SIZE_M, True, True, True, True, BLOCK_SIZE_DSTATE)
