"""The drift study's fits (bench/drift.py): slopes, intervals and the excess over conventional decode."""
import numpy as np
import pytest

from bench import drift


def _result(replay_rate, *, noise=0.02, steps=32768, L=16, seed=0):
  """A synthetic study: conventional error rising 0.015 decades per 1000 steps, replay's at
  ``replay_rate``; both with the same multiplicative noise pattern plus a little of replay's own."""
  rng = np.random.default_rng(seed)
  flush_steps = list(range(L - 1, steps, 256))
  t = np.asarray(flush_steps, np.float64) + 1
  conv = 1e-6 * 10 ** (0.015 * t / 1000 + noise * rng.normal(size=t.size))
  replay = conv * 0.3 * 10 ** ((replay_rate - 0.015) * t / 1000 + 0.1 * noise * rng.normal(size=t.size))
  series = [{"family": "mamba2", "regime": "slow", "arm": arm, "state_dtype": "float32", "buffer_len": bl,
             "fold": None, "status": "ok", "step": flush_steps, "state_err": list(e), "o_err": list(e),
             "fit": {"state_err": {}, "o_err": {}}}
            for arm, bl, e in (("conventional", None, conv), ("replay", L, replay))]
  return {"options": {"fit_skip": 0.1, "steps": steps}, "samples": {"flush_steps": flush_steps},
          "series": series}


@pytest.mark.parametrize("rate,verdict", [(0.015, "flat"), (0.025, "grows"), (0.005, "shrinks")])
def test_excess_over_conventional_recovers_the_rate_difference(rate, verdict):
  result = _result(rate)
  drift.excess_over_conventional(result)
  conv, replay = result["series"]
  assert "excess" not in conv["fit"]["state_err"]
  ex = replay["fit"]["state_err"]["excess"]
  lo, hi = ex["per_kstep_ci95"]
  assert lo <= rate - 0.015 <= hi and abs(ex["per_kstep"] - (rate - 0.015)) < 2e-4, ex
  assert ex["verdict"] == verdict


def test_excess_needs_a_matching_conventional_arm():
  result = _result(0.02)
  result["series"][0]["state_dtype"] = "bfloat16"   # no f32 conventional arm for the f32 replay arm
  drift.excess_over_conventional(result)
  assert "excess" not in result["series"][1]["fit"]["state_err"]
  assert "-" == drift.summary_rows({**result, "series": [{**result["series"][1], "fit": {
      "state_err": {"per_kflush": 0.0, "per_kflush_ci95": [0.0, 0.0], "verdict": "flat", "rise_decades": 0.0},
      "o_err": None}}]})[0][-1]
