"""Launch configs of the Pallas kernels, chosen by hardware and shape. Never autotuned at run time.

Each rule carries a one-line reason. Numbers come from the H200 calibration in
notes/pallas-gpu.md ("Calibration"); rules marked *untuned* are a best guess awaiting a sweep
(the ``gdn_triton`` functions take ``block_v``/``num_warps``/``num_stages`` overrides for that).
"""
import dataclasses

import jax.numpy as jnp

ROUTES = ("output_only", "reconstruct")


def _pow2(n: int) -> bool:
  return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """One Pallas-Triton launch: V tile rows per program, K chunk (None = all of K; the replay step
  walks K in chunks of block_k to bound live registers), warps, software-pipeline stages."""
  block_v: int
  num_warps: int
  num_stages: int = 1
  block_k: int | None = None

  def __post_init__(self):
    if not _pow2(self.block_v):
      raise ValueError(f"block_v={self.block_v!r}; expected a power of two (Triton tile)")
    if self.block_k is not None and not _pow2(self.block_k):
      raise ValueError(f"block_k={self.block_k!r}; expected None or a power of two (Triton tile)")
    if not _pow2(self.num_warps) or self.num_warps > 32:
      raise ValueError(f"num_warps={self.num_warps!r}; expected a power of two <= 32")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r}; expected an int >= 1")

  def fit(self, head_v_dim: int, head_k_dim: int | None = None) -> "KernelConfig":
    """The same config with tiles clipped to the head (a tile never exceeds V or K)."""
    block_k = self.block_k
    if head_k_dim is not None:
      block_k = head_k_dim if block_k is None else min(block_k, head_k_dim)
    return dataclasses.replace(self, block_v=min(self.block_v, head_v_dim), block_k=block_k)

  def override(self, *, block_v=None, num_warps=None, num_stages=None,
               block_k=None) -> "KernelConfig":
    changes = {k: v for k, v in (("block_v", block_v), ("num_warps", num_warps),
                                 ("num_stages", num_stages), ("block_k", block_k)) if v is not None}
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
  """The replay step kernel, its compute route for route="auto", and the flush-fold pass with
  ``fold_rows`` row slots (its grid's third axis; flushing rows beyond that loop)."""
  step: KernelConfig
  route: str
  fold: KernelConfig
  fold_rows: int = 1

  def __post_init__(self):
    if self.route not in ROUTES:
      raise ValueError(f"route={self.route!r}; expected one of {ROUTES}")
    if not isinstance(self.fold_rows, int) or self.fold_rows < 1:
      raise ValueError(f"fold_rows={self.fold_rows!r}; expected an int >= 1")


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _is_cpu(device_kind: str) -> bool:
  return device_kind.lower() == "cpu"


def _is_f32(state_dtype) -> bool:
  return jnp.dtype(state_dtype) == jnp.dtype(jnp.float32)


def decode_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  batch: int) -> KernelConfig:
  """Conventional decode, grid (V/BV, Hv, B), state tile [BV, K]."""
  del head_k_dim, batch
  if _is_cpu(device_kind):
    # Interpret mode: speed is irrelevant; small tiles make CPU tests cover the multi-tile indexing.
    cfg = KernelConfig(block_v=16, num_warps=4)
  elif _is_f32(state_dtype):
    # H200 sweep 2026-11-29, B=256: BV=16/2 warps 0.297 ms (87 % of the copy ceiling); BV=8/1,
    # 32/4 within 1 %; BV=128/8 0.309 ms; BV=64/2 0.319 ms.
    cfg = KernelConfig(block_v=16, num_warps=2)
  else:
    # H200 sweep 2026-11-29, bf16 state, B=256: BV=32/4 warps 0.160 ms (82 %); BV=16/1-2 and
    # 8/1 within 2 %; BV=32/1 0.192 ms.
    cfg = KernelConfig(block_v=32, num_warps=4)
  return cfg.fit(head_v_dim)


def replay_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  num_k_heads: int, batch: int, buffer_len: int) -> ReplayConfig:
  """Replay step, grid (V/BV, Hk, B), plus the fold pass, grid (V/BV · K/BK, Hv, fold_rows)."""
  # Output-only never builds S: H200, B=256, L=16, f32: 0.219 ms vs 0.39 ms or more reconstructing.
  route = "output_only"
  if _is_cpu(device_kind):
    # Interpret mode: speed is irrelevant; two V tiles and two K chunks make CPU tests cover the
    # multi-tile indexing.
    step = KernelConfig(block_v=16, num_warps=4, block_k=max(head_k_dim // 2, 1))
  else:
    # H200 sweep 2026-11-29, B=256, L=16 (f32 and bf16 state): BV=64, K in two chunks of 64,
    # 2 warps was best (f32 0.226 ms vs 0.238-0.283 for BV 16-64 with 1-4 warps and whole K).
    step = KernelConfig(block_v=64, num_warps=2, block_k=64)
  step = step.fit(head_v_dim, head_k_dim)
  if not _is_cpu(device_kind) and batch * num_k_heads * (head_v_dim // step.block_v) < 2 * 132:
    # Untuned: fewer than two programs per H200 SM leaves SMs idle; halve the tile for parallelism.
    step = step.override(block_v=max(16, step.block_v // 2))
  # Fold: runs on the flushing rows only, one [BV, BK] tile per program. CPU: two V and two K
  # tiles so the tests cover the tile indexing.
  fold = _fold_tile(device_kind, head_k_dim)
  # Rows at staggered phases flush about B/L per step; twice that many row slots keeps one row
  # per fold program in steady state, and rows beyond (synchronised flushes) loop, never drop.
  fold_rows = min(batch, _next_pow2(-(-2 * batch // buffer_len)))
  return ReplayConfig(step=step, route=route, fold=fold.fit(head_v_dim, head_k_dim),
                      fold_rows=fold_rows)


def materialize_config(*, device_kind: str, head_k_dim: int, head_v_dim: int) -> KernelConfig:
  """Materialize runs the fold kernel body on every row (f32 output)."""
  # Same tile as the fold pass: it is the same kernel body (not on the decode hot path).
  return _fold_tile(device_kind, head_k_dim).fit(head_v_dim, head_k_dim)


def _fold_tile(device_kind: str, head_k_dim: int) -> KernelConfig:
  if _is_cpu(device_kind):
    return KernelConfig(block_v=16, block_k=max(head_k_dim // 2, 1), num_warps=4)
  # H200 sweep 2026-11-29, B=256, L=16: a [32, 64] tile in 2 warps (f32 0.2191, bf16 0.1438 ms per
  # layer-step in all); [16-64, 64-128] tiles with 1-4 warps within 2 %, except [64, 128] f32
  # (spills: 0.63 ms).
  return KernelConfig(block_v=32, block_k=64, num_warps=2)
