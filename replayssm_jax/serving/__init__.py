"""Serving: a continuous-batching engine over a slot pool with prefix caching and preemption.

``Engine(model, EngineConfig(...))``; ``submit`` requests, ``step``/``run``; ``stats`` per request;
``preempt(directory)`` / ``Engine.resume(directory)`` through Orbax. See ``engine`` for details.
"""
from replayssm_jax.serving.engine import Engine, EngineConfig, RequestStats

__all__ = ["Engine", "EngineConfig", "RequestStats"]
