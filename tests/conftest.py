"""Shared pytest setup.

* ``gpu``-marked tests (marker registered in pyproject.toml) are skipped unless JAX runs on a GPU.
* ``implementation`` runs a test once per kernel implementation. On CPU a named Pallas
  implementation runs in interpret mode, so the real kernel bodies are exercised in CI.
* CPU async dispatch is off: the Mosaic GPU interpreter calls JAX from host callbacks, which can
  deadlock against async dispatch (``pallas.common.mosaic_interpret_mode``).
* ``checked_mode`` turns ``rs.set_checks(True)`` on for one test and restores the previous value.

float64 stays off (``jax_enable_x64`` is never turned on): the float64 oracles are numpy code.

An xdist worker collects its garbage and freezes the survivors when its session finishes
(``pytest_sessionfinish``), so its exit stays within pytest-xdist's shutdown grace.

The suite is dominated by compiling many small programs (interpreted Pallas kernels are large HLO
loops), not by running them, so XLA's LLVM backend runs at optimization level 0 unless XLA_FLAGS
already chooses one (``helpers.with_xla_flags`` passes it on to subprocesses). That changes how fast
the compiled code is, not what it computes; on CPU it cut a 73 s sample of the suite to 57 s.

Every program XLA compiles for the CPU keeps a few memory mappings for as long as JAX caches it: a
worker that ran the serving tests held ~25,000 after 36 tests, and at the kernel's limit
(``vm.max_map_count``, 65,530 by default) the next mapping fails: XLA's compiler segfaults or Python
"can't start new thread". After a test that leaves the worker above half the limit, JAX's caches
are cleared (``pytest_runtest_teardown``); its programs compile again when a later test needs them.
"""
import gc
import os
from pathlib import Path

FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  # Before JAX creates a backend: XLA reads XLA_FLAGS once, at backend start.
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# The Mosaic GPU interpreter calls JAX from host callbacks; with CPU async dispatch on, a test's
# next dispatch can deadlock against one (CI hung twice in test_verify_decode_mosaic_variants).
# Read once, when the CPU backend starts: set here, before any test computes.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from replayssm_jax import _checks  # noqa: E402

IMPLEMENTATIONS = ("xla", "pallas_triton")


def pytest_report_header(config):
  """The versions a run tested (``make test`` runs the pinned ones and the newest pip resolves)."""
  from importlib import metadata
  names = ("jax", "jaxlib", "flax", "orbax-checkpoint")
  return "versions: " + ", ".join(f"{name} {metadata.version(name)}" for name in names)


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a CUDA GPU (jax.default_backend() == {jax.default_backend()!r})")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """In an xdist worker: one full collection now, then ``gc.freeze()``, so pytest's end-of-run
  collections (one in ``pytest_unconfigure``, one in its cleanup) skip the heap a full suite
  leaves behind (JAX caches, ~10^6 objects: seconds per pass on 2 shared cores). Those passes run
  after the worker reports "workerfinished"; the controller then asks the worker to exit, and
  execnet SIGINTs a worker still busy 5 s later. The KeyboardInterrupt then lands in the first
  Python code a running collection calls, hypothesis's gc callback (printed as an unraisable
  exception in ``gc_callback`` at the end of ``make test``). Collecting here, before the worker
  reports, keeps pytest's unraisable-exception check for whatever the collection finalizes."""
  if hasattr(session.config, "workerinput"):
    gc.collect()
    gc.freeze()


def _mapping_counts() -> tuple[int, int] | None:
  """(memory mappings this process holds, the kernel's limit per process), or None off Linux."""
  try:
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps), limit
  except OSError:
    return None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  counts = _mapping_counts()
  if counts is not None and counts[0] > counts[1] // 2:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
  return request.param


@pytest.fixture
def checked_mode():
  previous = _checks.checks_enabled()
  _checks.set_checks(True)
  try:
    yield
  finally:
    _checks.set_checks(previous)


@pytest.fixture(autouse=True, scope="session")
def _float64_stays_off():
  assert not jax.config.jax_enable_x64, "tests must not turn on jax_enable_x64 globally"
  yield
  assert not jax.config.jax_enable_x64, "a test turned on jax_enable_x64 globally"
