"""One MoE MLP per decode step: the grouped matmul as the Pallas-Triton kernel against XLA's
``ragged_dot``.

The layer is ``models.moe.MoE`` at Qwen3-Next-80B-A3B's shapes (D 2048, 512 experts of width 512,
top-10, a gated shared expert of 512; bf16 parameters, random weights, so the router spreads the
B·10 token-expert pairs over the experts), B tokens per step (one per batch row). Arms: ``xla``
(``implementation="xla"``: ``jax.lax.ragged_dot``) and ``pallas_triton`` (pallas/moe_triton.py; a
``--configs`` row per launch config). Method (bench/common.py): n steps inside one ``jax.jit``
(``lax.fori_loop``), each step's x depending on the last step's output (nothing is hoisted), carry
donated; ``time_loop`` warms up, calibrates and times ``--reps`` calls; ms per step is the median,
with p20–p80. Bytes: the weights a step must read, the experts its pairs hit (counted on the first
step's routing) plus router and shared expert, against a copy ceiling measured in the same run.
Gate, before timing: the first step's output of the kernel arms against the xla arm's (the same
bf16 routing), relative L2 < 1e-3; every arm's distance to a float32 evaluation of the layer
(parameters cast to float32, ``ragged_dot`` at HIGHEST) is recorded too (about 1e-2 at bf16: a
near-tie between two experts' scores flips with the rounding of x).

    python -m bench.moe_decode --batches 1,32,256 --out-json bench/results/moe_decode_h200.json
    python -m bench.moe_decode --configs default,bm16bn128bk64,bm32bn64bk128w8s4
    python -m bench.moe_decode --trace --arms pallas_triton   # + per-kernel µs and launches per step
    python -m bench.moe_decode --smoke          # CPU: tiny layer, kernel interpreted

``--trace``: before timing, ``--trace-steps`` steps of the same loop run under the profiler and each row
records the GPU kernels per step (bench.model_trace's summing: µs and launches per kernel name; on
CPU there are no GPU streams, so none are listed).

A row whose run fails on the device (JAX runtime error: at prefill sizes XLA's ``ragged_dot``
autotuner runs out of memory, and the gate needs its output) is recorded with its error and the
run goes on.

Kernel configs: ``default`` (``config.grouped_matmul_config``) or tokens ``bm``, ``bn``, ``bk``
(block_m / block_n / block_k), ``w`` (warps), ``s`` (stages), e.g. ``bm16bn128bk64w4s3``.
"""
import argparse
import dataclasses
import functools
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from bench import common
from bench import model_trace
from replayssm_jax.models import moe as moe_lib
from replayssm_jax.pallas import moe_triton

ARMS = ("xla", "pallas_triton")
QWEN3_NEXT = moe_lib.MoEConfig(hidden_size=2048, num_experts=512, top_k=10,
                               expert_intermediate_size=512, shared_intermediate_size=512,
                               shared_expert_gate=True, dtype=jnp.bfloat16)
SMOKE = dataclasses.replace(QWEN3_NEXT, hidden_size=32, num_experts=8, top_k=2,
                            expert_intermediate_size=16, shared_intermediate_size=16)
GATE_TOL = 1e-3
_KNOBS = {"bm": "block_m", "bn": "block_n", "bk": "block_k", "w": "num_warps", "s": "num_stages"}


def parse_config(text: str) -> tuple:
  """``default`` → (); ``bm16bn128`` → (("block_m", 16), ("block_n", 128))."""
  return common.parse_knobs(text, _KNOBS, example="bm16bn128bk64w4s3")


def _forward(graphdef, state, x, arm, knobs):
  """The layer with the arm's grouped matmul (kernel knobs patched in for this trace)."""
  layer = nnx.merge(graphdef, state)
  if arm == "pallas_triton" and knobs:
    real = moe_lib.grouped_matmul

    def tuned(x, w, s, *, preferred_element_type=None, implementation=None):
      return moe_triton.grouped_matmul(x, w, s, preferred_element_type=preferred_element_type,
                                       **dict(knobs))
    moe_lib.grouped_matmul = tuned
    try:
      return layer(x, implementation=arm)
    finally:
      moe_lib.grouped_matmul = real
  return layer(x, implementation=arm)


