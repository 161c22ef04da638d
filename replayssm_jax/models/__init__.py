"""Flax NNX layers and the jitted decode loop.

``GatedDeltaNet`` is the Qwen3-Next mixer with an explicit decode cache (``GdnLayerCache``);
``Mamba2`` the Mamba2 / Nemotron-H mixer (``Mamba2LayerCache``); ``LM`` a small language model
whose layers are GatedDeltaNet and/or Mamba2 (``LMConfig.tiny()``, ``tiny_mamba2()``,
``tiny_hybrid()``, ``make_model``; ``LM.verify`` / ``LM.commit`` for speculative steps);
``generate`` runs prefill and the decode loop in one ``jax.jit`` with the cache donated
(``speculative=k``: n-gram drafts verified k at a time, greedy); ``load_pretrained`` reads a local Hugging Face checkpoint
(Qwen3-Next / Qwen3.5 with their multi-token-prediction heads, ``models.mtp``, Mamba2, Nemotron-H,
Granite 4.0, Bamba); ``shard_model`` shards mixer heads over a
mesh axis (tensor parallel, ``jax.shard_map``).
"""
from replayssm_jax.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetConfig, GdnLayerCache
from replayssm_jax.models.generate import GenerateStats, generate, ngram_drafts
from replayssm_jax.models.hf import load_pretrained
from replayssm_jax.models.lm import LM, LMCache, LMConfig, VerifyStep, make_model
from replayssm_jax.models.mamba2 import Mamba2, Mamba2Config, Mamba2LayerCache
from replayssm_jax.models.sharding import ShardedLM, make_sharded_model, shard_model

__all__ = ["GatedDeltaNet", "GatedDeltaNetConfig", "GdnLayerCache", "GenerateStats", "LM", "LMCache",
           "LMConfig", "Mamba2", "Mamba2Config", "Mamba2LayerCache", "ShardedLM", "VerifyStep", "generate",
           "load_pretrained", "make_model", "make_sharded_model", "ngram_drafts", "shard_model"]
