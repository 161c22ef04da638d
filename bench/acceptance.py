"""The kernel and model acceptance rows in one command: every measure beside its target.

    python -m bench.acceptance --out DIR [--peer-dir DIR ...] [--only decode,small,verify,models]
                               [--baseline EARLIER_DIR]
    python -m bench.acceptance --out DIR --dry-run          # print the commands, run nothing
    python -m bench.acceptance --summarize DIR [--baseline EARLIER_DIR]   # the table again

Each benchmark runs in its own process (a fresh device allocator each; bench/NOTES.md, "Harness,
CI and interpreter hazards") and writes ``DIR/<run>.json`` and ``DIR/<run>.log``:

* ``gdn_decode``: conv-pallas, replay-pallas-oo, the opt-in bf16 read copy (``replay-pallas-copy``,
  f32 state only) and SGLang's kernel (``peer-sglang-replay``), B ∈ {32, 256}, L = 16, f32 and bf16
  state;
* ``mamba2_decode``: conv-pallas, both replay routes, the read copy and vLLM's kernel
  (``peer-vllm-replay``), B ∈ {32, 256}, L ∈ {8, 16}, f32 and bf16;
* ``gdn_small``, ``mamba2_small``: conv-pallas and the small-batch policy's flush-every-step kernels
  (``replay-pallas-flushall``) at B ∈ {1, 8}, same L and dtypes;
* ``verify_gdn``, ``verify_mamba2``: T = 4, L = 8, B = 256, f32, the conventional speculative
  verify against the Triton and Mosaic replay verify;
* ``model_e2e``: Qwen3.5-4B and Nemotron-H-8B at B = 256 with 1k tokens of context.

Then it prints one table: measure, our value, the target, whether it is met. The f32 targets get
two rows: the exact default route, and the opt-in read copy (the issue's "faster precision";
SGLang's kernel, the GDN peer, reconstructs in bf16 too). A peer that is not
installed (and not in ``--peer-dir``) is a skipped row, and a target that compares against it
reads "no peer row". The targets are the open issues' acceptance lines, for an H200. On another
card the table still prints, for comparison only.

The issues' small-batch line ("no regression below B = 32, ≥ 0.97x of today's defaults") compares
against an earlier run: ``--baseline EARLIER_DIR``, a folder this command wrote before the change
(on the same kind of card; another card's is compared but reads "other card"). Its row is the
worst ratio earlier ÷ now over the default kernels' rows at B ≤ 32 (conv-pallas, the flush-every-
step kernels, the Triton output-only replay) that both runs have.
"""
import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

from bench import common

BATCH = 256
SMALL_BATCH = 32            # the small-batch line covers B ≤ this
SMALL_ARMS = ("conv-pallas", "replay-pallas-flushall", "replay-pallas-oo")   # the defaults there
SMALL_RATIO = 0.97


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  module: str
  args: tuple[str, ...]
  group: str              # --only selects by group
  takes_peer_dir: bool = False


