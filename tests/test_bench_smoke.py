"""The GDN decode benchmark harness, end to end on CPU (``python -m bench.gdn_decode --smoke``).

Checks the result file's fields, the byte model against hand-computed numbers, the timing and
cursor checks, and that a wrong kernel fails the gate and gets no speedup.
"""
import json
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import pytest

from bench import common
from bench import gdn_decode
from bench import harness
from tests.helpers import with_xla_flags

META_FIELDS = ("date", "device_kind", "platform", "jax_version", "jaxlib_version", "command", "argv",
               "git_commit", "source_digest", "geometry", "options", "elapsed_s")
ROW_FIELDS = ("arm", "label", "impl", "family", "route", "state_dtype", "batch", "buffer_len", "layers",
              "ms_per_layer_step", "median_ms", "p20_ms", "p80_ms", "n_cycles", "bytes_per_row",
              "bytes_per_layer_step", "eff_gbps", "pct_ceiling", "speedup_vs_conv", "speedup_vs_xla",
              "gate", "checks", "status", "repeat")


@pytest.mark.slow
def test_smoke_run_writes_complete_results(tmp_path, emulated_peers):
  """The default arms, the small-batch policy's arm (plan(flush_all=True) every step: gated against
  XLA under the same plan policy, its cursor checks expecting empty windows) and SGLang's two
  (kernels emulated: see ``_fake_triton_call``)."""
  out, md, png = tmp_path / "r.json", tmp_path / "RESULTS.md", tmp_path / "p.png"
  arms = ",".join(gdn_decode.DEFAULT_ARMS + ("replay-pallas-flushall", "peer-sglang-conv", "peer-sglang-replay"))
  result = gdn_decode.main(["--smoke", "--arms", arms, "--out-json", str(out), "--markdown", "--results-md", str(md),
                            "--plot", str(png)])
  data = json.loads(out.read_text())
  assert data["rows"] and len(data["rows"]) == len(result["rows"])
  for field in META_FIELDS:
    assert field in data["meta"], field
  assert data["meta"]["command"].startswith("python -m bench.gdn_decode --smoke")
  assert data["ceiling"]["gbps"] > 0 and len(data["ceiling"]["runs"]) == 2
  assert {"conv", "replay", "not_counted"} <= set(data["bytes_model"])

  pallas_missing = gdn_decode.BENCH.pallas_available() is not None
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
  _check_peer_rows({r["label"]: r for r in data["rows"]})

  text = md.read_text()
  assert text.startswith("# replayssm_jax benchmark results")
  assert "## GDN decode" in text and "| replay-xla |" in text and "| x peer |" in text
  pytest.importorskip("matplotlib")
  assert png.stat().st_size > 1000

  again = gdn_decode.main(["--from-json", str(out)])  # re-render only, no device work
  assert len(again["rows"]) == len(data["rows"])


