"""bench.acceptance: the table from recorded runs, its verdicts, and the commands it would run."""
import json
import pathlib
import shutil

import pytest

from bench import acceptance

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
# One H100, jax 0.12.1, before the register caps (bench/RESULTS.md, "JAX 0.12.1 on the GPU").
RECORDED = {"gdn_decode": "gdn_decode_2026-12-07_h100_jax0.12.1.json",
            "mamba2_decode": "mamba2_decode_2026-12-07_h100_jax0.12.1.json",
            "verify_gdn": "verify_gdn_2026-12-07_h100_jax0.12.1.json",
            "verify_mamba2": "verify_mamba2_2026-12-07_h100_jax0.12.1.json"}


@pytest.fixture
def recorded(tmp_path):
  for name, file in RECORDED.items():
    shutil.copy(RESULTS / file, tmp_path / f"{name}.json")
  models = [json.loads((RESULTS / f"model_e2e_2026-12-07_h100_{m}_jax0.12.1.json").read_text())
            for m in ("qwen35", "nemotron")]
  models[0]["results"] += models[1]["results"]
  (tmp_path / "model_e2e.json").write_text(json.dumps(models[0]))
  return tmp_path


def test_table_of_recorded_runs(recorded):
  table = {measure: (value, met) for measure, value, _, met in acceptance.summarize(acceptance.load(recorded))}
  assert table == {
      "GDN replay, float32, B = 256, L = 16 (replay-pallas-oo)": ("0.2487 ms", "no"),
      "GDN replay, float32, B = 256, L = 16 (replay-pallas-copy)": ("missing", "no row"),
      "GDN replay, bfloat16, B = 256, L = 16 (replay-pallas-oo)": ("0.1500 ms", "no"),
      "Mamba2 replay, float32, B = 256, L = 8 (replay-mosaic-rc)": ("0.4487 ms", "no"),
      "Mamba2 replay, float32, B = 256, L = 8 (replay-pallas-copy)": ("missing", "no row"),
      "Mamba2 bf16 replay over conventional, B = 256, L = 8 (replay-pallas-oo)": ("1.23x", "no"),
      "Mamba2 bf16 replay over conventional, B = 256, L = 16 (no arm)": ("missing", "no row"),
      "small batch, B ≤ 32, default kernels against the baseline": ("no baseline given", "no baseline"),
      "gdn verify T = 4 over conventional, B = 256 (replay-mosaic)": ("2.66x", "yes"),
      "mamba2 verify T = 4 over conventional, B = 256 (replay-mosaic)": ("2.80x", "yes"),
      "qwen3.5-4b tokens/s, replay over conventional, B = 256, 1k context": ("1.19x", "no"),
      "nemotron-h-8b tokens/s, replay over conventional, B = 256, 1k context": ("1.29x", "no"),
  }


def test_read_copy_rows_against_the_peers(tmp_path):
  """The H200 run beside the peers (bench/RESULTS.md, "One H200, with the read copy"): the opt-in
  read copy meets both f32 targets, the exact routes do not."""
  for name, file in (("gdn_decode", "peer_sglang_2026-12-06_h200_read_copy.json"),
                     ("mamba2_decode", "peer_vllm_2026-12-06_h200_read_copy.json")):
    shutil.copy(RESULTS / file, tmp_path / f"{name}.json")
  table = {measure: (value, target, met)
           for measure, value, target, met in acceptance.summarize(acceptance.load(tmp_path))}
  assert table["GDN replay, float32, B = 256, L = 16 (replay-pallas-oo)"] == (
      "0.1858 ms", "≤ 0.160 ms, faster than SGLang (0.1779 ms)", "no")
  assert table["GDN replay, float32, B = 256, L = 16 (replay-pallas-copy)"] == (
      "0.1374 ms", "≤ 0.160 ms, faster than SGLang (0.1779 ms)", "yes")
  assert table["GDN replay, bfloat16, B = 256, L = 16 (replay-pallas-oo)"] == ("0.1178 ms", "≤ 0.105 ms", "no")
  assert table["Mamba2 replay, float32, B = 256, L = 8 (replay-mosaic-rc)"] == (
      "0.3860 ms", "≤ 0.320 ms, faster than vLLM (0.4196 ms)", "no")
  assert table["Mamba2 replay, float32, B = 256, L = 8 (replay-pallas-copy)"] == (
      "0.3025 ms", "≤ 0.320 ms, faster than vLLM (0.4196 ms)", "yes")


def test_missing_runs_are_rows_not_errors(tmp_path, capsys):
  assert {met for *_, met in acceptance.summarize({})} == {"no row", "no baseline"}
  acceptance.main(["--summarize", str(tmp_path)])
  assert "acceptance on no runs" in capsys.readouterr().out


