"""Mamba2: references (conventional and ReplaySSM decode to follow)."""
from replayssm_jax.mamba2.reference import chunked, recurrent

__all__ = ["chunked", "recurrent"]
