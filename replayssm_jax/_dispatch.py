"""Implementation selection: ``implementation=None`` picks the fastest available, else the named one.

A named implementation that cannot handle a valid input raises NotImplementedError; with
``implementation=None`` that error falls back to XLA, so auto-selection never gives a wrong result.
"""
import logging

import jax

IMPLEMENTATIONS = ("xla", "pallas_triton", "pallas_mosaic")
logger = logging.getLogger("replayssm_jax")


def _auto_order() -> tuple[str, ...]:
  # Pallas-Triton is the measured-faster GPU path; on CPU its interpreter is a test tool, not a
  # fast path, so auto stays on XLA there.
  return ("pallas_triton", "xla") if jax.default_backend() == "gpu" else ("xla",)


def without_mosaic(implementation):
  """The implementation of an op with no Mosaic kernel (attention, grouped matmul, conv step) under
  a model- or layer-level name: the same name where it has it ("xla", "pallas_triton"); None (its
  automatic choice) under "pallas_mosaic", which names the recurrent kernels only."""
  return None if implementation == "pallas_mosaic" else implementation


def resolve(op: str, implementation) -> str | None:
  if implementation is None:
    return None
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}; expected None or one of {IMPLEMENTATIONS}")
  return implementation


def run(op: str, implementation, table: dict, prefer: tuple[str, ...] = ()):
  """Runs ``table[name]()`` for the chosen implementation (see module doc). With
  ``implementation=None`` on a GPU, the measured-faster ``prefer`` (a config rule) go first."""
  name = resolve(op, implementation)
  if name is not None:
    if name not in table:
      raise NotImplementedError(f"{op}: implementation={name!r} is not available yet "
                                f"(available: {sorted(table)})")
    return table[name]()
  errors = []
  order = _auto_order()
  if "pallas_triton" in order:   # a GPU: the op's measured preference, then the usual order
    order = (*prefer, *(c for c in order if c not in prefer))
  for candidate in order:
    if candidate not in table:
      continue
    try:
      return table[candidate]()
    except NotImplementedError as e:  # valid input this implementation cannot handle
      logger.info("%s: %s cannot handle this input (%s); trying the next implementation", op, candidate, e)
      errors.append(e)
  raise NotImplementedError(f"{op}: no implementation handles this input: {errors}")
