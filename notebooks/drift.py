# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Drift: does ReplaySSM accumulate error over long decodes?
#
# ReplaySSM folds a ring of cached inputs into the checkpoint once every L steps. If the fold
# were *open loop* — each flush adding its own rounding on top of the last, with nothing pulling
# the state back — the error would grow with the number of flushes; this is the bug SGLang found
# in its GDN speculative path (notes/reliability.md §0). This notebook runs the drift study
# (`bench/drift.py`, whose docstring has the full protocol) and plots it:
#
# * synthetic GDN and Mamba2 decode streams in two regimes: *typical* gates and an adversarial
#   *slow*-decay regime (GDN g ≈ −1e-3 with β ≈ 1, Mamba2 Δ·A ≈ 0, large inputs);
# * arms: replay and conventional decode × checkpoint dtype × L (× GDN fold mode when the
#   library has fold modes; plus the speculative path with random accepts when it has
#   `replay_verify`);
# * error: relative RMS of output and state against a float64 numpy reference;
# * drift: the OLS slope of log10(error) against the number of flushes, with its 95 % interval.
#
# On CPU the notebook runs the study's small path (a few hundred steps); the figures use the
# stored full run (`bench/results/drift_*.json`, 32k steps on the H200) when there is one.

# %%
import json
import os
import pathlib
import sys
import tempfile

import matplotlib.pyplot as plt
import numpy as np


def repo_root() -> pathlib.Path:
  for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (p / "bench" / "drift.py").is_file():
      return p
  raise FileNotFoundError("run this notebook inside the replayssm_jax checkout")


ROOT = repo_root()
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
from bench import drift

FIG_DIR = os.environ.get("REPLAYSSM_FIG_DIR")  # set it to also save the figures as PNG

# %% [markdown]
# ## Run the small path
#
# `python -m bench.drift --smoke`: both families and regimes, f32 and bf16 checkpoints, L = 8,
# 256 steps (CPU compile time, not compute, is what limits it). The full run is
# `python -m bench.drift --out-json bench/results/drift_<date>.json` on a GPU.

# %%
smoke_json = pathlib.Path(tempfile.mkdtemp()) / "drift_smoke.json"
smoke = drift.main(["--smoke", "--out-json", str(smoke_json)])
assert smoke["series"] and all(s["status"] == "ok" for s in smoke["series"]), \
    [s.get("error") for s in smoke["series"] if s["status"] != "ok"]

# %% [markdown]
# ## Which data the figures show
#
# Every stored full run (`bench/results/drift_*.json` with more than the smoke's steps: the H200
# runs, each adding arms the earlier ones lacked), merged arm by arm (a later file's arm replaces an
# earlier one with the same family, regime, arm, dtype, L and fold); else the small run above.

# %%
stored = []
for path in sorted((ROOT / "bench" / "results").glob("drift_*.json")):
  try:
    data = json.loads(path.read_text())
  except (OSError, ValueError):
    continue
  if data.get("series") and data.get("options", {}).get("steps", 0) > smoke["options"]["steps"]:
    stored.append((path, data))

def arm_key(s):
  return tuple(s.get(k) for k in ("family", "regime", "arm", "state_dtype", "buffer_len", "fold"))


runs = stored or [(smoke_json, smoke)]
merged = {}
for path, data in runs:
  meta, opts = data.get("meta", {}), data["options"]
  print(f"data: {path.name}: device {meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}, "
        f"commit {meta.get('git_commit') or '?'}, {meta.get('date', '?')}; {opts['steps']} steps x "
        f"{opts['rows']} rows; GDN Hk,Hv,K,V = {opts['gdn_dims']}; Mamba2 H,P,G,N = {opts['mamba2_dims']}")
  for s in data["series"]:   # each arm keeps its own run's flush steps (the L sets differ)
    merged[arm_key(s)] = dict(s, flush_steps=data["samples"]["flush_steps"], source=path.name)
model = next((d["model"] for _, d in reversed(runs) if d.get("model")), None)


def covered(skip):
  """A skipped arm (or whole regime, or the model check) that a later run supplied."""
  if "model" in skip:
    return model is not None
  if "arm" not in skip:
    return any(k[:2] == (skip["family"], skip["regime"]) for k in merged)
  return arm_key(skip) in merged


skipped = [k for _, d in runs for k in d.get("skipped", []) if not covered(k)]
result = dict(runs[0][1], series=list(merged.values()), skipped=skipped, model=model)
print(f"reference: {result['reference']}; fold modes: {result['fold_modes']}")
series = [s for s in result["series"] if s.get("status") == "ok"]
errors = [s for s in result["series"] if s.get("status") != "ok"]
if errors:
  print(f"{len(errors)} arm(s) failed:", {(e['family'], e['arm'], e['state_dtype']): e['error'][:120] for e in errors})
if result.get("skipped"):
  print(f"{len(result['skipped'])} arm(s) skipped (time limit)")

# %% [markdown]
# ## Error along the run
#
# State error after each sampled step (log-log), one panel per family and regime. Dashed:
# conventional decode (rounds the state to the checkpoint dtype every step); solid: replay at
# one L (rounds at flushes only). A drifting arm climbs; a healthy one stays level once the state
# has filled.

# %%
DT_COLOR = {"float32": "C0", "bfloat16": "C3", "float16": "C2"}
FOLD_STYLE = {"default": "-", "u": "-", "exact": ":"}
panels = sorted({(s["family"], s["regime"]) for s in series})
Ls = sorted({s["buffer_len"] for s in series if s["arm"] == "replay"})
L_show = Ls[len(Ls) // 2] if Ls else None


def save(fig, name):
  if FIG_DIR:
    pathlib.Path(FIG_DIR).mkdir(parents=True, exist_ok=True)
    fig.savefig(pathlib.Path(FIG_DIR) / f"drift_{name}.png", dpi=120, bbox_inches="tight")


fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
for ax, (fam, regime) in zip(axes[0], panels):
  for s in series:
    if (s["family"], s["regime"]) != (fam, regime):
      continue
    steps = np.asarray(s["step"]) + 1
    if s["arm"] == "conventional":
      ax.plot(steps, s["state_err"], "--", color=DT_COLOR[s["state_dtype"]], lw=1,
              label=f"conv {s['state_dtype']}")
    elif s["arm"] == "replay" and s["buffer_len"] == L_show:
      ax.plot(steps, s["state_err"], FOLD_STYLE.get(s["fold"], "-"), color=DT_COLOR[s["state_dtype"]],
              label=f"replay {s['state_dtype']} fold={s['fold']}")
  ax.set(xscale="log", yscale="log", xlabel="decode step", title=f"{fam}, {regime} (replay L = {L_show})")
  ax.grid(alpha=0.3)
axes[0][0].set_ylabel("relative RMS error of the state")
handles = {}
for ax in axes[0]:
  for h, lab in zip(*ax.get_legend_handles_labels()):
    handles.setdefault(lab, h)
fig.legend(handles.values(), handles.keys(), fontsize=7, loc="lower center", ncol=min(len(handles), 5))
fig.tight_layout(rect=(0, 0.1, 1, 1))
save(fig, "error_vs_step")
plt.show()

# %% [markdown]
# ## Drift slopes with 95 % intervals
#
# OLS of log10(state error) on the number of flushes, over the flush samples after the first
# 10 % of the run; slope in decades per 1000 flushes (conventional: per 1000 steps; "spec" = the
# speculative arm, x = mean flushes per row). An interval
# that contains 0 (grey line) means no detectable drift. The fit on log error (not linear error)
# because the arms' errors sit decades apart and scatter multiplicatively, so log puts every arm's
# residuals on one scale; successive samples are correlated, so read a "significant" slope
# together with its total rise over the run (in the table below).

# %%
fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False, sharey=False)
for ax, (fam, regime) in zip(axes[0], panels):
  rows = [s for s in series if (s["family"], s["regime"]) == (fam, regime) and s["fit"].get("state_err")]
  labels, ys, lo, hi, colors = [], [], [], [], []
  for s in rows:
    f = s["fit"]["state_err"]
    key = "per_kflush" if "per_kflush" in f else "per_kstep"
    arm = {"conventional": "conv (/1000 steps)", "replay": "replay", "replay-spec": "spec",
           "replay-read-copy": "replay, bf16 copy"}[s["arm"]]
    dt = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[s["state_dtype"]]
    L = f" L{s['buffer_len']}" if s["buffer_len"] else ""
    fold = f" {s['fold']}" if s["fold"] not in (None, "default") else ""
    labels.append(f"{arm} {dt}{L}{fold}")
    ys.append(f[key])
    lo.append(f[key] - f[key + "_ci95"][0])
    hi.append(f[key + "_ci95"][1] - f[key])
    colors.append(DT_COLOR[s["state_dtype"]])
  pos = np.arange(len(ys))
  for i in pos:
    ax.errorbar(ys[i], i, xerr=[[lo[i]], [hi[i]]], fmt="o", color=colors[i], ms=4, capsize=2)
  ax.axvline(0.0, color="gray", lw=1)
  ax.set_yticks(pos, labels, fontsize=6)
  ax.invert_yaxis()
  ax.set(xlabel="slope, log10(error) per 1000 flushes", title=f"{fam}, {regime}")
