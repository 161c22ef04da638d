"""What every replayssm_jax benchmark shares.

* Run metadata: date, device kind, jax/jaxlib versions, exact command line, git commit (read from
  ``.git`` without running git; ``--git-commit`` or ``$GIT_COMMIT`` where the checkout has no
  ``.git``), a digest of the library and bench sources, and a read-only ``nvidia-smi`` query.
* Timing (METHOD.md, notes/pallas-gpu.md "Calibration"): a compiled program runs many steps inside
  one ``jax.jit`` (a ``lax.fori_loop``), so dispatch is amortized; its carry is donated and threaded
  from call to call. ``time_loop`` warms up (one untimed call), calibrates the number of cycles per
  call to about ``rep_seconds``, then times ``reps`` calls with ``block_until_ready`` on a host clock
  and reports median and p20/p80.
* The copy ceiling: an in-place ``x + z`` (``z`` a traced zero, so XLA cannot fold it) over a few
  rotating buffers of ≥ 2 GB in all, timed the same way; bandwidth = bytes read + written / time.
* Random data: a counter-based integer hash (``hash_uniform``, ``hash_normal``) and ``l2_normalize``.
* Launch-config strings (``bv32w2``), parallel compilation, text/markdown tables, result files.
"""
import concurrent.futures
import dataclasses
import datetime
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


# CPU runs (--smoke) interpret the Mosaic arms, whose interpreter calls JAX from host callbacks: with
# CPU async dispatch on, that can deadlock (pallas/common.mosaic_interpret_mode). Read at backend
# start, so set on import, before any computation; GPU timing does not use the CPU client.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from replayssm_jax.pallas import register_caps  # noqa: E402  (after the setting above)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_DIR = REPO_ROOT / "bench"
_T0 = time.perf_counter()


# ----------------------------------------------------------------------------------------------
# Logging

def elapsed() -> float:
  """Seconds since this module was imported (≈ since the benchmark started)."""
  return time.perf_counter() - _T0


