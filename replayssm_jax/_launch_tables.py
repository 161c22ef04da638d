"""Launch choices per device kind, as data: the tables replayssm_jax/config.py picks from.

A ``Table`` maps a key (``"f32"`` / ``"bf16"`` state, a family, a route; ``"*"`` when there is one
entry) to a *ladder*: ``(when, value)`` rules, the first whose ``when`` holds wins. ``when`` bounds
named inputs (batch, tokens, buffer_len, ring_size) by inclusive ``(lo, hi)`` ranges, None open;
the last rule of every ladder has no condition. Tile values are keyword arguments of the config
dataclasses. ``"bf16"`` stands for every state dtype but float32 (bf16 and f16: the same bytes
and kernels; f16 is not measured separately).

``source`` cites what set the values: bench/results/ files (each JSON records its command, date,
device, JAX version and commit; all H200 files ran JAX 0.11.2), or a dated command where no file
holds the run, or *untuned* with the prior the value came from. tests/test_launch_tables.py checks
every table against its rule and that each cited file exists.
"""
import dataclasses

HALF = "half"            # interpret mode: n // 2 (at least 1), two tiles of a head
HALF_POW2 = "half_pow2"  # interpret mode: half of n rounded up to a power of two
ANY = "*"


@dataclasses.dataclass(frozen=True)
class Table:
  rows: dict
  source: tuple[str, ...]


def always(value) -> tuple:
  """The one-rule ladder."""
  return (({}, value),)


def _tile(block_v, num_warps, block_k=None):
  return {"block_v": block_v, "num_warps": num_warps, "block_k": block_k}


def _m2(block_p, num_warps, block_n=None, heads=1):
  return {"block_p": block_p, "num_warps": num_warps, "block_n": block_n, "heads": heads}


SMALL_BATCH = {"batch": (None, 32)}   # config.SMALL_TILE_MAX_BATCH


def _attention(block_kv, num_warps=4, num_stages=2, min_programs=256):
  """A row's K/V blocks of ``block_kv`` tokens; its blocks split over programs while the
  (B, Hkv) grid has fewer than ``min_programs``."""
  return {"block_kv": block_kv, "num_warps": num_warps, "num_stages": num_stages,
          "min_programs": min_programs}


def _grouped(block_m, block_n, block_k, num_warps, num_stages):
  return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": num_warps,
          "num_stages": num_stages}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceTables:
  """Every launch table of one device kind. ``num_sms``: None turns off the rule that shrinks a
  program's work when the grid would give an SM fewer than two programs."""
  kind: str
  num_sms: int | None
  gdn_decode: Table                # GDN conventional decode [BV, K] tile; by state, batch
  gdn_flush_decode: Table          # GDN fold-and-step (flush_all); by state, batch, ring_size
  gdn_replay_step: Table           # GDN output-only replay step [BV, BK] tile
  gdn_fold: Table                  # GDN fold pass [BV, BK] tile (and materialize); by ring_size
  gdn_fold_tiles: Table            # GDN fold tiles per program; by state, batch
  verify_route: Table              # route of replay_verify(route=None), both families
  gdn_verify_reconstruct: Table    # GDN verify reconstruct tile; None: the decode tile
  gdn_verify_output_only: Table    # GDN verify output-only step; by tokens; None: the replay step
  verify_mosaic: Table             # Mosaic first for replay_verify(None)? by (family, state)
  replay_min_batch: Table          # flush every step below this batch; by (family, state)
  mamba2_decode: Table             # Mamba2 conventional decode [BP, N] tile; by state, batch
  mamba2_flush_block_n: Table      # N chunk of the Mamba2 fold-and-step rebuild branch
  mamba2_replay_route: Table       # Mamba2 replay route "auto"; by state, buffer_len, batch
  mamba2_replay_step: Table        # Mamba2 replay step tile; by route
  mamba2_fold: Table               # Mamba2 fold tile by ring_size; None: GDN's fold tile
  mamba2_fold_tiles: Table         # Mamba2 fold tiles per program; by ring_size, batch
  mamba2_verify_reconstruct: Table  # Mamba2 verify reconstruct tile; None: the decode tile
  mamba2_verify_output_only: Table  # Mamba2 verify output-only step; by tokens
  mamba2_materialize: Table        # Mamba2 materialize tile
  mosaic: Table                    # Mosaic GPU kernels: state-tile rows, batch rows per program
  gdn_verify_mosaic_rows: Table    # GDN Mosaic verify: batch rows per program; by tokens, batch
  attention_decode: Table          # decode attention: K/V block, warps, stages, split target; by head_dim
  grouped_matmul: Table            # MoE grouped matmul tile; by rows (token-expert pairs)


