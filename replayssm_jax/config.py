"""Launch configs of the Pallas kernels, chosen by hardware and shape. Never autotuned at run time.

The choices are data: replayssm_jax/_launch_tables.py holds, per device kind, the tables measured
on the H200 (each citing the result that set it), the H100's (the H200's tiles with its own
verify preference) and the interpret-mode tiles of the CPU tests.
This module holds the config types and the short rules that pick from those tables; entries the
tables mark *untuned* are a best guess awaiting a sweep (the kernel wrappers take tile overrides
for that).
"""
import dataclasses

import jax.numpy as jnp

from replayssm_jax import _launch_tables as tables

ROUTES = ("output_only", "reconstruct")
SMALL_BATCH_FAMILIES = ("gdn", "mamba2")
# At and below this batch the conventional and flush-every-step kernels take small-batch tiles.
SMALL_TILE_MAX_BATCH = tables.SMALL_BATCH["batch"][1]


def _pow2(n: int) -> bool:
  return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


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


def _pick(table: tables.Table, key=tables.ANY, **inputs):
  """The value of the first rule of ``table.rows[key]`` whose bounds hold for ``inputs``."""
  for when, value in table.rows[key]:
    if all((lo is None or inputs[name] >= lo) and (hi is None or inputs[name] <= hi)
           for name, (lo, hi) in when.items()):
      return value
  raise LookupError(f"no rule of {key!r} holds for {inputs}; a table's last rule must be "
                    f"unconditional")


def _state(state_dtype) -> str:
  """The tables' state key: float32, or the 16-bit class (bf16, f16)."""
  return "f32" if jnp.dtype(state_dtype) == jnp.dtype(jnp.float32) else "bf16"


def _size(value, n: int):
  """A table size: a number, or an interpret-mode fraction of the head dimension n."""
  if value == tables.HALF:
    return max(n // 2, 1)
  if value == tables.HALF_POW2:
    return _half_pow2(n)
  return value


def _too_few_programs(device: tables.DeviceTables, programs: int) -> bool:
  """*Untuned* rule: a grid with fewer than two programs per SM leaves SMs idle."""
  return device.num_sms is not None and programs < 2 * device.num_sms


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


def _kernel(entry: dict, head_k_dim: int) -> KernelConfig:
  """A KernelConfig from a table entry (its K chunk resolved for ``head_k_dim``, not clipped)."""
  return KernelConfig(**{**entry, "block_k": _size(entry.get("block_k"), head_k_dim)})


def decode_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  batch: int) -> KernelConfig:
  """Conventional decode, grid (V/BV, Hv, B), state tile [BV, K]."""
  entry = _pick(tables.for_device(device_kind).gdn_decode, _state(state_dtype), batch=batch)
  return _kernel(entry, head_k_dim).fit(head_v_dim)


def _gdn_fold(device: tables.DeviceTables, head_k_dim: int, ring_size: int) -> KernelConfig:
  """The fold pass's [BV, BK] tile (not yet clipped to the head)."""
  return _kernel(_pick(device.gdn_fold, ring_size=ring_size), head_k_dim)


