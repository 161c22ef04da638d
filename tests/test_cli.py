"""The command line (``python -m replayssm_jax``): generation from a checkpoint directory, and
bad input or an unsupported checkpoint as one line on stderr with exit code 2, no traceback."""
import json
import shutil
import subprocess
import sys

import numpy as np

from tests.helpers import with_xla_flags
from tests.test_hf_parity import DATA, ROOT_DIR


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "replayssm_jax", *args], cwd=ROOT_DIR, env=with_xla_flags(),
                        capture_output=True, text=True, timeout=600)


def test_generate_from_a_checkpoint_gives_transformers_greedy_tokens():
  ref = np.load(DATA / "qwen3_5" / "reference.npz")
  ids = ",".join(map(str, ref["prompt_1"]))
  proc = _cli("generate", "--model-dir", str(DATA / "qwen3_5"), "--token-ids", ids, "--max-new-tokens", "8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split("\n")[0].split() == [str(t) for t in ref["greedy_1"][:8]]


def test_speculative_generate_with_the_mtp_head():
  ref = np.load(DATA / "qwen3_5_mtp" / "reference.npz")
  ids = ",".join(map(str, ref["prompt_0"]))
  proc = _cli("generate", "--model-dir", str(DATA / "qwen3_5_mtp"), "--token-ids", ids, "--max-new-tokens", "8",
              "--speculative", "3", "--drafter", "mtp")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.split("\n")[0].split() == [str(t) for t in ref["greedy_0"][:8]]


def test_errors_are_one_line(tmp_path):
  bad = tmp_path / "nemotron"
  shutil.copytree(DATA / "nemotron_h", bad)
  cfg = json.loads((bad / "config.json").read_text())
  cfg["layers_block_type"][1] = "sliding_attention"
  (bad / "config.json").write_text(json.dumps(cfg))
  for args, match in ((("generate", "--model-dir", str(bad), "--token-ids", "1,2"), "layer 1 is 'sliding_attention'"),
                      (("generate", "--model-dir", str(tmp_path / "none"), "--token-ids", "1"), "has no config.json"),
                      (("generate", "--token-ids", "1,x"), "--token-ids '1,x'"),
                      (("generate", "--token-ids", "1", "--speculative", "2", "--drafter", "mtp"),
                       "a model with a multi-token-prediction head"),
                      (("demo", "--model-dir", str(tmp_path / "none")), "has no config.json")):
    proc = _cli(*args)
    assert proc.returncode == 2, (args, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], (args, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr
