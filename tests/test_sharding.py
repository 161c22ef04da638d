"""Tensor parallelism (``models.shard_model``) on 4 CPU host devices.

The checks run in a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``:
the flag only takes effect before JAX creates its CPU backend, which the test session (and each
pytest-xdist worker) has already done, and changing the device count in-process would disturb
every other test. The subprocess imports this module and calls ``_check``.

For three hybrid stacks — GatedDeltaNet and Mamba2 layers; and GatedDeltaNet, attention, Mamba2 and
a mixture of experts (in a mixer block and in an MoE-only block), with Granite's multipliers (embedding,
residual, attention logits, logits scaling); and Falcon-H1's parallel Mamba2 + attention block beside a
GatedDeltaNet layer — heads, KV heads and expert widths split 4 ways: prefill, then 10 decode steps with buffer_len 4 (natural flushes) plus one forced
flush, in replay and conventional mode: sharded logits == unsharded logits (float32, up to the
psum's summation order), greedy tokens identical, and every cache array (checkpoints, rings, conv
states, KV caches, cursor, positions) equal after unsharding. Then speculative verify + commit
(T = 3, short rows, random accepted counts, a forced flush), ReplaySSM and conventional (state
stacks): logits of the real lanes and every cache array equal. ``generate`` over the sharded
model gives the unsharded model's tokens and stats (greedy, speculative, sampled), and
``load_pretrained(mesh=...)`` loads transformers fixtures straight into shards.
"""
import pathlib
import subprocess
import sys

import numpy as np

from tests.helpers import with_xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
ATOL = 2e-5


def _check():
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh

  from replayssm_jax.models import LMConfig
  from replayssm_jax.models.attention import AttentionConfig
  from replayssm_jax.models.moe import MoEConfig

  assert jax.device_count() == 4, jax.devices()
  heads = dict(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8, mamba2_num_heads=8,
               mamba2_num_groups=4, max_prompt_len=16)
  _check_model(LMConfig.tiny_hybrid(num_layers=2, **heads))
  _check_generate(LMConfig.tiny_hybrid(num_layers=2, **heads))
  _check_load_pretrained()
  _check_make_sharded_model()
  attention = AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=8, rotary_dim=4, qk_norm=True,
                              norm_offset=1.0, output_gate=True, scale=0.125)
  moe = MoEConfig(hidden_size=64, num_experts=8, top_k=2, expert_intermediate_size=16,
                  shared_intermediate_size=16, shared_expert_gate=True)
  _check_model(LMConfig.tiny_mamba2(num_layers=4, layer_types=("gdn", "attention", "mamba2", "moe"),
                                    mlp_types=("moe", "dense", "dense", "dense"), attention=attention,
                                    moe=moe, embedding_multiplier=3.0, residual_multiplier=0.5,
                                    logits_scaling=2.0, mtp_layers=1, **heads))
  _check_model(LMConfig.tiny_mamba2(num_layers=2, layer_types=("parallel", "gdn"), mamba2_norm="norm_then_gate",
                                    attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=8, rotary_dim=8),
                                    **heads))
  print("sharding checks passed")


