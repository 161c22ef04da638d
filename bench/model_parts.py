"""The model step's shared parts, timed alone: the conv-state step and the SwiGLU MLP (B = 256).

bench/model_trace.py showed where a model decode step spends its GPU time outside the mixer
kernels. This times the two parts that were changed, each against the form it
replaced, in one run:

* conv step (``models._conv.step``: gather the slot's W-1 inputs, W multiply-adds, scatter the
  shifted window back) on a [B, 3, C] bf16 pool, with the scatter declared unique (the library) and
  with the earlier index, where every padding row pointed at the same out-of-range slot so XLA had
  to assume repeats.
* SwiGLU: ``lm.SwiGLU`` (gate | up as one [D, 2·I] projection) against two separate projections
  of the same x (which XLA merges into one dot over concatenated weights).

Each part runs ``--steps`` times inside one ``jax.jit`` (``lax.fori_loop``, carry donated), timed by
``bench.common.time_loop``; the table gives µs per call (median, p20–p80).

    python -m bench.model_parts                 # GPU: B = 256, GDN conv C = 8192, Mamba2 C = 5376
    python -m bench.model_parts --smoke         # CPU: tiny shapes
"""
import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from bench import common
from replayssm_jax.models import _conv
from replayssm_jax.models.lm import SwiGLU

f32 = jnp.float32


def conv_step_repeated_index(x, weight, conv_state, slots):
  """``_conv.step`` as it was: padding rows all scatter to index N (mode="drop"), not unique."""
  live = slots >= 0
  hist = conv_state[jnp.where(live, slots, 0)]
  window = jnp.concatenate([hist, x[:, None, :].astype(hist.dtype)], axis=1)
  out = sum(weight[i].astype(f32) * window[:, i].astype(f32) for i in range(weight.shape[0]))
  put = jnp.where(live, slots, conv_state.shape[0])
  return out, conv_state.at[put].set(window[:, 1:], mode="drop")


def library_conv_step(x, weight, conv_state, slots):
  return _conv.step(x, weight, None, conv_state, slots)


CONV_ARMS = {"conv (unique scatter)": library_conv_step, "conv (repeated index)": conv_step_repeated_index}


def time_conv(step, *, batch, channels, width, reps, rep_seconds):
  x0 = common.hash_normal(1, (batch, channels)).astype(jnp.bfloat16)
  weight = common.hash_normal(2, (width, channels))
  slots = jnp.arange(batch, dtype=jnp.int32)

  def run(carry, n):
    def body(_, c):
      pool, acc = c
      out, pool = step((x0 + acc[:, None]).astype(x0.dtype), weight, pool, slots)
      return pool, acc + 1e-6 * out[:, 0]     # a dependence between steps: nothing is hoisted
    return jax.lax.fori_loop(0, n, body, carry)

  carry = (common.hash_normal(3, (batch, width - 1, channels)).astype(jnp.bfloat16), jnp.zeros((batch,), f32))
  _, timing = common.time_loop(jax.jit(run, donate_argnums=(0,)), carry, reps=reps, rep_seconds=rep_seconds)
  return timing


class TwoProjections(nnx.Module):
  """down(silu(gate(x)) · up(x)) with gate and up as separate matrices (the earlier SwiGLU)."""

  def __init__(self, dim, hidden, *, dtype, rngs):
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.gate, self.up, self.down = lin(dim, hidden), lin(dim, hidden), lin(hidden, dim)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


MLP_ARMS = {"SwiGLU (gate|up one matrix)": SwiGLU, "SwiGLU (two projections)": TwoProjections}


def time_mlp(cls, *, batch, dim, hidden, reps, rep_seconds):
  graphdef, params = nnx.split(cls(dim, hidden, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))

  def run(x, n):
    mlp = nnx.merge(graphdef, params)
    return jax.lax.fori_loop(0, n, lambda _, h: (h + 1e-3 * mlp(h)).astype(h.dtype), x)

  x = common.hash_normal(4, (batch, dim)).astype(jnp.bfloat16)
  _, timing = common.time_loop(jax.jit(run, donate_argnums=(0,)), x, reps=reps, rep_seconds=rep_seconds)
  return timing


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.model_parts", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes for CPU")
  parser.add_argument("--batch", type=int, default=None)
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--rep-seconds", type=float, default=None)
  parser.add_argument("--out-json", default=None)
  args = parser.parse_args(argv)
  batch = args.batch or (4 if args.smoke else 256)
  reps = args.reps or (5 if args.smoke else 7)
  rep_seconds = args.rep_seconds if args.rep_seconds is not None else (0.01 if args.smoke else 0.2)
  # Conv channels: Qwen3.5-4B's GDN conv (2·16·128 + 32·128) and mamba2-2.7b's (80·64 + 2·128).
  channels = (64,) if args.smoke else (8192, 5376)
  dim, hidden = (32, 64) if args.smoke else (2560, 9216)
  rows = []
  for c in channels:
    for name, step in CONV_ARMS.items():
      t = time_conv(step, batch=batch, channels=c, width=4, reps=reps, rep_seconds=rep_seconds)
      rows.append({"part": name, "shape": f"B={batch} C={c} bf16", "timing": t})
  for name, cls in MLP_ARMS.items():
    t = time_mlp(cls, batch=batch, dim=dim, hidden=hidden, reps=reps, rep_seconds=rep_seconds)
    rows.append({"part": name, "shape": f"B={batch} D={dim} I={hidden} bf16", "timing": t})
  for r in rows:
    s = r.pop("timing").ms_per(1e-3)   # µs per call
    r.update(us_median=s["median_ms"], us_p20=s["p20_ms"], us_p80=s["p80_ms"])
    common.log(f"{r['part']}, {r['shape']}: {r['us_median']:.1f} µs")
  print(common.render_table(["part", "shape", "µs/call", "p20-p80"],
                            [[r["part"], r["shape"], f"{r['us_median']:.1f}",
                              f"{r['us_p20']:.1f}-{r['us_p80']:.1f}"] for r in rows]))
  result = {"meta": common.run_metadata(argv, "bench.model_parts"),
            "rows": rows}
  if args.out_json:
    common.write_json(args.out_json, result)
  return result


if __name__ == "__main__":
  main()
