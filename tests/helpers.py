"""Shared test helpers: input factories, independent float64 oracles, tolerances.

The oracles here are plain numpy float64 loops written from DESIGN §2, independent of the
library's jnp code, so a bug shared by the XLA path and a kernel cannot hide.
"""
import dataclasses
import os

import jax.numpy as jnp
import numpy as np

# Geometries of the issue: (Hk, Hv, K, V).
GEOMETRIES = {
    "small": (2, 4, 16, 8),
    "qwen35_4b": (16, 32, 128, 128),
    "qwen35_122b": (16, 64, 128, 128),
}

# (state dtype, activation/ring dtype) pairs of notes/peers.md §7.
PRECISION_PAIRS = [
    ("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"),
    ("float32", "float16"), ("float16", "float16"), ("float16", "bfloat16"),
]


def tolerance(state_dtype: str, act_dtype: str) -> float:
  """Max-abs tolerance on outputs/states of unit scale vs the float64 oracle.

  float32 everywhere: 2e-5 — a TF32 dot (10-bit mantissa, ~5e-4 relative) fails it.
  Otherwise dominated by the storage rounding of the low-precision dtype.
  """
  worst = {"float32": 0, "float16": 1, "bfloat16": 2}
  w = max(worst[state_dtype], worst[act_dtype])
  return (2e-5, 6e-3, 4e-2)[w]


@dataclasses.dataclass
class GdnStep:
  q: np.ndarray      # [B, Hk, K]
  k: np.ndarray      # [B, Hk, K] (L2-normalised)
  v: np.ndarray      # [B, Hv, V]
  g: np.ndarray      # [B, Hv] log decay <= 0
  beta: np.ndarray   # [B, Hv] in (0, 1)

  def as_jax(self, dtype="float32"):
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(self.q), cast(self.k), cast(self.v), jnp.asarray(self.g, dtype), jnp.asarray(self.beta, dtype)

  def rounded(self, dtype="float32"):
    """The step as the kernel sees it after casting to ``dtype`` (float64 copy)."""
    return GdnStep(*(np.asarray(x, np.float64) for x in
                     (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in
                      (self.q, self.k, self.v, self.g, self.beta))))


def make_gdn_step(rng: np.random.Generator, batch: int, hk: int, hv: int, kd: int, vd: int,
                  *, decay=(0.02, 1.0)) -> GdnStep:
  """Realistic decode inputs: L2-normalised keys, sigmoid-range beta, log decays in -decay."""
  k = rng.normal(size=(batch, hk, kd))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  q = rng.normal(size=(batch, hk, kd))
  v = rng.normal(size=(batch, hv, vd))
  g = -rng.uniform(*decay, size=(batch, hv))
  beta = 1.0 / (1.0 + np.exp(-rng.normal(size=(batch, hv))))
  return GdnStep(q, k, v, g, beta)


def gdn_step_f64(S: np.ndarray, step: GdnStep, scale: float | None = None):
  """One exact GDN step in float64 per row. S: [B, Hv, V, K]. Returns (o [B, Hv, V], S_new)."""
  S = np.asarray(S, np.float64)
  b, hv, vd, kd = S.shape
  r = hv // step.q.shape[1]
  scale = kd ** -0.5 if scale is None else scale
  q = np.repeat(np.asarray(step.q, np.float64), r, axis=1) * scale
  k = np.repeat(np.asarray(step.k, np.float64), r, axis=1)
  alpha = np.exp(np.asarray(step.g, np.float64))[..., None, None]
  S_t = alpha * S
  u = np.asarray(step.beta, np.float64)[..., None] * (np.asarray(step.v, np.float64)
                                                      - np.einsum("bhvk,bhk->bhv", S_t, k))
  S_new = S_t + u[..., :, None] * k[..., None, :]
  return np.einsum("bhvk,bhk->bhv", S_new, q), S_new


