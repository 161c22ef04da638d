"""Model-level decode benchmark: a Qwen3.5-4B-like GatedDeltaNet stack, replay vs conventional.

Stack: hidden 2560, Hk 16, Hv 32, K = V = 128, 8 GDN layers each with a SwiGLU MLP (9216), vocab
32768 (smaller than Qwen3.5's so the head does not dominate; the mixers are what differ), random
weights, bf16 parameters and ring, float32 state. For each batch size B the decode loop
(``LM.decode`` + greedy argmax fed back) runs inside one ``jax.jit`` (``lax.fori_loop`` over full
flush cycles of L steps, cache donated); rows start at staggered cursor phases (row b has b mod
(L-1) pending zero entries, an exact state), so every step has a mix of flushing and non-flushing
rows. ``bench.common.time_loop`` warms up, calibrates and reports the median / p20 / p80 per step.
``--stack mamba2`` / ``hybrid`` replaces every / every other mixer by a Mamba2 mixer of
mamba2-2.7b's shape (H 80, P 64, G 1, N 128). Modes: conventional, replay (the library's default,
including the small-batch policy) and, where the policy is on, replay without it.

    python -m bench.model_decode                      # GPU: B = 1, 32, 128, 256
    python -m bench.model_decode --stack hybrid --batches 8,32,256
    python -m bench.model_decode --smoke              # CPU: tiny stack, B = 1, 4
"""
import argparse
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from bench import common
from replayssm_jax.models import LMConfig, make_model

QWEN35_4B_LIKE = dict(vocab_size=32768, hidden_size=2560, num_layers=8, num_k_heads=16, num_v_heads=32,
                      head_k_dim=128, head_v_dim=128, intermediate_size=9216, max_prompt_len=16)
SMOKE = dict(vocab_size=256, hidden_size=64, num_layers=2, num_k_heads=2, num_v_heads=4, head_k_dim=16,
             head_v_dim=16, intermediate_size=128, max_prompt_len=16)
# Mamba2 mixers of mamba2-2.7b's shape (H 80, P 64, G 1, N 128 at hidden 2560) in the same stack.
MAMBA2_HEADS = dict(mamba2_num_heads=80, mamba2_head_dim=64, mamba2_num_groups=1, mamba2_state_dim=128)
SMOKE_MAMBA2_HEADS = dict(mamba2_num_heads=8, mamba2_head_dim=16, mamba2_num_groups=2, mamba2_state_dim=16)
STACKS = ("gdn", "mamba2", "hybrid")


def stack_geometry(stack: str, smoke: bool) -> dict:
  """The benchmark LM: every mixer GatedDeltaNet ("gdn"), Mamba2, or alternating ("hybrid")."""
  geometry = dict(SMOKE if smoke else QWEN35_4B_LIKE)
  if stack == "gdn":
    return geometry
  n = geometry["num_layers"]
  types = ("mamba2",) * n if stack == "mamba2" else tuple(("gdn", "mamba2")[i % 2] for i in range(n))
  return dict(geometry, layer_types=types, **(SMOKE_MAMBA2_HEADS if smoke else MAMBA2_HEADS))


def _loop(graphdef, *, replay, buffer_len, implementation, flush_all):
  def run(params, carry, n):
    model = nnx.merge(graphdef, params)
    slots = jnp.arange(carry[0].shape[0], dtype=jnp.int32)

    def step(_, c):
      tok, cache = c
      logits, cache = model.decode(tok, cache, slots, replay=replay, implementation=implementation,
                                   flush_all=flush_all)
      return jnp.argmax(logits, -1).astype(jnp.int32), cache
    return jax.lax.fori_loop(0, n * buffer_len, step, carry)
  return jax.jit(run, donate_argnums=(1,))   # n traced: one compilation for every n


def staggered_cache(model, batch, *, replay, buffer_len, max_draft=0):
  """A bf16-ring cache whose row b has b mod (L-1) pending entries (replay): mixed flush phases.
  ``max_draft``: rings sized for verify steps of up to max_draft + 1 tokens (bench.model_spec)."""
  cache = model.init_cache(batch, buffer_len=buffer_len, max_draft=max_draft, ring_dtype=jnp.bfloat16)
  count = (jnp.arange(batch, dtype=jnp.int32) % max(1, buffer_len - 1)) if replay else cache.cursor.count
  return cache.replace(cursor=cache.cursor.replace(count=count))


