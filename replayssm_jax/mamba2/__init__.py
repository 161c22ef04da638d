"""Mamba2: references, conventional decode and ReplaySSM decode (XLA; Pallas kernels to follow)."""
from replayssm_jax.mamba2.buffers import ReplayBuffers
from replayssm_jax.mamba2.ops import (copy_slots, decode, materialize, replay_decode, replay_verify,
                                      verify_conventional, write_state)
from replayssm_jax.mamba2.reference import chunked, recurrent

__all__ = ["ReplayBuffers", "chunked", "copy_slots", "decode", "materialize", "recurrent",
           "replay_decode", "replay_verify", "verify_conventional", "write_state"]
