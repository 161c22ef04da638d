# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # replayssm_jax quickstart (CPU, tiny shapes)
#
# ReplaySSM keeps, per pool slot, a *checkpoint* state plus a short *ring* of recent per-step
# inputs. Most decode steps read the checkpoint and replay the ring; the full state is written
# back once every `L` steps (a *flush*). This notebook walks through the API on CPU:
#
# 1. a Gated DeltaNet (GDN) layer: prefill with the chunked scan, then replay decode;
# 2. the cursor and its flushes, made visible;
# 3. equality with conventional decode (read + write the state every step);
# 4. a Mamba2 layer, the same way;
# 5. the tiny language model's `generate`, replay vs conventional.
#
# It is a jupytext `py:percent` file: `jupytext --to ipynb notebooks/quickstart.py` makes the
# notebook; `tests/test_notebooks.py` runs it end to end.

# %%
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import replayssm_jax as rs

rng = np.random.default_rng(0)


def normal(*shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def uniform(lo, hi, *shape):
  return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)


# %% [markdown]
# ## 1. A GDN layer: prefill, then replay decode
#
# Shapes follow DESIGN §2: q, k `[B, (T,) Hk, K]`, v `[B, (T,) Hv, V]`, log decay g ≤ 0 and β
# `[B, (T,) Hv]`; the state of a value head is a `V × K` matrix. Here: 2 key heads, 4 value heads
# (GQA 2:1), K = V = 32, a pool of 8 slots, 3 batch rows and a buffer length L = 4.

# %%
Hk, Hv, K, V = 2, 4, 32, 32      # key heads, value heads, head dims
N, B, L = 8, 3, 4                # pool slots, batch rows, buffer length
slots = jnp.array([1, 4, 6], jnp.int32)


def gdn_inputs(*prefix):
  k = normal(*prefix, Hk, K)
  return (normal(*prefix, Hk, K), k / jnp.linalg.norm(k, axis=-1, keepdims=True),
          normal(*prefix, Hv, V),
          -uniform(0.05, 1.0, *prefix, Hv),        # log decay g <= 0
          uniform(0.0, 1.0, *prefix, Hv))          # beta


# %% [markdown]
# Prefill 10 prompt tokens per row with the chunked scan; `write_state` makes the final state each
# slot's checkpoint and empties its ring window. The conventional decoder gets a plain state pool
# with the same contents.

# %%
_, S = rs.gdn.chunked(*gdn_inputs(B, 10), chunk_size=4)
cursor = rs.ReplayCursor.create(N, buffer_len=L)
bufs = rs.gdn.ReplayBuffers.create(N, cursor, num_k_heads=Hk, num_v_heads=Hv, head_k_dim=K,
                                   head_v_dim=V)
bufs, cursor = rs.gdn.write_state(bufs, cursor, slots, S)
pool = jnp.zeros_like(bufs.state).at[slots].set(S)     # the conventional decoder's pool
print("checkpoint", bufs.state.shape, bufs.state.dtype, "| ring_k", bufs.ring_k.shape,
      "| ring_u", bufs.ring_u.shape, "| ring_g", bufs.ring_g.shape)

# %% [markdown]
# ## 2. The cursor and its flushes
#
# Each step: `cursor.plan(slots)` decides per row whether it flushes, every layer runs with that
# plan, and `cursor.commit(plan)` advances the cursor once. A row flushes naturally when its
# window would reach `L` entries; `force_flush` flushes early (e.g. at a prefix-cache block
# boundary). Below, rows 1 and 2 are forced to flush at steps 1 and 2, so the three rows run at
# different phases — one compiled step serves them all. Conventional decode runs alongside on the
# same inputs.

# %%
steps = 16
forced = {1: [False, True, False], 2: [False, False, True]}
windows, flushes, max_diff = [], [], 0.0
for t in range(steps):
  x = gdn_inputs(B)
  force = jnp.array(forced[t]) if t in forced else None
  plan = cursor.plan(slots, force_flush=force)
  o_replay, bufs = rs.gdn.replay_decode(*x, bufs, plan)
  cursor = cursor.commit(plan)
  o_conv, pool = rs.gdn.decode(*x, pool, slots)
  max_diff = max(max_diff, float(jnp.max(jnp.abs(o_replay - o_conv))))
  windows.append(np.asarray(cursor.count[slots]))
  flushes.append(np.asarray(plan.flush))
windows, flushes = np.array(windows), np.array(flushes)

fig, ax = plt.subplots(figsize=(7, 2.8))
for r in range(B):
  ax.step(np.arange(steps), windows[:, r] + 0.06 * r, where="mid", label=f"row {r} (slot {int(slots[r])})")
  ts = np.nonzero(flushes[:, r])[0]
  ax.plot(ts, windows[ts, r] + 0.06 * r, "v", color=ax.lines[-1].get_color())
