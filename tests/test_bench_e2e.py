"""``bench.model_e2e --smoke`` on CPU: the tiny checkpoints' shapes (attention, MoE, GDN and Mamba2
layers) through the end-to-end loop, the per-part split and the plot; the table has every row."""
import json

from bench import model_e2e


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