RUNS = (
    Run("gdn_decode", "bench.gdn_decode",
        ("--arms", "conv-pallas,replay-pallas-oo,replay-pallas-copy,peer-sglang-replay", "--batches", "32,256",
         "--buffer-lens", "16", "--state-dtypes", "float32,bfloat16", "--repeat-arm", "none",
         "--reps", "5"), "decode", takes_peer_dir=True),
    Run("mamba2_decode", "bench.mamba2_decode",
        ("--arms", "conv-pallas,replay-pallas-oo,replay-mosaic-rc,replay-pallas-copy,peer-vllm-replay",
         "--batches", "32,256", "--buffer-lens", "8,16", "--state-dtypes", "float32,bfloat16",
         "--repeat-arm", "none", "--reps", "5"), "decode", takes_peer_dir=True),
    *(Run(f"{family}_small", f"bench.{family}_decode",
          ("--arms", "conv-pallas,replay-pallas-flushall", "--batches", "1,8", "--buffer-lens", lens,
           "--state-dtypes", "float32,bfloat16", "--repeat-arm", "none", "--reps", "5"), "small")
      for family, lens in (("gdn", "16"), ("mamba2", "8,16"))),
    *(Run(f"verify_{family}", "bench.verify_decode",
          ("--family", family, "--tokens", "4", "--batches", str(BATCH), "--buffer-len", "8",
           "--state-dtypes", "float32", "--arms", "conv-pallas,replay-pallas,replay-mosaic",
           "--reps", "5"), "verify") for family in ("gdn", "mamba2")),
    Run("model_e2e", "bench.model_e2e",
        ("--presets", "qwen3.5-4b,nemotron-h-8b", "--batches", str(BATCH), "--contexts", "1024",
         "--reps", "3", "--rep-seconds", "0.2"), "models"),
)
GROUPS = tuple(dict.fromkeys(run.group for run in RUNS))


def command(run: Run, out: pathlib.Path, peer_dirs) -> list[str]:
  peers = [a for d in peer_dirs for a in ("--peer-dir", str(d))] if run.takes_peer_dir else []
  return [sys.executable, "-m", run.module, *run.args, *peers, "--out-json", str(out / f"{run.name}.json")]


# ----------------------------------------------------------------------------------------------
# The table

def _ms(rows, **match):
  """Median ms of the ok benchmark row whose fields equal ``match``, or None."""
  for r in rows:
    if r["status"] == "ok" and all(r[k] == v for k, v in match.items()):
      return r["median_ms"]
  return None


def _decode_ms(rows, arm, dtype, batch, buffer_len):
  """ms per layer-step of one decode row (conventional rows have ``buffer_len`` None)."""
  return _ms(rows, arm=arm, state_dtype=dtype, batch=batch, buffer_len=buffer_len)


def _verify_ms(rows, arm):
  return _ms(rows, arm=arm, batch=BATCH)


def _e2e_ms(results, preset, mode):
  for result in results:
    if result["preset"] == preset:
      for r in result["rows"]:
        if r["mode"] == mode and r["batch"] == BATCH and r["context"] == 1024:
          return r["median_ms"]
  return None


def _best(*named):
  """(ms, name) of the fastest arm that has a value, or (None, None)."""
  have = [(ms, name) for name, ms in named if ms is not None]
  return min(have) if have else (None, None)


def _fmt(ms):
  return "missing" if ms is None else f"{ms:.4f} ms"


def _at_most(value, limit, peer=None, peer_name="peer"):
  """Met when value ≤ limit and (given a peer) value < peer; the verdict says which part fails."""
  if value is None:
    return "no row"
  parts = [value <= limit]
  if peer_name:
    parts.append(None if peer is None else value < peer)
  if False in parts:
    return "no"
  return "yes" if None not in parts else f"no {peer_name} row"


def _ratio(num, den):
  return None if num is None or den is None else num / den


def _at_least(ratio, target):
  return "no row" if ratio is None else ("yes" if ratio >= target else "no")


def _small_rows(results: dict) -> dict:
  """{(family, arm, state dtype, B, L): ms} of the default kernels' rows at B ≤ SMALL_BATCH."""
  rows = {}
  for name in ("gdn_decode", "gdn_small", "mamba2_decode", "mamba2_small"):
    family = name.split("_")[0]
    for r in results.get(name, {}).get("rows", []):
      if r["status"] == "ok" and r["arm"] in SMALL_ARMS and r["batch"] <= SMALL_BATCH:
        rows[(family, r["arm"], r["state_dtype"], r["batch"], r["buffer_len"])] = r["median_ms"]
  return rows


def _metas(results: dict) -> list[dict]:
  return [r["meta"] for r in results.values() if "meta" in r]


