# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # replayssm_jax performance
#
# Reads the benchmark results under `bench/results/*.json` (written by `python -m bench.gdn_decode`
# and the other benchmark scripts) and plots:
#
# * speed-up of ReplaySSM over the conventional kernel vs batch, vs buffer length L, and vs the
#   number of verify tokens T (when speculative-verify results exist);
# * effective bandwidth (minimal bytes / time) against the measured copy ceiling;
# * memory per request, computed from buffer shapes: replay = one checkpoint + rings,
#   conventional speculative decoding = T + 1 states.
#
# On a GPU (`jax.default_backend() == "gpu"`) it first re-runs a short GDN benchmark and adds it
# to the stored data; on CPU it uses the stored data only (CPU timings say nothing about HBM).
# Methods and definitions: `bench/gdn_decode.py` and `bench/RESULTS.md`.

# %%
import json
import math
import pathlib
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import matplotlib.ticker

import replayssm_jax as rs


def repo_root() -> pathlib.Path:
  for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]:
    if (p / "bench" / "gdn_decode.py").is_file():
      return p
  raise FileNotFoundError("run this notebook inside the replayssm_jax checkout")


ROOT = repo_root()
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"

# %% [markdown]
# ## Load every result file
#
# A file counts if it is JSON with a `rows` list of timed rows (`median_ms`); anything else
# (the drift study, logs, a half-written file) is skipped with a note. Missing fields are
# tolerated: each plot uses the rows that have what it needs.

# %%
def load_results(paths):
  files, rows = [], []
  for path in sorted(paths):
    try:
      data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
      print(f"skip {path.name}: {type(e).__name__}")
      continue
    rows_of = data.get("rows", []) if isinstance(data, dict) else []
    timed = [r for r in rows_of if isinstance(r, dict) and r.get("median_ms")]
    if not timed:
      print(f"skip {path.name}: no timed rows")
      continue
    meta = data.get("meta", {})
    ceiling = (data.get("ceiling") or {}).get("gbps")
    for r in timed:
      r["source"] = pathlib.Path(path).stem
      r.setdefault("label", r.get("arm") or r.get("mode"))   # model_decode rows name a mode
      r["ceiling_gbps"] = ceiling
    files.append({"file": pathlib.Path(path).name, "meta": meta, "ceiling": ceiling, "rows": len(timed)})
    rows += timed
  return files, rows


files, rows = load_results(RESULTS.glob("*.json"))
print(f"{len(rows)} timed rows from {len(files)} file(s)")

# %% [markdown]
# ## Which runs each plot shows
#
# The results directory holds the runs that `bench/RESULTS.md` cites, launch-config sweeps
# included. Each plot shows the runs listed here for it (result-file stems, each with the reason);
# `ALL_RUNS = True` plots every stored run instead (one line per run: crowded). A run re-timed on a
# GPU below is added to the batch plots.

# %%
ALL_RUNS = False
CURRENT = {
    "batch": {   # speed-up and effective bandwidth vs batch
        "gdn_decode_2026-11-30_batches": "GDN decode B = 1-512, L = 16, f32 and bf16: output-only and the fold-and-step kernel",
        "mamba2_decode_2026-11-30_batches": "Mamba2 decode B = 1/32/256, L = 8, f32 and bf16: output-only, Mosaic reconstruct, fold-and-step",
        "gdn_decode_2026-11-30_small_batch_defaults": "GDN decode B = 1/8/32, L = 16: the small-batch defaults",
        "mamba2_decode_2026-11-30_small_batch_defaults": "Mamba2 decode B = 1/8/32, L = 8: the small-batch defaults",
        "model_decode_2026-11-29_gdn": "model step (8 GDN layers + MLP) B = 1-256, small-batch policy on and off",
    },
    "L": {       # buffer-length sweeps
        "gdn_decode_2026-11-30_buffer_lens": "GDN decode, L = 8/16/32 at B = 32/256",
        "mamba2_decode_2026-11-30_fold_tiles": "Mamba2 decode, L = 8/16 at B = 256, 1/2/4 fold tiles per program",
        "mamba2_decode_2026-11-30_L4_L16": "Mamba2 decode, L = 4/16 at B = 256",
    },
    "T": {       # speculative verify
        "verify_gdn_2026-11-30_T4": "GDN B = 256, L = 8, T = 4: Mosaic (the default) and Triton",
        "verify_mamba2_2026-11-30_T4": "Mamba2 B = 256, L = 8, T = 4: Mosaic (the default) and Triton",
        "verify_gdn_2026-11-30_T2_T8": "GDN B = 256, L = 8, T = 2/8: Mosaic",
        "verify_mamba2_2026-11-30_T2_T8": "Mamba2 B = 256, L = 8, T = 2/8: Mosaic",
        "verify_gdn_2026-11-30_B1_B8": "GDN B = 1/8, L = 8, T = 2/4/8: Mosaic and Triton",
        "verify_mamba2_2026-11-30_B1_B8": "Mamba2 B = 1/8, L = 8, T = 2/4/8: Mosaic and Triton",
    },
}


def run_tag(src):
  """'gdn_decode_2026-11-30_small_batch_defaults' -> 'gdn_decode small_batch_defaults' (legends)."""
  m = re.match(r"(.*?)_\d{4}-\d{2}-\d{2}_?(.*)", src)
  return f"{m.group(1)} {m.group(2)}".strip() if m else src


def shown(plot, rows_):
  """The rows of ``plot``'s listed runs (all rows when ALL_RUNS)."""
  if ALL_RUNS:
    return rows_
  keep = CURRENT[plot]
  missing = sorted(set(keep) - {r["source"] for r in rows})
  if missing:
    print(f"{plot}: listed runs not found in bench/results: {missing}")
  return [r for r in rows_ if r["source"] in keep]


for plot, runs in CURRENT.items():
  print(f"{plot}:")
  for stem, why in runs.items():
    print(f"  {stem}: {why}")

# %% [markdown]
# ## Re-run on a GPU
#
# With a GPU attached, time a short GDN run now (f32 state, L = 16, two batches) and add it.
# On CPU this is skipped: the smoke benchmark (`python -m bench.gdn_decode --smoke`) checks the
# harness, not performance.

# %%
if jax.default_backend() == "gpu":
  from bench import gdn_decode
  out = pathlib.Path(tempfile.mkdtemp()) / "gdn_decode_rerun.json"
  gdn_decode.main(["--state-dtypes", "float32", "--buffer-lens", "16", "--batches", "32,256",
                   "--arms", "conv-pallas,replay-pallas-oo", "--repeat-arm", "none",
                   "--out-json", str(out)])
  new_files, new_rows = load_results([out])
  files += new_files
  rows += new_rows
  CURRENT["batch"][out.stem] = "re-timed by this notebook"
else:
  print(f"backend {jax.default_backend()!r}: no re-run; using the stored results")

# %% [markdown]
# ## Which machine and versions produced the data

# %%
for f in files:
  m = f["meta"]
  smi = m.get("nvidia_smi") or {}
  print(f"{f['file']}: {m.get('device_kind', '?')} (driver {smi.get('driver_version', '?')}), "
        f"jax {m.get('jax_version', '?')} / jaxlib {m.get('jaxlib_version', '?')}, "
        f"python {m.get('python', '?')}, commit {m.get('git_commit') or '?'}, {m.get('date', '?')}; "
        f"copy ceiling {f['ceiling'] or float('nan'):.0f} GB/s; {f['rows']} rows")


# %%
def ok_rows(pred=lambda r: True):
  return [r for r in rows if r.get("status", "ok") == "ok" and not r.get("repeat") and pred(r)]


def short(dt):
  return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", None: ""}.get(dt, str(dt))


def group_by(rs_, keys):
  out = {}
  for r in rs_:
    out.setdefault(tuple(r.get(k) for k in keys), []).append(r)
  return out


def no_data(ax, what):
  ax.text(0.5, 0.5, f"no {what} in bench/results", ha="center", va="center", transform=ax.transAxes)
  ax.set_axis_off()