H200 = DeviceTables(
    kind="NVIDIA H200",
    num_sms=132,
    # f32 B ≤ 32: [8, K]/1 0.0032 / 0.0106 / 0.0374 ms at B = 1 / 8 / 32 vs [16, K]/2 0.0037 /
    # 0.0112 / 0.0379. f32 B = 256: [16, K]/2 0.2828 ms, [8, K]/1 0.2824, others ≥ 0.2840.
    # bf16 B = 256: [32, K]/4 0.162 ms, [32, K]/2 0.165, [64, K]/4 0.168; B ≤ 32: [32, K]/4 and
    # [16, K]/2 equal, [8, K]/1 slower (0.0031 / 0.0077 / 0.0213).
    gdn_decode=Table({
        "f32": ((SMALL_BATCH, _tile(8, 1)), ({}, _tile(16, 2))),
        "bf16": always(_tile(32, 4)),
    }, source=("gdn_decode_2026-11-30_small_batch_tiles.json",
               "gdn_decode_2026-11-30_conv_tiles_b256.json",
               "git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s2_fold_in_step_a.json")),
    # The kernel's registers are set by its fold branch (an IEEE dot over R ring entries), which
    # steady-state steps never run: the smallest tile keeps the empty-window branch at the
    # conventional decode's speed. f32 L = 16: [8, K]/1 0.97-0.98x of conventional at B = 8-128,
    # [16, K]/2 0.89-0.91x; bf16 B = 128: the decode tile [32, K]/4 0.99x, [8, K]/1 0.94x; bf16
    # B ≤ 32: [8, K]/1 0.0027 / 0.0072 / 0.0218 ms against 0.0029 / 0.0077 / 0.0217. R ≥ 32:
    # [8, K]/1 (f32 L = 32, B = 8: 1.01x of conventional).
    gdn_flush_decode=Table({
        "f32": always(_tile(8, 1)),
        "bf16": ((SMALL_BATCH, _tile(8, 1)), ({"ring_size": (32, None)}, _tile(8, 1)),
                 ({}, _tile(32, 4))),
    }, source=("git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s4_flushall_tiles.json",
               "git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s4_flushall_default.json",
               "gdn_decode_2026-11-30_small_batch_tiles.json")),
    # B = 256, L = 16: [64, 64] in 2 warps (K walked in two chunks) 0.226 ms f32, against
    # 0.238-0.283 for BV 16-64 with 1-4 warps and whole K.
    gdn_replay_step=Table({ANY: always(_tile(64, 2, 64))},
                          source=("git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s2_step_tiles.json",
                                  "git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s2_fold_in_step_a.json")),
    # R ≥ 32: the fold's window dot holds R-long operand rows per thread; [32, 64]/2 spills
    # (2.83 ms for 62 flushing rows, 7 GB of local loads), [16, 64]/4 0.184 ms (63 registers).
    # R = 16, B = 256: [32, 64]/2 (f32 0.2191, bf16 0.1438 ms per layer-step), [16-64, 64-128]
    # with 1-4 warps within 2 %.
    gdn_fold=Table({ANY: (({"ring_size": (32, None)}, _tile(16, 4, 64)), ({}, _tile(32, 2, 64)))},
                   source=("git show 60b2ea2:bench/results/verify_parts_2026-11-29_T4.log", "git show 60b2ea2:bench/results/ncu_gdn_verify_fold_2026-11-29.log",
                           "git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s2_P8.json")),
    # L = 16. B = 256, 1 / 2 / 4 / 8 tiles: f32 0.1861 / 0.1842 / 0.1895 / 0.1844 ms, bf16
    # 0.1205 / 0.1200 / 0.1166 / 0.1210. Fewer flushing rows leave too few programs to share out:
    # B = 128 f32 1 / 2 tiles 0.0997 / 0.0985, bf16 1 / 4 0.0656 / 0.0655; B = 32 f32 0.0308 /
    # 0.0318, bf16 0.0204 / 0.0240.
    gdn_fold_tiles=Table({
        "f32": (({"batch": (128, None)}, 2), ({}, 1)),
        "bf16": (({"batch": (256, None)}, 4), ({}, 1)),
    }, source=("git show 60b2ea2:bench/results/gdn_decode_2026-11-30_s11_fold_tiles1.json",
               "git show 60b2ea2:bench/results/gdn_decode_2026-11-30_s11_fold_tiles2.json",
               "git show 60b2ea2:bench/results/gdn_decode_2026-11-30_s11_fold_tiles4.json",
               "git show 60b2ea2:bench/results/gdn_decode_2026-11-30_s11_fold_tiles8.json",
               "gdn_decode_2026-11-30_fold_tiles_b32_b128.json")),
    # B = 256, L = 16, f32, x the conventional speculative verify: reconstruct [8, ·]/1 GDN 1.33x
    # (T = 4) / 1.49x (T = 8), Mamba2 1.41x / 1.82x; output-only GDN 0.52x / 0.09x, Mamba2 0.71x /
    # 0.55x.
    verify_route=Table({ANY: always("reconstruct")},
                       source=("git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s5_routes.json",
                               "git show 60b2ea2:bench/results/verify_mamba2_2026-11-29_s5_routes.json")),
    # Same runs: [8, K]/1 0.552 / 0.912 ms (T = 4 / 8) vs [16, K]/2 0.722 / 1.042 and [32, K]/4
    # 0.752 / 1.124: the window loop and the T steps are latency-bound, more smaller programs win.
    gdn_verify_reconstruct=Table({ANY: always({"block_v": 8, "num_warps": 1})},
                                 source=("git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s5_routes.json",)),
    # T ≤ 4 (B = 256, T = 4, L = 16, step kernel alone): [32, 64]/4 1.26 ms, /2 1.30, [16, 64]
    # 1.64 (4 warps) / 1.93 (2), [16, 128] 1.61, [32, 32] 1.70. T = 5..8: *untuned*, half the
    # rows for the doubled live vectors.
    gdn_verify_output_only=Table({ANY: (({"tokens": (None, 4)}, _tile(32, 4, 64)),
                                        ({}, _tile(16, 4, 64)))},
                                 source=("git show 60b2ea2:bench/results/verify_parts_2026-11-29_T4.log",)),
    # Mosaic vs Triton reconstruct, L = 8, f32, ms per layer-step. GDN T = 2: a tie from B = 8
    # (0.0145 vs 0.0141 at B = 8, 0.2933 vs 0.2909 at 256), Mosaic at B = 1 (0.0049 vs 0.0057);
    # T = 4: 0.0072 vs 0.0077 (B = 1) ... 0.4071 vs 0.4770 (256); T = 8 Mosaic everywhere.
    # GDN bf16, B = 256: T = 4 0.3886 vs 0.4270 (measured there only). Mamba2 f32: Mosaic at every
    # B (T = 4, B = 256 0.638 vs 0.873); bf16 unmeasured. Model step (one verify + commit of the
    # whole stack): Mosaic 1.12-1.22x (GDN), 1.04-1.10x (Mamba2) at B = 32 / 256.
    verify_mosaic=Table({
        ("gdn", "f32"): (({"tokens": (4, None)}, True), ({"batch": (None, 7)}, True), ({}, False)),
        ("gdn", "bf16"): (({"tokens": (4, None), "batch": (256, None)}, True), ({}, False)),
        ("mamba2", "f32"): always(True),
        ("mamba2", "bf16"): always(False),
    }, source=("git show 60b2ea2:bench/results/verify_gdn_2026-11-30_s8_mosaic.json",
               "git show 60b2ea2:bench/results/verify_gdn_2026-11-30_s8_mosaic_b32_128.json",
               "git show 60b2ea2:bench/results/verify_gdn_2026-11-30_s8_mosaic_bf16.json",
               "git show 60b2ea2:bench/results/verify_2026-11-30_s8_staged_tokens.log",
               "git show 60b2ea2:bench/results/verify_mamba2_2026-11-30_s8_mosaic.json",
               "verify_gdn_2026-11-30_B1_B8.json",
               "verify_mamba2_2026-11-30_B1_B8.json",
               "model_spec_gdn_2026-11-30.json",
               "model_spec_mamba2_2026-11-30.json",
               "git show 60b2ea2:bench/results/model_spec_2026-11-30_s11_b1_b8.json")),
    # Per layer-step vs the conventional kernel, bf16 ring. GDN, L = 16 (measured there only):
    # f32 replay 0.34x / 0.78x / 1.23x / 1.43x at B = 1 / 8 / 32 / 128, flush-every-step 1.13x /
    # 1.00x / 0.98x / 0.97x; bf16 replay 0.34x / 0.53x / 1.02x / 1.14x. Mamba2 f32, L ≤ 8: replay
    # 0.76x / 0.98x / 1.09x / 1.17x at B = 1 / 8 / 32 / 128; L = 16 with the [64, N] step tile
    # 1.30x / 1.47x at B = 32 / 128 (it lost up to B = 128 with [32, N] tiles). Mamba2 bf16 with
    # the [64, N] tile: L = 16 replay 1.19x / 1.21x / 1.29x at B = 32 / 64 / 128, flush-every-step
    # 0.99-1.00x; L = 8 0.97x at B = 32 (1.05x at 128 with [32, N] tiles); L = 4 0.99x at 128, 1.06x
    # at 256. L = 9-15 keep L = 8's threshold (unmeasured). Flush-every-step runs at 0.93-1.03x
    # everywhere.
    replay_min_batch=Table({
        ("gdn", "f32"): always(32),
        ("gdn", "bf16"): always(32),
        ("mamba2", "f32"): always(32),
        ("mamba2", "bf16"): (({"buffer_len": (None, 7)}, 256), ({"buffer_len": (None, 15)}, 128),
                             ({}, 32)),
    }, source=("gdn_decode_2026-11-30_batches.json",
               "mamba2_decode_2026-12-03_step_tiles_L8_L16.log",
               "mamba2_decode_2026-12-03_bf16_small_batch_L16.json",
               "mamba2_decode_2026-12-03_defaults_L8_L16.json",
               "gdn_decode_2026-11-30_small_batch_defaults.json",
               "git show 60b2ea2:bench/results/mamba2_decode_2026-11-29_s4_matrix_f32.log",
               "git show 60b2ea2:bench/results/mamba2_decode_2026-11-29_s7_bf16_matrix.json",
               "mamba2_decode_2026-11-30_batches.json",
               "mamba2_decode_2026-11-30_small_batch_defaults.json")),
    # B ≤ 32: f32 [16, N]/1 0.0045 / 0.0197 / 0.0725 ms at B = 1 / 8 / 32 vs [16, N]/2 0.0047 /
    # 0.0201 / 0.0732; bf16 [8, N]/1 0.0033 / 0.0120 / 0.0399 vs [32, N]/4 0.0036 / 0.0124 /
    # 0.0405. Above: *untuned*, GDN's B = 256 tiles.
    mamba2_decode=Table({
        "f32": ((SMALL_BATCH, _m2(16, 1)), ({}, _m2(16, 2))),
        "bf16": ((SMALL_BATCH, _m2(8, 1)), ({}, _m2(32, 4))),
    }, source=("mamba2_decode_2026-11-30_small_batch_tiles.json",
               "untuned above B = 32: GDN's conventional decode tiles")),
    # *untuned*: the rebuild walks N in chunks of 32 as the replay step's fold does.
    mamba2_flush_block_n=Table({ANY: always(32)}, source=("untuned: the replay step's N chunk",)),
    # f32, bf16 ring, x conventional: reconstruct 1.20x / 1.09x at B = 32, L = 4 / 8 (output-only
    # 0.84x / 0.80x), 1.32x / 1.17x at 128 (1.09x / 1.17x); at L = 16 output-only wins everywhere
    # (B = 256: 1.17x vs 0.40x), and at B = 1. bf16: output-only wins at every B ≥ 128 and L.
    mamba2_replay_route=Table({
        "f32": (({"buffer_len": (None, 4), "batch": (8, None)}, "reconstruct"),
                ({"buffer_len": (None, 8), "batch": (8, 128)}, "reconstruct"),
                ({}, "output_only")),
        "bf16": always("output_only"),
    }, source=("git show 60b2ea2:bench/results/mamba2_decode_2026-11-29_s4_matrix_f32.log",
               "git show 60b2ea2:bench/results/mamba2_decode_2026-11-29_s7_bf16_matrix.json")),
    # Output-only: a head's whole [64, 128] checkpoint per program in 2 warps, 4 heads per program
    # share B_j·C. B = 256, f32: L = 16 0.3578 ms against 0.3987 for [32, 128] tiles (the window's
    # B_j·C, computed per program, is then computed once per head); L = 8 0.4213 against 0.4250.
    # Reconstruct one head per program (nothing shared), *untuned*.
    mamba2_replay_step=Table({
        "output_only": always(_m2(64, 2, 32, heads=4)),
        "reconstruct": always(_m2(32, 2, 32, heads=1)),
    }, source=("mamba2_decode_2026-12-03_step_fold_tiles.json",
               "mamba2_decode_2026-12-03_L16_tiles.json",
               "untuned (reconstruct): GDN's replay-step tile size")),
    # R < 16 (unrolled rank-one FMAs), B = 256, L = 8, f32: [64, 64]/4 0.4436 ms, [32, 128]/4
    # 0.4465, GDN's [32, 64]/2 0.4522, [16, 64]/4 0.4896. R ≥ 16: GDN's fold tile (*untuned* here).
    mamba2_fold=Table({ANY: (({"ring_size": (None, 15)}, _tile(64, 4, 64)), ({}, None))},
                      source=("git show 60b2ea2:bench/results/mamba2_decode_2026-11-29_s6_fold_sweep.json",)),
    # B = 256, 1 / 2 / 4 tiles: R = 8 f32 0.4268 / 0.4444 / 0.4466 ms, bf16 0.2554 / 0.2593 /
    # 0.2597; R = 16 f32 0.4060 / 0.4045 / 0.3997, bf16 0.2586 / 0.2569 / 0.2537. Smaller batches
    # unmeasured (GDN's fold lost with more tiles there): one.
    mamba2_fold_tiles=Table({ANY: (({"ring_size": (16, None), "batch": (256, None)}, 4), ({}, 1))},
                            source=("mamba2_decode_2026-11-30_fold_tiles.json",
                                    "git show 60b2ea2:bench/results/mamba2_decode_2026-11-30_s12_fold_tiles_default.json")),
    # B = 256, L = 16: [8, N]/1 1.026 / 1.490 ms (T = 4 / 8) vs the decode's [16, N]/2 1.119 /
    # 1.892.
    mamba2_verify_reconstruct=Table({ANY: always(_m2(8, 1))},
                                    source=("git show 60b2ea2:bench/results/verify_mamba2_2026-11-29_s5_routes.json",)),
    # *untuned*: T ≤ 4 the output-only replay step's tile; T = 5..8 keeps T Δx vectors and T window
    # products live per head: 2 heads per program.
    mamba2_verify_output_only=Table({ANY: (({"tokens": (None, 4)}, _m2(32, 2, 32, heads=4)),
                                           ({}, _m2(32, 2, 32, heads=2)))},
                                    source=("untuned: the output-only replay step's tile",)),
    mamba2_materialize=Table({ANY: always(_m2(32, 2, 32))},
                             source=("untuned: the replay step's rebuild chunk",)),
    # 64 rows: the smallest WGMMA tile that lowers; r = 2 f32 [64, 128] tiles and a 16-entry ring
    # stay under 100 KiB of SMEM. Batch rows per program, B = 256, rows 1 / 2 / 4, ms: GDN replay
    # L = 16 f32 0.197 / 0.295 / 0.293, bf16 0.185 / 0.183 / 0.183; Mamba2 replay (reconstruct)
    # L = 8 f32 0.388 / 0.447 / 0.417; GDN verify T = 4 L = 8 f32 0.388 / 0.373 / 0.366; Mamba2
    # verify 0.615 / 0.744 / 0.738; GDN conventional f32 0.290 / 0.289 / 0.290, bf16 0.186 / 0.173
    # / 0.161 (Triton's 0.285 / 0.1495). One row everywhere: only GDN verify gains (5.7 % at
    # rows = 4, B = 256 only; smaller batches unmeasured), and the conventional Mosaic decode
    # stays behind Triton's with any rows.
    mosaic=Table({ANY: always({"block_v": 64, "rows": 1})}, source=(
        "H200 2026-12-01, JAX 0.11.2, commit 60b2ea2: python -m bench.gdn_decode --arms "
        "conv-pallas,conv-mosaic,replay-pallas-oo,replay-mosaic --configs default,r2,r4 "
        "--batches 256 --buffer-lens 16 --state-dtypes float32,bfloat16; python -m "
        "bench.mamba2_decode --arms conv-pallas,replay-pallas-oo,replay-mosaic-rc --configs "
        "default,r2,r4 --batches 256 --buffer-lens 8 --state-dtypes float32; python -m "
        "bench.verify_decode --family {gdn,mamba2} --tokens 4 --batches 256 --buffer-len 8 "
        "--state-dtypes float32 --arms replay-mosaic,conv-pallas --variants ,rows=2,rows=4",)),
    # GDN verify, f32, L = 8, rows 1 / 4, ms. H200 T = 4 B = 256 0.388 / 0.366. H100 T = 4 B = 8
    # 0.0202 / 0.0236 (rows 2 0.0196), B = 32 0.0584 / 0.0586, B = 64 0.1073 / 0.1057, B = 128
    # 0.2061 / 0.1987, B = 256 0.4016 / 0.3872; T = 2 B = 32 0.0437 / 0.0443, B = 256 0.3009 /
    # 0.2786; T = 8 B = 32 0.0886 / 0.2548, B = 256 0.6305 / 2.0420 (four rows' T staged tokens
    # crowd SMEM). Four rows from B = 128 at T <= 4; one elsewhere.
    gdn_verify_mosaic_rows=Table(
        {ANY: (({"tokens": (None, 4), "batch": (128, None)}, 4), ({}, 1))},
        source=("verify_gdn_2026-12-01_mosaic_rows.json",
                "verify_gdn_2026-12-06_h100_rows_routes_read_copy.json",
                "verify_gdn_2026-12-06_h100_T4_rows_batches.log",
                "verify_gdn_2026-12-06_h100_T2_T8_rows.json")),
    # Qwen3.5-4B layer (Dh 256), 1k context, ms: B = 256 block 32 / 4 warps / 2 stages 0.2953,
    # block 64 0.3058, 8 warps 0.3133-0.3524; B = 32 block 32 0.0455, block 64 0.0450, one split
    # instead of several 0.0605. Dh <= 128 (Nemotron-H): *untuned*, the same bytes per block.
    attention_decode=Table({ANY: (({"head_dim": (129, None)}, _attention(32)), ({}, _attention(64)))},
                           source=("attention_decode_2026-12-02_configs.json",
                                   "untuned (head_dim <= 128): twice the Dh = 256 block")),
    # Qwen3-Next MoE layer (D 2048, 512 experts of I 512, top-10), ms per step, [BM, BN, BK]/warps:
    # B = 256 [16, 64, 64]/4 1.094, [16, 128, 64]/4 1.037, [16, 64, 128]/4 1.135, [16, 128, 128]/8
    # 1.104; B = 32 0.626 / 0.657 / 0.611 / 0.635; B = 1 0.268 / 0.315 / 0.283 / 0.248 (XLA's
    # ragged_dot 12.91 / 1.79 / 0.82). No tile leads at every batch by more than 5 %: the first.
    # Prefill, B = 1024 tokens (10240 rows): [16, 64, 64]/4 1.367, [32, 128, 64]/4 1.123,
    # [64, 64, 64]/4 1.271, [64, 128, 64]/8 1.145, [128, 128, 64]/8 1.242 (ragged_dot 55.0);
    # rows between 2560 and 10240 and past 10240 unmeasured.
    grouped_matmul=Table({ANY: (({"rows": (10240, None)}, _grouped(32, 128, 64, 4, 3)),
                                ({}, _grouped(16, 64, 64, 4, 3)))},
                         source=("moe_decode_2026-12-03_configs.json",
                                 "moe_decode_2026-12-04_prefill_rows.json")),
)

