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
  ``fold_rows`` row slots (its grid's third axis; flushing rows beyond that loop) and
  ``fold_tiles`` [BV, BK] tiles per program (a row's window and decays are loaded once for them)."""
  step: KernelConfig
  route: str
  fold: KernelConfig
  fold_rows: int = 1
  fold_tiles: int = 1

  def __post_init__(self):
    if self.route not in ROUTES:
      raise ValueError(f"route={self.route!r}; expected one of {ROUTES}")
    if not isinstance(self.fold_rows, int) or self.fold_rows < 1:
      raise ValueError(f"fold_rows={self.fold_rows!r}; expected an int >= 1")
    if not _pow2(self.fold_tiles):
      raise ValueError(f"fold_tiles={self.fold_tiles!r}; expected a power of two (tiles of a head "
                       f"split evenly between programs)")


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _is_cpu(device_kind: str) -> bool:
  return device_kind.lower() == "cpu"


def _is_f32(state_dtype) -> bool:
  return jnp.dtype(state_dtype) == jnp.dtype(jnp.float32)


# At and below this batch the conventional and flush-every-step kernels take the small-batch tiles
# of the session-10 sweep (B = 1, 8, 32 measured; above, the B = 256 tiles).
SMALL_TILE_MAX_BATCH = 32


def decode_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  batch: int) -> KernelConfig:
  """Conventional decode, grid (V/BV, Hv, B), state tile [BV, K]."""
  del head_k_dim
  if _is_cpu(device_kind):
    # Interpret mode: speed is irrelevant; small tiles make CPU tests cover the multi-tile indexing.
    cfg = KernelConfig(block_v=16, num_warps=4)
  elif _is_f32(state_dtype) and batch <= SMALL_TILE_MAX_BATCH:
    # H200 2026-11-30, layers unrolled (bench/RESULTS.md session 10, tile sweep): [8, K]/1 warp
    # 0.0032 / 0.0106 / 0.0374 ms at B = 1 / 8 / 32 against [16, K]/2 0.0037 / 0.0112 / 0.0379:
    # at small batch more, smaller programs hide the load latency.
    cfg = KernelConfig(block_v=8, num_warps=1)
  elif _is_f32(state_dtype):
    # H200 sweep 2026-11-29, B=256: BV=16/2 warps 0.297 ms (87 % of the copy ceiling); BV=8/1,
    # 32/4 within 1 %; BV=128/8 0.309 ms; BV=64/2 0.319 ms.
    cfg = KernelConfig(block_v=16, num_warps=2)
  else:
    # H200 sweep 2026-11-29, bf16 state, B=256: BV=32/4 warps 0.160 ms (82 %); BV=16/1-2 and
    # 8/1 within 2 %; BV=32/1 0.192 ms. Session 10 (B = 1 / 8 / 32): [32, K]/4 0.0028 / 0.0063 /
    # 0.0206 ms, [16, K]/2 equal, [8, K]/1 0.0031 / 0.0077 / 0.0213.
    cfg = KernelConfig(block_v=32, num_warps=4)
  return cfg.fit(head_v_dim)


def replay_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  num_k_heads: int, batch: int, buffer_len: int, ring_size: int,
                  route: str = "auto") -> ReplayConfig:
  """Output-only: the replay step, grid (V/BV, Hk, B), plus the fold pass, grid
  (V/BV · K/BK, Hv, fold_rows). Reconstruct: one launch, grid (V/BV, Hv, B), tile ``step``
  [BV, K] (the verify kernel at T = 1; the fold fields are unused)."""
  if route != "auto" and route not in ROUTES:
    raise ValueError(f"route={route!r}; expected 'auto' or one of {ROUTES}")
  # "auto": output-only. H200 2026-11-29 (bench/RESULTS.md, session 5), L=16, vs the one-launch
  # reconstruct route (window loop, flush stored in place) in the same run: B=256 f32 0.212 ms vs
  # 0.313 ([8, K], 1 warp) / 0.360 (the decode tile); bf16 0.142 vs 0.310; B=32 f32 0.045 vs 0.055.
  route = "output_only" if route == "auto" else route
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
  fold = _fold_tile(device_kind, head_k_dim, ring_size)
  fold_rows = _decode_fold_rows(batch, buffer_len)
  if _is_cpu(device_kind):
    fold_tiles = 2   # interpret mode: two tiles per program cover the kernel's tile loop
  else:
    # H200 2026-11-30 (bench/RESULTS.md, sessions 11 and 12), L=16, full cycles. B=256, 1 / 2 / 4 /
    # 8 tiles per program: f32 0.1861 / 0.1842 / 0.1895 / 0.1844 ms, bf16 0.1205 / 0.1200 / 0.1166
    # / 0.1210. Below, fewer flushing rows (B/L) leave too few fold programs to share out: B=128
    # f32 1 / 2 tiles 0.0997 / 0.0985, bf16 1 / 4 tiles 0.0656 / 0.0655; B=32 f32 0.0308 / 0.0318,
    # bf16 0.0204 / 0.0240 (4 tiles turned replay's 1.01x into 0.86x there).
    if _is_f32(state_dtype):
      fold_tiles = 2 if batch >= 128 else 1
    else:
      fold_tiles = 4 if batch >= 256 else 1
  if route == "reconstruct":
    # The conventional decode's [BV, K] tile (the kernel is that step plus a window replay into the
    # tile). H200 B=256 L=16 f32: [8, K] in 1 warp is faster (0.313 vs 0.360 ms) but the route
    # loses to output-only either way, so this explicit-only route keeps the decode's tile.
    step = decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                         head_v_dim=head_v_dim, batch=batch).fit(head_v_dim, head_k_dim)
  return ReplayConfig(step=step, route=route, fold=fold.fit(head_v_dim, head_k_dim),
                      fold_rows=fold_rows, fold_tiles=fold_tiles)


