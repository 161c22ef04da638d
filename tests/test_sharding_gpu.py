"""GPU-only run of ``ShardedLM``'s own steps (marker ``gpu``; skipped on CPU): prefill, decode and
speculative verify + commit over a mesh of the GPUs (one GPU: a one-device mesh; 3 rows, so decode
runs the small-batch policy's flush-every-row kernels), with the kernels
``implementation=None`` picks at head sizes they take (K = V = 64), against the unsharded model
(``tests/test_sharding.py`` runs the same on 4 CPU devices); and ``make_sharded_model`` drawing
the weights on the mesh. Float32 matmuls at "highest" precision: TF32 projections would round
the two programs differently."""
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from tests.test_sharding import ATOL, _check_model

pytestmark = pytest.mark.gpu


def _config():
  from replayssm_jax.models import LMConfig
  from replayssm_jax.models.attention import AttentionConfig
  from replayssm_jax.models.moe import MoEConfig
  return LMConfig.tiny_mamba2(
      num_layers=4, layer_types=("gdn", "attention", "mamba2", "moe"),
      mlp_types=("moe", "dense", "dense", "dense"),
      attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=64, rotary_dim=32),
      moe=MoEConfig(hidden_size=64, num_experts=8, top_k=2, expert_intermediate_size=16,
                    shared_intermediate_size=16),
      num_k_heads=4, num_v_heads=8, head_k_dim=64, head_v_dim=64, mamba2_num_heads=8,
      mamba2_head_dim=64, mamba2_num_groups=4, mamba2_state_dim=64, max_prompt_len=16)


def _mesh():
  n = max(k for k in (1, 2, 4) if k <= jax.device_count())   # heads split 4 ways at most
  return Mesh(np.array(jax.devices()[:n]), ("tp",))


def test_sharded_steps_on_the_gpus():
  with jax.default_matmul_precision("highest"):
    _check_model(_config(), _mesh(), mixed_phases=False)


def test_make_sharded_model_on_the_gpus():
  import jax.numpy as jnp
  from flax import nnx

  from replayssm_jax.models import make_sharded_model

  config, mesh = _config(), _mesh()
  sharded = make_sharded_model(config, mesh, seed=1)
  model = jax.device_put(nnx.merge(nnx.graphdef(sharded.abstract_model), sharded.unshard_params()))
  tokens = jnp.asarray(np.random.RandomState(0).randint(1, config.vocab_size, (2, 16)), jnp.int32)
  slots, lengths = jnp.array([0, 1], jnp.int32), jnp.array([16, 9], jnp.int32)
  with jax.default_matmul_precision("highest"):
    want, _ = model.prefill(tokens, model.init_cache(2, buffer_len=4, max_len=32), slots, lengths)
    have, _ = sharded.prefill(tokens, sharded.init_cache(2, buffer_len=4, max_len=32), slots,
                              lengths)
  np.testing.assert_allclose(np.asarray(have), np.asarray(want), atol=ATOL, rtol=0)