# %% [markdown]
# ## Speed-up vs batch and vs L
#
# `speedup_vs_conv` = conventional kernel time / replay time, same state dtype, same run; only rows
# whose correctness gate passed have one. Above 1 is faster. Each line is one run (result file):
# kernels change between runs, so rows of different runs are never joined into one line.

# %%
sp = ok_rows(lambda r: r.get("speedup_vs_conv") and not r.get("num_tokens", 1) > 1)
sp_batch, sp_L = shown("batch", sp), shown("L", sp)
fig, axes = plt.subplots(1, 2, figsize=(14, 8))
for ax in axes:
  ax.set_prop_cycle(color=plt.cm.tab20.colors)
ax = axes[0]
if sp_batch:
  for (src, arm, dt, L), g in sorted(group_by(sp_batch, ["source", "label", "state_dtype", "buffer_len"]).items(),
                                     key=lambda kv: str(kv[0])):
    g = sorted(g, key=lambda r: r["batch"])
    if len(g) > 1:
      ax.plot([r["batch"] for r in g], [r["speedup_vs_conv"] for r in g], "o-",
              label=f"{run_tag(src)}: {arm} {short(dt)} L={L}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xscale="log", xlabel="batch (rows)", ylabel="speed-up vs conventional (x)", title="Speed-up vs batch")
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
else:
  no_data(axes[0], "replay rows with a speed-up")
ax = axes[1]
if sp_L:
  b_show = sorted({r["batch"] for r in sp_L})[-2:]
  for (src, arm, dt, b), g in sorted(group_by(sp_L, ["source", "label", "state_dtype", "batch"]).items(),
                                     key=lambda kv: str(kv[0])):
    g = sorted(g, key=lambda r: r["buffer_len"])
    if len(g) > 1 and b in b_show and "oo" in str(arm):
      ax.plot([r["buffer_len"] for r in g], [r["speedup_vs_conv"] for r in g], "o-",
              label=f"{run_tag(src)}: {arm} {short(dt)} B={b}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xscale="log", xlabel="buffer length L (steps per flush)", ylabel="speed-up vs conventional (x)",
         title="Speed-up vs L")
  ax.set_xticks([4, 8, 16, 32], ["4", "8", "16", "32"])
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
else:
  no_data(axes[1], "replay rows with a speed-up")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Speed-up vs T (speculative verify)
#
# Rows with `num_tokens > 1` (verify benchmarks): replay verify against the conventional
# speculative baseline (one state written per draft position).

# %%
ver = shown("T", ok_rows(lambda r: (r.get("num_tokens") or r.get("T") or 1) > 1 and r.get("speedup_vs_conv")))
fig, ax = plt.subplots(figsize=(7, 7))
ax.set_prop_cycle(color=plt.cm.tab20.colors)
if ver:
  for (src, arm, dt, b), g in sorted(group_by(ver, ["source", "label", "state_dtype", "batch"]).items(),
                                     key=lambda kv: str(kv[0])):
    g = sorted(g, key=lambda r: r.get("num_tokens") or r.get("T"))
    ax.plot([r.get("num_tokens") or r.get("T") for r in g], [r["speedup_vs_conv"] for r in g], "o-",
            label=f"{run_tag(src)}: {arm} {short(dt)} B={b}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set(xlabel="tokens per verify step T", ylabel="speed-up vs conventional speculative (x)",
         title="Speed-up vs T")
  ax.set_xticks([2, 4, 8])
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
  fig.tight_layout()
else:
  no_data(ax, "verify (T > 1) results")
plt.show()

# %% [markdown]
# ## Effective bandwidth against the copy ceiling
#
# Effective bandwidth = batch × minimal bytes per row / time (the byte model in
# `bench/gdn_decode.py`); the dashed line is the device-to-device copy ceiling measured in the
# same run — what a perfect memory-bound kernel could reach.

# %%
bw = shown("batch", ok_rows(lambda r: r.get("eff_gbps") and r.get("buffer_len") in (None, 16)
                            and r.get("num_tokens", 1) in (None, 1)))
fig, ax = plt.subplots(figsize=(7, 7))
ax.set_prop_cycle(color=plt.cm.tab20.colors)
if bw:
  for (src, arm, dt), g in sorted(group_by(bw, ["source", "label", "state_dtype"]).items(), key=lambda kv: str(kv[0])):
    g = sorted(g, key=lambda r: r["batch"])
    if len(g) > 1:
      ax.plot([r["batch"] for r in g], [r["eff_gbps"] for r in g], "o-", label=f"{run_tag(src)}: {arm} {short(dt)}")
  ceil = [r["ceiling_gbps"] for r in bw if r.get("ceiling_gbps")]
  if ceil:
    ax.axhline(max(ceil), color="k", ls="--", lw=1, label=f"copy ceiling {max(ceil):.0f} GB/s")
  ax.set(xscale="log", xlabel="batch (rows)", ylabel="effective bandwidth (GB/s)",
         title="Effective bandwidth (replay at L = 16)")
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1)
  fig.tight_layout()
else:
  no_data(ax, "rows with a bandwidth")
plt.show()

# %% [markdown]
# ## Memory per request
#
# From the buffers' shapes (`jax.eval_shape`, nothing allocated), per layer and slot:
# replay = checkpoint + rings (ring size R = next power of two ≥ L + T − 1); conventional
# speculative decoding keeps T + 1 states (one per draft position plus the committed one).
# Geometry: the benchmark's (Qwen3.5-4B GDN layer) when a result file names it, else that default.

# %%
geo = next((f["meta"].get("geometry") for f in files if f["meta"].get("geometry")), None) or \
    {"hk": 16, "hv": 32, "kd": 128, "vd": 128}


def nbytes(tree):
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def replay_bytes(L, T, state_dtype, ring_dtype=jnp.bfloat16):
  def make():
    cursor = rs.ReplayCursor.create(1, buffer_len=max(L, T), max_draft=T - 1)
    return rs.gdn.ReplayBuffers.create(1, cursor, num_k_heads=geo["hk"], num_v_heads=geo["hv"],
                                       head_k_dim=geo["kd"], head_v_dim=geo["vd"],
                                       state_dtype=state_dtype, ring_dtype=ring_dtype)
  return nbytes(jax.eval_shape(make))


def state_bytes(state_dtype):
  return geo["hv"] * geo["vd"] * geo["kd"] * jnp.dtype(state_dtype).itemsize


Ts = [1, 2, 4, 8]
fig, ax = plt.subplots(figsize=(7, 4))
for dt, mk in ((jnp.float32, "o"), (jnp.bfloat16, "s")):
  name = short(jnp.dtype(dt).name)
  ax.plot(Ts, [(T + 1) * state_bytes(dt) / 2**20 for T in Ts], mk + "--", label=f"conventional spec, {name} states (T + 1)")
  ax.plot(Ts, [replay_bytes(16, T, dt) / 2**20 for T in Ts], mk + "-", label=f"replay L = 16, {name} checkpoint, bf16 ring")
ax.set(xlabel="tokens per step T", ylabel="MiB per request and layer",
       title=f"Memory per request (GDN Hk={geo['hk']}, Hv={geo['hv']}, K={geo['kd']}, V={geo['vd']})")
ax.set_xticks(Ts)
ax.legend(fontsize=7)
plt.show()
for T in (4, 8):
  r, c = replay_bytes(16, T, jnp.float32), (T + 1) * state_bytes(jnp.float32)
  print(f"T={T}, f32: replay {r / 2**20:.2f} MiB vs conventional {c / 2**20:.2f} MiB -> {100 * r / c:.0f} %")

# %% [markdown]
# ## Table of the stored rows
#
# The same data as `bench/RESULTS.md`, re-rendered from the JSON (first rows only).

# %%
cols = ["source", "label", "state_dtype", "batch", "buffer_len", "median_ms", "eff_gbps", "pct_ceiling", "speedup_vs_conv"]
print(" | ".join(cols))
for r in ok_rows()[:24]:
  print(" | ".join(f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols))