@pytest.mark.parametrize("value, peer, peer_name, verdict", [
    (0.15, 0.17, "SGLang", "yes"), (0.15, 0.14, "SGLang", "no"), (0.17, 0.20, "SGLang", "no"),
    (0.15, None, "SGLang", "no SGLang row"), (0.17, None, "SGLang", "no"), (0.15, None, None, "yes"),
    (None, 0.17, "SGLang", "no row"),
])
def test_at_most_verdicts(value, peer, peer_name, verdict):
  assert acceptance._at_most(value, 0.16, peer, peer_name) == verdict


def test_commands(tmp_path, capsys):
  acceptance.main(["--out", str(tmp_path), "--dry-run", "--peer-dir", "/peers", "--only", "decode,verify"])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split()[2] for line in lines] == ["bench.gdn_decode", "bench.mamba2_decode",
                                                 "bench.verify_decode", "bench.verify_decode"]
  assert [("--peer-dir /peers" in line) for line in lines] == [True, True, False, False]
  assert all(f"--out-json {tmp_path}/" in line for line in lines)
  assert not list(tmp_path.iterdir())   # a dry run writes nothing


def test_a_broken_json_is_one_line(tmp_path, capsys):
  (tmp_path / "gdn_decode.json").write_text("{ cut off")
  with pytest.raises(SystemExit):
    acceptance.main(["--summarize", str(tmp_path)])
  assert "gdn_decode.json: not a benchmark JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--only", "decode,kernels", "--out", "x"], "--only: unknown ['kernels']"),
    (["--dry-run"], "--out is required"),
    (["--summarize", "/no/such/dir"], "not a directory"),
    (["--summarize", ".", "--baseline", "/no/such/dir"], "--baseline /no/such/dir: not a directory"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
  with pytest.raises(SystemExit):
    acceptance.main(argv)
  assert message in capsys.readouterr().err


def test_summarize_a_recorded_run_folder(capsys):
  """The folder one ``--out`` run wrote (bench/RESULTS.md, "The acceptance rows in one run"): every
  row has a value, and the verdicts are the ones recorded there."""
  folder = RESULTS / "acceptance_2026-12-08_h100_jax0.11.2"
  results = acceptance.load(folder)
  assert sorted(results) == sorted(run.name for run in acceptance.RUNS if run.group != "small")
  met = [(value, verdict) for _, value, _, verdict in acceptance.summarize(results)]
  assert [v for v, _ in met] == ["0.2327 ms", "0.1607 ms", "0.1374 ms", "0.4500 ms", "0.3684 ms", "1.28x",
                                 "1.47x", "no baseline given", "2.73x", "2.81x", "1.22x", "1.33x"]
  assert [m for _, m in met] == ["no"] * 6 + ["yes", "no baseline"] + ["yes"] * 2 + ["no", "yes"]
  acceptance.main(["--summarize", str(folder)])
  assert "acceptance on NVIDIA H100 80GB HBM3 (jax 0.11.2" in capsys.readouterr().out


SMALL = "small batch, B ≤ 32, default kernels against the baseline"


def _small_row(results, baseline):
  return {measure: (value, met) for measure, value, _, met in acceptance.summarize(results, baseline)}[SMALL]


def test_small_batch_against_a_baseline(tmp_path, capsys):
  """jax 0.12.1 capped against 0.11.2 on the same card (bench/RESULTS.md, "The acceptance rows in
  one run"): the conventional kernel, not capped, is the worst row at 0.974x."""
  now, before = (RESULTS / f"acceptance_2026-12-08_h100_jax{v}" for v in ("0.12.1", "0.11.2"))
  assert _small_row(acceptance.load(now), acceptance.load(before)) == (
      "worst 0.974x of 10 rows (gdn conv-pallas float32 B = 32)", "yes")
  assert _small_row(acceptance.load(before), acceptance.load(before)) == (
      "worst 1.000x of 10 rows (gdn conv-pallas bfloat16 B = 32)", "yes")
  acceptance.main(["--summarize", str(now), "--baseline", str(before)])
  assert "| worst 0.974x of 10 rows" in capsys.readouterr().out


def test_small_batch_regression_and_other_card(tmp_path):
  before = acceptance.load(RESULTS / "acceptance_2026-12-08_h100_jax0.11.2")
  now = json.loads(json.dumps(before))
  for r in now["mamba2_decode"]["rows"]:
    if (r["arm"], r["state_dtype"], r["batch"], r["buffer_len"]) == ("replay-pallas-oo", "bfloat16", 32, 8):
      r["median_ms"] *= 1.05
  assert _small_row(now, before) == (
      "worst 0.952x of 10 rows (mamba2 replay-pallas-oo bfloat16 B = 32 L = 8)", "no")
  for result in now.values():
    result["meta"]["device_kind"] = "NVIDIA H200"
  assert _small_row(now, before)[1] == "other card"
  assert _small_row({}, before) == ("no row in both runs", "no row")
