"""``bench.model_e2e --smoke`` and ``bench.engine_spec --smoke`` on CPU: the tiny checkpoints' shapes
(attention, MoE, GDN and Mamba2 layers) through the end-to-end loop, the per-part split and the
plot, and through the serving engine with and without drafting; the tables have every row."""
import json

import pytest

from bench import engine_spec, model_e2e


def test_model_e2e_smoke(tmp_path):
  out = model_e2e.main(["--smoke", "--out-json", str(tmp_path / "e2e.json"), "--plot", str(tmp_path / "e2e.png")])
  assert (tmp_path / "e2e.png").stat().st_size > 0
  saved = json.loads((tmp_path / "e2e.json").read_text())
  assert saved["meta"]["command"].startswith("python -m bench.model_e2e --smoke")
  for res in out["results"]:
    modes = {r["mode"] for r in res["rows"]}
    assert modes == {"conventional", "replay"}
    assert all(r["median_ms"] > 0 and r["tokens_per_s"] > 0 for r in res["rows"])
    kinds = {r["kind"] for r in res["parts"]}
    assert kinds == {"recurrent", "attention", "mlp", "head"}
    # Recurrent mixers are timed in both modes; every other part once.
    assert {r["mode"] for r in res["parts"] if r["kind"] == "recurrent"} == {"conventional", "replay"}
  moe = [r for res in out["results"] for r in res["parts"] if r["part"] == "moe"]
  assert moe and moe[0]["layers"] == 1


def test_engine_spec_smoke(tmp_path):
  # Given the tiny Qwen3.5 shape with the looping head (float32 throughout on CPU),
  out = engine_spec.main(["--smoke", "--model", "looping", "--out-json", str(tmp_path / "spec.json"),
                          "--plot", str(tmp_path / "spec.png")])
  assert (tmp_path / "spec.png").stat().st_size > 0
  saved = json.loads((tmp_path / "spec.json").read_text())
  assert saved["meta"]["command"].startswith("python -m bench.engine_spec --smoke")
  rows = out["result"]["rows"]
  assert {(r["prompts"], r["arm"]) for r in rows} == {
      (p, a) for p in ("random", "repetitive") for a in engine_spec.DEFAULT_ARMS}
  # every arm emits the greedy tokens of standard ReplaySSM decode,
  assert all(r["identical_to_baseline"] == 1.0 and r["tokens_per_s"] > 0 for r in rows)
  # the step's time splits into dispatch, device wait and host work (all measured, non-negative),
  assert all(set(r["ms_per_step"]) == {"dispatch", "device_wait", "host"}
             and min(r["ms_per_step"].values()) >= 0 and r["ms_per_step"]["dispatch"] > 0 for r in rows)
  # the decode arms draft nothing and the drafting arms verify drafts, accepting some on the
  # repetitive prompts (more than one token per step).
  for r in rows:
    if r["num_drafts"] == 0:
      assert r["drafted"] == 0 and r["tokens_per_step"] == 1.0
    elif r["prompts"] == "repetitive":
      assert r["accepted"] > 0 and r["tokens_per_step"] > 1.0


def test_engine_spec_overlapped_drafting_smoke():
  # The overlapped drafting arms (drafts made on the device) emit the decode arm's tokens with the
  # synchronous drafting arm's drafts.
  out = engine_spec.main(["--smoke", "--model", "looping", "--prompts", "repetitive", "--arms",
                          "decode-replay,spec-replay,spec-replay-overlap,spec-conv-overlap"])
  rows = out["result"]["rows"]
  assert [r["arm"] for r in rows] == ["decode-replay", "spec-replay", "spec-replay-overlap",
                                      "spec-conv-overlap"]
  assert all(r["identical_to_baseline"] == 1.0 for r in rows)
  assert rows[1]["accepted"] > 0
  assert all((r["drafted"], r["accepted"]) == (rows[1]["drafted"], rows[1]["accepted"])
             for r in rows[2:])


