"""Run a benchmark module with other register caps on the Pallas-Triton kernels.

    python -m bench.register_cap --caps replayssm_gdn_replay_step=128,replayssm_gdn_fold=96 bench.gdn_decode ARGS...
    python -m bench.register_cap --caps none bench.gdn_decode ARGS...

``--caps`` replaces the library's caps (``replayssm_jax.pallas.register_caps``: on jaxlib 0.12 and
later the replay step and fold kernels are capped at 128 registers per thread) for the whole run:
the kernels named get those caps, every other kernel none; ``none`` lowers every kernel uncapped.
Kernel names are the pallas_call names, ``replayssm_<family>_<kernel>``. The run's JSON records
the caps in effect (``meta.register_caps``); ncu's ``launch__registers_per_thread`` shows what the
compiler made of them.
"""
import argparse
import runpy
import sys

from replayssm_jax.pallas import register_caps


def parse_caps(text: str) -> dict[str, int]:
  """"name=N,..." → {name: N} with N a positive int; "none" → {}."""
  if text == "none":
    return {}
  caps = {}
  for item in filter(None, text.split(",")):
    name, sep, value = item.partition("=")
    if not sep or not name or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--caps item {item!r}; expected NAME=N with N a positive integer, or 'none'")
    caps[name] = int(value)
  return caps


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m bench.register_cap", description=__doc__.split("\n\n")[0])
  parser.add_argument("--caps", required=True,
                      help="NAME=N,...: cap the kernel named NAME at N registers; 'none': no caps")
  parser.add_argument("module", help="the benchmark module to run, e.g. bench.gdn_decode")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
  opts = parser.parse_args(argv)
  try:
    caps = register_caps.check_caps(parse_caps(opts.caps))
  except (ValueError, NotImplementedError) as e:
    parser.error(str(e))
  sys.argv = [opts.module, *opts.args]
  with register_caps.use_caps(caps):
    runpy.run_module(opts.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