# H100: the H200's tiles, with the Mosaic verify preference measured on one H100. At B = 256 no
# other tile beat the H200's by 2 % there (conventional decode of both families, GDN bf16 replay,
# Mamba2 bf16 replay at L = 8 / 16; mamba2_decode_2026-12-07_h100_bf16_replay_tiles.json,
# {mamba2,gdn}_decode_2026-12-07_h100_conv_tiles.json, gdn_decode_2026-12-07_h100_bf16_replay_tiles.json).
# Verify, f32, L = 8, ms Triton reconstruct / Mosaic: GDN T = 2 B = 8 0.0158 / 0.0163, B = 256
# 0.3059 / 0.2978 (a tie: Triton stays first); T = 4 B = 32 / 128 / 256 0.0710 / 0.0585,
# 0.2540 / 0.2065, 0.4996 / 0.4016; T = 8 B = 8 0.0360 / 0.0274, B = 256 0.8642 / 0.6296; Mamba2
# T = 4 B = 256 0.9426 / 0.6787 (its other shapes follow the H200, where Mosaic led at every one).
H100 = dataclasses.replace(
    H200, kind="H100",
    verify_mosaic=Table({
        ("gdn", "f32"): (({"tokens": (4, None)}, True), ({}, False)),
        ("gdn", "bf16"): always(False),
        ("mamba2", "f32"): (({"tokens": (4, None)}, True), ({}, False)),
        ("mamba2", "bf16"): always(False),
    }, source=("verify_gdn_2026-12-06_h100_rows_routes_read_copy.json",
               "verify_gdn_2026-12-06_h100_T2_T8.json",
               "verify_mamba2_2026-12-06_h100_routes_read_copy.json",
               "untuned on the H100: Mamba2 at T != 4 or B < 256, and bf16 state")))