def max_err(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def round_to_tf32(x) -> np.ndarray:
  """x rounded to TF32 (float32 with a 10-bit mantissa, round to nearest even), as float64.

  What a TF32 tensor-core dot does to its float32 inputs; used to show that a tolerance would
  catch a dot that silently ran at TF32.
  """
  bits = np.asarray(x, np.float32).view(np.uint32)
  lsb = (bits >> np.uint32(13)) & np.uint32(1)
  bits = (bits + np.uint32(0xFFF) + lsb) & np.uint32(0xFFFFE000)
  return bits.view(np.float32).astype(np.float64)


def run_each_setting(cursor, bufs, slots_at, steps: int, make_args, decode, settings):
  """The same ``steps`` decode steps (same plans, same inputs ``make_args()``) from ``bufs`` once
  per setting: ``decode(args, bufs, plan, setting) -> (out, bufs)``, cursor committed after each
  step. Returns ({setting: final buffers}, number of flushing rows over the steps)."""
  runs = {setting: bufs for setting in settings}
  flushed = 0
  for t in range(steps):
    plan = cursor.plan(slots_at(t))
    flushed += int(np.sum(np.asarray(plan.flush)))
    args = make_args()
    for setting in settings:
      _, runs[setting] = decode(args, runs[setting], plan, setting)
    cursor = cursor.commit(plan)
  return runs, flushed


def assert_rows_agree(runs: dict):
  """``runs`` maps a kernel's batch rows per program (1, 2, 4) and "xla" to the pytree (buffers,
  outputs) left by the same steps: every rows setting equals rows = 1 bit for bit, and rows = 4
  equals XLA's (where given) within float32 tolerance, NaN patterns included."""
  import jax
  first = jax.tree.leaves(runs[1])
  for rows in (2, 4):
    for a, b in zip(first, jax.tree.leaves(runs[rows])):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"rows={rows} vs rows=1"
  for a, b in zip(jax.tree.leaves(runs[4]), jax.tree.leaves(runs.get("xla", runs[4]))):
    a, b = (np.asarray(jnp.asarray(x).astype(jnp.float32)) for x in (a, b))
    assert np.array_equal(np.isnan(a), np.isnan(b)), "rows=4 vs xla: NaN patterns differ"
    assert max_err(np.nan_to_num(a), np.nan_to_num(b)) <= tolerance("float32", "float32"), \
        "rows=4 vs xla"


def set_mosaic_rows(monkeypatch, rows: int, *config_names: str):
  """Makes each named ``replayssm_jax.config`` function return its MosaicConfig with ``rows``
  batch rows per program (the original's config with that one field replaced)."""
  import dataclasses

  from replayssm_jax import config as config_lib
  for name in config_names:
    real = getattr(config_lib, name)
    monkeypatch.setattr(config_lib, name,
                        lambda real=real, **kw: dataclasses.replace(real(**kw), rows=rows))


def lower_for_h200(fn, donate, *args, strict: bool = False) -> str:
  """StableHLO text of ``jax.jit(fn, donate_argnums=donate)`` lowered for an abstract H200 with
  the Pallas kernels built for real (not interpreted): notes/pallas-gpu.md §4. Shows what
  interpret mode hides: Triton power-of-two sizes, unsupported primitives, in-place aliasing.
  ``strict``: a DeprecationWarning while tracing or lowering fails (for the Mosaic kernels, which
  must lower on every supported JAX without deprecated calls such as ``pl.program_id``)."""
  import warnings

  import jax
  from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

  from replayssm_jax.pallas import common
  device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
  with common.force_lowering(), use_abstract_mesh(mesh), warnings.catch_warnings():
    if strict:
      warnings.simplefilter("error", DeprecationWarning)
    lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


def assert_store_waits_only_compiled(fn, *args):
  """``fn``'s Mosaic kernels wait for their SMEM → GMEM stores when built for a GPU, and emit no
  such wait when interpreted (``gdn_mosaic._drain_stores``: there it would only be one more host
  callback calling JAX). Each check traces afresh:
  jit's trace cache does not see ``force_lowering``."""
  import jax

  from replayssm_jax.pallas import common

  def jaxpr(compiled: bool) -> str:
    with common.force_lowering(compiled):
      return str(jax.make_jaxpr(lambda *a: fn(*a))(*args))
  assert "wait_smem_to_gmem" in jaxpr(True)
  if jax.default_backend() == "cpu":
    assert "wait_smem_to_gmem" not in jaxpr(False)


def with_xla_flags(*flags: str) -> dict:
  """This process's environment with ``flags`` added to XLA_FLAGS, for a test's CPU subprocess
  (which so keeps conftest's compile-speed flag)."""
  return dict(os.environ, XLA_FLAGS=" ".join([os.environ.get("XLA_FLAGS", ""), *flags]).strip(),
              JAX_PLATFORMS="cpu")