def flush_decode_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                        ring_size: int, batch: int) -> KernelConfig:
  """Fold-and-step kernel of ``plan.flush_all`` steps, grid (V/BV, Hv, B), tile [BV, K]."""
  if _is_cpu(device_kind):
    return decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                         head_v_dim=head_v_dim, batch=batch)
  if _is_f32(state_dtype) or ring_size >= 32 or batch <= SMALL_TILE_MAX_BATCH:
    # (bf16 at small batch, session 10, L = 16: [8, K]/1 0.0027 / 0.0072 / 0.0218 ms at B = 1 / 8 /
    # 32 against the decode tile's 0.0029 / 0.0077 / 0.0217.)
    # The kernel's registers are set by its fold branch (an IEEE dot over R ring entries), which
    # steady-state steps never run; the smallest tile keeps the empty-window branch at the
    # conventional decode's speed. H200 2026-11-29, f32, L = 16 (R = 16), vs conv-pallas in the
    # same run: [8, K]/1 warp 0.97x at B = 8, 0.98x at 32, 0.97x at 128; [16, K]/2 warps and the
    # bf16 tile 0.89-0.91x. At R = 32 (L = 32) [8, K]/1 0.050 ms vs [16, K]/4 0.069 ms at B = 32
    # (f32); bf16 at R = 32 was timed at B = 1 only (all tiles within 2 %).
    return KernelConfig(block_v=8, num_warps=1).fit(head_v_dim)
  # bf16/f16 state, R = 16, larger batches: the conventional decode's tile [32, K]/4 warps 0.99x at
  # B = 128 (H200 2026-11-29, layer loop); [8, K]/1 0.94x, [16, K]/2 0.92-0.98x.
  return decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, batch=batch)


def verify_implementations(*, device_kind: str, family: str, state_dtype, num_tokens: int,
                           batch: int) -> tuple[str, ...]:
  """GPU implementations that ``replay_verify(implementation=None)`` tries first, fastest first
  (the rest follow in the usual order; a kernel that cannot take the input falls through)."""
  if family not in SMALL_BATCH_FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {SMALL_BATCH_FAMILIES}")
  if "H200" not in device_kind:
    return ()   # the Mosaic kernels are Hopper kernels, measured on the H200 only
  # H200 2026-11-30 (bench/RESULTS.md, session 8), L = 8, f32 state, ms per layer-step, Mosaic
  # (commit bd683aa) vs Triton's reconstruct kernel in the same run:
  # GDN T=2: 0.0525 vs 0.0523 (B=32), 0.1565 vs 0.1537 (128), 0.2933 vs 0.2909 (256) → a tie, Triton;
  # T=4: 0.0687 vs 0.0765, 0.2149 vs 0.2472, 0.4071 vs 0.4770; T=8: 0.0980 vs 0.1244, 0.3341 vs
  # 0.4407, 0.6437 vs 0.8621. bf16 state, B=256: T=4 0.3886 vs 0.4270, T=8 0.6120 vs 0.7330.
  # Mamba2 (Nemotron-3-Super layer), B=256: T=2/4/8 0.456/0.638/1.110 vs 0.546/0.873/1.412; the
  # first Mosaic kernel also won at B=32 (T=2/4/8 0.0765/0.1027/0.1654 vs 0.0831/0.1239/0.1951).
  # Model level (bench.model_spec, H200 2026-11-30, session 9: one verify + commit step of the whole
  # stack, L = 8, f32): Mosaic over Triton GDN T=4 1.12x (B=32) / 1.22x (256), T=8 1.16x / 1.20x;
  # Mamba2 T=4 1.04x / 1.08x, T=8 1.07x / 1.10x. The kernels' lead survives inside the model.
  # Below B = 32 (session 11, 2026-11-30, L = 8, f32, layers unrolled), Mosaic vs Triton at
  # B = 1 / 8: GDN T=2 0.0049 vs 0.0057 / 0.0145 vs 0.0141 (Mosaic at B = 1, a tie from B = 8;
  # B = 2-7 unmeasured, taken as B = 1); T=4 0.0072 vs 0.0077 / 0.0183 vs 0.0221; T=8 0.0109 vs
  # 0.0132 / 0.0256 vs 0.0338. Mamba2 T=2/4/8 at B = 1: 0.0059 / 0.0081 / 0.0116 vs 0.0065 /
  # 0.0083 / 0.0130; at B = 8: 0.0215 / 0.0282 / 0.0427 vs 0.0225 / 0.0338 / 0.0520. Model step
  # (GDN stack, T=4): Mosaic 1.01x (B=1) / 1.02x (B=8) over Triton. GDN bf16 keeps B ≥ 256
  # (measured there only); Mamba2 bf16 is unmeasured: Triton stays first.
  if family == "gdn" and _is_f32(state_dtype):
    mosaic = num_tokens >= 4 or batch < 8
  elif family == "gdn":
    mosaic = num_tokens >= 4 and batch >= 256
  else:
    mosaic = _is_f32(state_dtype)
  return ("pallas_mosaic",) if mosaic else ()


DECODE_BUFFER_LEN = 16


def buffer_len_for(num_tokens: int) -> int:
  """The buffer length L a cache gets when the caller leaves it to the library: ``num_tokens`` T
  tokens per verify step (1 without speculative decoding)."""
  if num_tokens <= 1:
    # One token per step: L = 16 is the GDN-core and model benchmarks' operating point (H200, B=256
    # f32: L = 8 1.24x, L = 16 1.40x, L = 32 1.32x over conventional decode).
    return DECODE_BUFFER_LEN
  # Speculative verify: short windows win, every flush being cheaper than a long window replay.
  # H200 2026-11-29 (bench/RESULTS.md, session 6), B = 256, f32 checkpoint, x the conventional
  # speculative verify in the same run: GDN T=2 L=4 1.59 vs L=8 1.52; T=4 L=8 1.52 vs L=16 1.32;
  # T=8 L=8 1.56 vs L=16 1.48. Mamba2 T=2 1.65 vs 1.59; T=4 1.64 vs 1.41; T=8 1.90 vs 1.81.
  # L >= T keeps a flushed row's tokens inside its window (T = 3, 5-7: interpolated, unmeasured).
  return max(num_tokens, min(2 * num_tokens, 8))


SMALL_BATCH_FAMILIES = ("gdn", "mamba2")


def replay_min_batch(*, device_kind: str, state_dtype, buffer_len: int, family: str = "gdn") -> int:
  """Below this batch a model flushes every step (``cursor.plan(flush_all=True)``): replay's ring
  work costs more than the state traffic it saves, so each step is one conventional-like pass
  (the fold-and-step kernels of both families run at 0.94-1.01x of conventional decode)."""
  if family not in SMALL_BATCH_FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {SMALL_BATCH_FAMILIES}")
  if _is_cpu(device_kind):
    return 0   # CPU: no policy (nothing is bandwidth-bound in interpret mode or XLA on CPU)
  # f16 shares bf16's bytes and kernels (unmeasured separately).
  if family == "gdn":
    del buffer_len, state_dtype   # measured at L = 16 only (the default)
    # H200 2026-11-30, Qwen3.5-4B layer, L = 16, bf16 ring, per layer-step vs conv-pallas in the
    # same run, layers unrolled (bench/RESULTS.md, session 10): f32 state: replay 0.34x / 0.78x /
    # 1.23x / 1.43x at B = 1 / 8 / 32 / 128; flush-every-step 1.13x / 1.00x / 0.98x / 0.97x.
    # bf16 state: replay 0.34x / 0.53x / 1.02x / 1.14x; flush-every-step 0.97x / 0.82x / 0.96x /
    # 0.96x → both switch below 32.
    return 32
  # Mamba2, H200 2026-11-29, Nemotron-3-Super layer, bf16 ring, vs conv-pallas in the same run;
  # flush-every-step 0.96-1.00x at B = 1-128 (both dtypes, L = 8).
  # f32 state, L <= 8 (the auto route: reconstruct for B = 8-128): replay 0.76x / 0.98x / 1.09x /
  # 1.17x at B = 1 / 8 / 32 / 128 (L = 8) → below 32. L = 16: replay loses up to B = 128 (best
  # route 0.90x) and wins at 256 (1.17x) → below 256.
  # bf16 state, output-only (the auto route), session 7 matrix: L = 8 / 16 replay 0.83x / 0.86x at
  # B = 32, 1.05x / 1.03x at B = 128; L = 4 0.99x at B = 128, 1.06x at 256 → below 128 for L ≥ 8,
  # else below 256.
  # Re-measured with the layers unrolled (session 10, L = 8): f32 flush-every-step 0.93x / 0.99x /
  # 1.01x at B = 1 / 32 / 256 against output-only 0.61x / 1.04x / 1.34x; bf16 1.00x / 1.00x /
  # 1.00x against 0.62x / 0.88x / 1.16x. The thresholds stand. (With the small-batch tiles of
  # mamba2_decode_config on both sides the policy is 1.02x (f32) and 0.97x (bf16) at B = 1.)
  if _is_f32(state_dtype):
    return 32 if buffer_len <= 8 else 256
  return 128 if buffer_len >= 8 else 256


def materialize_config(*, device_kind: str, head_k_dim: int, head_v_dim: int,
                       ring_size: int) -> KernelConfig:
  """Materialize runs the fold kernel body on every row (f32 output)."""
  # Same tile as the fold pass: it is the same kernel body (not on the decode hot path).
  return _fold_tile(device_kind, head_k_dim, ring_size).fit(head_v_dim, head_k_dim)