fig.tight_layout()
save(fig, "slopes")
plt.show()

# %% [markdown]
# ## Error at flushes vs L
#
# Mean state error over the flush samples, per checkpoint dtype and L (conventional at the left
# edge, marked "conv"). A longer window means fewer roundings of the checkpoint per token.

# %%
fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
for ax, (fam, regime) in zip(axes[0], panels):
  for dt, color in DT_COLOR.items():
    conv = [s for s in series if (s["family"], s["regime"], s["arm"], s["state_dtype"]) == (fam, regime, "conventional", dt)]
    rep = sorted((s for s in series if (s["family"], s["regime"], s["arm"], s["state_dtype"]) == (fam, regime, "replay", dt)
                  and s["fold"] in ("default", "u")), key=lambda s: s["buffer_len"])

    def level(s):
      flush_steps = set(s["flush_steps"])
      e = [err for t, err in zip(s["step"], s["state_err"]) if t in flush_steps]
      return float(np.exp(np.mean(np.log(np.maximum(e, 1e-30))))) if e else np.nan
    if conv:
      ax.plot([1], [level(conv[0])], "x", color=color, ms=8)
    if rep:
      ax.plot([s["buffer_len"] for s in rep], [level(s) for s in rep], "o-", color=color, label=dt)
  ax.set(xscale="log", yscale="log", xlabel="L (1 = conventional, x)", title=f"{fam}, {regime}")
  ax.grid(alpha=0.3)
axes[0][0].set_ylabel("geometric-mean state error at flushes")
axes[0][-1].legend(fontsize=7)
fig.tight_layout()
save(fig, "error_vs_L")
plt.show()

# %% [markdown]
# ## The table
#
# Last and largest state error, last output error, the fitted slope with its interval and the
# verdict ("flat": the interval contains 0). This is the table that goes into `bench/RESULTS.md`.

# %%
print(drift.render(result))

# %% [markdown]
# ## Model level: greedy tokens, replay vs conventional
#
# The tiny model (GatedDeltaNet + Mamba2 layers, random weights), greedy decoding from the same
# prompts; first index where replay and conventional tokens differ, per row (None: identical over
# all tokens). Only in the full run (the CPU path skips it: its compiles alone take ~30 s).

# %%
model = result.get("model")
if model and model.get("results"):
  print(f"{model['tokens']} tokens, {model['rows']} rows, L = {model['buffer_len']}")
  for r in model["results"]:
    print(f"  {r['state_dtype']:<9} replay vs conventional: {r['replay_vs_conventional']}; "
          f"replay vs conventional f32: {r['replay_vs_conventional_f32']}; "
          f"conventional vs conventional f32: {r['conventional_vs_conventional_f32']}")
else:
  print("no model-level check in this data", "" if not model else model)