@pytest.mark.slow
def test_wrong_kernel_fails_the_gate(tmp_path, monkeypatch, emulated_peers):
  """An arm whose output is off by 50 % fails its gate and gets no speed-up (here: none against the
  peer arm, which our passing replay-xla row gets)."""
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
  gdn_decode.main(["--smoke", "--arms", "replay-xla,replay-xla-rc,peer-sglang-replay", "--repeat-arm", "none",
                   "--out-json", str(out)])
  rows = {r["label"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["replay-xla"]["status"] == "ok" and rows["replay-xla"]["speedup_vs_peer"] > 0
  bad = rows["replay-xla-rc"]
  assert bad["status"] == "gate-failed" and not bad["gate"]["passed"]
  assert bad["gate"]["o_rel"] > 0.1 and bad["speedup_vs_peer"] is None


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
  # P·pool >= 1 GiB, P >= 2, P <= the unrolled-layer cap.
  assert harness.layers_for(geo, 512, "float32", 2**30, 4096) == 2
  assert harness.layers_for(geo, 16, "bfloat16", 2**30, 4096) == 64
  assert harness.layers_for(geo, 4, "bfloat16", 2**30, 4096) == 128                # 256 uncapped
  assert harness.layers_for(geo, 1, "bfloat16", 2**30, 4096) == common.MAX_UNROLLED_LAYERS == 128


def test_launch_config_strings():
  assert common.parse_config("default").is_default
  cfg = common.parse_config("bv64w4s2fbv32fw2ft4")
  assert cfg.kwargs() == {"block_v": 64, "num_warps": 4, "num_stages": 2, "fold_block_v": 32,
                          "fold_num_warps": 2, "fold_tiles": 4}
  with pytest.raises(ValueError, match="launch config"):
    common.parse_config("bv64x")


@pytest.mark.slow
def test_mamba2_smoke_run(tmp_path, emulated_peers):
  """``python -m bench.mamba2_decode --smoke`` end to end (one Pallas arm per family: interpreted
  Pallas programs take seconds each to compile on CPU), with the vLLM and mamba_ssm peer arms
  (kernels emulated)."""
  from bench import mamba2_decode  # noqa: PLC0415
  out, md = tmp_path / "r.json", tmp_path / "RESULTS.md"
  mamba2_decode.main(["--smoke", "--arms", "conv-pallas,replay-pallas-oo,peer-mamba-ssm-conv,peer-vllm-replay",
                      "--repeat-arm", "none", "--out-json", str(out), "--markdown", "--results-md", str(md)])
  data = json.loads(out.read_text())
  assert data["meta"]["command"].startswith("python -m bench.mamba2_decode --smoke")
  assert data["ceiling"]["gbps"] > 0 and {"conv", "replay"} <= set(data["bytes_model"])
  rows = {r["label"]: r for r in data["rows"]}
  assert set(rows) == {"conv-pallas", "replay-pallas-oo", "peer-mamba-ssm-conv", "peer-vllm-replay"}
  for r in rows.values():
    for field in ROW_FIELDS:
      assert field in r, (r["label"], field)
    assert r["status"] == "ok", (r["label"], r["status"], r["error"], r.get("gate"), r.get("checks"))
    assert r["gate"]["passed"] and r["gate"]["oracle_o_rel"] <= r["gate"]["tol_rel"]
    assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
  oo = rows["replay-pallas-oo"]
  assert oo["checks"]["cursor_count_back"] and oo["checks"]["cursor_base_advanced"]
  assert oo["speedup_vs_conv"] > 0   # (x xla: the GDN smoke run)
  _check_peer_rows(rows)
  assert "## Mamba2 decode" in md.read_text()


def test_mamba2_bytes_model_nemotron_super():
  from bench import mamba2_decode  # noqa: PLC0415
  geo = mamba2_decode.NEMOTRON_SUPER
  io = (2 * 128 * 64 + 128 + 2 * 8 * 128) * 2 + 128 * 64 * 2  # x, z, dt, B, C (bf16), y
  state = 128 * 64 * 128 * 4
  conv = mamba2_decode.bytes_model(geo, "conv", None, "float32", "bfloat16", "bfloat16")
  assert conv["total"] == io + 2 * state
  entry = (128 * 64 + 8 * 128) * 2 + 128 * 4
  rep = mamba2_decode.bytes_model(geo, "replay", 8, "float32", "bfloat16", "bfloat16")
  assert rep["total"] == pytest.approx(io + state * (1 + 1 / 8) + entry * (7 / 2 + 1))
  # The layers share one pool array; past 2**31 elements the Triton kernels address it with int64
  # offsets, so the layer count follows --min-layers and --target-bytes alone.
  assert harness.layers_for(geo, 512, "bfloat16", 2**30, 4096, min_layers=8) == 8
  assert harness.layers_for(geo, 4, "bfloat16", 2**30, 4096, min_layers=8) == 128   # unroll cap


def test_model_decode_smoke(tmp_path):
  from bench import model_decode
  out, md = tmp_path / "m.json", tmp_path / "m.md"
  result = model_decode.main(["--smoke", "--batches", "4", "--reps", "2", "--rep-seconds", "0.01",
                              "--out-json", str(out), "--markdown", str(md)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["batch"], r["mode"]) for r in rows] == [(4, "conventional"), (4, "replay")]
  for r in rows:
    assert r["median_ms"] > 0 and r["tokens_per_s"] > 0 and len(r["ms_per_step"]) == 2
  assert rows[1]["speedup_vs_conv"] > 0 and len(result["rows"]) == 2
  assert "| replay |" in md.read_text()


def test_model_parts_smoke_compares_like_with_like(tmp_path):
  """bench.model_parts: each pair of arms computes the same thing (conv outputs on live rows and the
  conv state; the two MLP forms with the same weights), and the smoke run writes one row per arm."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from bench import model_parts
  from replayssm_jax.models.lm import SwiGLU
  x = common.hash_normal(1, (4, 16)).astype(jnp.bfloat16)
  weight, pool = common.hash_normal(2, (4, 16)), common.hash_normal(3, (6, 3, 16)).astype(jnp.bfloat16)
  slots = jnp.array([4, -1, 0, 2], jnp.int32)
  (o1, p1), (o2, p2) = (arm(x, weight, pool, slots) for arm in model_parts.CONV_ARMS.values())
  live = np.asarray(slots) >= 0
  np.testing.assert_array_equal(np.asarray(o1)[live], np.asarray(o2)[live])
  np.testing.assert_array_equal(np.asarray(p1, np.float32), np.asarray(p2, np.float32))
  assert not np.array_equal(np.asarray(p1, np.float32), np.asarray(pool, np.float32))
  fused = SwiGLU(8, 12, dtype=jnp.float32, rngs=nnx.Rngs(0))
  two = model_parts.TwoProjections(8, 12, dtype=jnp.float32, rngs=nnx.Rngs(1))
  gate, up = jnp.split(fused.gate_up.kernel[...], 2, axis=1)
  two.gate.kernel[...], two.up.kernel[...], two.down.kernel[...] = gate, up, fused.down.kernel[...]
  h = common.hash_normal(4, (3, 8))
  np.testing.assert_allclose(np.asarray(fused(h)), np.asarray(two(h)), rtol=1e-6, atol=1e-6)

  out = tmp_path / "parts.json"
  model_parts.main(["--smoke", "--reps", "2", "--rep-seconds", "0.001", "--out-json", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [r["part"] for r in rows] == [*model_parts.CONV_ARMS, *model_parts.MLP_ARMS]
  assert all(r["us_median"] > 0 for r in rows)


def test_a_group_that_cannot_be_set_up_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
  """Buffers that cannot be built for a group (e.g. past the random generator's index range) give
  error rows; the run still writes its results."""
  from bench import harness  # noqa: PLC0415

  def refuse(bench, setup):
    raise ValueError("too many elements for this test")
  monkeypatch.setattr(harness, "abstract_state", refuse)
  out = tmp_path / "r.json"
  gdn_decode.main(["--smoke", "--arms", "conv-xla,replay-xla", "--out-json", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert rows and all(r["status"] == "error" and "too many elements" in r["error"] for r in rows)


def test_model_decode_stacks():
  """--stack: every mixer GDN, Mamba2 (mamba2-2.7b heads) or alternating; each a valid LMConfig."""
  from bench import model_decode  # noqa: PLC0415
  from replayssm_jax.models import LMConfig  # noqa: PLC0415
  for smoke in (True, False):
    types = {stack: LMConfig(**model_decode.stack_geometry(stack, smoke)).layer_types
             for stack in model_decode.STACKS}
    n = len(types["gdn"])
    assert types["gdn"] == ("gdn",) * n and types["mamba2"] == ("mamba2",) * n
    assert types["hybrid"][:2] == ("gdn", "mamba2") and len(types["hybrid"]) == n
  assert model_decode.stack_geometry("mamba2", False)["mamba2_num_heads"] == 80


@pytest.mark.slow
def test_verify_decode_smoke(tmp_path):
  """``python -m bench.verify_decode --smoke``: all four GDN arms, honest steps, gate, speedups, memory."""
  from bench import verify_decode  # noqa: PLC0415
  out, md = tmp_path / "v.json", tmp_path / "v.md"
  result = verify_decode.main(["--smoke", "--out-json", str(out), "--markdown", str(md)])
  data = json.loads(out.read_text())
  assert data["meta"]["command"].startswith("python -m bench.verify_decode --smoke")
  rows = {r["arm"]: r for r in data["rows"]}
  assert set(rows) == set(verify_decode.DEFAULT_ARMS) and len(result["rows"]) == 4
  for r in rows.values():
    assert r["status"] == "ok", (r["arm"], r["status"], r["error"], r.get("gate"))
    assert r["gate"]["o_rel_vs_xla"] <= r["gate"]["tol_rel"]
    assert 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
  assert rows["replay-pallas"]["speedup_vs_conv"] > 0 and rows["replay-xla"]["speedup_vs_conv"] > 0
  # The resolved launch config (route and tiles) is recorded, so a run stays readable after the
  # config's defaults change.
  assert "route='output_only'" in rows["replay-pallas"]["launch_config"]
  assert "launch_config" not in rows["replay-xla"]
  assert "## Memory per request and layer" in md.read_text()


def test_verify_decode_read_copy_arm(tmp_path):
  """``--arms replay-pallas-copy``: verify over buffers with a bf16 read copy, gated against XLA over
  the same buffers, on the route the copy-free arm takes, its speed-up against conv-pallas, the copy
  counted in its memory; skipped (not failed) for a bf16 checkpoint."""
  from bench import verify_decode  # noqa: PLC0415
  out = tmp_path / "v.json"
  verify_decode.main(["--smoke", "--arms", "replay-pallas,replay-pallas-copy,conv-pallas",
                      "--state-dtypes", "float32,bfloat16", "--out-json", str(out)])
  rows = {(r["arm"], r["state_dtype"]): r for r in json.loads(out.read_text())["rows"]}
  copy, plain = rows["replay-pallas-copy", "float32"], rows["replay-pallas", "float32"]
  assert copy["status"] == "ok" and copy["read_copy_dtype"] == "bfloat16", (copy["status"], copy["error"])
  assert copy["speedup_vs_conv"] > 0 and copy["launch_config"] == plain["launch_config"]
  assert copy["memory_per_request"] > plain["memory_per_request"]
  assert rows["replay-pallas-copy", "bfloat16"]["status"] == "skipped"


@pytest.mark.slow
def test_verify_decode_mosaic_variants(tmp_path):
  """``--variants`` reaches the Mosaic arm's wrapper too: rows=2 (two batch rows per program)
  runs, passes its gate and is labelled (one interpreted Mosaic arm: each costs ~20 s on CPU)."""
  from bench import verify_decode  # noqa: PLC0415
  out = tmp_path / "v.json"
  verify_decode.main(["--smoke", "--arms", "replay-mosaic", "--variants", "rows=2", "--out-json", str(out)])
  rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {"replay-mosaic[rows=2]"}
  for r in rows.values():
    assert r["status"] == "ok" and r["gate"]["passed"], (r["arm"], r["error"], r.get("gate"))
  # Each arm runs the variants its wrapper takes; a variant no arm takes is refused.
  both = verify_decode._variants(",rows=2,split=true")
  assert verify_decode.arm_variants("replay-pallas", both) == [(), (("split", True),)]
  assert verify_decode.arm_variants("replay-mosaic", both) == [(), (("rows", 2),)]
  assert verify_decode.arm_variants("conv-pallas", both) == [()]
  with pytest.raises(SystemExit):
    verify_decode.parse_args(["--arms", "replay-pallas,conv-pallas", "--variants", ",rows=2"])


def test_configs_reach_the_arms_that_take_them(capsys):
  """--configs go to the arms whose kernels take their knobs: Triton arms all but the Mosaic-only
  rows, the Mosaic arms only rows; a config no arm takes is refused."""
  from bench import common, gdn_decode, harness, mamba2_decode  # noqa: PLC0415
  cfgs = [common.parse_config(c) for c in ("default", "r2", "ft2", "bv32r2")]
  names = lambda bench, arm: [c.name for c in harness._arm_configs(bench, harness.ARMS[arm], cfgs)]
  assert names(gdn_decode.BENCH, "replay-pallas-oo") == ["default", "ft2"]
  assert names(gdn_decode.BENCH, "replay-mosaic") == ["default", "r2"]
  assert names(gdn_decode.BENCH, "conv-mosaic") == ["default", "r2"]
  assert names(gdn_decode.BENCH, "replay-xla") == ["default"]
  assert names(mamba2_decode.BENCH, "replay-mosaic-rc") == ["default", "r2"]
  for main, arms in ((gdn_decode.main, "conv-pallas,replay-pallas-oo"),
                     (mamba2_decode.main, "conv-xla,replay-pallas-rc")):
    with pytest.raises(SystemExit):
      main(["--smoke", "--arms", arms, "--configs", "default,r2", "--dry-run"])
    assert "no arm of" in capsys.readouterr().err


def test_verify_layers_follow_the_target_bytes():
  from bench import verify_decode  # noqa: PLC0415
  mamba2_super, qwen = 128 * 64 * 128, 32 * 128 * 128   # one slot's state elements
  assert verify_decode.layers_for(mamba2_super, 256, "float32", 2**30, 64) == 2   # at least 2
  assert verify_decode.layers_for(qwen, 256, "bfloat16", 2**30, 64) == 4
  assert verify_decode.layers_for(qwen, 32, "float32", 2**30, 64) == 16


def test_verify_memory_model_qwen35_4b():
  """Checkpoint + rings (R = next_pow2(16 + 7) = 32, bf16 ring) vs T + 1 f32 states at T = 8."""
  from bench import verify_decode  # noqa: PLC0415
  mem = verify_decode.memory_per_request(verify_decode.FAMILIES["gdn"], 8, 16, "float32", "bfloat16")
  state = 32 * 128 * 128 * 4
  rings = 16 * 32 * 128 * 2 + 32 * 32 * 128 * 2 + 32 * 32 * 4
  assert mem["ring_size"] == 32 and mem["replay"] == state + rings
  assert mem["conv_t_plus_1"] == 9 * state
  assert mem["ratio_vs_t_plus_1"] == pytest.approx(0.1322, abs=1e-3)   # issue 4: <= 35 %


def test_tp_decode_smoke(tmp_path):
  """bench.tp_decode on 2 CPU host devices (a subprocess: the device count is fixed at backend start):
  sharded greedy tokens == one-device tokens, caches equal. The timing part (CPU times mean nothing)
  is left to the GPU run; it shares ``staggered_cache``/``step_row`` with model_decode's smoke test."""
  import pathlib
  import subprocess
  import sys
  out = tmp_path / "tp.json"
  env = with_xla_flags("--xla_force_host_platform_device_count=2")
  subprocess.run([sys.executable, "-m", "bench.tp_decode", "--smoke", "--steps", "6", "--skip-timing",
                  "--out-json", str(out)],
                 cwd=pathlib.Path(__file__).resolve().parent.parent, env=env, check=True, timeout=600)
  rows = json.loads(out.read_text())["rows"]
  assert [r["mode"] for r in rows] == ["replay", "conventional"] and {r["part"] for r in rows} == {"equality"}
  for r in rows:
    assert r["tokens_identical"] and r["cache_max_abs_diff"] < 1e-4 and r["devices"] == 2, r


def test_engine_spec_tp_smoke(tmp_path):
  """bench.engine_spec --tp 2 on 2 CPU host devices (a subprocess, as above): the engine serves the
  sharded model, every arm's greedy tokens equal the first arm's, the drafts get accepted."""
  import pathlib
  import subprocess
  import sys
  out = tmp_path / "tp.json"
  env = with_xla_flags("--xla_force_host_platform_device_count=2")
  arms = "decode-replay,decode-replay-overlap,spec-replay-overlap"
  subprocess.run([sys.executable, "-m", "bench.engine_spec", "--smoke", "--model", "looping", "--tp", "2",
                  "--prompts", "repetitive", "--arms", arms, "--out-json", str(out)],
                 cwd=pathlib.Path(__file__).resolve().parent.parent, env=env, check=True, timeout=900)
  result = json.loads(out.read_text())["result"]
  assert result["tp"] == 2 and len(result["rows"]) == 3
  for row in result["rows"]:
    assert row["identical_to_baseline"] == 1.0, row
  assert result["rows"][-1]["accepted"] > 0, result["rows"][-1]


def test_model_trace_sums_stream_kernels_per_step():
  """bench.model_trace's parser: complete events on GPU stream threads only, summed by name and
  divided by the steps (host threads and metadata ignored)."""
  from bench import model_trace  # noqa: PLC0415
  meta = lambda tid, name: {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
  run = lambda tid, name, dur: {"ph": "X", "pid": 1, "tid": tid, "name": name, "dur": dur}
  events = [meta(7, "Stream #13(Compute)"), meta(3, "python3"),
            run(7, "replay_step", 100.0), run(7, "replay_step", 120.0), run(7, "fold", 30.0),
            run(3, "replay_step", 999.0), {"ph": "i", "pid": 1, "tid": 7, "name": "marker"}]
  got = model_trace.kernel_times(events, steps=2)
  assert got == [{"kernel": "replay_step", "us_per_step": 110.0, "launches_per_step": 1.0},
                 {"kernel": "fold", "us_per_step": 15.0, "launches_per_step": 0.5}]


def test_verify_mosaic_arm_is_compared_with_conv_pallas():
  """Mosaic has no conventional verify: the replay-mosaic row's speed-up is against conv-pallas."""
  from bench import verify_decode  # noqa: PLC0415
  base = dict(family="gdn", state_dtype="float32", num_tokens=4, batch=8, status="ok")
  rows = [dict(base, kind="conv", impl="pallas_triton", median_ms=2.0),
          dict(base, kind="conv", impl="xla", median_ms=8.0),
          dict(base, kind="replay", impl="pallas_mosaic", median_ms=1.0),
          dict(base, kind="replay", impl="xla", median_ms=4.0)]
  verify_decode.derive(rows)
  assert rows[2]["speedup_vs_conv"] == 2.0 and rows[2]["speedup_vs_conv_pallas"] == 2.0
  assert rows[3]["speedup_vs_conv"] == 2.0 and rows[3]["speedup_vs_conv_pallas"] == 0.5


@pytest.mark.slow
def test_model_spec_smoke(tmp_path):
  """``python -m bench.model_spec --smoke`` on the hybrid stack (GDN + Mamba2 mixers): the XLA and the
  interpreted Triton verify kernels pass the gate, are timed, and get speed-ups vs pallas_triton."""
  from bench import model_spec  # noqa: PLC0415
  out, md = tmp_path / "s.json", tmp_path / "s.md"
  result = model_spec.main(["--smoke", "--stack", "hybrid", "--reps", "2", "--rep-seconds", "0.01",
                            "--out-json", str(out), "--markdown", str(md)])
  data = json.loads(out.read_text())
  assert data["meta"]["command"].startswith("python -m bench.model_spec --smoke")
  assert data["meta"]["source_digest"] and len(result["rows"]) == 2
  rows = {r["implementation"]: r for r in data["rows"]}
  assert list(rows) == ["xla", "pallas_triton"]
  for r in rows.values():
    assert (r["stack"], r["num_tokens"], r["batch"], r["buffer_len"]) == ("hybrid", 4, 8, 8)
    assert r["status"] == "ok", (r["implementation"], r["status"], r["error"], r.get("gate"))
    gate = r["gate"]
    assert gate["passed"] and gate["cursor_equal"] and gate["max_rel_vs_xla"] <= gate["tol_rel"]
    assert {"digest", "state0", "state1", "conv0", "conv1"} <= set(gate["rel"])
    assert len(r["ms_per_step"]) == 2 and 0 < r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
    assert r["state_finite"] and r["speedup_vs_triton"] > 0 and isinstance(r["cache_copies"], list)
  # The Triton kernels really ran: their bf16 ring entries round apart from XLA's.
  assert rows["pallas_triton"]["gate"]["max_rel_vs_xla"] > 0 and rows["pallas_triton"]["speedup_vs_triton"] == 1.0
  assert "| hybrid | 4 | 8 | 8 | pallas_triton |" in md.read_text()


def test_model_spec_wrong_kernel_fails_the_gate(tmp_path, monkeypatch):
  """A GDN verify whose outputs are shifted by one token (only for implementation=None, the "none"
  arm; on CPU None runs XLA) fails the gate against the XLA arm: timed, but no speed-up."""
  import jax.numpy as jnp  # noqa: PLC0415

  import replayssm_jax as rs  # noqa: PLC0415
  from bench import model_spec  # noqa: PLC0415
  real = rs.gdn.replay_verify

  def wrong(*args, implementation=None, **kwargs):
    o, bufs = real(*args, implementation=implementation, **kwargs)
    return (jnp.roll(o, 1, axis=1) if implementation is None else o), bufs
  monkeypatch.setattr(rs.gdn, "replay_verify", wrong)
  out = tmp_path / "w.json"
  model_spec.main(["--smoke", "--implementations", "xla,none", "--reps", "2", "--rep-seconds", "0.01",
                   "--out-json", str(out)])
  rows = {r["implementation"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["xla"]["status"] == "ok" and rows["xla"]["gate"]["passed"]
  bad = rows["none"]
  assert bad["status"] == "gate-failed" and not bad["gate"]["passed"], bad["gate"]
  assert bad["gate"]["max_rel_vs_xla"] > 0.1 and bad["gate"]["cursor_equal"] and bad["median_ms"] > 0


def test_model_spec_speedups_only_between_passed_rows():
  """Speed-up = the pallas_triton median of the same (stack, T, B, L) / the row's median; none for a
  row that failed its gate, nor where the pallas_triton row failed or is missing."""
  from bench import model_spec  # noqa: PLC0415
  base = dict(stack="gdn", num_tokens=4, buffer_len=8, status="ok")
  rows = [dict(base, batch=32, implementation="pallas_triton", median_ms=2.0),
          dict(base, batch=32, implementation="pallas_mosaic", median_ms=1.0),
          dict(base, batch=32, implementation="none", median_ms=4.0, status="gate-failed"),
          dict(base, batch=256, implementation="pallas_triton", median_ms=3.0, status="gate-failed"),
          dict(base, batch=256, implementation="pallas_mosaic", median_ms=1.0),
          dict(base, batch=8, implementation="pallas_mosaic", median_ms=1.0)]
  model_spec.derive(rows)
  assert [r["speedup_vs_triton"] for r in rows] == [1.0, 2.0, None, None, None, None]


class _FakeTensor:
  """The few torch.Tensor methods bench.peer_fla's gate uses, over a numpy array."""

  def __init__(self, a):
    self.a = np.asarray(a)

  def __getitem__(self, i):
    return _FakeTensor(self.a[i])

  def float(self):
    return _FakeTensor(self.a.astype(np.float32))

  def cpu(self):
    return self

  def numpy(self):
    return self.a


class _FakeTorch:
  from_dlpack = staticmethod(lambda x: _FakeTensor(np.asarray(jnp.asarray(x, jnp.float32))))

  class cuda:  # noqa: N801  (torch.cuda)
    synchronize = staticmethod(lambda: None)


def _fla_convention_step(decay: float):
  """One GDN step in fla's calling convention (q, k [B, 1, Hk, K]; state [N, Hv, V, K] with
  state_v_first): a stand-in for fused_recurrent_gated_delta_rule; ``decay`` 1 is exact."""
  def step(q, k, v, *, g, beta, scale, initial_state, output_final_state, state_v_first):
    assert output_final_state and state_v_first
    q, k, v, g, beta, S = (x.a.astype(np.float64) for x in (q, k, v, g, beta, initial_state))
    group = v.shape[2] // k.shape[2]
    kh = np.repeat(k[:, 0], group, axis=1)
    S = decay * np.exp(g[:, 0])[..., None, None] * S
    u = beta[:, 0][..., None] * (v[:, 0] - np.einsum("bhvk,bhk->bhv", S, kh))
    S = S + u[..., :, None] * kh[..., None, :]
    o = np.einsum("bhvk,bhk->bhv", S, np.repeat(q[:, 0], group, axis=1) * scale)
    return _FakeTensor(o[:, None]), _FakeTensor(S)
  return step


def test_peer_fla_gate_reads_fla_layouts():
  """The peer gate compares fla's [B, 1, Hv, V] output and [N, Hv, V, K] state with XLA's decode:
  an exact step in fla's convention passes, a 1 % decay error fails."""
  from bench import peer_fla
  geo = gdn_decode.SMOKE
  inputs, state = peer_fla.make_inputs(geo, 3, seed=1), peer_fla.make_state(geo, 3, seed=2)
  scale = geo.kd ** -0.5
  ok = peer_fla.gate(_FakeTorch, _fla_convention_step(1.0), inputs, state, scale)
  assert ok["passed"] and ok["rel_l2"]["state"] < 1e-6, ok
  bad = peer_fla.gate(_FakeTorch, _fla_convention_step(0.99), inputs, state, scale)
  assert not bad["passed"], bad


def test_peer_fla_compare_and_skip(monkeypatch):
  """Speed-up only where both gates passed; GB/s from the byte model; a missing peer is a
  recorded skip, not an error."""
  from bench import peer_fla
  peers = [{"batch": b, "layers": 8, "median_ms": 0.3, "status": s, "bytes_per_layer_step": 3e8,
            "gate": {"rel_l2": {"output": 1e-6, "state": 2e-6}}} for b, s in ((32, "ok"), (256, "gate-failed"))]
  ours = [{"arm": "conv-pallas", "batch": b, "median_ms": 0.25, "status": "ok", "eff_gbps": 1.0,
           "pct_ceiling": 2.0} for b in (32, 256)]
  rows = peer_fla.compare(ours, peers, ceiling_gbps=4000.0)
  assert rows[0]["ours_speedup_vs_peer"] == pytest.approx(1.2)
  assert rows[1]["ours_speedup_vs_peer"] is None
  assert rows[0]["peer_gbps"] == pytest.approx(1000.0) and rows[0]["peer_pct_ceiling"] == pytest.approx(25.0)
  assert "FAILED" in peer_fla.table(rows).splitlines()[-1]

  def missing():
    raise ImportError("fla (fla-core) is not importable (test)")
  monkeypatch.setattr(peer_fla, "load_peer", missing)
  assert "fla" in peer_fla.main(["--batches", "2"])["skipped"]


def _scan_lengths(jaxpr) -> list[int]:
  """Trip counts of the static loops (``scan``: a fori_loop with static bounds) in a jaxpr, nested
  ones included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      out.append(eqn.params["length"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _scan_lengths(sub)
  return out


@pytest.mark.parametrize("arm", ["conv-xla", "replay-xla"])
def test_runner_unrolls_the_layers(arm):
  """No loop of the timed program runs over the P = 5 layers: they are unrolled, each with its
  operands made outside the loops (a loop over layers cost ~7.5 µs per layer-step on the H200)."""
  bench = gdn_decode.BENCH
  setup = harness.Setup(geo=bench.smoke_geometry, family=harness.ARMS[arm].family, batch=2,
                        layers=5, buffer_len=4, state_dtype="float32", ring_dtype="float32",
                        act_dtype="float32", bank=2, seed=0)
  case = harness.Case(harness.ARMS[arm], harness._DEFAULT, setup)
  carry, consts = harness.abstract_state(bench, setup)
  jaxpr = jax.make_jaxpr(harness.make_runner(bench, case))(carry, consts, 1)
  lengths = _scan_lengths(jaxpr.jaxpr)
  assert setup.cycle_steps in lengths and setup.layers not in lengths


@pytest.mark.parametrize("kind", ["conv", "replay"])
def test_verify_runner_unrolls_the_layers(kind):
  """bench.verify_decode's timed program has no loop over its P = 5 layers, as the layer harness."""
  from bench import verify_decode  # noqa: PLC0415
  setup = verify_decode.Setup(family=verify_decode.SMOKE["gdn"], batch=2, num_tokens=2, buffer_len=4,
                              layers=5, state_dtype="float32", ring_dtype="float32",
                              act_dtype="float32", bank=2, cycle_steps=2, seed=0)
  carry, consts = jax.eval_shape(lambda: verify_decode.init(setup, kind))
  jaxpr = jax.make_jaxpr(verify_decode.make_runner(setup, kind, "xla"))(carry, consts, 1)
  lengths = _scan_lengths(jaxpr.jaxpr)
  assert setup.cycle_steps in lengths and setup.layers not in lengths


def test_gdn_breakdown_runs_each_pass():
  """bench.gdn_breakdown calls kernel internals (the step and fold launches on their own), so it
  breaks silently when their signatures move: run it once on CPU, interpreted."""
  from bench import gdn_breakdown  # noqa: PLC0415
  rows = gdn_breakdown.main(["--batch", "2", "--buffer-len", "2", "--layers", "1", "--config", "ft2",
                             "--reps", "1", "--rep-seconds", "0.001",
                             "--stream-configs", "bv8w1,bv64w2", "--native-stream-configs", "bv8w1"])
  assert len(rows) == 10 and all(float(r[1]) > 0 for r in rows)
  assert [r[0] for r in rows[-5:]] == ["checkpoint read only, XLA reduce",
                                       "checkpoint read only, Triton bv8w1, readout pattern",
                                       "checkpoint read only, Triton bv64w2, readout pattern",
                                       "checkpoint read only, Triton bv8w1, step pattern",
                                       "checkpoint read only, Triton bv64w2, step pattern"]


def test_gdn_breakdown_read_only_stream_reads_the_rows_checkpoints():
  """The read-only floor's kernels compute S_c[slot] · q per value head (``readout``) and
  S_c[slot] · (q + k/2) per value head in the step's program layout (``step``)."""
  from bench import gdn_breakdown as gb  # noqa: PLC0415
  state = jax.random.normal(jax.random.key(0), (5, gb.HV, gb.VD, gb.KD), jnp.float32)
  q = jax.random.normal(jax.random.key(1), (3, gb.HK, gb.KD), jnp.float32)
  k = jax.random.normal(jax.random.key(2), (3, gb.HK, gb.KD), jnp.float32)
  slots = jnp.array([4, 0, 2], jnp.int32)
  rep = lambda x: jnp.repeat(x, gb.HV // gb.HK, axis=1)
  for pattern, x in (("readout", q), ("step", q + 0.5 * k)):
    want = jnp.einsum("bhvk,bhk->bhv", state[slots], rep(x), precision="highest")
    got = gb.stream_readout(q, k, state, slots, block_v=32, num_warps=1, pattern=pattern)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4,
                               err_msg=pattern)


# ----------------------------------------------------------------------------------------------
# Peer arms (bench.peer_*): jax_triton has no CPU path, so their kernels are emulated here in the
# peers' calling conventions (the semantics their sources document), and the harness gates them
# against XLA and the float64 oracle exactly as on the GPU. What is checked is ours: input packing
# and gate conversion, ring layout conversion, cursor marshalling, aliasing indices, scalar types.

_PEER_KERNELS = types.SimpleNamespace(
    sglang_replay_decode="sglang_replay", sglang_packed_decode="sglang_packed", precompute="vllm_precompute",
    replay="vllm_replay", update="mamba_ssm_update", config=lambda kernel, dstate, L: (16, 1, 64, 128, 2))


def _scatter_rows(a, idx, keep, values):
  """``a`` with a[idx[b]] = values[b] where keep[b] (other rows dropped)."""
  return a.at[jnp.where(keep, idx, a.shape[0])].set(values.astype(a.dtype), mode="drop")


def _sglang_replay(mixed, a, b, A_log, dt_bias, h0, d, kc, gc, idx, wp, scale, *, H, HV, K, V, L, **_):
  B, r = mixed.shape[0], HV // H
  f = lambda x: x.astype(jnp.float32)
  q, k = f(mixed[:, :H * K]).reshape(B, H, K), f(mixed[:, H * K:2 * H * K]).reshape(B, H, K)
  v = f(mixed[:, 2 * H * K:]).reshape(B, HV, V)
  alpha = jnp.exp(-jnp.exp(A_log) * jax.nn.softplus(a + dt_bias))
  beta = jax.nn.sigmoid(b)
  live = jnp.arange(L)[None, :] < wp[:, None]                                     # [B, L]
  g = jnp.where(live[:, None], f(gc[idx]), 0.0)                                    # [B, HV, L]
  w = jnp.where(live[:, None], jnp.exp(g.sum(-1, keepdims=True) - jnp.cumsum(g, -1)), 0.0)
  kk = jnp.repeat(f(kc[idx]), r, axis=1)                                           # [B, HV, L, K]
  S = (jnp.exp(g.sum(-1))[..., None, None] * f(h0[idx])
       + jnp.einsum("bhj,bhjv,bhjk->bhvk", w, f(d[idx]), kk))
  kh, qh = jnp.repeat(k, r, axis=1), jnp.repeat(q, r, axis=1) * scale
  S = alpha[..., None, None] * S
  u = beta[..., None] * (v - jnp.einsum("bhvk,bhk->bhv", S, kh))
  o = jnp.einsum("bhvk,bhk->bhv", S, qh) + u * jnp.sum(kh * qh, -1)[..., None]
  flush = wp == L - 1
  h0 = _scatter_rows(h0, idx, flush, S + u[..., None] * kh[..., None, :])
  pos = lambda c: c.at[jnp.where(flush, c.shape[0], idx), :, wp]
  d = pos(d).set(u.astype(d.dtype), mode="drop")
  kc = pos(kc).set(k.astype(kc.dtype), mode="drop")
  gc = pos(gc).set(jnp.log(alpha), mode="drop")
  return o[:, None].astype(mixed.dtype), h0, d, kc, gc


def _sglang_packed(mixed, a, b, A_log, dt_bias, h0, idx, scale, *, H, HV, K, V, **_):
  B, r = mixed.shape[0], HV // H
  f = lambda x: x.astype(jnp.float32)
  q, k = f(mixed[:, :H * K]).reshape(B, H, K), f(mixed[:, H * K:2 * H * K]).reshape(B, H, K)
  kh, qh = jnp.repeat(k, r, axis=1), jnp.repeat(q, r, axis=1) * scale
  S = jnp.exp(-jnp.exp(A_log) * jax.nn.softplus(a + dt_bias))[..., None, None] * f(h0[idx])
  u = jax.nn.sigmoid(b)[..., None] * (f(mixed[:, 2 * H * K:]).reshape(B, HV, V) - jnp.einsum("bhvk,bhk->bhv", S, kh))
  S = S + u[..., None] * kh[..., None, :]
  o = jnp.einsum("bhvk,bhk->bhv", S, qh)
  return o[:, None].astype(mixed.dtype), _scatter_rows(h0, idx, idx >= 0, S)


def _vllm_precompute(B, C, Bc, wp, is_flush, idx, *, L, **_):
  cur = jnp.arange(L)[None, :, None] == wp[:, None, None]                             # [B, L, 1]
  B_all = jnp.where(cur[:, None], B[:, :, None].astype(jnp.float32), Bc[idx].astype(jnp.float32))
  return jnp.einsum("bgjn,bgn->bgj", B_all, C.astype(jnp.float32))


def _vllm_replay(pool, seed, x, dt, dt_bias, A, B, C, D, z, xc, dtc, Bc, bc, wp, is_flush, idx, *, L, ngroups,
                 **_):
  f = lambda t: t.astype(jnp.float32)
  r = x.shape[1] // ngroups
  dt_cur = jax.nn.softplus(f(dt) + dt_bias)                                          # [B, H]
  j = jnp.arange(L)[None, None, :]
  cur, hist = j == wp[:, None, None], j < wp[:, None, None]                          # [B, 1, L]
  dt_all = jnp.where(cur, dt_cur[..., None], jnp.where(hist, dtc[idx], 0.0))          # [B, H, L]
  cum, tot = A[:, None] * jnp.cumsum(dt_all, -1), A * dt_all.sum(-1)
  scale = jnp.where(cur | hist, dt_all * jnp.exp(tot[..., None] - cum), 0.0)
  x_all = jnp.where(cur[..., None], f(x)[:, :, None], f(xc[idx]))                     # [B, H, L, P]
  B_all = jnp.where(cur[..., None], f(B)[:, :, None], f(Bc[idx]))                     # [B, G, L, N]
  Ch, S0 = jnp.repeat(f(C), r, axis=1), f(pool[idx])
  flush = is_flush != 0
  S_new = jnp.exp(tot)[..., None, None] * S0 + jnp.einsum("bhj,bhjp,bhjn->bhpn", scale, x_all,
                                                           jnp.repeat(B_all, r, axis=1))
  y_window = (jnp.exp(tot)[..., None] * jnp.einsum("bhpn,bhn->bhp", S0, Ch)
              + jnp.einsum("bhjp,bhj->bhp", x_all, scale * jnp.repeat(bc, r, axis=1)))
  y = jnp.where(flush[:, None, None], jnp.einsum("bhpn,bhn->bhp", S_new, Ch), y_window)
  y = (y + D[:, None] * f(x)) * f(z) * jax.nn.sigmoid(f(z))
  at = lambda c: c.at[jnp.where(flush, c.shape[0], idx), :, wp]
  return (y.astype(x.dtype), _scatter_rows(pool, idx, flush, S_new), at(xc).set(x.astype(xc.dtype), mode="drop"),
          at(dtc).set(dt_cur, mode="drop"), at(Bc).set(B.astype(Bc.dtype), mode="drop"))


def _mamba_ssm_update(S, x, dt, dt_bias, A, B, C, D, z, idx, *, ngroups, **_):
  f = lambda t: t.astype(jnp.float32)
  r = x.shape[1] // ngroups
  delta = jax.nn.softplus(f(dt) + dt_bias)
  St = (jnp.exp(delta * A)[..., None, None] * f(S[idx])
        + (delta[..., None] * f(x))[..., None] * jnp.repeat(f(B), r, axis=1)[:, :, None, :])
  y = jnp.einsum("bhpn,bhn->bhp", St, jnp.repeat(f(C), r, axis=1)) + D[:, None] * f(x)
  return _scatter_rows(S, idx, idx >= 0, St), (y * f(z) * jax.nn.sigmoid(f(z))).astype(x.dtype)


_EMULATED = {"sglang_replay": _sglang_replay, "sglang_packed": _sglang_packed, "vllm_precompute": _vllm_precompute,
             "vllm_replay": _vllm_replay, "mamba_ssm_update": _mamba_ssm_update}


def _fake_triton_call(*args, kernel, out_shape, grid, input_output_aliases=None, num_warps=None,
                      num_stages=None, **meta):
  """jax_triton.triton_call's contract, checked, around an emulated kernel: aliases index the array
  arguments only, an aliased output has its input's shape and dtype, float scalars are np.float32
  (a Python float would reach the kernel as fp64), every grid extent is a positive int."""
  arrays = [a for a in args if not isinstance(a, (bool, int, float, np.floating))]
  assert all(isinstance(a, np.float32) for a in args if isinstance(a, (float, np.floating))), args
  outs = out_shape if isinstance(out_shape, (list, tuple)) else [out_shape]
  for i, j in (input_output_aliases or {}).items():
    assert (arrays[i].shape, arrays[i].dtype) == (outs[j].shape, outs[j].dtype), (kernel, i, j)
  assert all(isinstance(g, int) and g > 0 for g in grid), grid
  got = _EMULATED[kernel](*args, **meta)
  got = got if isinstance(got, tuple) else (got,)
  assert [(o.shape, o.dtype) for o in got] == [(o.shape, o.dtype) for o in outs], kernel
  return list(got) if isinstance(out_shape, (list, tuple)) else got[0]


@pytest.fixture
def emulated_peers(monkeypatch):
  from bench import peer_common  # noqa: PLC0415
  monkeypatch.setattr(peer_common.Peer, "kernels", lambda self: _PEER_KERNELS)
  monkeypatch.setattr(peer_common, "triton_call", _fake_triton_call)


def _check_peer_rows(rows):
  """Peer rows (kernels emulated) passed their gate like ours; the replay peer ran on its own setup
  (ring base 0) with cursors advancing; our rows got an "x peer" speed-up against the peer of their kind."""
  peers = {r["family"]: r for r in rows.values() if r["impl"] == "peer"}
  assert set(peers) == {"conv", "replay"}
  for r in peers.values():
    assert r["status"] == "ok" and r["gate"]["passed"], (r["arm"], r["error"], r.get("gate"))
    assert r["gate"]["oracle_o_rel"] <= r["gate"]["tol_rel"] and r["speedup_vs_peer"] is None
  assert peers["replay"]["ring_layout"] and peers["replay"]["checks"]["cursor_base_advanced"]
  for r in rows.values():
    if r["impl"] != "peer" and not r["repeat"] and r["status"] == "ok":
      assert r["speedup_vs_peer_basis"] == peers[r["family"]]["arm"] and r["speedup_vs_peer"] > 0, r["label"]


def test_missing_peers_are_skipped_rows(tmp_path):
  """On CPU (no jax_triton path) every peer arm is a skipped row that says why; the run goes on."""
  from bench import peer_vllm  # noqa: PLC0415
  out = tmp_path / "skip.json"
  peer_vllm.main(["--smoke", "--arms", "peer-vllm-replay,peer-mamba-ssm-conv", "--out-json", str(out)])
  data = json.loads(out.read_text())
  rows = {r["arm"]: r for r in data["rows"]}
  assert data["meta"]["command"].startswith("python -m bench.peer_vllm --smoke")
  assert {"peer-vllm-replay", "peer-mamba-ssm-conv", "replay-mosaic-rc"} <= set(peer_vllm.DEFAULT_ARMS)
  for arm in ("peer-vllm-replay", "peer-mamba-ssm-conv"):
    assert rows[arm]["status"] == "skipped" and "CUDA" in rows[arm]["error"], rows[arm]
  assert data["meta"]["peers"]["status"]["vllm"].startswith("peer vllm unavailable")


def test_vllm_ring_layout_round_trips():
  """The vLLM arm's buffers are ours in its form (x = Δx / Δ, Δ = ΔA / A): converted back they are
  ours again, so the gate compares peer and ours on the same history."""
  from bench import peer_vllm  # noqa: PLC0415
  from replayssm_jax.mamba2.buffers import ReplayBuffers  # noqa: PLC0415
  N, H, G, R, P, Ns = 3, 4, 2, 8, 8, 16
  A = -common.hash_uniform(1, (H,), 1.0, 2.0)
  ours = ReplayBuffers(state=common.hash_normal(2, (N, H, P, Ns)),
                       ring_x=(0.05 * common.hash_normal(3, (N, H, R, P))).astype(jnp.bfloat16),
                       ring_B=common.hash_normal(4, (N, G, R, Ns)).astype(jnp.bfloat16),
                       ring_a=-common.hash_uniform(5, (N, H, R), 0.01, 0.5))
  ring = peer_vllm.LAYOUT.from_ours(ours, {"A": A})
  np.testing.assert_allclose(np.asarray(ring.dt_cache), np.asarray(ours.ring_a / A[None, :, None]), rtol=1e-6)
  back = peer_vllm.LAYOUT.to_ours(ring, {"A": A})
  np.testing.assert_allclose(np.asarray(back.ring_a), np.asarray(ours.ring_a), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(back.ring_x, np.float32), np.asarray(ours.ring_x, np.float32), rtol=1e-2)
  assert back.ring_B is ours.ring_B and back.state is ours.state


def test_verify_drift_smoke(capsys):
  """``python -m bench.verify_drift --smoke`` (a few steps): every arm's materialized state stays near
  the float32 conventional verify's (bf16 checkpoints at bf16 rounding)."""
  from bench import verify_drift  # noqa: PLC0415
  verify_drift.main(["--smoke", "--steps", "3"])
  lines = [line.split() for line in capsys.readouterr().out.splitlines() if line[:5].strip().isdigit()]
  assert [int(line[0]) for line in lines] == [1, 2, 3]
  errors = np.array([[float(x) for x in line[1:]] for line in lines])
  assert errors.shape == (3, 4) and np.all(np.isfinite(errors)) and errors.max() < 2e-2, errors


def test_model_trace_smoke(tmp_path):
  """``python -m bench.model_trace --smoke``: the traced loop runs and is recorded (a CPU trace has no
  GPU stream, so no kernel is listed)."""
  from bench import model_trace  # noqa: PLC0415
  out = tmp_path / "t.json"
  result = model_trace.main(["--smoke", "--cycles", "1", "--buffer-len", "4", "--out-json", str(out)])
  data = json.loads(out.read_text())
  assert data["meta"]["command"].startswith("python -m bench.model_trace --smoke")
  assert [(r["mode"], r["implementation"]) for r in result["runs"]] == [("replay", "none")]
  assert data["runs"][0]["kernels"] == [] and data["runs"][0]["us_per_step"] == 0


def test_model_trace_preset_runs_both_modes_and_refuses_other_modes(tmp_path):
  """``--preset``: bench.model_e2e's step loop of a tiny checkpoint's architecture, both modes
  recorded; a bench.model_decode-only mode is a one-line parser error."""
  from bench import model_trace  # noqa: PLC0415
  out = tmp_path / "t.json"
  result = model_trace.main(["--preset", "tiny-qwen3_5", "--context", "8", "--batch", "2",
                             "--cycles", "1", "--modes", "conventional,replay", "--out-json", str(out)])
  data = json.loads(out.read_text())
  assert data["preset"] == "tiny-qwen3_5" and data["context"] == 8
  assert [r["mode"] for r in result["runs"]] == ["conventional", "replay"]
  with pytest.raises(SystemExit):
    model_trace.main(["--preset", "tiny-qwen3_5", "--modes", "replay-no-policy"])
  with pytest.raises(SystemExit):   # options the preset loop does not take are refused, not ignored
    model_trace.main(["--preset", "tiny-qwen3_5", "--implementations", "xla"])
  with pytest.raises(SystemExit):
    model_trace.main(["--preset", "no-such-model"])


def test_attention_decode_smoke_gates_and_times_every_arm(tmp_path, monkeypatch):
  """``python -m bench.attention_decode --smoke``: one row per arm with a passing gate and a time;
  a kernel whose outputs are off fails its gate."""
  import jax.numpy as jnp

  from bench import attention_decode
  from replayssm_jax.pallas import attention_triton
  out = tmp_path / "attention.json"
  argv = ["--smoke", "--tokens", "2", "--reps", "2", "--rep-seconds", "0.001", "--out-json", str(out)]
  attention_decode.main(argv)
  rows = json.loads(out.read_text())["rows"]
  assert [r["arm"] for r in rows] == list(attention_decode.ARMS)
  assert all(r["gate"] == "ok" and r["median_ms"] > 0 and r["gbps"] > 0 for r in rows)
  assert all("vs_xla" in r["gate_rel_l2"] for r in rows if r["arm"].startswith("kernel"))
  assert attention_decode.parse_config("bk64w8p2") == (("block_kv", 64), ("num_splits", 2), ("num_warps", 8))

  real = attention_triton.decode_attention
  monkeypatch.setattr(attention_triton, "decode_attention",
                      lambda *a, **kw: jnp.roll(real(*a, **kw), 1, axis=2))   # heads swapped
  attention_decode.main([*argv, "--arms", "kernel-permuted"])
  row, = json.loads(out.read_text())["rows"]
  assert row["gate"] == "FAILED"


def test_moe_decode_smoke_gates_and_times_both_arms(tmp_path, monkeypatch):
  """``python -m bench.moe_decode --smoke``: a row per arm and kernel config with a passing gate
  and a time (and a traced kernel list with ``--trace``); a kernel whose outputs are off fails
  its gate."""
  from bench import moe_decode
  from replayssm_jax.pallas import moe_triton
  out = tmp_path / "moe.json"
  argv = ["--smoke", "--reps", "2", "--rep-seconds", "0.001", "--configs", "default,bm32bn16",
          "--out-json", str(out)]
  moe_decode.main(argv)
  rows = json.loads(out.read_text())["rows"]
  assert [(r["arm"], r["config"]) for r in rows] == [("xla", "-"), ("pallas_triton", "default"),
                                                     ("pallas_triton", "bm32bn16")]
  assert all(r["gate"] == "ok" and r["median_ms"] > 0 and r["experts_hit"] >= 2 for r in rows)
  assert all(r["kernels"] is None for r in rows)      # no --trace
  moe_decode.main([*argv[:-2], "--arms", "pallas_triton", "--configs", "default", "--trace",
                   "--trace-steps", "2", "--out-json", str(out)])
  row, = json.loads(out.read_text())["rows"]
  assert row["kernels"] == []                           # traced; CPU has no GPU streams
  assert moe_decode.parse_config("bm16bn128w8") == (("block_m", 16), ("block_n", 128), ("num_warps", 8))
  with pytest.raises(ValueError, match="launch config 'bq16'"):
    moe_decode.parse_config("bq16")

  # a row that fails on the device is recorded with its error and the run goes on
  real_measure = moe_decode.measure

  def failing(cfg, case, *, arm, **kw):
    if arm == "xla":
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    return real_measure(cfg, case, arm=arm, **kw)
  real_case, cases = moe_decode.make_case, []
  monkeypatch.setattr(moe_decode, "measure", failing)
  monkeypatch.setattr(moe_decode, "make_case", lambda *a: cases.append(a) or real_case(*a))
  moe_decode.main(argv)
  assert len(cases) == 1        # the layer and gate references are built once per batch
  rows = json.loads(out.read_text())["rows"]
  assert rows[0] == {"batch": 4, "arm": "xla", "config": "-",
                     "error": "RESOURCE_EXHAUSTED: Out of memory"}
  assert [r["gate"] for r in rows[1:]] == ["ok", "ok"]
  # references that fail fail every row of their batch, tried once
  cases.clear()

  def no_case(*a):
    cases.append(a)
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
  monkeypatch.setattr(moe_decode, "make_case", no_case)
  moe_decode.main(argv)
  assert len(cases) == 1
  assert [r.get("error") for r in json.loads(out.read_text())["rows"]] == [
      "RESOURCE_EXHAUSTED: Out of memory"] * 3
  monkeypatch.undo()

  real = moe_triton.grouped_matmul
  monkeypatch.setattr(moe_triton, "grouped_matmul", lambda *a, **kw: 2 * real(*a, **kw))
  moe_decode.main(["--smoke", "--reps", "2", "--rep-seconds", "0.001", "--arms", "pallas_triton",
                   "--out-json", str(out)])
  row, = json.loads(out.read_text())["rows"]
  assert row["gate"] == "FAILED"


def test_read_stream_table_and_skip(tmp_path):
  """bench.read_stream: the best launch per arm against the copy; no torch or GPU: a skipped run."""
  from bench import read_stream  # noqa: PLC0415
  row = lambda arm, gbps, **kn: {"arm": arm, **kn, "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0,
                                 "gbps": gbps}
  rows = [row("copy", 4000.0), row("sum", 4200.0, block=2048, warps=8),
          row("sum", 3000.0, block=8192, warps=2)]
  rows += [row(m, g, block_v=64, heads=2, warps=2) for m, g in
           (("tile sum", 4100.0), ("readout", 3900.0), ("two readouts", 3500.0))]
  lines = read_stream.table(rows).splitlines()
  assert "block=2048, warps=8" in lines[3] and lines[3].split()[-2:] == ["105", "3000"]
  assert lines[-1].split()[:2] == ["two", "readouts"]
  try:
    import torch  # noqa: F401, PLC0415
    has_cuda = torch.cuda.is_available()
  except ImportError:
    has_cuda = False
  if not has_cuda:
    out = read_stream.main(["--out-json", str(tmp_path / "r.json")])
    assert out["skipped"] and out["rows"] == [] and (tmp_path / "r.json").exists()
