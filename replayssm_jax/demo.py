"""The demo job: prefill a GDN layer with the chunked scan, then decode the same token stream
through ReplaySSM (``replay_decode``) and through conventional decode, and compare.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

import replayssm_jax as rs

# A small GDN layer (GQA 2:1) that runs in seconds on a CPU.
NUM_K_HEADS, NUM_V_HEADS, HEAD_K_DIM, HEAD_V_DIM = 4, 8, 64, 64
CHUNK = 40  # decode steps per jitted call (one progress-bar tick)


def _inputs(key, shape_prefix):
  kq, kk, kv, kg, kb = jax.random.split(key, 5)
  q = jax.random.normal(kq, shape_prefix + (NUM_K_HEADS, HEAD_K_DIM))
  k = jax.random.normal(kk, shape_prefix + (NUM_K_HEADS, HEAD_K_DIM))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = jax.random.normal(kv, shape_prefix + (NUM_V_HEADS, HEAD_V_DIM))
  g = -jax.nn.softplus(jax.random.normal(kg, shape_prefix + (NUM_V_HEADS,)))  # log decay <= 0
  beta = jax.nn.sigmoid(jax.random.normal(kb, shape_prefix + (NUM_V_HEADS,)))
  return q, k, v, g, beta


def run(*, steps: int, batch: int, buffer_len: int, prompt_len: int, implementation=None) -> int:
  print(f"replayssm_jax demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): GDN layer "
        f"Hk={NUM_K_HEADS} Hv={NUM_V_HEADS} K={HEAD_K_DIM} V={HEAD_V_DIM}, batch {batch}, "
        f"buffer_len L={buffer_len}, {prompt_len}-token prompts, {steps} decode steps")
  num_slots = 2 * batch
  slots = jnp.arange(batch, dtype=jnp.int32) * 2  # a sparse set of pool slots
  prompt = _inputs(jax.random.PRNGKey(0), (batch, prompt_len))
  _, prefilled = rs.gdn.chunked(*prompt)

  cursor = rs.ReplayCursor.create(num_slots, buffer_len=buffer_len)
  bufs = rs.gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=NUM_K_HEADS, num_v_heads=NUM_V_HEADS,
                                     head_k_dim=HEAD_K_DIM, head_v_dim=HEAD_V_DIM)
  bufs, cursor = rs.gdn.write_state(bufs, cursor, slots, prefilled)
  pool = jnp.zeros_like(bufs.state).at[slots].set(prefilled)

  def replay_chunk(carry, xs):
    bufs, cursor = carry
    plan = cursor.plan(slots)
    o, bufs = rs.gdn.replay_decode(*xs, bufs, plan, implementation=implementation)
    return (bufs, cursor.commit(plan)), o

  def conventional_chunk(pool, xs):
    o, pool = rs.gdn.decode(*xs, pool, slots, implementation=implementation)
    return pool, o

  replay_fn = jax.jit(lambda c, xs: jax.lax.scan(replay_chunk, c, xs), donate_argnums=0)
  conv_fn = jax.jit(lambda p, xs: jax.lax.scan(conventional_chunk, p, xs), donate_argnums=0)

  num_chunks = -(-steps // CHUNK)
  keys = jax.random.split(jax.random.PRNGKey(1), num_chunks)
  # Inputs are [CHUNK, B, ...] per call; step-major for lax.scan.
  chunk_inputs = [jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), _inputs(kc, (batch, CHUNK))) for kc in keys]

  results = {}
  for name, fn, carry in (("replay", replay_fn, (bufs, cursor)), ("conventional", conv_fn, pool)):
    jax.block_until_ready(fn(jax.tree.map(jnp.copy, carry), chunk_inputs[0]))  # compile once
    outs, elapsed = [], 0.0
    for xs in tqdm(chunk_inputs, desc=f"{name:>12}", unit="chunk", leave=True):
      t0 = time.perf_counter()
      carry, o = fn(carry, xs)
      jax.block_until_ready(o)
      elapsed += time.perf_counter() - t0
      outs.append(o)
    results[name] = (np.concatenate([np.asarray(o, np.float32) for o in outs])[:steps], elapsed, carry)

  diff = float(np.max(np.abs(results["replay"][0] - results["conventional"][0])))
  flushes = steps // buffer_len
  for name in ("replay", "conventional"):
    _, elapsed, _ = results[name]
    print(f"{name:>12}: {num_chunks * CHUNK / elapsed:9.1f} steps/s  ({num_chunks * CHUNK} steps, batch {batch})")
  final_replay = rs.gdn.materialize(*results["replay"][2], slots)
  state_diff = float(jnp.max(jnp.abs(final_replay - results["conventional"][2][slots].astype(jnp.float32))))
  print(f"max |output replay - conventional| over {steps} steps: {diff:.3e}; "
        f"final state: {state_diff:.3e}; about {flushes} flushes per row")
  if jax.default_backend() != "gpu":
    print("note: on CPU the XLA fallback runs; replay saves HBM traffic, so its speed-up is a GPU "
          "result (bench/RESULTS.md)")
  ok = diff < 1e-3 and state_diff < 1e-3
  print("OK: replay and conventional decode agree" if ok else "MISMATCH")
  return 0 if ok else 1
