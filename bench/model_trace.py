"""Where a model decode step spends its GPU time: per-kernel durations from a profiler trace.

    python -m bench.model_trace --stack mamba2 --buffer-len 8 --batch 256 \
        --implementations pallas_triton,pallas_mosaic
    python -m bench.model_trace --modes conventional,replay   # where the two modes differ
    python -m bench.model_trace --preset qwen3.5-4b --modes conventional,replay --top 40
    python -m bench.model_trace --smoke      # CPU: tiny stack; no GPU streams, so no kernels listed

The model and its decode loop are bench/model_decode.py's (replay mode, staggered cursor phases,
one ``jax.jit`` over full flush cycles, cache donated), or with ``--preset`` bench/model_e2e.py's
real architecture and step loop with ``--context`` KV tokens per slot. Per implementation the
loop is warmed up, then ``--cycles`` cycles of L steps run under ``jax.profiler.trace(create_perfetto_trace=True)``;
the trace's complete events on GPU stream threads are summed by kernel name and divided by the
number of steps: microseconds and launches per model step (all layers). This measures kernels in
place, inside the model, where bench/mamba2_decode.py and bench/gdn_decode.py measure a layer
alone (the two can disagree).
"""
import argparse
import collections
import glob
import gzip
import json
import pathlib
import tempfile

import jax
import jax.numpy as jnp
from flax import nnx

from bench import common
from bench import model_decode
from bench import model_e2e
from replayssm_jax import config as config_lib
from replayssm_jax.models import LMConfig, make_model


def kernel_times(events: list[dict], steps: int) -> list[dict]:
  """Per kernel name: µs and launches per step, from perfetto trace events (complete events "X" on
  threads whose name mentions a stream), longest first."""
  streams = {(e.get("pid"), e.get("tid")) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"
             and "stream" in str(e.get("args", {}).get("name", "")).lower()}
  total, launches = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams:
      total[e["name"]] += float(e.get("dur", 0.0))
      launches[e["name"]] += 1
  return [{"kernel": name, "us_per_step": us / steps, "launches_per_step": launches[name] / steps}
          for name, us in total.most_common()]


def trace_events(trace_dir: str) -> list[dict]:
  """The events of the perfetto trace that ``jax.profiler.trace`` wrote under ``trace_dir``."""
  files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
  if not files:
    raise RuntimeError(f"no perfetto trace under {trace_dir}")
  data = json.load(gzip.open(files[-1]))
  return data["traceEvents"] if isinstance(data, dict) else data


def _trace(fn, params, carry, *, cycles: int, steps_per_cycle: int, hlo_path=None) -> list[dict]:
  """Warms ``fn(params, carry, n)`` up, then traces ``cycles`` cycles: kernels per step."""
  carry = jax.block_until_ready(fn(params, carry, 1))          # compile and warm up
  if hlo_path:   # the optimized HLO names the fusions the trace lists
    pathlib.Path(hlo_path).write_text(fn.lower(params, carry, cycles).compile().as_text())
  with tempfile.TemporaryDirectory() as tdir:
    with jax.profiler.trace(tdir, create_perfetto_trace=True):
      jax.block_until_ready(fn(params, carry, cycles))
    return kernel_times(trace_events(tdir), cycles * steps_per_cycle)


def trace_loop(model, *, batch: int, buffer_len: int, cycles: int, implementation,
               mode: str = "replay", hlo_path=None) -> list[dict]:
  """bench.model_decode's stack loop (``implementation`` for every mixer)."""
  replay, flush_all = model_decode.MODES[mode]
  graphdef, params = nnx.split(model)
  fn = model_decode._loop(graphdef, replay=replay, buffer_len=buffer_len,
                          implementation=implementation, flush_all=flush_all)
  carry = (jnp.ones((batch,), jnp.int32),
           model_decode.staggered_cache(model, batch, replay=replay, buffer_len=buffer_len))
  return _trace(fn, params, carry, cycles=cycles, steps_per_cycle=buffer_len, hlo_path=hlo_path)