def step_row(timing, *, batch, mode, buffer_len) -> dict:
  """A result row from ``common.time_loop``'s timing of L-step cycles."""
  summary = timing.ms_per(buffer_len)
  return {"mode": mode, "batch": batch, "buffer_len": buffer_len, "ms_per_step": summary.pop("ms"), **summary,
          "tokens_per_s": batch / (summary["median_ms"] / 1e3)}


# mode -> (replay, flush_all): "replay" follows the library's small-batch policy (flush_all=None:
# every step flushes below config.replay_min_batch); "replay-no-policy" always replays.
MODES = {"conventional": (False, None), "replay": (True, None), "replay-no-policy": (True, False)}


def measure(model, batch, *, mode, buffer_len, reps, rep_seconds, implementation):
  replay, flush_all = MODES[mode]
  graphdef, params = nnx.split(model)
  cache = staggered_cache(model, batch, replay=replay, buffer_len=buffer_len)
  fn = _loop(graphdef, replay=replay, buffer_len=buffer_len, implementation=implementation,
             flush_all=flush_all)
  carry = (jnp.ones((batch,), jnp.int32), cache)
  _, timing = common.time_loop(lambda c, n: fn(params, c, n), carry, reps=reps, rep_seconds=rep_seconds)
  return step_row(timing, batch=batch, mode=mode, buffer_len=buffer_len)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.model_decode", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny stack for CPU")
  parser.add_argument("--stack", choices=STACKS, default="gdn",
                      help="mixers: all GatedDeltaNet, all Mamba2 (mamba2-2.7b heads) or alternating")
  parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
  parser.add_argument("--buffer-len", type=int, default=16)
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--rep-seconds", type=float, default=None)
  parser.add_argument("--implementation", default=None)
  parser.add_argument("--out-json", default=None)
  parser.add_argument("--markdown", default=None, help="write the table to this markdown file")
  args = parser.parse_args(argv)
  geometry = stack_geometry(args.stack, args.smoke)
  batches = [int(b) for b in (args.batches or ("1,4" if args.smoke else "1,32,128,256")).split(",")]
  reps = args.reps or (5 if args.smoke else 7)
  rep_seconds = args.rep_seconds if args.rep_seconds is not None else (0.02 if args.smoke else 0.5)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  model = make_model(LMConfig(**geometry, dtype=dtype), seed=0)
  rows = []
  for batch in batches:
    probe = model.init_cache(batch, buffer_len=args.buffer_len, ring_dtype=jnp.bfloat16)
    modes = ["conventional", "replay"] + (["replay-no-policy"] if model._small_batch(probe, batch) else [])
    del probe
    group = [measure(model, batch, mode=m, buffer_len=args.buffer_len, reps=reps, rep_seconds=rep_seconds,
                     implementation=args.implementation) for m in modes]
    for r in group[1:]:
      r["speedup_vs_conv"] = group[0]["median_ms"] / r["median_ms"]
    rows += group
    common.log(f"B={batch}: " + ", ".join(f"{r['mode']} {r['median_ms']:.3f} ms/step"
                                          + (f" ({r['speedup_vs_conv']:.2f}x)" if "speedup_vs_conv" in r else "")
                                          for r in group))
  headers = ["B", "mode", "ms/step (median)", "p20", "p80", "tokens/s", "speed-up"]
  table = common.render_table(headers, [[str(r["batch"]), r["mode"], f"{r['median_ms']:.3f}", f"{r['p20_ms']:.3f}",
                                         f"{r['p80_ms']:.3f}", f"{r['tokens_per_s']:.0f}",
                                         common.fmt_float(r.get("speedup_vs_conv"), ".2f")] for r in rows],
                              markdown=True)
  print(table)
  result = {"meta": common.run_metadata(argv, "bench.model_decode"),
            "stack": args.stack, "geometry": geometry, "dtype": jnp.dtype(dtype).name, "rows": rows}
  if args.out_json:
    common.write_json(args.out_json, result)
  if args.markdown:
    pathlib.Path(args.markdown).write_text(f"## Model decode ({args.stack} stack)\n\n" + table + "\n")
  return result


if __name__ == "__main__":
  main()
