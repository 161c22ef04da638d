"""Flax NNX layers and the jitted decode loop.

``GatedDeltaNet`` is the Qwen3-Next mixer with an explicit decode cache (``GdnLayerCache``);
``LM`` a small GatedDeltaNet language model (``LMConfig.tiny()``, ``make_model``); ``generate``
runs prefill and the decode loop in one ``jax.jit`` with the cache donated.
"""
from replayssm_jax.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, GdnLayerCache
from replayssm_jax.models.generate import generate
from replayssm_jax.models.lm import LM, LMCache, LMConfig, make_model

__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "GdnLayerCache", "LM", "LMCache", "LMConfig",
           "generate", "make_model"]
