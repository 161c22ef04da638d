"""Shared pytest setup.

* ``gpu``-marked tests (marker registered in pyproject.toml) are skipped unless JAX runs on a GPU.
* ``implementation`` runs a test once per kernel implementation. On CPU a named Pallas
  implementation runs in interpret mode, so the real kernel bodies are exercised in CI.
* ``checked_mode`` turns ``rs.set_checks(True)`` on for one test and restores the previous value.

float64 stays off (``jax_enable_x64`` is never turned on): the float64 oracles are numpy code.
"""
import jax
import pytest

from replayssm_jax import _checks

IMPLEMENTATIONS = ("xla", "pallas_triton")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason=f"needs a CUDA GPU (jax.default_backend() == {jax.default_backend()!r})")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


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