def log(msg: str) -> None:
  """One progress line on stdout, prefixed by the elapsed time."""
  print(f"[{elapsed():7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Metadata

def git_commit(root: pathlib.Path = REPO_ROOT) -> str | None:
  """The checked-out commit, read from ``.git`` files (no git process is started)."""
  git = root / ".git"
  try:
    if git.is_file():  # worktree: "gitdir: <path>"
      git = pathlib.Path(git.read_text().split(":", 1)[1].strip())
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
      return head
    ref = head.split(None, 1)[1]
    loose = git / ref
    if loose.is_file():
      return loose.read_text().strip()
    packed = git / "packed-refs"
    if packed.is_file():
      for line in packed.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == ref:
          return parts[0]
  except (OSError, IndexError):
    return None
  return None


def source_digest(root: pathlib.Path = REPO_ROOT, folders=("replayssm_jax", "bench")) -> str:
  """sha256 (16 hex digits) over the .py files of the library and benchmarks: identifies the code
  that ran even where the checkout carries no .git or has uncommitted edits."""
  h = hashlib.sha256()
  for folder in folders:
    for path in sorted((root / folder).rglob("*.py")):
      h.update(str(path.relative_to(root)).encode())
      h.update(path.read_bytes())
  return h.hexdigest()[:16]


def nvidia_smi() -> dict | None:
  """Read-only query of the GPU's name, clocks, temperature and power (None where unavailable)."""
  fields = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw,memory.used"
  try:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  first = out.splitlines()[0] if out else ""
  return dict(zip(fields.split(","), (x.strip() for x in first.split(","))))


def run_metadata(argv: list[str] | None, module: str, *, git_commit_override: str | None = None) -> dict:
  """Everything needed to reproduce and place a run (``argv`` None: this process's arguments)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  dev = jax.devices()[0]
  import jaxlib  # noqa: PLC0415
  return {
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "device_kind": dev.device_kind,
      "platform": dev.platform,
      "num_devices": jax.device_count(),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jaxlib, "__version__", None),
      "python": platform.python_version(),
      "numpy": np.__version__,
      "hostname": platform.node(),
      "command": " ".join(["python", "-m", module] + [_quote(a) for a in argv]),
      "argv": list(argv),
      "git_commit": git_commit_override or os.environ.get("GIT_COMMIT") or git_commit(),
      "source_digest": source_digest(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "register_caps": register_caps.active_caps(),
      "nvidia_smi": nvidia_smi(),
  }


def _quote(arg: str) -> str:
  return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def timestamp() -> str:
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


# ----------------------------------------------------------------------------------------------
# Timing

def quantiles(times) -> tuple[float, float, float]:
  """(median, p20, p80) of a list of times."""
  t = np.asarray(times, np.float64)
  med, p20, p80 = np.percentile(t, [50, 20, 80])
  return float(med), float(p20), float(p80)


@dataclasses.dataclass
class LoopTiming:
  """Seconds per call of ``n_cycles`` cycles, for each timed repetition."""
  n_cycles: int
  times_s: list
  warmup_s: float
  calib_s: float
  cycles_run: int  # every cycle the carry went through: warm-up + calibration + timed

  def per_cycle(self) -> list:
    return [t / self.n_cycles for t in self.times_s]

  def ms_per(self, units: float) -> dict:
    """Milliseconds per unit of work, a cycle being ``units`` units (layer-steps, steps): each timed
    call's (``ms``), their median, p20 and p80, and the cycles per call."""
    ms = [1e3 * t / units for t in self.per_cycle()]
    med, p20, p80 = quantiles(ms)
    return {"ms": ms, "median_ms": med, "p20_ms": p20, "p80_ms": p80, "n_cycles": self.n_cycles}


def time_loop(call, carry, *, reps: int, rep_seconds: float, max_cycles: int = 1 << 20):
  """Times ``carry = call(carry, n)`` (n cycles per call; carry donated and threaded through).

  One untimed warm-up call of one cycle (compilation happened before), one calibration call of one
  cycle, then ``reps`` calls of ``n`` cycles with ``n`` chosen so that a call takes about
  ``rep_seconds``. Returns (carry, LoopTiming).
  """
  t0 = time.perf_counter()
  carry = jax.block_until_ready(call(carry, 1))
  warm = time.perf_counter() - t0
  t0 = time.perf_counter()
  carry = jax.block_until_ready(call(carry, 1))
  calib = time.perf_counter() - t0
  n = int(max(1, min(max_cycles, math.ceil(rep_seconds / max(calib, 1e-7)))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    carry = jax.block_until_ready(call(carry, n))
    times.append(time.perf_counter() - t0)
  return carry, LoopTiming(n_cycles=n, times_s=times, warmup_s=warm, calib_s=calib,
                           cycles_run=2 + reps * n)


@functools.cache
def _copy_program(per: int, num_buffers: int, passes_per_cycle: int):
  def run(bufs, z, n):
    def one_pass(_, bs):
      return tuple(b + z for b in bs)

    def cycle(_, bs):
      return lax.fori_loop(0, passes_per_cycle, one_pass, bs)
    return lax.fori_loop(0, n, cycle, bufs)
  spec = jax.ShapeDtypeStruct((per,), jnp.float32)
  return jax.jit(run, donate_argnums=(0,)).lower(
      (spec,) * num_buffers, jax.ShapeDtypeStruct((), jnp.float32),
      jax.ShapeDtypeStruct((), jnp.int32)).compile()


def measure_copy_ceiling(total_bytes: int, *, num_buffers: int = 4, passes_per_cycle: int = 4,
                         reps: int = 7, rep_seconds: float = 0.2, seed: int = 0) -> dict:
  """Device-to-device copy bandwidth (bytes read + written per second), timed like the kernels.

  ``num_buffers`` float32 buffers of ``total_bytes`` in all, random (never zeros), each updated in
  place as ``x + z`` per pass, ``z`` a traced zero (XLA cannot drop the add). Each pass reads and
  writes every buffer once: 2·total_bytes per pass.
  """
  per = max(1, int(total_bytes) // num_buffers // 4)
  keys = jax.random.split(jax.random.key(seed), num_buffers)
  make = jax.jit(lambda k: jax.random.uniform(k, (per,), jnp.float32, 1.0, 2.0))
  bufs = tuple(make(k) for k in keys)
  zero = jnp.zeros((), jnp.float32)
  t0 = time.perf_counter()
  compiled = _copy_program(per, num_buffers, passes_per_cycle)
  compile_s = time.perf_counter() - t0
  call = lambda c, n: compiled(c, zero, np.int32(n))
  bufs, timing = time_loop(call, bufs, reps=reps, rep_seconds=rep_seconds)
  ok = all(bool(jnp.all(jnp.isfinite(b[:1024]))) for b in bufs)
  del bufs
  moved = 2 * per * 4 * num_buffers * passes_per_cycle  # bytes per cycle
  gbps = [moved / t / 1e9 for t in timing.per_cycle()]
  med, p20, p80 = quantiles(gbps)
  return {"gbps": med, "gbps_p20": p20, "gbps_p80": p80, "bytes_total": per * 4 * num_buffers,
          "num_buffers": num_buffers, "n_cycles": timing.n_cycles, "compile_s": compile_s,
          "times_s": timing.times_s, "finite": ok,
          "method": "in-place x + z (z traced zero) over rotating float32 buffers; bytes read + written"}


# ----------------------------------------------------------------------------------------------
# Random data

def mix32(x):
  """A 32-bit integer finaliser (xor-shift-multiply): a uint32 array to well-mixed uint32 bits."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def hash_uniform(stream: int, shape, lo: float, hi: float):
  """Uniform [lo, hi) float32 from a counter-based integer hash of (stream, flat index).

  A few elementwise integer ops: compiles in milliseconds on every backend (jax.random's threefry
  takes seconds per array on XLA:CPU) and generates gigabytes quickly on the GPU. Statistical
  quality is irrelevant here; what matters is non-zero, non-repeating data.
  """
  shape = tuple(shape)
  lead, inner = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
  if inner >= 1 << 32:
    raise ValueError(f"{shape}: {inner} elements per leading index; the hash generator indexes them "
                     f"with uint32")
  # (leading index, flat inner index), each with its own multiplier: arrays past 2^32 elements (a
  # B = 512 Mamba2 pool of 8 layers) do not repeat.
  row = lax.broadcasted_iota(jnp.uint32, (lead, inner), 0)
  col = lax.broadcasted_iota(jnp.uint32, (lead, inner), 1)
  x = mix32(col * jnp.uint32(0x9E3779B1) + row * jnp.uint32(0xC2B2AE35)
            + jnp.uint32((stream * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF))
  u = (x >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
  return (lo + (hi - lo) * u).reshape(shape)


def hash_normal(stream: int, shape):
  """Zero-mean, unit-variance (uniform) noise from ``hash_uniform``."""
  return hash_uniform(stream, shape, -math.sqrt(3.0), math.sqrt(3.0))


def l2_normalize(x, axis=-1):
  """``x`` scaled to unit L2 norm along ``axis``."""
  return x * lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + 1e-12)


# ----------------------------------------------------------------------------------------------
# Launch configs

_CFG_KEYS = {"fbv": "fold_block_v", "fbk": "fold_block_k", "fw": "fold_num_warps", "fr": "fold_rows",
             "ft": "fold_tiles", "bv": "block_v", "bk": "block_k", "w": "num_warps", "s": "num_stages",
             "r": "rows"}


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """Keyword-only launch overrides for a Pallas kernel; ``default`` passes none (the config module's)."""
  name: str
  overrides: tuple = ()  # sorted (kwarg, value) pairs

  @property
  def is_default(self) -> bool:
    return not self.overrides

  def kwargs(self, allowed=None) -> dict:
    return {k: v for k, v in self.overrides if allowed is None or k in allowed}


def parse_knobs(text: str, keys: dict, *, example: str) -> tuple:
  """``default`` (or empty) → (); else a run of tokens ``<key><int>`` with ``keys`` {token:
  kwarg}, e.g. ``bv32w2`` → (("block_v", 32), ("num_warps", 2)): sorted (kwarg, value) pairs.
  ValueError names the text, the tokens and ``example``."""
  text = text.strip()
  if text in ("", "default"):
    return ()
  token = re.compile("(" + "|".join(sorted(keys, key=len, reverse=True)) + r")(\d+)")
  pos, found = 0, {}
  for m in token.finditer(text):
    if m.start() != pos:
      break
    found[keys[m.group(1)]] = int(m.group(2))
    pos = m.end()
  if pos != len(text) or not found:
    raise ValueError(f"launch config {text!r}; expected 'default' or tokens "
                     f"{' '.join(k + '<int>' for k in keys)}, e.g. {example!r}")
  return tuple(sorted(found.items()))


def parse_config(text: str) -> LaunchConfig:
  """``default`` or tokens like ``bv32w2s3`` (block_v, num_warps, num_stages), ``bk64`` (block_k of
  the replay step), ``fbv64fw4ft2`` (fold_block_v, fold_num_warps, fold_tiles of the replay
  fold pass; ``fbk``, ``fr`` its block_k and row slots), e.g. ``bv64w4fbv32fw2``, and ``r4``
  (batch rows per program of the Mosaic kernels)."""
  overrides = parse_knobs(text, _CFG_KEYS, example="bv64w4s2")
  return LaunchConfig(text.strip() if overrides else "default", overrides)


# ----------------------------------------------------------------------------------------------
# Compilation

def compile_all(lowered: dict, workers: int) -> dict:
  """Compiles ``{key: jax.stages.Lowered}`` (lowering happened in this thread; XLA compiles release
  the GIL, so several run at once). Returns ``{key: (compiled | Exception, seconds)}``."""
  def one(item):
    key, low = item
    t0 = time.perf_counter()
    try:
      return key, (low.compile(), time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  (recorded per arm; the run goes on)
      return key, (e, time.perf_counter() - t0)

  items = list(lowered.items())
  if workers <= 1 or len(items) <= 1:
    return dict(map(one, items))
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    results = dict(pool.map(one, items))
  # A failure under parallel compilation is retried alone, so a thread-safety problem cannot
  # masquerade as a kernel failure.
  for key, (res, _) in list(results.items()):
    if isinstance(res, Exception):
      results[key] = one((key, lowered[key]))[1]
  return results


_COPY = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? copy(?:-start)?\(")
_DTYPE_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1}


def big_copies(compiled, min_bytes: float) -> list[str] | None:
  """Copy instructions of at least ``min_bytes`` in a compiled program's optimized HLO: a donated
  buffer updated in place should produce none. None if the HLO text is unavailable."""
  try:
    text = compiled.as_text()
  except Exception:  # noqa: BLE001
    return None
  if not text:
    return None
  found = []
  for m in _COPY.finditer(text):
    dims = [int(d) for d in m.group(2).split(",") if d]
    nbytes = math.prod(dims) * _DTYPE_BYTES.get(m.group(1), 4)
    if nbytes >= min_bytes:
      found.append(f"{m.group(1)}[{m.group(2)}]")
  return found


# ----------------------------------------------------------------------------------------------
# Tables and files

def render_table(headers: list[str], rows: list[list[str]], *, markdown: bool = False,
                 align_right=None) -> str:
  """A plain-text (aligned columns) or markdown table."""
  align_right = set(align_right or ())
  if markdown:
    sep = ["---:" if i in align_right else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

  def fmt(cells):
    return "  ".join(c.rjust(w) if i in align_right else c.ljust(w)
                     for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
  rule = "  ".join("-" * w for w in widths)
  return "\n".join([fmt(headers), rule] + [fmt(r) for r in rows])


def to_jsonable(x):
  """numpy scalars/arrays, dataclasses, paths and exceptions → JSON types."""
  if isinstance(x, dict):
    return {str(k): to_jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [to_jsonable(v) for v in x]
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return to_jsonable(dataclasses.asdict(x))
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, (pathlib.Path, BaseException)):
    return str(x)
  return x


def write_json(path, result) -> pathlib.Path:
  """``result`` as indented JSON (``to_jsonable``) at ``path``, its folder made if needed."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(to_jsonable(result), indent=1))
  return path


def fmt_float(x, spec: str, missing: str = "-") -> str:
  return missing if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


@functools.cache
def itemsize(dtype) -> int:
  return jnp.dtype(dtype).itemsize


# The benchmarks unroll their layers in the compiled step (a loop over them costs a fixed ~7.5 µs
# per layer-step on the H200), so P bounds the compile time. At B = 1 the
# 128 layers still touch 128 MB (GDN bf16) to 512 MB (Mamba2 f32) per step, 2-8x the 60 MB L2.
MAX_UNROLLED_LAYERS = 128

