"""Run a benchmark module with a register cap on named Pallas-Triton kernels (an experiment).

    python -m bench.register_cap --caps gdn_replay_step=128,gdn_fold=128 bench.gdn_decode ARGS...

Triton's ``maxnreg`` launch option is the module attribute ``ttg.maxnreg = N : i32``, which its
TritonGPU-to-LLVM lowering turns into PTX ``.maxnreg N``. Pallas builds each kernel's Triton module
itself and passes only ``num_warps`` and ``num_stages``, so this wraps Pallas' private
``lower_jaxpr_to_triton_module`` for the duration of the run and adds the attribute to every
module whose name contains a key of ``--caps`` (kernel names are ``replayssm_<family>_<kernel>``;
the first matching key wins). Why: jaxlib 0.12.1 compiles the GDN replay step to 181 registers
per thread where 0.11.2 used 128 (bench/NOTES.md, "JAX versions"). Whether XLA's Triton
pipeline honours the attribute on a GPU is what a run of this measures; ncu's
``launch__registers_per_thread`` shows it.
"""
import argparse
import contextlib
import runpy
import sys

ATTRIBUTE = "ttg.maxnreg"


def parse_caps(text: str) -> dict[str, int]:
  """"name=N,..." → {name: N}; N a positive int."""
  caps = {}
  for item in filter(None, text.split(",")):
    name, sep, value = item.partition("=")
    if not sep or not name or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--caps item {item!r}; expected NAME=N with N a positive integer")
    caps[name] = int(value)
  return caps


@contextlib.contextmanager
def register_caps(caps: dict[str, int]):
  """Within this context, Pallas-Triton modules whose name contains a key of ``caps`` are lowered
  with ``ttg.maxnreg`` set to its value. Applies to kernels lowered inside the context (jit
  caches compiled programs: trace afresh)."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import lowering

  real = lowering.lower_jaxpr_to_triton_module

  def capped(*args, **kwargs):
    result = real(*args, **kwargs)
    module = result.module
    name = ir.StringAttr(module.operation.attributes["sym_name"]).value
    cap = next((n for key, n in caps.items() if key in name), None)
    if cap is not None:
      with module.context:
        module.operation.attributes[ATTRIBUTE] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(32), cap)
    return result

  lowering.lower_jaxpr_to_triton_module = capped
  try:
    yield
  finally:
    lowering.lower_jaxpr_to_triton_module = real


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m bench.register_cap", description=__doc__.split("\n\n")[0])
  parser.add_argument("--caps", required=True, help="NAME=N,...: cap kernels whose name contains NAME at N registers")
  parser.add_argument("module", help="the benchmark module to run, e.g. bench.gdn_decode")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
  opts = parser.parse_args(argv)
  try:
    caps = parse_caps(opts.caps)
  except ValueError as e:
    parser.error(str(e))
  sys.argv = [opts.module, *opts.args]
  with register_caps(caps):
    runpy.run_module(opts.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
  main()
