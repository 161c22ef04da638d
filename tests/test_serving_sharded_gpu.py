"""GPU-only run of ``serving.Engine`` over a ``ShardedLM`` (marker ``gpu``; skipped on CPU): the
kernels ``implementation=None`` picks on the GPU run inside the engine's ``shard_map`` programs
over up to 4 GPUs (one GPU: a one-device mesh), at head sizes the GPU kernels take (K = V = 64),
and the engine gives the unsharded model's tokens, prefix hits and accepted drafts
(``tests/test_serving_sharded.py`` runs the same on 4 CPU devices). Passed on one H100,
2026-12-06."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.test_serving_sharded import engine_checks

pytestmark = pytest.mark.gpu


def test_engine_over_a_sharded_model_on_the_gpus():
  n = max(k for k in (1, 2, 4) if k <= jax.device_count())   # heads split 4 ways at most
  engine_checks(Mesh(np.array(jax.devices()[:n]), ("tp",)), head_dim=64)