def _check_model(config, mesh=None, *, mixed_phases=True):
  """Prefill, decode and verify of ``shard_model(make_model(config))`` over ``mesh`` (None: every
  device) against the unsharded model. ``mixed_phases``: check that the rows' flush phases
  differ (False on a GPU, whose small-batch policy flushes every row at these 3 rows)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh

  from replayssm_jax.models import make_model, shard_model

  model = make_model(config, seed=0)
  mesh = Mesh(np.array(jax.devices()), ("tp",)) if mesh is None else mesh
  sharded = shard_model(model, mesh, axis="tp")
  assert sharded.local_config.mtp_layers == 0   # an MTP head drafts for unsharded LMs only: left out
  tokens = jnp.asarray(np.random.RandomState(0).randint(1, 256, (3, 16)), jnp.int32)
  slots, lengths = jnp.array([4, 0, 2], jnp.int32), jnp.array([16, 5, 11], jnp.int32)

  def close(a, b, what):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0, err_msg=what)

  for replay in (True, False):
    ref_cache = model.init_cache(6, buffer_len=4, max_len=32)
    sh_cache = sharded.init_cache(6, buffer_len=4, max_len=32)
    ref_logits, ref_cache = model.prefill(tokens, ref_cache, slots, lengths)
    sh_logits, sh_cache = sharded.prefill(tokens, sh_cache, slots, lengths)
    close(sh_logits, ref_logits, "prefill logits")
    last = jnp.take_along_axis(ref_logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    tok = jnp.argmax(last, -1).astype(jnp.int32)
    step_slots = jnp.array([4, -1, 2], jnp.int32)  # a padding row in the middle
    for t in range(10):
      force = jnp.array([t == 6, False, False])
      ref_logits, ref_cache = model.decode(tok, ref_cache, step_slots, replay=replay, force_flush=force)
      sh_logits, sh_cache = sharded.decode(tok, sh_cache, step_slots, replay=replay, force_flush=force)
      close(sh_logits, ref_logits, f"decode logits, step {t}, replay={replay}")
      assert np.array_equal(np.argmax(sh_logits, -1), np.argmax(ref_logits, -1))
      tok = jnp.argmax(ref_logits, -1).astype(jnp.int32)
    state = sh_cache.layers[0].bufs.state
    assert len(state.sharding.device_set) == mesh.size
    assert state.addressable_shards[0].data.shape[1] == state.shape[1] // mesh.size
    back = sharded.unshard_cache(sh_cache)
    for path, a in jax.tree_util.tree_leaves_with_path(ref_cache):
      b = [x for p, x in jax.tree_util.tree_leaves_with_path(back) if p == path][0]
      close(b, a, f"cache {jax.tree_util.keystr(path)}, replay={replay}")
    if replay and mixed_phases:
      assert int(ref_cache.cursor.count[4]) != int(ref_cache.cursor.count[2])  # phases really differ
  _check_verify(model, sharded, tokens, slots, lengths, close)


def _check_verify(model, sharded, tokens, slots, lengths, close):
  """Speculative verify + commit, ReplaySSM and conventional (state stacks), T = 3 with short rows,
  a padding row, random accepted counts and a forced flush: sharded == unsharded."""
  import jax
  import jax.numpy as jnp

  rng = np.random.RandomState(1)
  for replay in (True, False):
    kw = dict(buffer_len=4, max_draft=2, max_len=48, verify_stacks=not replay)
    ref_cache, sh_cache = model.init_cache(6, **kw), sharded.init_cache(6, **kw)
    _, ref_cache = model.prefill(tokens, ref_cache, slots, lengths)
    _, sh_cache = sharded.prefill(tokens, sh_cache, slots, lengths)
    rows = jnp.array([2, -1, 4], jnp.int32)
    for t in range(6):
      draft = jnp.asarray(rng.randint(1, 256, (3, 3)), jnp.int32)
      n = rng.randint(1, 4, 3).astype(np.int32)
      force = jnp.array([False, False, t == 3])
      ref_logits, ref_step = model.verify(draft, ref_cache, rows, lengths=jnp.asarray(n), replay=replay,
                                          force_flush=force)
      sh_logits, sh_step = sharded.verify(draft, sh_cache, rows, lengths=jnp.asarray(n), replay=replay,
                                          force_flush=force)
      live = np.arange(3)[None, :] < n[[0, 2]][:, None]
      close(np.asarray(sh_logits)[[0, 2]][live], np.asarray(ref_logits)[[0, 2]][live],
            f"verify logits, step {t}, replay={replay}")
      accepted = jnp.asarray(rng.randint(1, n + 1).astype(np.int32))
      ref_cache, sh_cache = model.commit(ref_step, accepted), sharded.commit(sh_step, accepted)
    back = sharded.unshard_cache(sh_cache)
    for path, a in jax.tree_util.tree_leaves_with_path(ref_cache):
      b = [x for p, x in jax.tree_util.tree_leaves_with_path(back) if p == path][0]
      close(b, a, f"cache after verify {jax.tree_util.keystr(path)}, replay={replay}")


def _check_generate(config):
  """``generate`` over the ShardedLM: the unsharded model's tokens, greedy (plain, n-gram
  speculative, conventional speculative) and sampled."""
  import jax
  from jax.sharding import Mesh

  from bench.engine_spec import looping_model
  from replayssm_jax.models import generate, make_model, shard_model

  model = looping_model(make_model(config, seed=0))   # greedy cycles: drafts are accepted
  sharded = shard_model(model, Mesh(np.array(jax.devices()), ("tp",)), axis="tp")
  rng = np.random.RandomState(2)
  prompts = rng.randint(1, 256, (3, 12)).astype(np.int32)
  lengths = np.array([12, 4, 9], np.int32)
  for options in (dict(), dict(speculative=2), dict(speculative=2, replay=False),
                  dict(temperature=0.7, seed=3), dict(speculative=2, temperature=0.7, seed=3)):
    ref = generate(model, prompts, lengths, max_new_tokens=10, return_stats=True, **options)
    got = generate(sharded, prompts, lengths, max_new_tokens=10, return_stats=True, **options)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(options))
    if options.get("speculative") and not options.get("temperature"):
      assert int(np.sum(ref[2].accepted)) > 0, options
  try:
    generate(sharded, prompts, lengths, max_new_tokens=4, speculative=2, drafter="mtp")
  except NotImplementedError as e:
    assert "ShardedLM" in str(e), e
  else:
    raise AssertionError("drafter='mtp' over a ShardedLM was accepted")


def _check_load_pretrained():
  """``load_pretrained(mesh=...)`` of two committed transformers fixtures (2 key / KV heads and
  groups: a 2-device mesh) gives a ShardedLM whose unsharded model holds host arrays only, with
  the unsharded load's prefill logits."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import Mesh

  from replayssm_jax.models import ShardedLM, load_pretrained

  mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
  for name in ("qwen3_next", "nemotron_h"):
    path = ROOT / "tests" / "data" / "hf" / name
    model, config = load_pretrained(path, max_prompt_len=16)
    sharded, _ = load_pretrained(path, max_prompt_len=16, mesh=mesh)
    assert isinstance(sharded, ShardedLM), type(sharded)
    # No host copy kept: the structure is abstract, and the parameters come back from the shards.
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree.leaves(nnx.state(sharded.abstract_model))), name
    for a, b in zip(jax.tree.leaves(sharded.unshard_params()), jax.tree.leaves(nnx.state(model))):
      np.testing.assert_array_equal(a, np.asarray(b), err_msg=name)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(sharded.params)} == {2}, name
    tokens = jnp.asarray(np.random.RandomState(0).randint(1, config.vocab_size, (2, 16)), jnp.int32)
    slots, lengths = jnp.array([0, 1], jnp.int32), jnp.array([16, 9], jnp.int32)
    ref, _ = model.prefill(tokens, model.init_cache(2, buffer_len=4, max_len=32), slots, lengths)
    got, _ = sharded.prefill(tokens, sharded.init_cache(2, buffer_len=4, max_len=32), slots, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=ATOL, rtol=0, err_msg=name)