def _fold_tile(device_kind: str, head_k_dim: int, ring_size: int) -> KernelConfig:
  if _is_cpu(device_kind):
    return KernelConfig(block_v=16, block_k=max(head_k_dim // 2, 1), num_warps=4)
  if ring_size >= 32:
    # The fold's window sum is an IEEE-f32 dot over R entries, which holds R-long operand rows in
    # each thread: with R = 32 the [32, 64] / 2-warp tile spills (ncu: 7 GB of local loads, 2.83 ms
    # for 62 flushing rows, H200, Qwen3.5-4B, 2026-11-29). [16, 64] in 4 warps: 63 registers, no
    # spills, 0.184 ms; [16, 32] 0.27, [16, 128] 0.35, [32, 32] 0.36, [8, 128] 0.39 ms.
    return KernelConfig(block_v=16, block_k=64, num_warps=4)
  # H200 sweep 2026-11-29, B=256, L=16 (R = 16): a [32, 64] tile in 2 warps (f32 0.2191, bf16
  # 0.1438 ms per layer-step in all); [16-64, 64-128] tiles with 1-4 warps within 2 %, except
  # [64, 128] f32 (spills: 0.63 ms).
  return KernelConfig(block_v=32, block_k=64, num_warps=2)


# ----------------------------------------------------------------------------------------------
# Mamba2 (replayssm_jax/pallas/mamba2_triton.py). State [P, N] per head; programs cover a
# [block_p, N] state tile of ``heads`` heads of one group. All GPU rules are *untuned* guesses
# carried over from the GDN calibration until a Mamba2 sweep exists.


def _pow2_part(n: int) -> int:
  """Largest power of two dividing n (P = 80 → 16)."""
  return n & -n


def _half_pow2(n: int) -> int:
  """Half of n rounded up to a power of two (a CPU tile: two tiles per power-of-two head)."""
  return max(_next_pow2(n) // 2, 1)


def _gcd(a: int, b: int) -> int:
  while b:
    a, b = b, a % b
  return a


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2Config:
  """One Pallas-Triton Mamba2 launch: P rows per program, N chunk of the rebuild (fold) loop,
  heads per program (the replay step shares the ring's B_j·C among them), warps, stages."""
  block_p: int
  num_warps: int
  block_n: int | None = None
  heads: int = 1
  num_stages: int = 1

  def __post_init__(self):
    if not _pow2(self.block_p):
      raise ValueError(f"block_p={self.block_p!r}; expected a power of two (Triton tile)")
    if self.block_n is not None and not _pow2(self.block_n):
      raise ValueError(f"block_n={self.block_n!r}; expected None or a power of two (Triton tile)")
    if not isinstance(self.heads, int) or self.heads < 1:
      raise ValueError(f"heads={self.heads!r}; expected an int >= 1")
    if not _pow2(self.num_warps) or self.num_warps > 32:
      raise ValueError(f"num_warps={self.num_warps!r}; expected a power of two <= 32")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r}; expected an int >= 1")

  def fit(self, head_dim: int, state_dim: int, heads_per_group: int = 1) -> "Mamba2Config":
    """Tiles clipped to the head: block_p divides P (a power of two, so P = 80 gets 16),
    block_n ≤ N, heads divides H/G (a program never straddles two groups)."""
    block_n = state_dim if self.block_n is None else min(self.block_n, state_dim)
    return dataclasses.replace(self, block_p=min(self.block_p, _pow2_part(head_dim)),
                               block_n=block_n, heads=_gcd(self.heads, heads_per_group))

  def override(self, **changes) -> "Mamba2Config":
    return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mamba2ReplayConfig:
  """The replay step and its compute route; for the output-only route also the flush-fold pass
  (pallas/fold_triton.py: tile ``fold`` [block_v = P rows, block_k = N columns], ``fold_rows`` row
  slots, ``fold_tiles`` tiles per program). The reconstruct route stores flushing rows in its own
  launch (``fold`` is None)."""
  step: Mamba2Config
  route: str
  fold: KernelConfig | None = None
  fold_rows: int = 1
  fold_tiles: int = 1

  def __post_init__(self):
    if self.route not in ROUTES:
      raise ValueError(f"route={self.route!r}; expected one of {ROUTES}")
    if self.route == "output_only" and self.fold is None:
      raise ValueError("route='output_only' needs a fold config (its flush pass)")
    if not isinstance(self.fold_rows, int) or self.fold_rows < 1:
      raise ValueError(f"fold_rows={self.fold_rows!r}; expected an int >= 1")
    if not _pow2(self.fold_tiles):
      raise ValueError(f"fold_tiles={self.fold_tiles!r}; expected a power of two (tiles of a head "
                       f"split evenly between programs)")


def _mamba2_fold(device_kind: str, head_dim: int, state_dim: int, ring_size: int) -> KernelConfig:
  """The flush-fold tile for a [P, N] head, its rows a power of two dividing P."""
  if not _is_cpu(device_kind) and ring_size < 16:
    # R < 16: R unrolled rank-one FMAs, no dot. H200 2026-11-29 (session 6), Nemotron-3-Super,
    # B = 256, L = 8, f32, full cycle: [64, 64]/4 warps 0.4436 ms, [32, 128]/4 0.4465, GDN's
    # [32, 64]/2 0.4522, [16, 64]/4 0.4896.
    return KernelConfig(block_v=64, block_k=64, num_warps=4).fit(_pow2_part(head_dim), state_dim)
  # R ≥ 16: GDN's fold tile for a [V, K] head (the same kernel, the same window product; P = 64,
  # N = 128 as V = K = 128); *untuned* for Mamba2.
  return _fold_tile(device_kind, state_dim, ring_size).fit(_pow2_part(head_dim), state_dim)


def mamba2_decode_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         batch: int) -> Mamba2Config:
  """Conventional Mamba2 decode, grid (P/BP, H, B), state tile [BP, N]."""
  if _is_cpu(device_kind):
    # Interpret mode: speed is irrelevant; two P tiles per head cover the tile indexing.
    cfg = Mamba2Config(block_p=_half_pow2(head_dim), num_warps=4)
  elif batch <= SMALL_TILE_MAX_BATCH:
    # H200 2026-11-30, Nemotron-3-Super layer, layers unrolled (session 10, tile sweep), B = 1 / 8 /
    # 32: f32 [16, N]/1 warp 0.0045 / 0.0197 / 0.0725 ms against [16, N]/2 0.0047 / 0.0201 / 0.0732
    # ([8, N]/1 0.0048 / 0.0204 / 0.0724); bf16 [8, N]/1 0.0033 / 0.0120 / 0.0399 against
    # [32, N]/4 0.0036 / 0.0124 / 0.0405.
    cfg = Mamba2Config(block_p=16 if _is_f32(state_dtype) else 8, num_warps=1)
  elif _is_f32(state_dtype):
    # *untuned*: the GDN f32 optimum (tile [16, 128] in 2 warps, 87 % of the copy ceiling).
    cfg = Mamba2Config(block_p=16, num_warps=2)
  else:
    # *untuned*: the GDN bf16 optimum (tile [32, 128] in 4 warps, 82 %).
    cfg = Mamba2Config(block_p=32, num_warps=4)
  return cfg.fit(head_dim, state_dim)


def mamba2_replay_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         num_heads: int, num_groups: int, batch: int, buffer_len: int,
                         ring_size: int, route: str = "auto") -> Mamba2ReplayConfig:
  """Replay step, grid (P/BP, H/heads, B), and for the output-only route the fold pass, grid
  (P/BP · N/BN, H, fold_rows); ``route`` "auto" picks the route."""
  if route == "auto":
    # H200 2026-11-29, Nemotron-3-Super layer, f32 state, bf16 ring, vs conv-pallas in the same run
    # (bench/RESULTS.md, session 4): reconstruct 1.20x / 1.09x at B = 32, L = 4 / 8 (output-only
    # 0.84x / 0.80x), 1.32x / 1.17x at B = 128 (output-only 1.09x / 1.17x), 1.23x / 1.11x at
    # B = 256 (output-only 1.13x / 1.12x): its grid has one head per program, 4x the programs of
    # output-only, and the rebuild's rank-one FMAs need no reductions. At L = 16 output-only wins
    # everywhere (B = 256: 1.17x vs 0.40x), and at B = 1 (L = 4: 0.89x vs 0.77x). bf16 state
    # (session 7 matrix): output-only wins at every B ≥ 128 and L (B = 256 L = 8: 1.13x vs 0.65x);
    # reconstruct wins only at B ≤ 32, L = 4, where the small-batch policy flushes every step.
    window_cheap = buffer_len <= 4 or (buffer_len <= 8 and batch <= 128)
    small = _is_f32(state_dtype) and window_cheap and batch >= 8 and not _is_cpu(device_kind)
    route = "reconstruct" if small else "output_only"
  group = num_heads // num_groups
  if _is_cpu(device_kind):
    # Interpret mode: two P tiles, two N chunks and two heads per program cover the indexing.
    cfg = Mamba2Config(block_p=_half_pow2(head_dim), block_n=_half_pow2(state_dim), heads=2,
                       num_warps=4)
  elif route == "output_only":
    # *untuned*: [32, 128] checkpoint tiles (GDN's best replay tile had 64×64 = the same 4096
    # elements); 4 heads per program share B_j·C.
    cfg = Mamba2Config(block_p=32, block_n=32, heads=4, num_warps=2)
  else:
    # *untuned*: reconstruct rebuilds [BP, block_n] chunks for every row; nothing is shared
    # between heads, so one head per program keeps the grid wide.
    cfg = Mamba2Config(block_p=32, block_n=32, heads=1, num_warps=2)
  cfg = cfg.fit(head_dim, state_dim, group)
  if not _is_cpu(device_kind) and batch * (num_heads // cfg.heads) * (head_dim // cfg.block_p) < 2 * 132:
    # *untuned*: fewer than two programs per H200 SM leaves SMs idle; one head per program.
    cfg = cfg.override(heads=1)
  if route == "reconstruct":
    return Mamba2ReplayConfig(step=cfg, route=route)
  # Output-only: a separate fold pass over the flushing rows, as GDN (bench/NOTES.md item 8: a fold
  # branch inside the step kernel costs every program occupancy).
  return Mamba2ReplayConfig(step=cfg, route=route,
                            fold=_mamba2_fold(device_kind, head_dim, state_dim, ring_size),
                            fold_rows=_decode_fold_rows(batch, buffer_len),
                            fold_tiles=_mamba2_fold_tiles(device_kind, ring_size, batch))


def _mamba2_fold_tiles(device_kind: str, ring_size: int, batch: int) -> int:
  """Tiles per program of Mamba2's fold pass. CPU: two, so interpret mode covers the tile loop.
  H200 2026-11-30 (bench/RESULTS.md, session 12), Nemotron-3-Super layer, B=256, full cycles,
  1 / 2 / 4 tiles per program: R = 8 (the fold's unrolled rank-one FMAs) f32 0.4268 / 0.4444 /
  0.4466 ms, bf16 0.2554 / 0.2593 / 0.2597; R = 16 (the window product) f32 0.4060 / 0.4045 /
  0.3997, bf16 0.2586 / 0.2569 / 0.2537. The split follows the fold's two forms (unrolled FMAs below
  R = 16, one matrix product from R = 16); why more tiles help only the product was not measured,
  nor were smaller batches (GDN's fold lost with more tiles there), so they keep one."""
  if _is_cpu(device_kind):
    return 2
  return 4 if ring_size >= 16 and batch >= 256 else 1


def mamba2_flush_decode_config(*, device_kind: str, state_dtype, head_dim: int,
                               state_dim: int, batch: int) -> Mamba2Config:
  """Fold-and-step kernel of ``plan.flush_all`` steps, grid (P/BP, H, B), tile [BP, N]; block_n is
  the chunk of the (rarely taken) window-rebuild branch."""
  # The conventional decode's tile, small-batch tiles included (session 10, L = 8, B = 1 / 8 / 32:
  # f32 [16, N]/1 0.0044 / 0.0204 / 0.0742 ms against [16, N]/2 0.0050 / 0.0204 / 0.0750; bf16
  # [8, N]/1 0.0034 / 0.0121 / 0.0403 against [32, N]/4 0.0036 / 0.0125 / 0.0401).
  cfg = mamba2_decode_config(device_kind=device_kind, state_dtype=state_dtype, head_dim=head_dim,
                             state_dim=state_dim, batch=batch)
  if _is_cpu(device_kind):
    # Interpret mode: two N chunks cover the rebuild's chunk indexing.
    return cfg.override(block_n=_half_pow2(state_dim)).fit(head_dim, state_dim)
  # *untuned*: the conventional decode's tile (the steady state is that pass); the rebuild walks N
  # in chunks of 32 as the replay step's fold does, so its accumulator stays small.
  return cfg.override(block_n=32).fit(head_dim, state_dim)


def mamba2_materialize_config(*, device_kind: str, head_dim: int, state_dim: int) -> Mamba2Config:
  """Materialize rebuilds every row's state, grid (P/BP, H, B) (not on the decode hot path)."""
  if _is_cpu(device_kind):
    # Interpret mode: two P tiles and two N chunks cover the indexing.
    return Mamba2Config(block_p=_half_pow2(head_dim), block_n=_half_pow2(state_dim),
                        num_warps=4).fit(head_dim, state_dim)
  # *untuned*: the replay step's rebuild chunk.
  return Mamba2Config(block_p=32, block_n=32, num_warps=2).fit(head_dim, state_dim)


# ----------------------------------------------------------------------------------------------
# GDN speculative verify (replayssm_jax/pallas/gdn_verify_triton.py). GPU rules are *untuned*
# guesses from the decode calibration until an H200 sweep of bench/verify_decode.py exists.


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyConfig:
  """GDN verify. Route ``output_only``: the step kernel, grid (V/BV, Hk, B), which reads the
  checkpoint itself (``split`` False) or takes the 2T checkpoint readouts S_c·k_i, S_c·q_i from a
  separate readout launch, grid (V/BV, Hv, B) (``split`` True); then the replay fold pass over the
  flushing rows. Route ``reconstruct``: one launch, grid (V/BV, Hv, B), tile ``step`` [BV, K]
  (the window is replayed into the tile, the tokens stepped through it, flushing rows store it
  after token 0); ``readout``, ``split``, ``fold``, ``fold_rows`` and ``fold_tiles`` are unused.
  ``fold_tiles``: tiles per fold program, one (not measured with more for verify)."""
  step: KernelConfig
  readout: KernelConfig
  split: bool
  fold: KernelConfig
  fold_rows: int = 1
  fold_tiles: int = 1
  route: str = "output_only"

  def __post_init__(self):
    if self.route not in ROUTES:
      raise ValueError(f"route={self.route!r}; expected one of {ROUTES}")
    if not isinstance(self.split, bool):
      raise ValueError(f"split={self.split!r}; expected a bool")
    if not isinstance(self.fold_rows, int) or self.fold_rows < 1:
      raise ValueError(f"fold_rows={self.fold_rows!r}; expected an int >= 1")


def verify_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  num_k_heads: int, batch: int, buffer_len: int, ring_size: int,
                  num_tokens: int, route: str | None = None) -> VerifyConfig:
  """Verify step (fused or split), then the replay fold pass; or the one-launch reconstruct route.
  ``route`` None: reconstruct on GPUs, output-only in interpret mode."""
  base = replay_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, num_k_heads=num_k_heads, batch=batch,
                       buffer_len=buffer_len, ring_size=ring_size)
  if route is None:
    # H200 2026-11-29, B=256, L=16, f32 state, vs the conventional speculative verify in the same
    # run (bench/RESULTS.md, session 5): reconstruct [8, K] in 1 warp 1.33x (T=4) / 1.49x (T=8);
    # output-only 0.52x / 0.09x (its T=8 tile spills). CPU: output-only, the route the interpret
    # tests were sized for (both routes are tested by name).
    route = "output_only" if _is_cpu(device_kind) else "reconstruct"
  if route == "reconstruct":
    # H200, same runs: [8, K] in 1 warp 0.552 / 0.912 ms (T = 4 / 8) vs the decode's [16, K] in 2
    # warps 0.722 / 1.042 and [32, K] in 4 warps 0.752 / 1.124: the window loop and the T delta-rule
    # steps are latency-bound, so more, smaller programs win. CPU: the decode's two V tiles.
    step = decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                         head_v_dim=head_v_dim, batch=batch)
    if not _is_cpu(device_kind):
      step = KernelConfig(block_v=8, num_warps=1)
  elif _is_cpu(device_kind):
    # Interpret mode: the replay step's tiles (two V tiles, two K chunks cover the indexing).
    step = base.step
  elif num_tokens <= 4:
    # Each program keeps 2T checkpoint readouts (S_c·k_i, S_c·q_i) and T corrected values of BV rows
    # live. H200 2026-11-29, B=256, T=4, L=16 (R=32), step kernel alone: [32, 64] in 4 warps 1.26 ms,
    # 2 warps 1.30; [16, 64] 1.64 (4 warps) / 1.93 (2); [16, 128] 1.61; [32, 32] 1.70.
    step = KernelConfig(block_v=32, num_warps=4, block_k=64).fit(head_v_dim, head_k_dim)
  else:
    # *untuned*: T = 5..8 doubles the live vectors again: [16, 64] tiles, 4 warps for the 2T reductions.
    step = KernelConfig(block_v=16, num_warps=4, block_k=64).fit(head_v_dim, head_k_dim)
  # Split: the readout launch is shaped like the conventional decode (one [BV, K] checkpoint tile
  # per program, reductions only), so it starts from the decode's tile. H200 B=256 T=4 L=16 f32:
  # split 1.35 ms vs fused 1.44 (sessions 4-5), both far behind reconstruct (0.55); fused stays
  # the output-only default, a route now taken only by name.
  readout = decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                          head_v_dim=head_v_dim, batch=batch)
  return VerifyConfig(step=step, readout=readout, split=False, fold=base.fold,
                      fold_rows=_verify_fold_rows(batch, buffer_len, num_tokens), route=route)