@functools.partial(jax.jit, static_argnames=("graphdef", "arm", "knobs"), donate_argnums=(2,))
def _run(graphdef, state, x, n, *, arm, knobs):
  def step(_, x):
    return (x + 1e-3 * _forward(graphdef, state, x, arm, knobs)).astype(x.dtype)
  return lax.fori_loop(0, n, step, x)


def weight_bytes(cfg: moe_lib.MoEConfig, experts_hit: int) -> int:
  """Parameter bytes one step reads: the hit experts, the shared expert and the router."""
  item = jnp.dtype(cfg.dtype).itemsize
  d, i, s = cfg.hidden_size, cfg.expert_intermediate_size, cfg.shared_intermediate_size
  per_expert = 3 * d * i * item                       # gate | up, down
  shared = (3 * d * s + d) * item
  return experts_hit * per_expert + shared + d * cfg.num_experts * 4


def trace_kernels(call, carry, steps: int) -> list[dict]:
  """Per-kernel µs and launches per step of ``call(carry, steps)`` (warmed up first)."""
  carry = jax.block_until_ready(call(carry, 1))
  with tempfile.TemporaryDirectory() as tdir:
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
      jax.block_until_ready(call(carry, steps))
    return model_trace.kernel_times(model_trace.trace_events(tdir), steps)


@dataclasses.dataclass(frozen=True)
class Case:
  """One batch's layer, input and gate references, built once for all its arms and configs:
  ``ref`` the float32 layer at HIGHEST precision, ``xla`` the xla arm's output (float64 copies)."""
  graphdef: Any
  state: Any
  x: jax.Array
  experts_hit: int
  ref: np.ndarray
  xla: np.ndarray


