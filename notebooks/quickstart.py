# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # replayssm_jax quickstart (CPU, tiny shapes)
#
# A Gated DeltaNet layer's state through ReplaySSM: prefill with the chunked scan, decode with
# `replay_decode`, watch the cursor flush every `L` steps, and check against conventional decode.
# (Paired with jupytext; `jupytext --to ipynb notebooks/quickstart.py` makes the notebook.)

# %%
import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs

Hk, Hv, K, V = 2, 4, 32, 32      # key heads, value heads (GQA 2:1), head dims
N, B, L = 8, 3, 4                # pool slots, batch rows, buffer length
slots = jnp.array([1, 4, 6], jnp.int32)


def inputs(key, prefix):
  kq, kk, kv, kg, kb = jax.random.split(key, 5)
  k = jax.random.normal(kk, prefix + (Hk, K))
  return (jax.random.normal(kq, prefix + (Hk, K)), k / jnp.linalg.norm(k, axis=-1, keepdims=True),
          jax.random.normal(kv, prefix + (Hv, V)),
          -jax.nn.softplus(jax.random.normal(kg, prefix + (Hv,))),   # log decay g <= 0
          jax.nn.sigmoid(jax.random.normal(kb, prefix + (Hv,))))    # beta

# %% [markdown]
# Prefill 10 tokens with the chunked scan and make the final state each slot's checkpoint.

# %%
_, S = rs.gdn.chunked(*inputs(jax.random.PRNGKey(0), (B, 10)), chunk_size=4)
cursor = rs.ReplayCursor.create(N, buffer_len=L)
bufs = rs.gdn.ReplayBuffers.create(N, cursor, num_k_heads=Hk, num_v_heads=Hv, head_k_dim=K,
                                   head_v_dim=V)
bufs, cursor = rs.gdn.write_state(bufs, cursor, slots, S)
pool = jnp.zeros_like(bufs.state).at[slots].set(S)     # the conventional decoder's pool

# %% [markdown]
# Decode 10 steps both ways. A row flushes (writes its checkpoint) when its window would reach
# `L` entries; the window length per row is printed each step.

# %%
windows, max_diff = [], 0.0
for t in range(10):
  x = inputs(jax.random.PRNGKey(100 + t), (B,))
  plan = cursor.plan(slots)
  o_replay, bufs = rs.gdn.replay_decode(*x, bufs, plan)
  cursor = cursor.commit(plan)
  o_conv, pool = rs.gdn.decode(*x, pool, slots)
  max_diff = max(max_diff, float(jnp.max(jnp.abs(o_replay - o_conv))))
  windows.append(np.asarray(cursor.count[slots]))
  print(f"step {t}: flush {np.asarray(plan.flush).astype(int)}  window after {windows[-1]}")

S_replay = rs.gdn.materialize(bufs, cursor, slots)
state_diff = float(jnp.max(jnp.abs(S_replay - pool[slots])))
print(f"max |o_replay - o_conv| = {max_diff:.2e}, max |S_replay - S_conv| = {state_diff:.2e}")
assert max_diff < 1e-4 and state_diff < 1e-4
