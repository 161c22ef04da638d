"""``serving.Engine`` over a ``ShardedLM`` (tensor parallel) on 4 CPU host devices.

As in test_sharding.py the checks run in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` (the flag only acts before JAX creates its
CPU backend). A hybrid stack (GatedDeltaNet, attention, Mamba2, a mixture of experts) with heads,
KV heads and expert widths split 4 ways serves the same requests as the unsharded model, for
three engine configurations: overlapped decode with prefix caching; overlapped n-gram drafting
with prefix caching and a sampled request; synchronous conventional speculative verify (state
stacks). Greedy and sampled tokens, prefix hits and accepted drafts equal the unsharded engine's
(the logits differ by the psums' summation order only), and the cache really is sharded. A
sharded engine preempted mid-run resumes sharded bit for bit, and unsharded with the unsharded
engine's tokens. MTP drafting over a ShardedLM is a NotImplementedError.
"""
import pathlib
import subprocess
import sys

import numpy as np

from tests.helpers import with_xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _submitted(engine, requests):
  """``engine`` with ``requests`` queued; with drafting, request "a" drafts nothing (a one-token
  lane beside the drafting rows)."""
  for rid, (prompt, kwargs) in requests.items():
    extra = {"num_drafts": 0} if rid == "a" and engine.config.num_drafts else {}
    engine.submit(prompt, request_id=rid, **kwargs, **extra)
  return engine


def _engines(model, sharded, config, requests):
  """Tokens and stats of the unsharded and the sharded engine over the same requests."""
  from replayssm_jax.serving import Engine

  out = []
  for m in (model, sharded):
    engine = _submitted(Engine(m, config), requests)
    tokens = engine.run()
    stats = {rid: (engine.stats(rid).prefix_hit_tokens, engine.stats(rid).accepted_drafts)
             for rid in requests}
    out.append((tokens, stats, engine))
  return out


def _check(tmp):
  import jax
  from jax.sharding import Mesh

  assert jax.device_count() == 4, jax.devices()
  engine_checks(Mesh(np.array(jax.devices()), ("tp",)), resume_dir=tmp + "/ckpt")
  print("sharded engine checks passed")


def engine_checks(mesh, *, head_dim=8, resume_dir=None):
  """The checks of the module docstring over ``mesh`` (axis "tp", size dividing 4), at head size
  ``head_dim``; the preempt/resume checks with ``resume_dir``."""
  import jax
  from flax import nnx

  from bench.engine_spec import looping_model
  from replayssm_jax.models import LMConfig, make_model, shard_model
  from replayssm_jax.models.attention import AttentionConfig
  from replayssm_jax.models.moe import MoEConfig
  from replayssm_jax.serving import Engine, EngineConfig

  d = head_dim
  config = LMConfig.tiny_mamba2(
      num_layers=4, layer_types=("gdn", "attention", "mamba2", "moe"),
      mlp_types=("moe", "dense", "dense", "dense"),
      attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=d, rotary_dim=d // 2,
                                qk_norm=True, norm_offset=1.0, output_gate=True),
      moe=MoEConfig(hidden_size=64, num_experts=8, top_k=2, expert_intermediate_size=16,
                    shared_intermediate_size=16, shared_expert_gate=True),
      num_k_heads=4, num_v_heads=8, head_k_dim=d, head_v_dim=d, mamba2_num_heads=8,
      mamba2_head_dim=d, mamba2_num_groups=4, mamba2_state_dim=d, max_prompt_len=16, mtp_layers=1)
  model = looping_model(make_model(config, seed=0), mixer_scale=0.05)   # greedy cycles: drafts hit
  # Sharded from host copies of the parameters, as load_pretrained(mesh=...) does: preempt then
  # saves numpy arrays, which an unsharded resume must turn into device arrays.
  graphdef, params = nnx.split(model)
  sharded = shard_model(nnx.merge(graphdef, jax.tree.map(np.asarray, params)), mesh, axis="tp")
  tp = mesh.shape["tp"]

  rng = np.random.RandomState(0)
  shared = rng.randint(1, 256, 8).tolist()
  loop = [7, 8, 9, 10] * 3                       # repetitive: n-gram drafts get accepted
  requests = {
      "a": (shared + rng.randint(1, 256, 5).tolist(), dict(max_new_tokens=9)),
      "b": (shared + loop[:6], dict(max_new_tokens=12)),
      "c": (loop, dict(max_new_tokens=10)),
      "d": (shared + [3, 4], dict(max_new_tokens=7, temperature=0.8, seed=5)),
  }
  base = dict(max_running=3, batch_buckets=(1, 2, 4), buffer_len=4, prefix_slots=3)
  configs = {
      "decode, prefix caching": EngineConfig(**base, prefix_block=4),
      "n-gram drafting, prefix caching": EngineConfig(**base, prefix_block=4, num_drafts=2),
      "conventional verify": EngineConfig(**base, num_drafts=2, replay=False, overlap=False),
  }
  for name, cfg in configs.items():
    (ref, ref_stats, _), (got, got_stats, engine) = _engines(model, sharded, cfg, requests)
    assert got == ref, (name, got, ref)
    assert got_stats == ref_stats, (name, got_stats, ref_stats)
    state = engine.cache.layers[0].bufs.state
    assert len(state.sharding.device_set) == tp, name
    assert state.addressable_shards[0].data.shape[1] == 8 // tp, name   # 8 value heads
    # The paths under test were taken: prefix hits, accepted drafts.
    assert (ref_stats["b"][0] > 0) == bool(cfg.prefix_block), (name, ref_stats)
    assert (sum(a for _, a in ref_stats.values()) > 0) == bool(cfg.num_drafts), (name, ref_stats)

  if resume_dir is None:
    return
  # Preempted sharded mid-run: resumed sharded (bit for bit) and unsharded.
  cfg = configs["n-gram drafting, prefix caching"]

  def start():
    return _submitted(Engine(sharded, cfg), requests)

  full = start()
  expected = full.run()
  engine = start()
  for _ in range(4):
    engine.step()
  engine.preempt(resume_dir)
  resumed = Engine.resume(resume_dir, mesh=mesh)
  assert resumed._programs is engine._programs   # same layout: nothing compiled again
  assert resumed.run() == expected
  for x, y in zip(jax.tree.leaves(full.cache), jax.tree.leaves(resumed.cache)):
    assert x.sharding == y.sharding
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  unsharded = Engine.resume(resume_dir)
  assert unsharded.run() == expected

  try:
    Engine(sharded, EngineConfig(**base, num_drafts=2, drafter="mtp"))
  except NotImplementedError as e:
    assert "ShardedLM" in str(e), e
  else:
    raise AssertionError("drafter='mtp' over a ShardedLM was accepted")


def test_engine_over_a_sharded_model_on_4_devices(tmp_path):
  env = with_xla_flags("--xla_force_host_platform_device_count=4")
  code = f"import tests.test_serving_sharded as t; t._check({str(tmp_path)!r})"
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1200)
  assert proc.returncode == 0 and "sharded engine checks passed" in proc.stdout, (
      proc.stdout + proc.stderr[-6000:])