def _decode_fold_rows(batch: int, buffer_len: int) -> int:
  """Row slots of the decode's fold pass. Rows at staggered phases flush about B/L per step: that
  many row slots gives one row per fold program in steady state, and rows beyond (synchronised
  flushes) loop, never drop. H200 2026-11-29 (bench/NOTES.md 32), GDN B=256 L=16: B/L slots
  0.2015 ms f32 / 0.1349 bf16, 2B/L 0.2019 / 0.1360, 4B/L 0.2067 / 0.1406 (empty programs cost);
  Mamba2 B=256 L=8 f32: B/L 0.4420, 2B/L 0.4419."""
  return min(batch, _next_pow2(-(-batch // buffer_len)))


def _verify_fold_rows(batch: int, buffer_len: int, num_tokens: int) -> int:
  """Row slots of the verify's fold pass. A row's window grows by (T + 1) / 2 tokens per step on
  average (random accepts) and flushes once it exceeds L - 1 - T: about B (T + 1) / (2 (L - T))
  flushing rows per step; twice that many row slots keeps one row per fold program, and rows beyond
  loop, never drop."""
  flushing = -(-batch * (num_tokens + 1) // (2 * max(buffer_len - num_tokens, 1)))
  return min(batch, _next_pow2(2 * flushing))


def verify_conventional_config(*, device_kind: str, state_dtype, head_k_dim: int,
                               head_v_dim: int, batch: int) -> KernelConfig:
  """Conventional verify, grid (V/BV, Hv, B): one [BV, K] state tile stepped T times in registers."""
  # *untuned*: the conventional decode's tiles; the tile is read once and written T times, so the
  # decode's bandwidth-bound optimum is the best prior.
  return decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, batch=batch)


# ----------------------------------------------------------------------------------------------
# Mamba2 speculative verify (replayssm_jax/pallas/mamba2_verify_triton.py). GPU rules are *untuned*
# guesses from the Mamba2 replay step until an H200 sweep exists.


def mamba2_verify_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         num_heads: int, num_groups: int, batch: int, buffer_len: int,
                         ring_size: int, num_tokens: int,
                         route: str | None = None) -> Mamba2ReplayConfig:
  """Verify, T tokens per row. Route ``output_only``: the step kernel, grid (P/BP, H/heads, B), then
  the fold pass over the flushing rows; ``reconstruct``: one launch, grid (P/BP, H, B), the window
  replayed into the [BP, N] tile. ``route`` None: reconstruct on GPUs, output-only in interpret
  mode."""
  if route is None:
    # H200 2026-11-29, Nemotron-3-Super layer, B=256, L=16, f32 state, vs the conventional
    # speculative verify in the same run (bench/RESULTS.md, session 5): reconstruct [8, N] in 1
    # warp 1.41x (T=4) / 1.82x (T=8); output-only 0.71x / 0.55x. CPU: output-only (both routes
    # are tested by name).
    route = "output_only" if _is_cpu(device_kind) else "reconstruct"
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected None or one of {ROUTES}")
  if route == "reconstruct":
    # H200, same runs: [8, N] in 1 warp 1.026 / 1.490 ms (T = 4 / 8) vs the decode's [16, N] in 2
    # warps 1.119 / 1.892. CPU: the decode's two P tiles cover the tile indexing.
    step = mamba2_decode_config(device_kind=device_kind, state_dtype=state_dtype,
                                head_dim=head_dim, state_dim=state_dim, batch=batch)
    if not _is_cpu(device_kind):
      step = Mamba2Config(block_p=8, num_warps=1).fit(head_dim, state_dim)
    return Mamba2ReplayConfig(step=step, route=route)
  if _is_cpu(device_kind):
    # Interpret mode: two P tiles, two N chunks (fold) and two heads per program cover the indexing.
    cfg = Mamba2Config(block_p=_half_pow2(head_dim), block_n=_half_pow2(state_dim), heads=2,
                       num_warps=4)
  elif num_tokens <= 4:
    # *untuned*: the output-only replay step's tile ([32, 128] checkpoint, 4 heads sharing B_w·C_i).
    cfg = Mamba2Config(block_p=32, block_n=32, heads=4, num_warps=2)
  else:
    # *untuned*: T = 5..8 keeps T Δx vectors and T window products live per head: 2 heads per program.
    cfg = Mamba2Config(block_p=32, block_n=32, heads=2, num_warps=2)
  cfg = cfg.fit(head_dim, state_dim, num_heads // num_groups)
  if not _is_cpu(device_kind) and batch * (num_heads // cfg.heads) * (head_dim // cfg.block_p) < 2 * 132:
    # *untuned*: fewer than two programs per H200 SM leaves SMs idle; one head per program.
    cfg = cfg.override(heads=1)
  return Mamba2ReplayConfig(step=cfg, route=route,
                            fold=_mamba2_fold(device_kind, head_dim, state_dim, ring_size),
                            fold_rows=_verify_fold_rows(batch, buffer_len, num_tokens))


def mamba2_verify_conventional_config(*, device_kind: str, state_dtype, head_dim: int,
                                      state_dim: int, batch: int, num_tokens: int) -> Mamba2Config:
  """Conventional verify, grid (P/BP, H, B): one [BP, N] state tile stepped T times in registers."""
  del num_tokens
  # *untuned*: the conventional decode's tiles; the tile is read once and written T times, so the
  # decode's bandwidth-bound optimum is the best prior.
  return mamba2_decode_config(device_kind=device_kind, state_dtype=state_dtype, head_dim=head_dim,
                              state_dim=state_dim, batch=batch)


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet, Mosaic GPU (replayssm_jax/pallas/gdn_mosaic.py). One warpgroup per program; all
# GPU rules are *untuned* until bench/gdn_decode.py --impls times them on the H200.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicConfig:
  """One Mosaic GPU launch: state-tile rows per program (GDN's [BV, K] checkpoint tile, Mamba2's
  [BP, N] state tile, staged by TMA); ``rows``: batch rows per program (decode, replay and verify
  kernels; with rows ≥ 2 the next row's staging overlaps the current row's work, in doubled SMEM
  buffers)."""
  block_v: int
  rows: int = 1

  def __post_init__(self):
    if not isinstance(self.block_v, int) or self.block_v < 1:
      raise ValueError(f"block_v={self.block_v!r}; expected an int >= 1")
    if not _pow2(self.rows):
      raise ValueError(f"rows={self.rows!r}; expected a power of two (batch rows per program)")


def mosaic_decode_config(*, device_kind: str, state_dtype, head_v_dim: int) -> MosaicConfig:
  """Conventional decode, grid (V/BV, Hv, B)."""
  del state_dtype
  if _is_cpu(device_kind):
    # Interpret mode ignores layouts: a 16-row tile gives CPU tests two V tiles per head; four rows
    # per program cover the double-buffered row loop.
    return MosaicConfig(block_v=min(16, head_v_dim), rows=4)
  # *untuned*: the 64-row WGMMA tile is the smallest that lowers; more programs per SM for latency.
  # One batch row per program until the rows sweep has run (bench/NOTES.md 74).
  return MosaicConfig(block_v=min(64, head_v_dim))


def mosaic_replay_config(*, device_kind: str, state_dtype, head_v_dim: int, num_k_heads: int,
                         group: int, batch: int) -> MosaicConfig:
  """Replay step with fused flush fold, grid (V/BV, Hk, B / rows); r = ``group`` checkpoint tiles
  in SMEM per row in flight."""
  del state_dtype, num_k_heads, batch, group
  if _is_cpu(device_kind):
    # Interpret mode ignores layouts: two V tiles per head cover the tile indexing; four rows per
    # program cover the double-buffered row loop.
    return MosaicConfig(block_v=min(16, head_v_dim), rows=4)
  # *untuned*: 64 rows; r = 2 f32 [64, 128] tiles + a 16-entry ring stay under 100 KiB of SMEM.
  # One batch row per program until the rows sweep has run (bench/NOTES.md 73).
  return MosaicConfig(block_v=min(64, head_v_dim))


def mosaic_mamba2_decode_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Conventional Mamba2 decode, grid (P/BP, H, B); ``block_v`` holds BP."""
  if _is_cpu(device_kind):
    # Interpret mode ignores layouts: a 16-row tile gives CPU tests two P tiles per head; four rows
    # per program cover the double-buffered row loop.
    return MosaicConfig(block_v=min(16, head_dim), rows=4)
  # *untuned*: the 64-row WGMMA tile, the smallest that lowers (GDN's Mosaic decode tile); one
  # batch row per program until the rows sweep has run (bench/NOTES.md 74).
  return MosaicConfig(block_v=min(64, head_dim))


def mosaic_mamba2_replay_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Mamba2 replay step (reconstruct route, flush fused), grid (P/BP, H, B / rows); ``block_v``
  holds BP."""
  # *untuned*: the decode's tile; the staged ring (R·(N + BP) entries) fits beside an f32
  # [64, 128] tile for R ≤ 128 within the SMEM budget, and its rows per program.
  return mosaic_mamba2_decode_config(device_kind=device_kind, head_dim=head_dim)


def mosaic_verify_config(*, device_kind: str, head_v_dim: int) -> MosaicConfig:
  """Verify (reconstruct route), grid (V/BV, Hv, B / rows): one checkpoint tile and the row's ring
  in SMEM per row in flight."""
  # *untuned*: the replay tile, the smallest that lowers (the Triton reconstruct route ran fastest
  # with its smallest tile, [8, K]; Mosaic's WGMMA layout cannot go below 64 rows), and its rows
  # per program: one on the H200 until measured (bench/NOTES.md 72), four on CPU.
  return mosaic_replay_config(device_kind=device_kind, state_dtype=jnp.float32,
                              head_v_dim=head_v_dim, num_k_heads=1, group=1, batch=1)


def mosaic_mamba2_verify_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Mamba2 verify (reconstruct route), grid (P/BP, H, B / rows); ``block_v`` holds BP."""
  # *untuned*: the replay kernel's tile and rows per program (the same program, stepping T tokens).
  return mosaic_mamba2_replay_config(device_kind=device_kind, head_dim=head_dim)


def mosaic_materialize_config(*, device_kind: str, head_v_dim: int) -> MosaicConfig:
  """Materialize, grid (V/BV, Hv, B), f32 output tile staged in SMEM."""
  # *untuned*: the replay tile (same fold body; not on the decode hot path); one row per program
  # (the kernel has no row loop).
  tile = mosaic_replay_config(device_kind=device_kind, state_dtype=jnp.float32,
                              head_v_dim=head_v_dim, num_k_heads=1, group=1, batch=1)
  return dataclasses.replace(tile, rows=1)
