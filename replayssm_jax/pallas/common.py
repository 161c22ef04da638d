"""Shared Pallas plumbing: the interpret-mode decision, the device kind, shape guards.

Pallas kernels run compiled on a GPU and in interpret mode on CPU (so CPU tests execute the real
kernel bodies). ``force_lowering()`` turns interpret mode off on CPU, for the abstract-H200
lowering check (notes/pallas-gpu.md §4): trace under ``use_abstract_mesh`` with an abstract GPU
device and lower with ``lowering_platforms=("cuda",)``.
"""
import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt
# Imported up front: its first (lazy) import, during the first Pallas lowering, registers a
# trace-context config option, which changes every jit cache key and recompiles each program
# traced before it once (the first kernel compiled twice; ~15 s per interpreted verify kernel).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

_force_lowering = contextvars.ContextVar("replayssm_force_lowering", default=False)


@contextlib.contextmanager
def force_lowering(enabled: bool = True):
  """Within this context Pallas kernels are built for real lowering, never interpreted."""
  token = _force_lowering.set(bool(enabled))
  try:
    yield
  finally:
    _force_lowering.reset(token)


def interpret_mode() -> bool:
  """True when kernels must run in the Pallas interpreter: on CPU, unless lowering is forced."""
  if _force_lowering.get():
    return False
  return jax.default_backend() == "cpu"


def device_kind() -> str:
  """Device kind that configs are chosen for: the abstract device if one is set, else device 0."""
  mesh = jax.sharding.get_abstract_mesh()
  abstract = getattr(mesh, "abstract_device", None)
  if abstract is not None and getattr(abstract, "device_kind", None):
    return abstract.device_kind
  kind = jax.devices()[0].device_kind
  if _force_lowering.get() and jax.default_backend() == "cpu":
    return "NVIDIA H200"  # lowering for a GPU we do not have: use the calibrated GPU's configs
  return kind


def is_pow2(n: int) -> bool:
  return n >= 1 and (n & (n - 1)) == 0


def require_pow2(op: str, **sizes: int) -> None:
  """NotImplementedError unless every size is a power of two (Triton loads and stores need it)."""
  bad = {name: n for name, n in sizes.items() if not is_pow2(int(n))}
  if bad:
    listed = ", ".join(f"{name}={n}" for name, n in bad.items())
    raise NotImplementedError(
        f"{op}: the Pallas-Triton kernels need power-of-two sizes for every load and store; got "
        f"{listed} (use implementation='xla', or None to fall back automatically)")


def load_window(ref, inside_rows):
  """Masked float32 load of a ring tile [R, X]: rows outside the window are never read (zeros).

  Ring entries outside a window may be stale or NaN, so they are masked at load time rather
  than multiplied by zero.
  """
  mask = jnp.broadcast_to(inside_rows[:, None], ref.shape)
  return plt.load(ref, mask=mask, other=jnp.zeros((), ref.dtype)).astype(jnp.float32)


def load_entry(ref, live):
  """Masked load of one ring entry (a vector): zeros unless ``live``."""
  return plt.load(ref, mask=jnp.broadcast_to(live, ref.shape), other=jnp.zeros((), ref.dtype))
