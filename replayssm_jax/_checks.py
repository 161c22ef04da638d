"""Input validation shared by every op: eager shape/dtype checks and the optional checked mode.

Shape, dtype and config errors are raised eagerly (at trace time) as ``ValueError`` naming the
argument, its shape and what was expected. *Checked mode* (``REPLAYSSM_CHECKS=1`` or
``set_checks(True)``) adds value checks — slots in range and unique among live rows, cursors
inside the ring. On concrete arrays they raise ``ValueError`` at once; inside ``jax.jit`` they run
as a host callback and surface as a runtime error carrying the same message.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np

_checks_enabled = os.environ.get("REPLAYSSM_CHECKS", "0") not in ("", "0", "false", "False")


def set_checks(enabled: bool) -> None:
  """Turns checked mode on or off for ops traced from now on."""
  global _checks_enabled
  _checks_enabled = bool(enabled)


def checks_enabled() -> bool:
  return _checks_enabled


def expect_shape(name: str, x, shape: tuple, what: str = "") -> None:
  """Raises ValueError unless ``x.shape == shape`` (``None`` entries match anything)."""
  got = tuple(jnp.shape(x))
  ok = len(got) == len(shape) and all(e is None or e == g for e, g in zip(shape, got))
  if not ok:
    pretty = "[" + ", ".join("?" if e is None else str(e) for e in shape) + "]"
    raise ValueError(f"{name} has shape {list(got)}; expected {pretty}{' ' + what if what else ''}")


def expect_float(name: str, x) -> None:
  dt = jnp.result_type(x)
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"{name} has dtype {dt}; expected a floating dtype (float32, bfloat16, float16)")


def expect_dtype(name: str, x, dtypes) -> None:
  dt = jnp.result_type(x)
  if dt not in tuple(jnp.dtype(d) for d in dtypes):
    raise ValueError(f"{name} has dtype {dt}; expected one of {[str(jnp.dtype(d)) for d in dtypes]}")


def expect_slots(name: str, slots, batch: int | None = None) -> None:
  expect_dtype(name, slots, (jnp.int32,))
  expect_shape(name, slots, (batch,), "(int32[B], negative = padding row)")


def _is_concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _slot_problems(name: str, slots: np.ndarray, num_slots: int) -> str | None:
  live = slots[slots >= 0]
  if np.any(live >= num_slots):
    return (f"{name} holds slot {int(live.max())} but the pool has {num_slots} slots "
            f"(valid: 0..{num_slots - 1}, negative = padding row)")
  uniq, counts = np.unique(live, return_counts=True)
  if np.any(counts > 1):
    return f"{name} holds live slot {int(uniq[counts > 1][0])} more than once (live slots must be unique)"
  return None


def check_slots(name: str, slots, num_slots: int) -> None:
  """Checked mode: live slots in range and unique. No-op when checked mode is off."""
  if not _checks_enabled:
    return
  if _is_concrete(slots):
    msg = _slot_problems(name, np.asarray(slots), num_slots)
    if msg:
      raise ValueError(msg)
    return

  def host(s):
    msg = _slot_problems(name, np.asarray(s), num_slots)
    if msg:
      raise ValueError(msg)

  jax.debug.callback(host, slots)


def check_host(predicate_fn, message_fn, *arrays) -> None:
  """Checked mode: ``predicate_fn(*numpy arrays)`` must hold, else ValueError(message_fn(...))."""
  if not _checks_enabled:
    return

  def host(*xs):
    xs = [np.asarray(x) for x in xs]
    if not predicate_fn(*xs):
      raise ValueError(message_fn(*xs))

  if _is_concrete(*arrays):
    host(*arrays)
  else:
    jax.debug.callback(host, *arrays)
