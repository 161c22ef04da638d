"""Tensor-parallel decode across GPUs: sharded == one-device run, and per-step time vs one device.

The Qwen3.5-4B-like GatedDeltaNet stack of bench/model_decode.py with its mixer heads split over
all visible devices (``rs.models.shard_model``, heads on a ``tp`` mesh axis; embedding, norms,
MLPs and head replicated). Two parts:

1. **Equality** (float32 parameters): prefill a small batch, then ``--steps`` greedy decode steps
   on one device and on the mesh, replay and conventional. Greedy tokens must be identical at
   every step; at the end the unsharded mesh cache is compared with the one-device cache
   (checkpoints, rings, conv states: max |difference|, float summation order of the psum only).
2. **Timing** (bf16 parameters and ring, f32 state, as bench/model_decode.py): per decode step at
   batch B on one device and on the mesh (each device serves all B rows for its share of the
   heads), replay and conventional, honest flush cycles inside one jit (``lax.fori_loop``), median
   over repetitions (``bench.common.time_loop``).

    python -m bench.tp_decode                    # all GPUs (2 on the two-H200 machine)
    python -m bench.tp_decode --smoke            # CPU: run with XLA_FLAGS=--xla_force_host_platform_device_count=2

Rows are appended to ``--out-json`` as they finish, so a run cut short keeps what it measured.
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from bench import common
from bench.model_decode import QWEN35_4B_LIKE, SMOKE, measure, staggered_cache, step_row
from replayssm_jax.models import LMConfig, make_model, shard_model


def greedy_run(decode, prefill, cache, prompts, lengths, steps):
  """Prefill, then ``steps`` greedy steps; returns (tokens [steps, B], final cache)."""
  slots = jnp.arange(prompts.shape[0], dtype=jnp.int32)
  logits, cache = prefill(prompts, cache, slots, lengths)
  tok = jnp.argmax(jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], -1)
  out = []
  for _ in range(steps):
    tok = tok.astype(jnp.int32)
    out.append(np.asarray(tok))
    logits, cache = decode(tok, cache, slots)
    tok = jnp.argmax(logits, -1)
  return np.stack(out), cache


def equality(geometry, mesh, *, steps, batch, buffer_len) -> list[dict]:
  model = make_model(LMConfig(**geometry, dtype=jnp.float32), seed=0)
  sharded = shard_model(model, mesh, axis="tp")
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, geometry["vocab_size"], (batch, geometry["max_prompt_len"])), jnp.int32)
  lengths = jnp.asarray(rng.integers(1, geometry["max_prompt_len"] + 1, batch), jnp.int32)
  graphdef, params = nnx.split(model)

  def one_device(replay):
    @jax.jit
    def decode(params, tok, cache, slots):
      return nnx.merge(graphdef, params).decode(tok, cache, slots, replay=replay)

    @jax.jit
    def prefill(params, tokens, cache, slots, lengths):
      return nnx.merge(graphdef, params).prefill(tokens, cache, slots, lengths)
    return (lambda t, c, s: decode(params, t, c, s)), (lambda *a: prefill(params, *a))

  rows = []
  for replay in (True, False):
    with jax.default_matmul_precision("highest"):   # float32 means float32: no TF32 projections
      rows.append(_compare(model, sharded, one_device(replay), replay, prompts, lengths, steps, batch,
                           buffer_len, mesh.size))
  return rows


def _compare(model, sharded, one_device, replay, prompts, lengths, steps, batch, buffer_len, devices):
  """Greedy tokens and final caches of the one-device run vs the mesh run."""
  dec, pre = one_device
  ref_tokens, ref_cache = greedy_run(dec, pre, model.init_cache(batch, buffer_len=buffer_len),
                                     prompts, lengths, steps)
  sh_tokens, sh_cache = greedy_run(lambda t, c, s: sharded.decode(t, c, s, replay=replay), sharded.prefill,
                                   sharded.init_cache(batch, buffer_len=buffer_len), prompts, lengths, steps)
  same = sh_tokens == ref_tokens
  first = int(np.argmin(same.all(axis=1))) if not same.all() else None
  back = sharded.unshard_cache(sh_cache)
  diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
           for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(ref_cache)) if np.size(a)]
  row = {"part": "equality", "mode": "replay" if replay else "conventional", "steps": steps,
         "batch": batch, "devices": devices, "tokens_identical": bool(same.all()),
         "first_divergent_step": first, "cache_max_abs_diff": max(diffs), "matmul_precision": "highest"}
  common.log(f"equality {row['mode']}: tokens identical {row['tokens_identical']} (first divergent step "
             f"{first}), cache max |diff| {row['cache_max_abs_diff']:.3g}")
  return row


def measure_sharded(sharded, batch, *, replay, buffer_len, reps, rep_seconds) -> dict:
  cache = sharded.shard_cache(staggered_cache(sharded.abstract_model, batch, replay=replay, buffer_len=buffer_len))
  slots = jnp.arange(batch, dtype=jnp.int32)
  no_flush = jnp.zeros((batch,), bool)
  decode = sharded.decode_step(cache, replay=replay)

  def run(params, carry, n):
    def step(_, c):
      logits, cache = decode(params, c[1], c[0], slots, no_flush)
      return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, n * buffer_len, step, carry)
  fn = jax.jit(run, donate_argnums=(1,))   # n traced: one compilation for every n
  _, timing = common.time_loop(lambda c, n: fn(sharded.params, c, n), (jnp.ones((batch,), jnp.int32), cache),
                               reps=reps, rep_seconds=rep_seconds)
  return step_row(timing, batch=batch, mode="replay" if replay else "conventional", buffer_len=buffer_len)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.tp_decode", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny stack (CPU host devices)")
  parser.add_argument("--steps", type=int, default=None, help="greedy steps of the equality part (256)")
  parser.add_argument("--batches", default=None, help="timing batch sizes (32,256)")
  parser.add_argument("--buffer-len", type=int, default=16)
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--rep-seconds", type=float, default=0.3)
  parser.add_argument("--skip-timing", action="store_true")
  parser.add_argument("--out-json", default=None)
  args = parser.parse_args(argv)
  geometry = SMOKE if args.smoke else QWEN35_4B_LIKE
  steps = args.steps or (12 if args.smoke else 256)
  batches = [int(b) for b in (args.batches or ("2" if args.smoke else "32,256")).split(",")]
  if jax.device_count() < 2:
    raise SystemExit(f"bench.tp_decode needs >= 2 devices; found {jax.devices()}")
  mesh = Mesh(np.array(jax.devices()), ("tp",))
  result = {"meta": common.run_metadata(argv, "bench.tp_decode"),
            "devices": [str(d) for d in jax.devices()], "geometry": geometry, "rows": []}

  def save(rows):
    result["rows"] += rows
    if args.out_json:
      common.write_json(args.out_json, result)

  save(equality(geometry, mesh, steps=steps, batch=4, buffer_len=args.buffer_len))
  if not args.skip_timing:
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    model = make_model(LMConfig(**geometry, dtype=dtype), seed=0)
    sharded = shard_model(model, mesh, axis="tp")
    for batch in batches:
      for replay in (False, True):
        one = measure(model, batch, mode="replay" if replay else "conventional", buffer_len=args.buffer_len, reps=args.reps,
                      rep_seconds=args.rep_seconds, implementation=None)
        many = measure_sharded(sharded, batch, replay=replay, buffer_len=args.buffer_len, reps=args.reps,
                               rep_seconds=args.rep_seconds)
        rows = [dict(one, part="timing", devices=1), dict(many, part="timing", devices=mesh.size)]
        rows[1]["speedup_vs_one_device"] = one["median_ms"] / many["median_ms"]
        common.log(f"B={batch} {rows[0]['mode']}: 1 device {one['median_ms']:.3f} ms/step, {mesh.size} devices "
                   f"{many['median_ms']:.3f} ms/step ({rows[1]['speedup_vs_one_device']:.2f}x)")
        save(rows)
  timing = [r for r in result["rows"] if r["part"] == "timing"]
  table = common.render_table(
      ["B", "mode", "devices", "ms/step", "p20-p80", "tokens/s", "x one device"],
      [[str(r["batch"]), r["mode"], str(r["devices"]), f"{r['median_ms']:.3f}", f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}",
        f"{r['tokens_per_s']:.0f}", common.fmt_float(r.get("speedup_vs_one_device"), ".2f")] for r in timing],
      markdown=True)
  print(table)
  return result


if __name__ == "__main__":
  main()