# Any other GPU: the H200's tiles, and no Mosaic preference for verify (measured on Hopper only).
OTHER_GPU = dataclasses.replace(
    H200, kind="other GPU",
    verify_mosaic=Table({key: always(False) for key in H200.verify_mosaic.rows},
                        source=("untuned: measured on the H200 and H100 only",)))

_INTERPRET = ("interpret mode: speed is irrelevant; two tiles per head (and per program, and "
              "two heads or rows per program) make the CPU tests cover the kernels' tile indexing",)
_CPU_TILE = _tile(16, 4)
_CPU_M2 = _m2(HALF_POW2, 4, HALF_POW2, heads=2)

# CPU: the Pallas interpreter. Rules that differ in kind from the GPU's say so in their value.
CPU = DeviceTables(
    kind="cpu",
    num_sms=None,
    gdn_decode=Table({"f32": always(_CPU_TILE), "bf16": always(_CPU_TILE)}, source=_INTERPRET),
    gdn_flush_decode=Table({"f32": always(_CPU_TILE), "bf16": always(_CPU_TILE)},
                           source=_INTERPRET),
    gdn_replay_step=Table({ANY: always(_tile(16, 4, HALF))}, source=_INTERPRET),
    gdn_fold=Table({ANY: always(_tile(16, 4, HALF))}, source=_INTERPRET),
    gdn_fold_tiles=Table({"f32": always(2), "bf16": always(2)}, source=_INTERPRET),
    verify_route=Table({ANY: always("output_only")},
                       source=("interpret mode: the route the interpret tests were sized for (both "
                               "routes are tested by name)",)),
    gdn_verify_reconstruct=Table({ANY: always(None)}, source=_INTERPRET),
    gdn_verify_output_only=Table({ANY: always(None)}, source=_INTERPRET),
    verify_mosaic=Table({key: always(False) for key in H200.verify_mosaic.rows},
                        source=("CPU: no GPU kernel is faster",)),
    replay_min_batch=Table({key: always(0) for key in H200.replay_min_batch.rows},
                           source=("CPU: nothing is bandwidth-bound in interpret mode or XLA on "
                                   "CPU",)),
    mamba2_decode=Table({"f32": always(_m2(HALF_POW2, 4)), "bf16": always(_m2(HALF_POW2, 4))},
                        source=_INTERPRET),
    mamba2_flush_block_n=Table({ANY: always(HALF_POW2)}, source=_INTERPRET),
    mamba2_replay_route=Table({"f32": always("output_only"), "bf16": always("output_only")},
                              source=_INTERPRET),
    mamba2_replay_step=Table({"output_only": always(_CPU_M2), "reconstruct": always(_CPU_M2)},
                             source=_INTERPRET),
    mamba2_fold=Table({ANY: always(None)}, source=_INTERPRET),
    mamba2_fold_tiles=Table({ANY: always(2)}, source=_INTERPRET),
    mamba2_verify_reconstruct=Table({ANY: always(None)}, source=_INTERPRET),
    mamba2_verify_output_only=Table({ANY: always(_CPU_M2)}, source=_INTERPRET),
    mamba2_materialize=Table({ANY: always(_m2(HALF_POW2, 4, HALF_POW2))}, source=_INTERPRET),
    # Interpret mode ignores Mosaic layouts: 16-row tiles give two tiles per 32-row head; four rows
    # per program cover the double-buffered row loop.
    mosaic=Table({ANY: always({"block_v": 16, "rows": 4})}, source=_INTERPRET),
    gdn_verify_mosaic_rows=Table({ANY: always(4)}, source=_INTERPRET),
    attention_decode=Table(H200.attention_decode.rows,
                           source=("interpret mode: the GPU's blocks, so CPU tests see the split rule "
                                   "and short-pool clipping as the GPU does",)),
    grouped_matmul=Table({ANY: always(_grouped(16, 16, 16, 4, 1))}, source=_INTERPRET),
)

