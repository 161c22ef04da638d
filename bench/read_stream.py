"""How fast the GPU reads: read-only streams in native Triton against the copy, in one process.

    python -m bench.read_stream [--gib 1] [--reps 40] [--out-json F]

Replay decode is read-mostly (each step reads every checkpoint once and writes 1/L of them), so
its floor is the rate at which a kernel can *read* HBM, not the copy rate the other benchmarks
quote. This measures that rate for one float32 buffer of ``--gib`` GiB (far past the L2), timed
by CUDA events around single launches (median of ``--reps`` after 3 warm-ups):

* ``copy``: ``dst.copy_(src)`` (PyTorch), bytes read + written: the copy ceiling of this run;
* ``sum``: a 1-D block sum, each program summing ``BLOCK`` contiguous floats (the pure read);
* ``tile sum`` / ``readout`` / ``two readouts``: [BV, 128] tiles, ``heads`` per program, each
  tile summed whole, reduced against one vector (o = S·q, one float per row), or against two
  (o = S·q + S·k/2: the replay step's two readouts), one program per ``heads`` tiles.

The kernels are ours, written in Triton and launched through PyTorch; bench.gdn_breakdown
measures the same tile patterns as Pallas-Triton kernels inside ``jax.jit``. Needs PyTorch with
a CUDA device and Triton; otherwise it prints why and records a skipped run.
"""
import os

# PyTorch allocates beside JAX (run metadata) in this process: JAX must not take 75 % up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402

from bench import common  # noqa: E402

TILE_CASES = ((16, 1), (32, 2), (64, 1), (64, 2))        # (BV, heads per program)
SUM_BLOCKS = (2048, 8192, 32768)
WARPS = (2, 4, 8)
MODES = ("tile sum", "readout", "two readouts")


def _kernels(triton, tl):
  @triton.jit
  def block_sum(x_ptr, o_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    v = tl.load(x_ptr + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))
    tl.store(o_ptr + pid, tl.sum(v, axis=0))

  @triton.jit
  def tiles(s_ptr, q_ptr, k_ptr, o_ptr, BV: tl.constexpr, K: tl.constexpr, HEADS: tl.constexpr,
            MODE: tl.constexpr):
    pid = tl.program_id(0)
    rv, rk = tl.arange(0, BV), tl.arange(0, K)
    q, k = tl.load(q_ptr + rk), tl.load(k_ptr + rk)
    for h in tl.static_range(HEADS):
      t = pid.to(tl.int64) * HEADS + h
      S = tl.load(s_ptr + t * BV * K + rv[:, None] * K + rk[None, :])
      if MODE == 0:
        tl.store(o_ptr + t, tl.sum(tl.sum(S, axis=1), axis=0))
      elif MODE == 1:
        tl.store(o_ptr + t * BV + rv, tl.sum(S * q[None, :], axis=1))
      else:
        tl.store(o_ptr + t * BV + rv,
                 tl.sum(S * q[None, :], axis=1) + 0.5 * tl.sum(S * k[None, :], axis=1))

  return block_sum, tiles


def run(gib: float, reps: int) -> list[dict]:
  import torch  # noqa: PLC0415
  import triton  # noqa: PLC0415
  import triton.language as tl  # noqa: PLC0415

  block_sum, tiles = _kernels(triton, tl)
  n = int(gib * (1 << 30)) // 4 // (1 << 15) * (1 << 15)   # a multiple of every block and tile
  x = torch.randn(n, device="cuda", dtype=torch.float32)
  q, k = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
  rows = []

  def timed(label, fn, nbytes, **knobs):
    for _ in range(3):
      fn()
    torch.cuda.synchronize()
    ms = []
    for _ in range(reps):
      a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      a.record()
      fn()
      b.record()
      b.synchronize()
      ms.append(a.elapsed_time(b))
    med, q20, q80 = common.quantiles(ms)
    rows.append({"arm": label, **knobs, "median_ms": med, "p20_ms": q20, "p80_ms": q80,
                 "gbps": nbytes / med / 1e6})
    common.log(f"{label} {knobs}: {med:.4f} ms, {nbytes / med / 1e6:.0f} GB/s")

  y = torch.empty_like(x)
  timed("copy", lambda: y.copy_(x), 8 * n)
  del y
  for block in SUM_BLOCKS:
    for w in WARPS:
      o = torch.empty(n // block, device="cuda")
      timed("sum", lambda: block_sum[(n // block,)](x, o, BLOCK=block, num_warps=w), 4 * n,
            block=block, warps=w)
  o = torch.empty(n // 64, device="cuda")
  for mode, name in enumerate(MODES):
    for bv, heads in TILE_CASES:
      for w in WARPS:
        grid = (n // (bv * 128 * heads),)
        timed(name, lambda: tiles[grid](x, q, k, o, BV=bv, K=128, HEADS=heads, MODE=mode,
                                        num_warps=w), 4 * n, block_v=bv, heads=heads, warps=w)
  return rows


def table(rows: list[dict]) -> str:
  """Best GB/s per arm, with the share of the copy's rate."""
  copy = next(r["gbps"] for r in rows if r["arm"] == "copy")
  out = []
  for arm in ("copy", "sum", *MODES):
    best = max((r for r in rows if r["arm"] == arm), key=lambda r: r["gbps"])
    knobs = ", ".join(f"{k}={best[k]}" for k in ("block", "block_v", "heads", "warps") if k in best)
    worst = min(r["gbps"] for r in rows if r["arm"] == arm)
    out.append([arm, knobs, f"{best['median_ms']:.4f}", f"{best['gbps']:.0f}",
                f"{100 * best['gbps'] / copy:.0f}", f"{worst:.0f}"])
  return common.render_table(["arm", "best launch", "ms", "GB/s", "% copy", "worst GB/s"], out)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.read_stream")
  p.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
  p.add_argument("--reps", type=int, default=40, help="timed launches per arm")
  p.add_argument("--out-json", default=None)
  p.add_argument("--git-commit", default=None)
  args = p.parse_args(argv)
  meta = common.run_metadata(argv, "bench.read_stream", git_commit_override=args.git_commit)
  try:
    import torch  # noqa: PLC0415
    import triton  # noqa: F401, PLC0415
    if not torch.cuda.is_available():
      raise RuntimeError("PyTorch sees no CUDA device")
  except (ImportError, RuntimeError) as e:
    print(f"skipped: {e}")
    result = {"meta": meta, "skipped": str(e), "rows": []}
  else:
    rows = run(args.gib, args.reps)
    print(table(rows))
    result = {"meta": {**meta, "torch": torch.__version__, "triton": triton.__version__},
              "rows": rows}
  if args.out_json:
    common.write_json(args.out_json, result)
  return result


if __name__ == "__main__":
  main()