def trace_preset(model, name: str, *, batch: int, context: int, cycles: int, mode: str,
                 buffer_len: int, hlo_path=None) -> list[dict]:
  """bench.model_e2e's step loop of ``model``, built from the preset ``name``
  (``implementation=None``), with ``context`` tokens in every KV slot; ``mode`` conventional or
  replay."""
  replay = model_e2e.MODES[mode]
  graphdef, params = nnx.split(model)
  fn = model_e2e._step_loop(graphdef, replay=replay, buffer_len=buffer_len, context=context)
  cache = model_e2e.prepared_cache(model, batch, context=context, buffer_len=buffer_len, replay=replay)
  return _trace(fn, params, (jnp.ones((batch,), jnp.int32), cache), cycles=cycles,
                steps_per_cycle=buffer_len, hlo_path=hlo_path)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.model_trace", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny stack for CPU")
  parser.add_argument("--stack", choices=model_decode.STACKS, default="gdn")
  parser.add_argument("--preset", default=None,
                      help="a real-architecture preset of bench.model_e2e (its step loop, L and "
                           "depth; implementation=None) instead of --stack")
  parser.add_argument("--context", type=int, default=1024, help="KV tokens per slot (--preset)")
  parser.add_argument("--batch", type=int, default=None, help="rows (default 256; smoke 4)")
  parser.add_argument("--buffer-len", type=int, default=None,
                      help="L of the loop (default 16, the library's decode default)")
  parser.add_argument("--cycles", type=int, default=4, help="flush cycles traced")
  parser.add_argument("--implementations", default="none",
                      help="comma-separated; 'none' = implementation=None (the library's choice)")
  parser.add_argument("--modes", default="replay",
                      help=f"comma-separated decode modes of bench.model_decode: {', '.join(model_decode.MODES)}")
  parser.add_argument("--top", type=int, default=14, help="kernels listed per implementation")
  parser.add_argument("--out-json", default=None)
  parser.add_argument("--hlo-dir", default=None,
                      help="write each loop's optimized HLO here (to map fusion names to ops)")
  args = parser.parse_args(argv)
  batch = args.batch or (4 if args.smoke else 256)
  runs = []

  def record(mode, name, kernels):
    total = sum(k["us_per_step"] for k in kernels)
    common.log(f"{mode}, {name}: {total:.1f} µs of GPU kernels per step, {len(kernels)} kernels")
    print(common.render_table(["µs/step", "launches/step", "kernel"],
                              [[f"{k['us_per_step']:.1f}", f"{k['launches_per_step']:.1f}", k["kernel"][:80]]
                               for k in kernels[:args.top]]))
    runs.append({"mode": mode, "implementation": name, "us_per_step": total, "kernels": kernels})

  hlo = lambda mode, name: args.hlo_dir and pathlib.Path(args.hlo_dir, f"{mode}_{name}.hlo.txt")
  modes = args.modes.split(",")
  if args.preset:
    for mode in modes:
      if mode not in model_e2e.MODES:
        parser.error(f"--modes {mode!r}: a preset runs one of {', '.join(model_e2e.MODES)}")
    if args.implementations != "none":
      parser.error("--preset runs implementation=None; drop --implementations")
    preset_len = config_lib.DECODE_BUFFER_LEN if args.buffer_len is None else args.buffer_len
    try:
      model = make_model(model_e2e.model_config(args.preset), seed=0)
    except ValueError as e:
      parser.error(f"--preset: {e}")
    for mode in modes:
      record(mode, "none", trace_preset(model, args.preset, batch=batch, context=args.context,
                                        cycles=args.cycles, mode=mode, buffer_len=preset_len,
                                        hlo_path=hlo(mode, "none")))
    setup = {"preset": args.preset, "context": args.context, "buffer_len": preset_len}
  else:
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    geometry = model_decode.stack_geometry(args.stack, args.smoke)
    model = make_model(LMConfig(**geometry, dtype=dtype), seed=0)
    buffer_len = 16 if args.buffer_len is None else args.buffer_len
    for mode in modes:
      for name in args.implementations.split(","):
        impl = None if name == "none" else name
        record(mode, name, trace_loop(model, batch=batch, buffer_len=buffer_len,
                                      cycles=args.cycles, implementation=impl, mode=mode,
                                      hlo_path=hlo(mode, name)))
    setup = {"stack": args.stack, "geometry": geometry, "buffer_len": buffer_len}
  result = {"meta": common.run_metadata(argv, "bench.model_trace"),
            **setup, "batch": batch, "cycles": args.cycles, "runs": runs}
  if args.out_json:
    common.write_json(args.out_json, result)
  return result


if __name__ == "__main__":
  main()
