"""What the peer arms share: finding a peer's kernel source, loading only its kernel files, jax_triton.

A peer arm runs another project's decode kernel (SGLang, vLLM, mamba_ssm) through jax_triton
inside our jitted harness, on the same arrays as our arms (bench/harness.py). Its code is read at
run time, from an installed distribution or from a directory given with ``--peer-dir``, and never
copied into this repository. Only the files a kernel needs are loaded, each under its own dotted
name with its parent packages as empty namespaces: a peer package's ``__init__`` pulls in its whole
runtime (a server, CUDA extensions, other dependencies) that the kernel does not need. A module that
a kernel file imports only for a helper or two is replaced by a small stub.

A peer that cannot run here (jax_triton missing, no CUDA GPU, source not found) raises
``PeerUnavailable``; its arm becomes a skipped row that says why, never an error.
"""
import dataclasses
import functools
import importlib
import importlib.util
import os
import pathlib
import sys
import types
from collections.abc import Callable

import jax


class PeerUnavailable(Exception):
  """A peer arm cannot run in this process; the message says why."""


# Directories searched (before the installed distributions) for a peer's source tree, e.g. one
# holding ``sglang/kernels/...``. Set from ``--peer-dir`` by the harness.
PEER_DIRS: list[pathlib.Path] = []


def set_peer_dirs(dirs) -> None:
  for d in dirs:
    if not pathlib.Path(d).is_dir():
      raise ValueError(f"--peer-dir {d}: not a directory")
  PEER_DIRS[:] = [pathlib.Path(d) for d in dirs]
  _load_kernels.cache_clear()


def find_source(package: str) -> pathlib.Path:
  """The directory of ``package`` (a top-level name): the first ``--peer-dir`` that holds it, else
  the installed distribution's (located, not imported)."""
  for d in PEER_DIRS:
    if (d / package).is_dir():
      return d / package
  spec = importlib.util.find_spec(package)
  if spec is not None and spec.submodule_search_locations:
    return pathlib.Path(next(iter(spec.submodule_search_locations)))
  where = ", ".join(map(str, PEER_DIRS)) or "none given"
  raise PeerUnavailable(f"{package}: not installed and not in --peer-dir ({where})")


def load_modules(package: str, names, stubs: dict | None = None) -> list[types.ModuleType]:
  """Imports the dotted modules ``names`` of ``package`` from its source (``find_source``).

  Every parent package is registered as an empty namespace over its directory, so no package
  ``__init__`` runs; ``stubs`` maps dotted names to attribute dicts of modules that stand in for
  the real ones. Modules already imported (the real package) are left as they are.
  """
  root = find_source(package).parent
  stubs = stubs or {}
  for name in [*names, *stubs]:
    parts = name.split(".")
    for i in range(1, len(parts)):
      parent = ".".join(parts[:i])
      if parent not in sys.modules:
        mod = types.ModuleType(parent)
        mod.__path__ = [str(root.joinpath(*parts[:i]))]
        sys.modules[parent] = mod
  for name, attrs in stubs.items():
    if name not in sys.modules:
      mod = types.ModuleType(name)
      mod.__dict__.update(attrs)
      sys.modules[name] = mod
  try:
    return [importlib.import_module(n) for n in names]
  except Exception as e:  # noqa: BLE001  (any import failure of a peer file makes the arm unavailable)
    raise PeerUnavailable(f"{package} kernel files under {root} do not import: {type(e).__name__}: {e}") from e


def import_jax_triton():
  """jax_triton, on a CUDA device. Importing it blanks ``TRITON_CACHE_DIR``; the value is restored."""
  if jax.default_backend() != "gpu":
    raise PeerUnavailable(f"jax_triton runs on CUDA GPUs only; the JAX backend is {jax.default_backend()!r}")
  saved = os.environ.get("TRITON_CACHE_DIR")
  try:
    import jax_triton  # noqa: PLC0415
  except ImportError as e:
    raise PeerUnavailable(f"jax_triton is not importable ({e})") from e
  finally:
    if saved is None:
      os.environ.pop("TRITON_CACHE_DIR", None)
    else:
      os.environ["TRITON_CACHE_DIR"] = saved
  return jax_triton


def triton_call(*args, **kwargs):
  """``jax_triton.triton_call`` (a module attribute, so CPU tests can put an emulation in its place)."""
  return import_jax_triton().triton_call(*args, **kwargs)


def compute_capability() -> tuple[int, int]:
  """(major, minor) of the first device, e.g. (9, 0) on an H200."""
  major, minor = str(jax.devices()[0].compute_capability).split(".")
  return int(major), int(minor)


@dataclasses.dataclass(frozen=True, eq=False)
class Peer:
  """A peer kernel as an arm of the layer harness (hashed by identity).

  * ``load() -> kernels``: imports jax_triton and the peer's kernel files (``PeerUnavailable`` if it
    cannot); called once per process and ``--peer-dir`` setting.
  * ``prepare(kernels, case, inputs, params) -> peer inputs``: the layer's inputs (one bank set, our
    layout) in the peer's calling convention; runs once per timed call, outside the loops.
  * ``step(kernels, case, peer_inputs, params, buffers, slots_or_plan) -> (out, buffers)``: one
    layer-step, our output layout, buffers in ``layout``.
  * ``layout``: how the peer keeps replay buffers (None: as ours, or a conventional arm).
  """
  name: str                 # "sglang", "vllm", "mamba_ssm": the row's "peer" field
  load: Callable
  prepare: Callable
  step: Callable
  layout: "RingLayout | None" = None

  def kernels(self):
    return _load_kernels(self)

  def available(self) -> str | None:
    """None if the peer can run here, else why not."""
    try:
      self.kernels()
    except PeerUnavailable as e:
      return f"peer {self.name} unavailable: {e}"
    except Exception as e:  # noqa: BLE001  (a peer that breaks while loading costs its arm, not the run)
      return f"peer {self.name} failed to load: {type(e).__name__}: {e}"
    return None


@functools.cache
def _load_kernels(peer: Peer):
  return peer.load()


@dataclasses.dataclass(frozen=True, eq=False)
class RingLayout:
  """Replay buffers as a peer keeps them: ``from_ours(buffers, params)`` at initialisation (the same
  data in the peer's form, untimed) and ``to_ours`` for the gate. Peers index their ring from entry
  0, so cursors of a setup with a layout start at base 0 (they stay there: ring size = L)."""
  name: str
  from_ours: Callable = lambda bufs, params: bufs
  to_ours: Callable = lambda bufs, params: bufs


def pow2(n: int) -> int:
  """The smallest power of two >= n (Triton's next_power_of_2, which the peers' launchers use)."""
  return 1 << (int(n) - 1).bit_length()


def require_ring_is_buffer_len(case) -> None:
  """Peers keep a ring of exactly L entries; ours has ring size next_pow2(L)."""
  if case.setup.ring_size != case.setup.buffer_len:
    raise NotImplementedError(f"peer {case.arm.name}: L={case.setup.buffer_len} is not a power of two "
                              f"(ring size {case.setup.ring_size}); peer rings hold exactly L entries")


def version(dist: str) -> str | None:
  """The installed version of a distribution, or None."""
  from importlib import metadata  # noqa: PLC0415
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None