# Device-independent defaults (measured on the H200).
# One token per step: L = 16. B = 256, x conventional: f32 L = 8 / 16 / 32 1.31x / 1.55x / 1.42x,
# bf16 1.12x / 1.26x / 0.93x. Speculative verify: short windows win (every flush is cheaper than
# a long window replay), L = max(T, min(2T, 8)). B = 256, f32, x conventional speculative, Triton:
# GDN T = 2 L = 4 1.59 vs L = 8 1.52, T = 8 L = 8 1.56 vs L = 16 1.48 (Mamba2 alike in the same
# runs); Mosaic T = 4: L = 8 / 12 / 16 1.82x / 1.76x / 1.64x (GDN), 2.30x / 2.23x / 2.06x
# (Mamba2). T = 3, 5-7 interpolated.
BUFFER_LEN = Table({"decode": always(16), "verify_max": always(8)},
                   source=("gdn_decode_2026-11-30_buffer_lens.json",
                           "git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s6_T2_L4.json",
                           "git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s6_T2_L8.json",
                           "git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s6_T8_L8.json",
                           "git show 60b2ea2:bench/results/verify_gdn_2026-11-29_s6_T8_L16.json",
                           "git show 60b2ea2:bench/results/verify_gdn_T4_L8_2026-11-30_s12.json",
                           "verify_gdn_2026-11-30_window_L12.json",
                           "verify_gdn_2026-11-30_window_L16.json",
                           "verify_mamba2_2026-11-30_window_L12.json"))
