"""The GDN decode benchmark harness, end to end on CPU (``python -m bench.gdn_decode --smoke``).

Checks the result file's fields, the byte model against hand-computed numbers, the timing and
cursor checks, and that a wrong kernel fails the gate and gets no speedup.
"""
import json

import pytest

from bench import common
from bench import gdn_decode

META_FIELDS = ("date", "device_kind", "platform", "jax_version", "jaxlib_version", "command", "argv",
               "git_commit", "source_digest", "geometry", "options", "elapsed_s")
ROW_FIELDS = ("arm", "label", "impl", "family", "route", "state_dtype", "batch", "buffer_len", "layers",
              "ms_per_layer_step", "median_ms", "p20_ms", "p80_ms", "n_cycles", "bytes_per_row",
              "bytes_per_layer_step", "eff_gbps", "pct_ceiling", "speedup_vs_conv", "speedup_vs_xla",
              "gate", "checks", "status", "repeat")


@pytest.mark.slow
def test_smoke_run_writes_complete_results(tmp_path):
  out, md, png = tmp_path / "r.json", tmp_path / "RESULTS.md", tmp_path / "p.png"
  result = gdn_decode.main(["--smoke", "--out-json", str(out), "--markdown", "--results-md", str(md),
                            "--plot", str(png)])
  data = json.loads(out.read_text())
  assert data["rows"] and len(data["rows"]) == len(result["rows"])
  for field in META_FIELDS:
    assert field in data["meta"], field
  assert data["meta"]["command"].startswith("python -m bench.gdn_decode --smoke")
  assert data["ceiling"]["gbps"] > 0 and len(data["ceiling"]["runs"]) == 2
  assert {"conv", "replay", "not_counted"} <= set(data["bytes_model"])

  pallas_missing = gdn_decode.pallas_available() is not None
  by_label = {(r["label"], r["buffer_len"]): r for r in data["rows"]}
  for arm in gdn_decode.DEFAULT_ARMS:
    assert any(r["arm"] == arm for r in data["rows"]), arm
  for r in data["rows"]:
    if r["status"] == "skipped":
      assert pallas_missing and r["impl"] == "pallas_triton"
      continue
    for field in ROW_FIELDS:
      assert field in r, (r["label"], field)
    assert r["status"] == "ok", (r["label"], r["status"], r["error"], r.get("gate"), r.get("checks"))
    assert r["gate"]["passed"] and r["gate"]["o_rel"] <= r["gate"]["tol_rel"]
    assert len(r["ms_per_layer_step"]) >= 5
    assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
    assert r["eff_gbps"] > 0 and r["pct_ceiling"] > 0
    assert r["layers"] >= 2
    assert r["bytes_per_layer_step"] == pytest.approx(r["bytes_per_row"]["total"] * r["batch"])
    if r["family"] == "replay":
      assert r["buffer_len"] == 4
      assert r["checks"]["cursor_count_back"] and r["checks"]["cursor_base_advanced"]
      if r["impl"] == "pallas_triton":
        assert r["speedup_vs_conv"] > 0 and r["speedup_vs_xla"] > 0
  if not pallas_missing:
    assert by_label[("conv-pallas#2", None)]["repeat"]

  text = md.read_text()
  assert text.startswith("# replayssm_jax benchmark results")
  assert "## GDN decode" in text and "| replay-xla |" in text
  pytest.importorskip("matplotlib")
  assert png.stat().st_size > 1000

  again = gdn_decode.main(["--from-json", str(out)])  # re-render only, no device work
  assert len(again["rows"]) == len(data["rows"])


@pytest.mark.slow
def test_wrong_kernel_fails_the_gate(tmp_path, monkeypatch):
  real = gdn_decode.layer_op

  def broken(arm, cfg, scale):
    op = real(arm, cfg, scale)
    if arm.name != "replay-xla-rc":
      return op

    def wrong(*a):
      o, bufs = op(*a)
      return o * 1.5, bufs
    return wrong
  monkeypatch.setattr(gdn_decode, "layer_op", broken)
  out = tmp_path / "r.json"
  gdn_decode.main(["--smoke", "--arms", "conv-xla,replay-xla,replay-xla-rc", "--repeat-arm", "none",
                   "--out-json", str(out)])
  rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["replay-xla"]["status"] == "ok"
  bad = rows["replay-xla-rc"]
  assert bad["status"] == "gate-failed" and not bad["gate"]["passed"]
  assert bad["gate"]["o_rel"] > 0.1 and bad["speedup_vs_conv"] is None


def test_bytes_model_qwen35_4b():
  geo = gdn_decode.QWEN35_4B
  io = (2 * 16 * 128 + 32 * 128 + 32) * 2 + 32 * 4 + 32 * 128 * 2  # q, k, v, beta (bf16), g (f32), o
  state = 32 * 128 * 128 * 4
  conv = gdn_decode.bytes_model(geo, "conv", None, "float32", "bfloat16", "bfloat16")
  assert conv["total"] == io + 2 * state
  entry = 16 * 128 * 2 + 32 * 128 * 2 + 32 * 4
  rep = gdn_decode.bytes_model(geo, "replay", 16, "float32", "bfloat16", "bfloat16")
  assert rep["total"] == pytest.approx(io + state * (1 + 1 / 16) + entry * (15 / 2 + 1))
  assert rep["total"] / conv["total"] == pytest.approx(0.559, abs=1e-3)
  # P·pool >= 1 GiB, P >= 2.
  assert gdn_decode.layers_for(geo, 512, "float32", 2**30, 4096) == 2
  assert gdn_decode.layers_for(geo, 1, "bfloat16", 2**30, 4096) == 1024


def test_launch_config_strings():
  assert common.parse_config("default").is_default
  cfg = common.parse_config("bv64w4s2fbv32fw2")
  assert cfg.kwargs() == {"block_v": 64, "num_warps": 4, "num_stages": 2, "fold_block_v": 32,
                          "fold_num_warps": 2}
  with pytest.raises(ValueError, match="launch config"):
    common.parse_config("bv64x")