def replay_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                  num_k_heads: int, batch: int, buffer_len: int, ring_size: int,
                  route: str = "auto") -> ReplayConfig:
  """Output-only: the replay step, grid (V/BV, Hk, B), plus the fold pass, grid
  (V/BV · K/BK, Hv, fold_rows). Reconstruct: one launch, grid (V/BV, Hv, B), tile ``step``
  [BV, K] (the verify kernel at T = 1; the fold fields are unused)."""
  if route != "auto" and route not in ROUTES:
    raise ValueError(f"route={route!r}; expected 'auto' or one of {ROUTES}")
  route = _pick(tables.GDN_REPLAY_ROUTE) if route == "auto" else route
  device = tables.for_device(device_kind)
  step = _kernel(_pick(device.gdn_replay_step), head_k_dim).fit(head_v_dim, head_k_dim)
  if _too_few_programs(device, batch * num_k_heads * (head_v_dim // step.block_v)):
    step = step.override(block_v=max(16, step.block_v // 2))   # halve the tile for parallelism
  fold = _gdn_fold(device, head_k_dim, ring_size)
  fold_rows = _decode_fold_rows(batch, buffer_len)
  fold_tiles = _pick(device.gdn_fold_tiles, _state(state_dtype), batch=batch)
  if route == "reconstruct":
    # The conventional decode's [BV, K] tile (the kernel is that step plus a window replay into the
    # tile); the route loses to output-only with any tile, so it is taken only by name.
    step = decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                         head_v_dim=head_v_dim, batch=batch).fit(head_v_dim, head_k_dim)
  return ReplayConfig(step=step, route=route, fold=fold.fit(head_v_dim, head_k_dim),
                      fold_rows=fold_rows, fold_tiles=fold_tiles)


def flush_decode_config(*, device_kind: str, state_dtype, head_k_dim: int, head_v_dim: int,
                        ring_size: int, batch: int) -> KernelConfig:
  """Fold-and-step kernel of ``plan.flush_all`` steps, grid (V/BV, Hv, B), tile [BV, K]."""
  entry = _pick(tables.for_device(device_kind).gdn_flush_decode, _state(state_dtype), batch=batch,
                ring_size=ring_size)
  return _kernel(entry, head_k_dim).fit(head_v_dim)


def verify_implementations(*, device_kind: str, family: str, state_dtype, num_tokens: int,
                           batch: int) -> tuple[str, ...]:
  """GPU implementations that ``replay_verify(implementation=None)`` tries first, fastest first
  (the rest follow in the usual order; a kernel that cannot take the input falls through)."""
  if family not in SMALL_BATCH_FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {SMALL_BATCH_FAMILIES}")
  mosaic = _pick(tables.for_device(device_kind).verify_mosaic, (family, _state(state_dtype)),
                 tokens=num_tokens, batch=batch)
  return ("pallas_mosaic",) if mosaic else ()


DECODE_BUFFER_LEN = _pick(tables.BUFFER_LEN, "decode")
VERIFY_MAX_BUFFER_LEN = _pick(tables.BUFFER_LEN, "verify_max")


def buffer_len_for(num_tokens: int) -> int:
  """The buffer length L a cache gets when the caller leaves it to the library: ``num_tokens`` T
  tokens per verify step (1 without speculative decoding). Verify: L >= T keeps a flushed row's
  tokens inside its window; short windows win (tables.BUFFER_LEN)."""
  if num_tokens <= 1:
    return DECODE_BUFFER_LEN
  return max(num_tokens, min(2 * num_tokens, VERIFY_MAX_BUFFER_LEN))


def replay_min_batch(*, device_kind: str, state_dtype, buffer_len: int, family: str = "gdn") -> int:
  """Below this batch a model flushes every step (``cursor.plan(flush_all=True)``): replay's ring
  work costs more than the state traffic it saves, so each step is one conventional-like pass
  (the fold-and-step kernels of both families run at 0.93-1.03x of conventional decode)."""
  if family not in SMALL_BATCH_FAMILIES:
    raise ValueError(f"family={family!r}; expected one of {SMALL_BATCH_FAMILIES}")
  return _pick(tables.for_device(device_kind).replay_min_batch, (family, _state(state_dtype)),
               buffer_len=buffer_len)


def materialize_config(*, device_kind: str, head_k_dim: int, head_v_dim: int,
                       ring_size: int) -> KernelConfig:
  """Materialize runs the fold kernel body on every row (f32 output): the fold pass's tile."""
  tile = _gdn_fold(tables.for_device(device_kind), head_k_dim, ring_size)
  return tile.fit(head_v_dim, head_k_dim)


# ----------------------------------------------------------------------------------------------
# Mamba2 (replayssm_jax/pallas/mamba2_triton.py). State [P, N] per head; programs cover a
# [block_p, N] state tile of ``heads`` heads of one group.


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


def _mamba2(entry: dict, head_dim: int, state_dim: int) -> Mamba2Config:
  """A Mamba2Config from a table entry over a [P, N] head (sizes resolved, not clipped)."""
  return Mamba2Config(**{k: _size(v, state_dim if k == "block_n" else head_dim)
                         for k, v in entry.items()})


def _mamba2_fold(device: tables.DeviceTables, head_dim: int, state_dim: int,
                 ring_size: int) -> KernelConfig:
  """The flush-fold tile for a [P, N] head, its rows a power of two dividing P (table entry None:
  GDN's fold tile for a [V, K] head, the same kernel and window product)."""
  entry = _pick(device.mamba2_fold, ring_size=ring_size)
  tile = _gdn_fold(device, state_dim, ring_size) if entry is None else _kernel(entry, state_dim)
  return tile.fit(_pow2_part(head_dim), state_dim)


def mamba2_decode_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         batch: int) -> Mamba2Config:
  """Conventional Mamba2 decode, grid (P/BP, H, B), state tile [BP, N]."""
  entry = _pick(tables.for_device(device_kind).mamba2_decode, _state(state_dtype), batch=batch)
  return _mamba2(entry, head_dim, state_dim).fit(head_dim, state_dim)


def mamba2_replay_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         num_heads: int, num_groups: int, batch: int, buffer_len: int,
                         ring_size: int, route: str = "auto") -> Mamba2ReplayConfig:
  """Replay step, grid (P/BP, H/heads, B), and for the output-only route the fold pass, grid
  (P/BP · N/BN, H, fold_rows); ``route`` "auto" picks the route."""
  device = tables.for_device(device_kind)
  if route == "auto":
    route = _pick(device.mamba2_replay_route, _state(state_dtype), buffer_len=buffer_len,
                  batch=batch)
  step = _pick(device.mamba2_replay_step,
               "output_only" if route == "output_only" else "reconstruct")
  cfg = _mamba2(step, head_dim, state_dim).fit(head_dim, state_dim, num_heads // num_groups)
  if _too_few_programs(device, batch * (num_heads // cfg.heads) * (head_dim // cfg.block_p)):
    cfg = cfg.override(heads=1)
  if route == "reconstruct":
    return Mamba2ReplayConfig(step=cfg, route=route)
  # Output-only: a separate fold pass over the flushing rows, as GDN (a fold branch inside the step
  # kernel costs every program occupancy).
  return Mamba2ReplayConfig(step=cfg, route=route,
                            fold=_mamba2_fold(device, head_dim, state_dim, ring_size),
                            fold_rows=_decode_fold_rows(batch, buffer_len),
                            fold_tiles=_pick(device.mamba2_fold_tiles, ring_size=ring_size,
                                             batch=batch))


def mamba2_flush_decode_config(*, device_kind: str, state_dtype, head_dim: int,
                               state_dim: int, batch: int) -> Mamba2Config:
  """Fold-and-step kernel of ``plan.flush_all`` steps, grid (P/BP, H, B), tile [BP, N]: the
  conventional decode's tile (the steady state is that pass); block_n is the chunk of the
  (rarely taken) window-rebuild branch."""
  cfg = mamba2_decode_config(device_kind=device_kind, state_dtype=state_dtype, head_dim=head_dim,
                             state_dim=state_dim, batch=batch)
  block_n = _size(_pick(tables.for_device(device_kind).mamba2_flush_block_n), state_dim)
  return cfg.override(block_n=block_n).fit(head_dim, state_dim)


def mamba2_materialize_config(*, device_kind: str, head_dim: int, state_dim: int) -> Mamba2Config:
  """Materialize rebuilds every row's state, grid (P/BP, H, B) (not on the decode hot path)."""
  entry = _pick(tables.for_device(device_kind).mamba2_materialize)
  return _mamba2(entry, head_dim, state_dim).fit(head_dim, state_dim)


# ----------------------------------------------------------------------------------------------
# GDN speculative verify (replayssm_jax/pallas/gdn_verify_triton.py).


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
  ``route`` None: the device's verify route (reconstruct on GPUs, output-only in interpret mode)."""
  base = replay_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, num_k_heads=num_k_heads, batch=batch,
                       buffer_len=buffer_len, ring_size=ring_size)
  device = tables.for_device(device_kind)
  if route is None:
    route = _pick(device.verify_route)
  # The readout launch of the split route is shaped like the conventional decode (one [BV, K]
  # checkpoint tile per program, reductions only): the decode's tile. Split (1.35 ms at B=256 T=4)
  # and fused (1.44) both lose to reconstruct (0.55); fused stays the output-only default.
  readout = decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                          head_v_dim=head_v_dim, batch=batch)
  if route == "reconstruct":
    entry = _pick(device.gdn_verify_reconstruct)
    step = readout if entry is None else KernelConfig(**entry)
  else:
    entry = _pick(device.gdn_verify_output_only, tokens=num_tokens)
    step = base.step if entry is None else _kernel(entry, head_k_dim).fit(head_v_dim,
                                                                                      head_k_dim)
  return VerifyConfig(step=step, readout=readout, split=False, fold=base.fold,
                      fold_rows=_verify_fold_rows(batch, buffer_len, num_tokens), route=route)


def _decode_fold_rows(batch: int, buffer_len: int) -> int:
  """Row slots of the decode's fold pass. Rows at staggered phases flush about B/L per step: that
  many row slots (tables.FOLD_ROW_SLOTS) gives one row per fold program in steady state, and rows
  beyond (synchronised flushes) loop, never drop."""
  slots = _pick(tables.FOLD_ROW_SLOTS, "decode") * -(-batch // buffer_len)
  return min(batch, _next_pow2(slots))


def _verify_fold_rows(batch: int, buffer_len: int, num_tokens: int) -> int:
  """Row slots of the verify's fold pass. A row's window grows by (T + 1) / 2 tokens per step on
  average (random accepts) and flushes once it exceeds L - 1 - T: about B (T + 1) / (2 (L - T))
  flushing rows per step; twice that many row slots (tables.FOLD_ROW_SLOTS) keeps one row per fold
  program, and rows beyond loop, never drop."""
  flushing = -(-batch * (num_tokens + 1) // (2 * max(buffer_len - num_tokens, 1)))
  return min(batch, _next_pow2(_pick(tables.FOLD_ROW_SLOTS, "verify") * flushing))


def verify_conventional_config(*, device_kind: str, state_dtype, head_k_dim: int,
                               head_v_dim: int, batch: int) -> KernelConfig:
  """Conventional verify, grid (V/BV, Hv, B): one [BV, K] state tile stepped T times in registers."""
  # *untuned*: the conventional decode's tiles; the tile is read once and written T times, so the
  # decode's bandwidth-bound optimum is the best prior.
  return decode_config(device_kind=device_kind, state_dtype=state_dtype, head_k_dim=head_k_dim,
                       head_v_dim=head_v_dim, batch=batch)


# ----------------------------------------------------------------------------------------------
# Mamba2 speculative verify (replayssm_jax/pallas/mamba2_verify_triton.py).


def mamba2_verify_config(*, device_kind: str, state_dtype, head_dim: int, state_dim: int,
                         num_heads: int, num_groups: int, batch: int, buffer_len: int,
                         ring_size: int, num_tokens: int,
                         route: str | None = None) -> Mamba2ReplayConfig:
  """Verify, T tokens per row. Route ``output_only``: the step kernel, grid (P/BP, H/heads, B), then
  the fold pass over the flushing rows; ``reconstruct``: one launch, grid (P/BP, H, B), the window
  replayed into the [BP, N] tile. ``route`` None: the device's verify route (reconstruct on GPUs,
  output-only in interpret mode)."""
  device = tables.for_device(device_kind)
  if route is None:
    route = _pick(device.verify_route)
  if route not in ROUTES:
    raise ValueError(f"route={route!r}; expected None or one of {ROUTES}")
  if route == "reconstruct":
    step = mamba2_decode_config(device_kind=device_kind, state_dtype=state_dtype,
                                head_dim=head_dim, state_dim=state_dim, batch=batch)
    entry = _pick(device.mamba2_verify_reconstruct)
    if entry is not None:
      step = _mamba2(entry, head_dim, state_dim).fit(head_dim, state_dim)
    return Mamba2ReplayConfig(step=step, route=route)
  entry = _pick(device.mamba2_verify_output_only, tokens=num_tokens)
  cfg = _mamba2(entry, head_dim, state_dim).fit(head_dim, state_dim, num_heads // num_groups)
  if _too_few_programs(device, batch * (num_heads // cfg.heads) * (head_dim // cfg.block_p)):
    cfg = cfg.override(heads=1)
  return Mamba2ReplayConfig(step=cfg, route=route,
                            fold=_mamba2_fold(device, head_dim, state_dim, ring_size),
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
# Mosaic GPU (replayssm_jax/pallas/gdn_mosaic.py, mamba2_mosaic.py). One warpgroup per program.


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


def _mosaic(device_kind: str, tile_rows: int) -> MosaicConfig:
  """The device's Mosaic tile, clipped to a head of ``tile_rows`` state-tile rows."""
  entry = _pick(tables.for_device(device_kind).mosaic)
  return MosaicConfig(block_v=min(entry["block_v"], tile_rows), rows=entry["rows"])


def mosaic_decode_config(*, device_kind: str, state_dtype, head_v_dim: int) -> MosaicConfig:
  """Conventional decode, grid (V/BV, Hv, B / rows)."""
  del state_dtype
  return _mosaic(device_kind, head_v_dim)


def mosaic_replay_config(*, device_kind: str, state_dtype, head_v_dim: int, num_k_heads: int,
                         group: int, batch: int) -> MosaicConfig:
  """Replay step with fused flush fold, grid (V/BV, Hk, B / rows); r = ``group`` checkpoint tiles
  in SMEM per row in flight."""
  del state_dtype, num_k_heads, batch, group
  return _mosaic(device_kind, head_v_dim)


def mosaic_mamba2_decode_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Conventional Mamba2 decode, grid (P/BP, H, B / rows); ``block_v`` holds BP."""
  return _mosaic(device_kind, head_dim)


def mosaic_mamba2_replay_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Mamba2 replay step (reconstruct route, flush fused), grid (P/BP, H, B / rows); ``block_v``
  holds BP. The decode's tile: the staged ring (R·(N + BP) entries) fits beside an f32 [64, 128]
  tile for R ≤ 128 within the SMEM budget."""
  return mosaic_mamba2_decode_config(device_kind=device_kind, head_dim=head_dim)


def mosaic_verify_config(*, device_kind: str, head_v_dim: int, batch: int,
                         num_tokens: int) -> MosaicConfig:
  """Verify (reconstruct route), grid (V/BV, Hv, B / rows): one checkpoint tile, the row's ring and
  its T tokens in SMEM per row in flight. The replay tile, the smallest that lowers (Mosaic's
  WGMMA layout cannot go below 64 rows); rows per program by tokens and batch."""
  cfg = mosaic_replay_config(device_kind=device_kind, state_dtype=jnp.float32,
                             head_v_dim=head_v_dim, num_k_heads=1, group=1, batch=batch)
  rows = _pick(tables.for_device(device_kind).gdn_verify_mosaic_rows, batch=batch,
               tokens=num_tokens)
  return dataclasses.replace(cfg, rows=rows)


def mosaic_mamba2_verify_config(*, device_kind: str, head_dim: int) -> MosaicConfig:
  """Mamba2 verify (reconstruct route), grid (P/BP, H, B / rows); ``block_v`` holds BP: the replay
  kernel's tile and rows per program (the same program, stepping T tokens)."""
  return mosaic_mamba2_replay_config(device_kind=device_kind, head_dim=head_dim)


def mosaic_materialize_config(*, device_kind: str, head_v_dim: int) -> MosaicConfig:
  """Materialize, grid (V/BV, Hv, B), f32 output tile staged in SMEM: the replay tile (same fold
  body; not on the decode hot path), one row per program (the kernel has no row loop)."""
  tile = mosaic_replay_config(device_kind=device_kind, state_dtype=jnp.float32,
                              head_v_dim=head_v_dim, num_k_heads=1, group=1, batch=1)
  return dataclasses.replace(tile, rows=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig:
  """Decode-attention launch (pallas/attention_triton.py): K/V blocks of ``block_kv`` tokens, a
  row's blocks split over ``num_splits`` programs, warps, software-pipeline stages."""
  block_kv: int
  num_splits: int
  num_warps: int
  num_stages: int


def attention_decode_config(*, device_kind: str, head_dim: int, batch: int, num_kv_heads: int,
                            seq_len: int) -> AttentionConfig:
  """The device's block for ``head_dim``, and splits doubled while the (B, Hkv, splits) grid has
  fewer programs than the table's target and every split keeps at least 8 blocks of S."""
  entry = _pick(tables.for_device(device_kind).attention_decode, head_dim=head_dim)
  block, splits = entry["block_kv"], 1
  while batch * num_kv_heads * splits < entry["min_programs"] and seq_len >= 2 * splits * 8 * block:
    splits *= 2
  return AttentionConfig(block_kv=block, num_splits=splits, num_warps=entry["num_warps"],
                         num_stages=entry["num_stages"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvStepConfig:
  """Conv decode-step launch (pallas/conv_triton.py): ``block_c`` channels per program (a power of
  two dividing C), warps."""
  block_c: int
  num_warps: int


def conv_step_config(*, channels: int) -> ConvStepConfig:
  """The largest power-of-two block dividing C, up to 1024 channels; one warp per 256 channels
  (a bandwidth-bound elementwise pass; not swept)."""
  block = min(_pow2_part(channels), 1024)
  return ConvStepConfig(block_c=block, num_warps=max(1, min(8, block // 256)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedMatmulConfig:
  """MoE grouped-matmul launch (pallas/moe_triton.py): [block_m, block_n] output tiles, K walked in
  blocks of block_k (all powers of two ≥ 16: Triton's smallest dot), warps, pipeline stages."""
  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if not _pow2(value) or value < 16:
        raise ValueError(f"{name}={value!r}; expected a power of two >= 16 (Triton's smallest dot)")
    if not _pow2(self.num_warps) or self.num_warps > 32:
      raise ValueError(f"num_warps={self.num_warps!r}; expected a power of two <= 32")
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages!r}; expected an int >= 1")

  def override(self, **knobs) -> "GroupedMatmulConfig":
    return dataclasses.replace(self, **{k: v for k, v in knobs.items() if v is not None})

  def fit(self, k: int, n: int) -> "GroupedMatmulConfig":
    """Column and K blocks that divide N and K (both multiples of 16): the largest power of two
    dividing each, capped by the config's."""
    return dataclasses.replace(self, block_n=min(self.block_n, _pow2_part(n)),
                               block_k=min(self.block_k, _pow2_part(k)))


def grouped_matmul_config(*, device_kind: str, rows: int) -> GroupedMatmulConfig:
  """The device's grouped-matmul tile for ``rows`` (T·k token-expert pairs)."""
  return GroupedMatmulConfig(**_pick(tables.for_device(device_kind).grouped_matmul, rows=rows))