def make_case(cfg, batch) -> Case:
  layer = moe_lib.MoE(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  x = common.hash_normal(1, (batch, cfg.hidden_size)).astype(cfg.dtype)
  hit = int(np.unique(np.asarray(layer.route(x)[1])).size)
  ref_graph = nnx.split(moe_lib.MoE(dataclasses.replace(cfg, dtype=jnp.float32), rngs=nnx.Rngs(0)))[0]
  ref_layer = nnx.merge(ref_graph, jax.tree.map(lambda a: a.astype(jnp.float32), state))
  with jax.default_matmul_precision("highest"):
    ref = np.asarray(ref_layer(x.astype(jnp.float32), implementation="xla"), np.float64)
  xla = np.asarray(_forward(graphdef, state, x, "xla", ()).astype(jnp.float32), np.float64)
  return Case(graphdef, state, x, hit, ref, xla)


def measure(cfg, case: Case, *, arm, knobs, reps, rep_seconds, trace_steps=0):
  graphdef, state, x = case.graphdef, case.state, case.x
  rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
  out = np.asarray(_forward(graphdef, state, x, arm, knobs).astype(jnp.float32), np.float64)
  errs = {"vs_f32": rel(out, case.ref), "vs_xla": rel(out, case.xla)}
  call = lambda carry, n: _run(graphdef, state, carry, np.int32(n), arm=arm, knobs=knobs)
  kernels = trace_kernels(call, jnp.array(x, copy=True), trace_steps) if trace_steps else None
  _, timing = common.time_loop(call, jnp.array(x, copy=True), reps=reps, rep_seconds=rep_seconds)
  stats = timing.ms_per(1)
  moved = weight_bytes(cfg, case.experts_hit)
  return {"median_ms": stats["median_ms"], "p20_ms": stats["p20_ms"], "p80_ms": stats["p80_ms"],
          "n_cycles": stats["n_cycles"], "experts_hit": case.experts_hit, "weight_bytes": moved,
          "gbps": moved / (stats["median_ms"] * 1e-3) / 1e9, "gate_rel_l2": errs,
          "gate": "ok" if errs["vs_xla"] < GATE_TOL else "FAILED", "kernels": kernels}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.moe_decode", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny layer for CPU (kernel interpreted)")
  parser.add_argument("--batches", default=None, help="comma list (default 1,32,256)")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--configs", default="default", help="kernel launch configs (module doc)")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--rep-seconds", type=float, default=None)
  parser.add_argument("--trace", action="store_true", help="also list the GPU kernels per step")
  parser.add_argument("--trace-steps", type=int, default=40)
  parser.add_argument("--out-json", default=None)
  args = parser.parse_args(argv)
  cfg = SMOKE if args.smoke else QWEN3_NEXT
  batches = [int(b) for b in (args.batches or ("4" if args.smoke else "1,32,256")).split(",")]
  arms = args.arms.split(",")
  for a in arms:
    if a not in ARMS:
      raise ValueError(f"--arms: {a!r}; expected a comma list of {ARMS}")
  configs = [(c, parse_config(c)) for c in args.configs.split(",")]
  reps = args.reps or (2 if args.smoke else 7)
  rep_seconds = args.rep_seconds if args.rep_seconds is not None else (0.01 if args.smoke else 0.2)
  ceiling = None if args.smoke else common.measure_copy_ceiling(2 * 10 ** 9)
  rows = []
  result = {"meta": common.run_metadata(argv, "bench.moe_decode"), "copy_ceiling": ceiling,
            "layer": {**dataclasses.asdict(cfg), "dtype": cfg.dtype.name}, "rows": rows}
  for batch in batches:
    case, case_error = None, None
    for arm in arms:
      for cname, knobs in (configs if arm == "pallas_triton" else [("-", ())]):
        try:
          if case_error is not None:   # the references failed once: every row of this batch fails
            raise case_error
          if case is None:
            try:
              case = make_case(cfg, batch)
            except jax.errors.JaxRuntimeError as e:
              case_error = e
              raise
          r = measure(cfg, case, arm=arm, knobs=knobs, reps=reps, rep_seconds=rep_seconds,
                      trace_steps=args.trace_steps if args.trace else 0)
        except jax.errors.JaxRuntimeError as e:   # e.g. XLA's ragged_dot autotuner out of memory
          error = str(e).strip().splitlines()[0][:300]
          rows.append({"batch": batch, "arm": arm, "config": cname, "error": error})
          common.log(f"B={batch} {arm} {cname}: failed: {error}")
          if args.out_json:
            common.write_json(args.out_json, result)
          continue
        r.update(batch=batch, arm=arm, config=cname)
        if ceiling:
          r["pct_ceiling"] = 100 * r["gbps"] / ceiling["gbps"]
        rows.append(r)
        common.log(f"B={batch} {arm} {cname}: {r['median_ms']:.4f} ms, {r['gbps']:.0f} GB/s, "
                   f"{r['experts_hit']} experts, gate {r['gate']} {r['gate_rel_l2']}")
        if r["kernels"] is not None:
          ks = r["kernels"]
          common.log(f"  {sum(k['us_per_step'] for k in ks):.1f} µs of kernels in "
                     f"{sum(k['launches_per_step'] for k in ks):.0f} launches per step; "
                     + ", ".join(f"{k['kernel']} {k['us_per_step']:.1f}" for k in ks[:6]))
        if args.out_json:
          common.write_json(args.out_json, result)
  timed = [r for r in rows if "error" not in r]
  xla = {r["batch"]: r["median_ms"] for r in timed if r["arm"] == "xla"}
  print(common.render_table(
      ["B", "arm", "config", "ms/step", "p20-p80", "experts hit", "GB/s", "% copy", "x xla", "gate"],
      [[str(r["batch"]), r["arm"], r["config"], f"{r['median_ms']:.4f}",
        f"{r['p20_ms']:.4f}-{r['p80_ms']:.4f}", str(r["experts_hit"]), f"{r['gbps']:.0f}",
        common.fmt_float(r.get("pct_ceiling"), ".0f"),
        common.fmt_float(xla[r["batch"]] / r["median_ms"] if r["batch"] in xla else None, ".2f"),
        r["gate"]] for r in timed],
      align_right={0, 3, 5, 6, 7, 8}))
  for r in rows:
    if "error" in r:
      print(f"B={r['batch']} {r['arm']} {r['config']}: failed: {r['error']}")
  return result


if __name__ == "__main__":
  main()