# GDN replay_decode(route="auto"): output-only. B = 256, L = 16 vs the one-launch reconstruct
# route: f32 0.212 ms vs 0.313 ([8, K]/1) / 0.360 (the decode tile); bf16 0.142 vs 0.310.
GDN_REPLAY_ROUTE = Table({ANY: always("output_only")},
                         source=("git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s5_reconstruct.json",))
# Fold-pass row slots per expected flushing row. Decode, B = 256, L = 16: B/L slots 0.2015 ms
# f32 / 0.1349 bf16, 2B/L 0.2019 / 0.1360, 4B/L 0.2067 / 0.1406 (empty programs cost); Mamba2
# B = 256, L = 8 f32: B/L 0.4420, 2B/L 0.4419. Verify: *untuned*, twice the expected flushing rows.
FOLD_ROW_SLOTS = Table({"decode": always(1), "verify": always(2)},
                       source=("git show 60b2ea2:bench/results/gdn_decode_2026-11-29_s7_fold_rows.json",
                               "untuned for verify: twice the expected flushing rows"))

def for_device(device_kind: str) -> DeviceTables:
  """The tables of a device kind: CPU, an H200 or an H100 (any kind naming it), else
  ``OTHER_GPU``."""
  if device_kind.lower() == "cpu":
    return CPU
  if "H200" in device_kind:
    return H200
  return H100 if "H100" in device_kind else OTHER_GPU