def _check_make_sharded_model():
  """``make_sharded_model``: on one device the weights are ``make_model``'s (MTP head included,
  to float32 rounding);
  on 4 the shards are what ``shard_model`` makes of the model ``unshard_params`` returns, with
  that model's logits, and the draw is partitioned (no collective; per-device temporaries
  shrink with the mesh as the per-device outputs do)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import Mesh

  from replayssm_jax.models import LMConfig, make_model, make_sharded_model, shard_model
  from replayssm_jax.models.attention import AttentionConfig
  from replayssm_jax.models.moe import MoEConfig
  from replayssm_jax.models.sharding import _draw_program

  config = LMConfig.tiny_mamba2(
      num_layers=4, layer_types=("gdn", "attention", "mamba2", "moe"),
      mlp_types=("moe", "dense", "dense", "dense"), mtp_layers=1, num_k_heads=4, num_v_heads=8,
      head_k_dim=8, head_v_dim=8, mamba2_num_heads=8, mamba2_num_groups=4, max_prompt_len=16,
      attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=8, rotary_dim=4),
      moe=MoEConfig(hidden_size=64, num_experts=8, top_k=2, expert_intermediate_size=16,
                    shared_intermediate_size=16))
  one = make_sharded_model(config, Mesh(np.array(jax.devices()[:1]), ("tp",)), seed=3)
  ref = jax.tree.leaves(nnx.state(make_model(config, seed=3)))
  got = jax.tree.leaves(one.unshard_params())
  assert len(got) == len(ref)
  for a, b in zip(got, ref):   # one compiled program against make_model's op-by-op: f32 rounding
    np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=0)

  mesh = Mesh(np.array(jax.devices()), ("tp",))
  sharded = make_sharded_model(config, mesh, seed=3)
  assert {len(x.sharding.device_set) for x in jax.tree.leaves(sharded.params)} == {4}
  model = jax.device_put(nnx.merge(nnx.graphdef(sharded.abstract_model), sharded.unshard_params()))
  for a, b in zip(jax.tree.leaves(shard_model(model, mesh).params), jax.tree.leaves(sharded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = jnp.asarray(np.random.RandomState(0).randint(1, config.vocab_size, (2, 16)), jnp.int32)
  slots, lengths = jnp.array([0, 1], jnp.int32), jnp.array([16, 9], jnp.int32)
  want, _ = model.prefill(tokens, model.init_cache(2, buffer_len=4, max_len=32), slots, lengths)
  have, _ = sharded.prefill(tokens, sharded.init_cache(2, buffer_len=4, max_len=32), slots, lengths)
  np.testing.assert_allclose(np.asarray(have), np.asarray(want), atol=ATOL, rtol=0)

  temps = {}
  for devices in (1, 4):
    layouts = make_sharded_model(config, Mesh(np.array(jax.devices()[:devices]), ("tp",)))._layouts
    with jax.threefry_partitionable(True):
      compiled = _draw_program(config, Mesh(np.array(jax.devices()[:devices]), ("tp",)), layouts,
                               3).lower().compile()
    text = compiled.as_text()
    assert not any(op in text for op in ("all-gather", "all-to-all", "collective-permute",
                                         "all-reduce")), devices
    memory = compiled.memory_analysis()
    temps[devices] = memory.temp_size_in_bytes, memory.output_size_in_bytes
  # Temporaries shrink with the mesh as the outputs do (replicated leaves set both ratios).
  (t1, o1), (t4, o4) = temps[1], temps[4]
  assert t4 / t1 <= 1.1 * o4 / o1, temps


def test_sharded_equals_unsharded_on_4_devices():
  env = with_xla_flags("--xla_force_host_platform_device_count=4")
  proc = subprocess.run([sys.executable, "-c", "import tests.test_sharding as t; t._check()"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "sharding checks passed" in proc.stdout, proc.stdout + proc.stderr[-6000:]