def test_engine_spec_read_copy_smoke():
  # The read-copy arms: plain decode, synchronous and overlapped drafting over a bf16 read copy of
  # the float32 checkpoint emit the same tokens, and the drafting arms accept drafts.
  arms = ["decode-replay-overlap-copy", "spec-replay-copy", "spec-replay-overlap-copy"]
  out = engine_spec.main(["--smoke", "--model", "looping", "--prompts", "repetitive", "--arms", ",".join(arms)])
  rows = out["result"]["rows"]
  assert [(r["arm"], r["read_copy_dtype"]) for r in rows] == [(a, "bfloat16") for a in arms]
  assert all(r["identical_to_baseline"] == 1.0 for r in rows)
  assert rows[1]["accepted"] > 0 and (rows[2]["drafted"], rows[2]["accepted"]) == (rows[1]["drafted"], rows[1]["accepted"])


def test_engine_spec_prefix_caching_smoke():
  # With prefix caching on prompts that share their first half, the overlapped decode arm and the
  # MTP drafting arm (synchronous) emit the synchronous decode arm's tokens, and the snapshots
  # serve every request after the first.
  out = engine_spec.main(["--smoke", "--prompts", "shared", "--prefix-block", "4", "--arms",
                          "decode-replay,decode-replay-overlap,spec-mtp"])
  rows = out["result"]["rows"]
  assert [(r["arm"], r["overlapped"]) for r in rows] == [("decode-replay", False),
                                                         ("decode-replay-overlap", True),
                                                         ("spec-mtp", False)]
  assert all(r["identical_to_baseline"] == 1.0 and r["prefix_block"] == 4 for r in rows)
  assert [r["prefix_hit_tokens"] for r in rows] == [4, 4, 4]   # B = 2, 6 shared tokens: one block
  with pytest.raises(SystemExit):    # one line on stderr: "--shared-len 13; expected 0 to ..."
    engine_spec.main(["--smoke", "--prompts", "shared", "--shared-len", "13"])
  with pytest.raises(ValueError, match="--shared-len 13; expected 0 to --prompt-len = 12"):
    engine_spec.prompt_sets(["shared"], batch=2, length=12, phrase=4, vocab=64, shared_len=13)


def test_engine_spec_smoke_mtp_arms():
  # Given the looping model, whose MTP head guesses the successor map one token further,
  out = engine_spec.main(["--smoke", "--model", "looping", "--prompts", "random",
                          "--arms", "decode-replay-overlap,spec-mtp-overlap,spec-mtp-conv-overlap"])
  rows = {r["arm"]: r for r in out["result"]["rows"]}
  # the MTP arms emit the plain greedy tokens, with most of the head's drafts accepted.
  assert all(r["identical_to_baseline"] == 1.0 for r in rows.values())
  for arm in ("spec-mtp-overlap", "spec-mtp-conv-overlap"):
    assert rows[arm]["drafter"] == "mtp" and rows[arm]["acceptance"] > 0.5, rows[arm]


def test_model_e2e_tp_smoke(tmp_path):
  """``bench.model_e2e --smoke --tp 2`` on 2 CPU host devices (a subprocess: the device count is
  fixed at backend start): both modes timed over the model drawn sharded, its per-device
  parameter bytes below the whole model's; ``--parts`` with ``--tp`` is a parser error."""
  import pathlib
  import subprocess
  import sys

  from tests.helpers import with_xla_flags
  out = tmp_path / "tp.json"
  env = with_xla_flags("--xla_force_host_platform_device_count=2")
  root = pathlib.Path(__file__).resolve().parent.parent
  subprocess.run([sys.executable, "-m", "bench.model_e2e", "--smoke", "--tp", "2", "--out-json", str(out)],
                 cwd=root, env=env, check=True, timeout=900)
  results = json.loads(out.read_text())["results"]
  whole = {r["preset"]: r["param_bytes"] for r in model_e2e.main(["--smoke"])["results"]}
  for result in results:
    assert result["tp"] == 2 and result["parts"] == [], result["preset"]
    assert [r["mode"] for r in result["rows"]] == ["conventional", "replay"]
    assert all(r["median_ms"] > 0 and r["speedup_vs_conv"] > 0 for r in result["rows"][1:])
    assert result["param_bytes"] < whole[result["preset"]], result["preset"]
  bad = subprocess.run([sys.executable, "-m", "bench.model_e2e", "--smoke", "--tp", "2", "--parts"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "--parts with --tp" in bad.stderr
