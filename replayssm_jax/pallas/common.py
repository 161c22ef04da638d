"""Shared Pallas plumbing: the interpret-mode decision, the device kind, shape guards.

Pallas kernels run compiled on a GPU and in interpret mode on CPU (so CPU tests execute the real
kernel bodies). ``force_lowering()`` turns interpret mode off on CPU, for the abstract-H200
lowering check (notes/pallas-gpu.md §4): trace under ``use_abstract_mesh`` with an abstract GPU
device and lower with ``lowering_platforms=("cuda",)``.
"""
import contextlib
import contextvars
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt
# Imported up front: its first (lazy) import, during the first Pallas lowering, registers a
# trace-context config option, which changes every jit cache key and recompiles each program
# traced before it once (the first kernel compiled twice; ~15 s per interpreted verify kernel).
from jax.experimental.pallas import fuser as _fuser  # noqa: F401

# Imported for its effect: the register caps that jaxlib 0.12+ needs on the replay kernels.
from replayssm_jax.pallas import register_caps as _register_caps  # noqa: F401

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


def mosaic_interpret_mode() -> bool:
  """``interpret_mode()`` for the Mosaic GPU kernels, warning once when interpreting them may hang.

  The Mosaic GPU interpreter runs each kernel operation as a host callback that itself calls JAX.
  With CPU async dispatch on (JAX's default), the caller's next dispatch can deadlock against
  such a callback, an upstream JAX problem that hung a CI run of this project. The setting is read
  when the CPU backend starts, so it must be off before JAX's first computation."""
  interpret = interpret_mode()
  if interpret and jax.config.read("jax_cpu_enable_async_dispatch"):
    warnings.warn("interpreting a Pallas Mosaic GPU kernel with CPU async dispatch on can deadlock "
                  "(the interpreter calls JAX from host callbacks); call "
                  "jax.config.update('jax_cpu_enable_async_dispatch', False) before JAX's first "
                  "computation", RuntimeWarning, stacklevel=2)
  return interpret


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


# Pallas-Triton (jax >= 0.11.2, jax/_src/pallas/triton/lowering.py) computes a ref's element
# offsets (index · stride, summed) in int64 when the array holds more than 2**32 bytes and in int32
# otherwise. int32 offsets reach 2**31 - 1 elements, so the one array it would address out of range
# (silently, modulo 2**32) has 1-byte elements and between 2**31 and 2**32 of them.
INT32_OFFSET_ELEMENTS = 2 ** 31
INT64_OFFSET_BYTES = 2 ** 32


def triton_addressable(shape, dtype) -> bool:
  """Whether Pallas-Triton's offset arithmetic reaches every element of a [shape] dtype array."""
  elements = math.prod(shape)
  return elements <= INT32_OFFSET_ELEMENTS or elements * jnp.dtype(dtype).itemsize > INT64_OFFSET_BYTES


def require_triton_addressable(op: str, **operands) -> None:
  """NotImplementedError if Pallas-Triton would address an operand with int32 element offsets that
  cannot reach all of it (``triton_addressable``)."""
  bad = {name: a for name, a in operands.items() if not triton_addressable(a.shape, a.dtype)}
  if bad:
    listed = ", ".join(f"{name} {a.dtype}{list(a.shape)} ({math.prod(a.shape)} elements)"
                       for name, a in bad.items())
    raise NotImplementedError(
        f"{op}: Pallas-Triton addresses an array of at most 2**32 bytes with int32 element "
        f"offsets, which reach 2**31 elements; got {listed} (use implementation='xla', or None "
        f"to fall back automatically)")


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


def softplus(x, log1p=jnp.log1p):
  """softplus as jax.nn.softplus (logaddexp(x, 0)) computes it, without overflow (kernel math).
  ``log1p``: a replacement where the lowering has none (Mosaic GPU: ``log1p_from_log``)."""
  return jnp.maximum(x, 0.0) + log1p(jnp.exp(-jnp.abs(x)))


def log1p_from_log(e):
  """log(1 + e) to a few ulps from ``log`` alone (Goldberg): with u = fl(1 + e), log(u) · e / (u − 1)
  cancels the rounding of u; where u rounds to 1, log(1 + e) = e to f32 precision."""
  u = 1.0 + e
  return jnp.where(u == 1.0, e, jnp.log(u) * (e / jnp.where(u == 1.0, 1.0, u - 1.0)))


def silu_gate(y, z):
  """y · silu(z), the Mamba2 output gate (kernel math)."""
  return y * (z / (1.0 + jnp.exp(-z)))