def small_batch(results: dict, baseline: dict | None) -> tuple[str, str, str, str]:
  """The small-batch row: the worst earlier ÷ now over the rows both runs have (module doc)."""
  measure = f"small batch, B ≤ {SMALL_BATCH}, default kernels against the baseline"
  target = f"≥ {SMALL_RATIO}x of the baseline"
  if baseline is None:
    return measure, "no baseline given", target, "no baseline"
  now, before = _small_rows(results), _small_rows(baseline)
  common_rows = now.keys() & before.keys()
  if not common_rows:
    return measure, "no row in both runs", target, "no row"
  worst = min(sorted(common_rows, key=str), key=lambda k: before[k] / now[k])
  ratio = before[worst] / now[worst]
  family, arm, dtype, batch, buffer_len = worst
  where = f"{family} {arm} {dtype} B = {batch}" + ("" if buffer_len is None else f" L = {buffer_len}")
  same_card = ({m.get("device_kind") for m in _metas(results)}
               == {m.get("device_kind") for m in _metas(baseline)})
  met = _at_least(ratio, SMALL_RATIO) if same_card else "other card"
  return measure, f"worst {ratio:.3f}x of {len(common_rows)} rows ({where})", target, met


def summarize(results: dict, baseline: dict | None = None) -> list[tuple[str, str, str, str]]:
  """(measure, value, target, met) rows from the runs' JSONs, keyed by run name (missing runs are
  "missing" rows, never an error); ``baseline``: an earlier run's, for the small-batch row."""
  table = []
  gdn = results.get("gdn_decode", {}).get("rows", [])
  for dtype, arm, limit in (("float32", "replay-pallas-oo", 0.160), ("float32", "replay-pallas-copy", 0.160),
                            ("bfloat16", "replay-pallas-oo", 0.105)):
    ours = _decode_ms(gdn, arm, dtype, BATCH, 16)
    peer = _decode_ms(gdn, "peer-sglang-replay", dtype, BATCH, 16)
    peer_part = "" if dtype == "bfloat16" else f", faster than SGLang ({_fmt(peer)})"
    table.append((f"GDN replay, {dtype}, B = {BATCH}, L = 16 ({arm})", _fmt(ours), f"≤ {limit:.3f} ms{peer_part}",
                  _at_most(ours, limit, peer, "SGLang" if dtype == "float32" else None)))
  m2 = results.get("mamba2_decode", {}).get("rows", [])
  peer = _decode_ms(m2, "peer-vllm-replay", "float32", BATCH, 8)
  for arms in (("replay-pallas-oo", "replay-mosaic-rc"), ("replay-pallas-copy",)):
    ms, arm = _best(*((a, _decode_ms(m2, a, "float32", BATCH, 8)) for a in arms))
    table.append((f"Mamba2 replay, float32, B = {BATCH}, L = 8 ({arm or ' / '.join(arms)})", _fmt(ms),
                  f"≤ 0.320 ms, faster than vLLM ({_fmt(peer)})", _at_most(ms, 0.320, peer, "vLLM")))
  conv = _decode_ms(m2, "conv-pallas", "bfloat16", BATCH, None)   # conventional rows have no L
  for buffer_len in (8, 16):
    ms, arm = _best(*((a, _decode_ms(m2, a, "bfloat16", BATCH, buffer_len))
                      for a in ("replay-pallas-oo", "replay-mosaic-rc")))
    ratio = _ratio(conv, ms)
    table.append((f"Mamba2 bf16 replay over conventional, B = {BATCH}, L = {buffer_len} ({arm or 'no arm'})",
                  "missing" if ratio is None else f"{ratio:.2f}x", "≥ 1.3x", _at_least(ratio, 1.3)))
  table.append(small_batch(results, baseline))
  for family, target in (("gdn", 2.2), ("mamba2", 2.7)):
    rows = results.get(f"verify_{family}", {}).get("rows", [])
    ms, arm = _best(*((a, _verify_ms(rows, a)) for a in ("replay-pallas", "replay-mosaic")))
    ratio = _ratio(_verify_ms(rows, "conv-pallas"), ms)
    table.append((f"{family} verify T = 4 over conventional, B = {BATCH} ({arm or 'no arm'})",
                  "missing" if ratio is None else f"{ratio:.2f}x", f"≥ {target}x", _at_least(ratio, target)))
  e2e = results.get("model_e2e", {}).get("results", [])
  for preset, target in (("qwen3.5-4b", 1.25), ("nemotron-h-8b", 1.3)):
    ratio = _ratio(_e2e_ms(e2e, preset, "conventional"), _e2e_ms(e2e, preset, "replay"))
    table.append((f"{preset} tokens/s, replay over conventional, B = {BATCH}, 1k context",
                  "missing" if ratio is None else f"{ratio:.2f}x", f"≥ {target}x", _at_least(ratio, target)))
  return table