ax.set(xlabel="decode step", ylabel="ring window (entries)",
       title=f"Window length per row after each step (L = {L}; ▼ = flush)")
ax.set_yticks(range(L))
ax.legend(fontsize=8, loc="upper right")
plt.show()
print("flushes per row:", flushes.sum(axis=0), " (steps:", steps, ")")

# %% [markdown]
# ## 3. Equality with conventional decode
#
# The outputs agreed at every step (float32, same recurrence). The replay state is never stored
# as such: `materialize` rebuilds it from checkpoint and window — it equals the conventional pool.

# %%
S_replay = rs.gdn.materialize(bufs, cursor, slots)
state_diff = float(jnp.max(jnp.abs(S_replay - pool[slots])))
print(f"max |o_replay - o_conv| = {max_diff:.2e}, max |S_replay - S_conv| = {state_diff:.2e}")
assert max_diff < 1e-4 and state_diff < 1e-4
assert flushes.sum() >= B * (steps // L - 1), "every row must have flushed several times"

# %% [markdown]
# ## 4. A Mamba2 layer
#
# The same API in `rs.mamba2`: state `[N, H, P, N_state]`, inputs x `[B, H, P]`, raw step sizes
# dt `[B, H]` (Δ = softplus(dt + dt_bias)), A `[H]` (negative), B/C `[B, G, N_state]`, skip D
# `[H]`. The ring stores (Δ·x, B, Δ·A), so buffers are self-contained.

# %%
H, P, G, Ns = 4, 16, 2, 16
A = -jnp.exp(uniform(0.0, 2.0, H))
D = normal(H)
dt_bias = uniform(-3.0, -1.0, H)


def mamba2_inputs(*prefix):
  return normal(*prefix, H, P), normal(*prefix, H), A, normal(*prefix, G, Ns), normal(*prefix, G, Ns)


_, S2 = rs.mamba2.chunked(*mamba2_inputs(B, 10), D=D, dt_bias=dt_bias, chunk_size=4)
cursor2 = rs.ReplayCursor.create(N, buffer_len=L)
bufs2 = rs.mamba2.ReplayBuffers.create(N, cursor2, num_heads=H, head_dim=P, num_groups=G, state_dim=Ns)
bufs2, cursor2 = rs.mamba2.write_state(bufs2, cursor2, slots, S2)
pool2 = jnp.zeros_like(bufs2.state).at[slots].set(S2)

y_diff = 0.0
for t in range(2 * L + 1):
  x = mamba2_inputs(B)
  plan = cursor2.plan(slots)
  y_replay, bufs2 = rs.mamba2.replay_decode(*x, bufs2, plan, D=D, dt_bias=dt_bias)
  cursor2 = cursor2.commit(plan)
  y_conv, pool2 = rs.mamba2.decode(*x, pool2, slots, D=D, dt_bias=dt_bias)
  y_diff = max(y_diff, float(jnp.max(jnp.abs(y_replay - y_conv))))
S2_diff = float(jnp.max(jnp.abs(rs.mamba2.materialize(bufs2, cursor2, slots) - pool2[slots])))
print(f"Mamba2: max |y_replay - y_conv| = {y_diff:.2e}, max |S_replay - S_conv| = {S2_diff:.2e}")
assert y_diff < 1e-4 and S2_diff < 1e-4

# %% [markdown]
# ## 5. The tiny model's `generate`
#
# `rs.models` has Flax NNX layers (Qwen3-Next-style GatedDeltaNet, Mamba2) and a small LM.
# `generate` runs prefill and the whole decode loop in one `jax.jit` with the cache donated.
# Random weights, so the tokens mean nothing — but greedy decoding with replay and with
# conventional decode must give the same tokens (same recurrence, float32).

# %%
model = rs.models.make_model(rs.models.LMConfig.tiny(num_layers=1, max_prompt_len=16), seed=0)
prompts = jnp.asarray(rng.integers(1, model.config.vocab_size, (2, 8)), jnp.int32)
lengths = jnp.array([8, 5], jnp.int32)    # right-padded prompts of different lengths
tok_replay, n_replay = rs.models.generate(model, prompts, lengths, max_new_tokens=20, replay=True,
                                          buffer_len=L)
tok_conv, n_conv = rs.models.generate(model, prompts, lengths, max_new_tokens=20, replay=False,
                                      buffer_len=L)
print("replay      :", np.asarray(tok_replay))
print("conventional:", np.asarray(tok_conv))
assert np.array_equal(np.asarray(tok_replay), np.asarray(tok_conv))
print("greedy tokens identical")
