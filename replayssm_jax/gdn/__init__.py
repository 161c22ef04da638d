"""Gated DeltaNet: references, conventional decode and verify, ReplaySSM decode and verify."""
from replayssm_jax.gdn.buffers import ReplayBuffers
from replayssm_jax.gdn.ops import (copy_slots, decode, materialize, replay_decode, replay_verify,
                                   verify_conventional, write_state)
from replayssm_jax.gdn.reference import chunked, recurrent

__all__ = ["ReplayBuffers", "chunked", "copy_slots", "decode", "materialize", "recurrent",
           "replay_decode", "replay_verify", "verify_conventional", "write_state"]
