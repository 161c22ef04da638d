"""replayssm_jax: ReplaySSM decode kernels for JAX (Gated DeltaNet and Mamba2).

ReplaySSM keeps a checkpoint state plus a short ring of recent per-step inputs and writes the
state back once every L steps; speculative rollback becomes a cursor move.
"""
from replayssm_jax import gdn
from replayssm_jax import mamba2
from replayssm_jax import models
from replayssm_jax import serving
from replayssm_jax._checks import set_checks
from replayssm_jax.cursor import ReplayCursor, ReplayPlan, count_accepted

__all__ = ["ReplayCursor", "ReplayPlan", "count_accepted", "gdn", "mamba2", "models", "serving",
           "set_checks"]
__version__ = "0.1.0"
