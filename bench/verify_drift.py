"""GDN fold drift under speculative verify: fold="u" vs fold="exact" over many steps.

Every step verifies T tokens per row (synthetic inputs: L2-normalised keys, β ~ sigmoid(N(0,1)),
g ~ −U(0.02, 1) or the slow-decay gate g ~ −U(1e-3, 1e-2)), accepts a random count in [1, T] and
commits. Arms: ReplaySSM with fold "u" and "exact", each with a float32 and a bfloat16 checkpoint
(ring in the checkpoint dtype), against the conventional verify (``verify_conventional``, float32
state stack) of the same accepted stream. Prints the relative RMS error of the materialized state
``rms(S − S_ref) / rms(S_ref)`` at log-spaced steps. A slope in the error vs step count is an
open-loop accumulator (notes/reliability.md §4).

    python -m bench.verify_drift --smoke          # CPU-size: 256 steps, small heads
    python -m bench.verify_drift                  # GPU-size: 4096 steps, Qwen3.5 head geometry
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs


def _inputs(key, batch, t, hk, hv, kd, vd, decay):
  kq, kk, kv, kg, kb, ka = jax.random.split(key, 6)
  k = jax.random.normal(kk, (batch, t, hk, kd))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  q = jax.random.normal(kq, (batch, t, hk, kd))
  v = jax.random.normal(kv, (batch, t, hv, vd))
  g = -jax.random.uniform(kg, (batch, t, hv), minval=decay[0], maxval=decay[1])
  beta = jax.nn.sigmoid(jax.random.normal(kb, (batch, t, hv)))
  accepted = jax.random.randint(ka, (batch,), 1, t + 1, dtype=jnp.int32)
  return (q, k, v, g, beta), accepted


@functools.partial(jax.jit, static_argnames=("t", "dims", "decay"), donate_argnums=(0, 2))
def _step(arms, cursor, stack, read_index, key, *, t, dims, decay):
  """One verify step of every arm and of the conventional reference on the same inputs."""
  batch = read_index.shape[0]
  slots = jnp.arange(batch, dtype=jnp.int32)
  x, accepted = _inputs(key, batch, t, *dims, decay)
  plan = cursor.plan(slots, num_tokens=t)
  arms = {name: rs.gdn.replay_verify(*x, bufs, plan, implementation="xla")[1] for name, bufs in arms.items()}
  _, stack = rs.gdn.verify_conventional(*x, stack, slots, read_index, implementation="xla")
  return arms, cursor.commit(plan, accepted), stack, accepted - 1


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--smoke", action="store_true", help="CPU-size run (small heads, 256 steps)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--num-tokens", type=int, default=4)
  p.add_argument("--buffer-len", type=int, default=16)
  p.add_argument("--slow-decay", action="store_true", help="g ~ -U(1e-3, 1e-2) (adversarial)")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)
  dims = (2, 4, 16, 16) if a.smoke else (16, 32, 128, 128)           # Hk, Hv, K, V
  steps = a.steps or (256 if a.smoke else 4096)
  batch = a.batch or (4 if a.smoke else 32)
  t, decay = a.num_tokens, (1e-3, 1e-2) if a.slow_decay else (0.02, 1.0)
  hk, hv, kd, vd = dims

  cursor = rs.ReplayCursor.create(batch, buffer_len=a.buffer_len, max_draft=t - 1)
  slots = jnp.arange(batch, dtype=jnp.int32)
  key = jax.random.PRNGKey(a.seed)
  key, k0 = jax.random.split(key)
  S0 = 0.3 * jax.random.normal(k0, (batch, hv, vd, kd))
  arms = {}
  for fold in ("u", "exact"):
    for dtype in ("float32", "bfloat16"):
      bufs = rs.gdn.ReplayBuffers.create(batch, cursor, num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                                         head_v_dim=vd, state_dtype=dtype, fold=fold)
      arms[f"{fold}/{dtype}"], _ = rs.gdn.write_state(bufs, cursor, slots, S0)
  stack = jnp.zeros((batch, t, hv, vd, kd), jnp.float32).at[:, 0].set(S0)
  read_index = jnp.zeros((batch,), jnp.int32)

  report = sorted({int(x) for x in np.geomspace(1, steps, 12)})
  print(f"# {jax.devices()[0].device_kind}: GDN verify drift, T={t}, L={a.buffer_len}, B={batch}, "
        f"(Hk, Hv, K, V)={dims}, g ~ -U{decay}; relative state RMS error vs float32 conventional verify")
  names = sorted(arms)  # a dict pytree comes back from jit in sorted key order
  print("step  " + "  ".join(f"{name:>14}" for name in names))
  for i in range(1, steps + 1):
    key, sub = jax.random.split(key)
    arms, cursor, stack, read_index = _step(arms, cursor, stack, read_index, sub, t=t, dims=dims, decay=decay)
    if i in report:
      ref = stack[slots, read_index]
      rms = lambda x: jnp.sqrt(jnp.mean(jnp.square(x)))
      errs = [float(rms(rs.gdn.materialize(arms[n], cursor, slots) - ref) / rms(ref)) for n in names]
      print(f"{i:5d} " + "  ".join(f"{e:14.3e}" for e in errs), flush=True)


if __name__ == "__main__":
  main()