def load(out: pathlib.Path) -> dict:
  """{run name: its JSON} of the runs ``out`` holds; ValueError names a file that is not JSON."""
  results = {}
  for run in RUNS:
    path = out / f"{run.name}.json"
    if path.is_file():
      try:
        results[run.name] = json.loads(path.read_text())
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a benchmark JSON ({e})") from None
  return results


def render(table, results: dict) -> str:
  where = ", ".join(sorted({f"{m.get('device_kind')} (jax {m.get('jax_version')}, "
                            f"{(m.get('git_commit') or '?')[:7]}, source {m.get('source_digest')})"
                            for m in _metas(results)}))
  return f"acceptance on {where or 'no runs'}\n" + common.render_table(
      ["measure", "value", "target", "met"], [list(row) for row in table], markdown=True)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.acceptance", description=__doc__.split("\n\n")[0])
  p.add_argument("--out", type=pathlib.Path, help="folder for each run's JSON and log")
  p.add_argument("--peer-dir", type=pathlib.Path, action="append", default=[],
                 help="where peer packages live (passed to the decode benchmarks)")
  p.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {GROUPS}")
  p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
  p.add_argument("--summarize", type=pathlib.Path, default=None, metavar="DIR",
                 help="print the table from DIR's JSONs and run nothing")
  p.add_argument("--baseline", type=pathlib.Path, default=None, metavar="EARLIER_DIR",
                 help="an earlier run's folder, for the small-batch row")
  args = p.parse_args(argv)
  for flag, folder in (("--summarize", args.summarize), ("--baseline", args.baseline)):
    if folder is not None and not folder.is_dir():
      p.error(f"{flag} {folder}: not a directory")
  try:
    _run(args, p)
  except ValueError as e:   # a folder's JSON that is not one
    p.error(str(e))


def _run(args, p):
  baseline = None if args.baseline is None else load(args.baseline)
  if args.summarize is not None:
    results = load(args.summarize)
    print(render(summarize(results, baseline), results))
    return
  if args.out is None:
    p.error("--out is required (unless --summarize)")
  groups = [g for g in args.only.split(",") if g]
  unknown = sorted(set(groups) - set(GROUPS))
  if unknown:
    p.error(f"--only: unknown {unknown}; expected some of {GROUPS}")
  runs = [run for run in RUNS if run.group in groups]
  if args.dry_run:
    for run in runs:
      print(" ".join(command(run, args.out, args.peer_dir)))
    return
  args.out.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "PYTHONUNBUFFERED": "1"}
  for i, run in enumerate(runs, 1):
    cmd = command(run, args.out, args.peer_dir)
    print(f"[{i}/{len(runs)}] {' '.join(cmd[1:])}", flush=True)
    with open(args.out / f"{run.name}.log", "w") as log:
      rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc:
      print(f"  {run.name} exited with {rc}: see {args.out / (run.name + '.log')}", flush=True)
  results = load(args.out)
  print(render(summarize(results, baseline), results))


if __name__ == "__main__":
  main()
