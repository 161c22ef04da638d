"""Register caps for the Pallas-Triton replay kernels, where jaxlib 0.12 and later need them.

jaxlib 0.12.1 compiles the same Triton IR of the GDN replay step and fold to 181 and 188 registers
per thread where 0.11.2 used 128: half as many blocks fit an SM, and the replay kernels of both
families run 7-9 % slower (bench/RESULTS.md, "Why: registers"). Pallas' Triton ``CompilerParams``
has no register limit, but Triton reads one from the module attribute ``ttg.maxnreg`` and lowers it
to PTX ``.maxnreg``. This module sets that attribute on the kernels named in ``CAPS`` by wrapping
Pallas' private ``lower_jaxpr_to_triton_module`` (the only place the module can be reached). With
the cap at 128, jax 0.12.1 runs these kernels within 1 % of their 0.11.2 speed or faster
(bench/RESULTS.md, "Register caps on jax 0.12.1").

The caps apply on jaxlib 0.12 and later. Under 0.11.2, the pinned version every other GPU number
was measured with, kernels compile exactly as Pallas builds them. ``REPLAYSSM_REGISTER_CAPS=0`` in
the environment turns the caps off. ``use_caps`` sets other caps within a context.
"""
import contextlib
import os
import re
import warnings
from collections.abc import Mapping

import jax
import jaxlib

ATTRIBUTE = "ttg.maxnreg"
ENV = "REPLAYSSM_REGISTER_CAPS"
KERNEL_PREFIX = "replayssm_"

# Registers per thread, by kernel name (the pallas_call name, which becomes the module's symbol).
# 128 is what jaxlib 0.11.2 gives the GDN step and fold (ncu). Capped at 128, jaxlib 0.12.1 runs the
# output-only replay kernels of both families 2-18 % faster than uncapped from B = 32 in every row
# of a sweep over B, L and dtype on one H100. Below B = 32 the results are mixed (up to 18 % slower,
# bf16, B = 1, L = 32), and the models' small-batch policy does not run these kernels there.
CAPS = {
    "replayssm_gdn_replay_step": 128,
    "replayssm_gdn_fold": 128,
    "replayssm_mamba2_replay_step": 128,
    "replayssm_mamba2_fold": 128,
}
SOURCE = ("ncu_gdn_step_fold_2026-12-07_h100_jax0.11.2.log",
          "ncu_gdn_step_fold_2026-12-07_h100_jax0.12.1_regcap_128_128.log",
          "gdn_decode_2026-12-07_h100_regcap_sweep_none_jax0.12.1.json",
          "gdn_decode_2026-12-07_h100_regcap_sweep_replay_step_128_fold_128_jax0.12.1.json",
          "mamba2_decode_2026-12-07_h100_regcap_sweep_none_jax0.12.1.json",
          "mamba2_decode_2026-12-07_h100_regcap_sweep_replay_step_128_fold_128_jax0.12.1.json")
FIRST_JAXLIB = (0, 12)


def _jaxlib_version() -> tuple[int, int]:
  major, minor = re.match(r"(\d+)\.(\d+)", jaxlib.__version__).groups()
  return int(major), int(minor)


def _defaults() -> dict[str, int]:
  if os.environ.get(ENV, "1") == "0" or _jaxlib_version() < FIRST_JAXLIB:
    return {}
  return dict(CAPS)


_active: dict[str, int] = _defaults()


def active_caps() -> dict[str, int]:
  """The caps that Pallas-Triton lowerings get now: {kernel name: registers per thread}."""
  return dict(_active)


def check_caps(caps: Mapping[str, int]) -> dict[str, int]:
  """``caps`` as a dict; ValueError if it is not {kernel name: registers per thread in [1, 255]}
  with names of this library's kernels (``replayssm_...``), NotImplementedError if it names any
  kernel and this JAX has no lowering to set caps on."""
  if not isinstance(caps, Mapping):
    raise ValueError(f"caps: expected a mapping of kernel name to registers per thread, got "
                     f"{type(caps).__name__}")
  for name, n in caps.items():
    if not isinstance(name, str) or not name.startswith(KERNEL_PREFIX):
      raise ValueError(f"caps: kernel names are this library's pallas_call names, "
                       f"{KERNEL_PREFIX}<family>_<kernel>; got {name!r}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 255:
      raise ValueError(f"caps[{name!r}] = {n!r}; expected an int in [1, 255] (registers per thread)")
  if caps and not _installed:
    raise NotImplementedError(
        f"register caps need jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module, which "
        f"jax {jax.__version__} does not have")
  return dict(caps)


@contextlib.contextmanager
def use_caps(caps: Mapping[str, int]):
  """Within this context the kernels named in ``caps`` are lowered with those register caps and
  every other kernel with none (``{}``: no caps at all). JAX reuses a jitted function's lowering
  across calls, so where the caps change, entering and leaving clear JAX's caches
  (``jax.clear_caches``) and every program compiles anew."""
  global _active
  caps = check_caps(caps)
  previous = _active
  if caps != previous:
    jax.clear_caches()
  _active = caps
  try:
    yield
  finally:
    _active = previous
    if caps != previous:
      jax.clear_caches()


def _install() -> bool:
  """Wrap Pallas' Triton module lowering once; False where this JAX has no such function."""
  try:
    from jax._src.lib.mlir import ir  # noqa: PLC0415
    from jax._src.pallas.triton import lowering  # noqa: PLC0415
  except ImportError:
    return False
  real = getattr(lowering, "lower_jaxpr_to_triton_module", None)
  if real is None:
    return False
  if getattr(real, "_replayssm_caps", False):
    return True

  def lower_with_caps(*args, **kwargs):
    result = real(*args, **kwargs)
    module = result.module
    cap = _active.get(ir.StringAttr(module.operation.attributes["sym_name"]).value)
    if cap is not None:
      with module.context:
        module.operation.attributes[ATTRIBUTE] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(32), cap)
    return result

  lower_with_caps._replayssm_caps = True
  lowering.lower_jaxpr_to_triton_module = lower_with_caps
  return True


_installed = _install()
if _active and not _installed:
  warnings.warn(f"replayssm_jax: jax {jax.__version__} has no Pallas-Triton module lowering to set "
                f"register caps on; the replay kernels compile uncapped and may run slower "
                f"(bench/RESULTS.md, 'Register caps on jax 0.12.1')", RuntimeWarning, stacklevel=2)
  _active = {}
