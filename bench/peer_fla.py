"""Peer arm: flash-linear-attention's GDN decode kernel against ours, on one GPU, in one run.

    python -m bench.peer_fla [--batches 32,256] [--reps 7] [--rep-seconds 0.2] [--out-json F]

The peer is fla's ``fused_recurrent_gated_delta_rule``: Triton, called through PyTorch. It comes
from the fla-core package, installed and never copied. Each call is one decode step (T = 1): it
reads ``initial_state`` and writes a new ``final_state``. The state is [N, Hv, V, K] float32
(``state_v_first=True``, our layout). Ours is the conventional decode
``rs.gdn.decode(implementation="pallas_triton")``. bench.gdn_decode's harness times it
(``--arms conv-pallas``, float32 state) in the same process, before the peer, and measures the
copy ceiling at the start and the end of that run.

The peer is measured the way the harness measures ours:
* The Qwen3.5-4B layer geometry, bf16 activations, float32 state.
* The harness's byte model: conventional, the state read and written once per layer-step.
* The same layer count P (at least 1 GiB of state over the layers).
* Inputs are JAX arrays handed to PyTorch by DLPack, without a copy. There is a bank of 4 input
  sets; layer l of step t reads set (t + l) mod 4.
* One CUDA graph holds 4 steps of P layers. Every call reads its layer's state and writes a
  state buffer of its own: out of place, as fla works. That moves the same bytes as our in-place
  update. The states do not chain from one replay to the next, which changes no traffic.
* Timing: CUDA events around m graph replays, with m calibrated to about ``--rep-seconds``;
  ``--reps`` repetitions; median, p20 and p80 in ms per layer-step.

Gate: the peer's first layer-step is compared, output and state, against
``implementation="xla"`` on the same arrays. The tolerances are relative L2 errors of 1e-2 on the
bf16 output and 1e-4 on the float32 state (``GATE_TOL``). A peer that fails the gate is timed but
gets no speed-up.

Needs PyTorch with a CUDA device and fla (fla-core >= 0.6) importable. Otherwise the peer is
skipped: the reason is printed and recorded, and ours is not timed either.
"""
import os

# PyTorch allocates beside JAX in this process: JAX must not take 75 % of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import replayssm_jax as rs  # noqa: E402

from bench import common, gdn_decode, harness  # noqa: E402

PEER = "peer-fla"
OURS = "conv-pallas"
BANK = 4
# Relative L2 against XLA: both outputs are rounded to bf16 (v's dtype) on their own, so they
# differ by up to a few bf16 ulps (2^-9 each); the float32 states differ by summation order only.
GATE_TOL = {"output": 1e-2, "state": 1e-4}


def load_peer():
  """(torch, fla's fused_recurrent_gated_delta_rule); ImportError with the reason if unusable."""
  try:
    import torch
  except ImportError as e:
    raise ImportError(f"PyTorch is not importable ({e})") from e
  if not torch.cuda.is_available():
    raise ImportError("PyTorch sees no CUDA device")
  try:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
  except ImportError as e:
    raise ImportError(f"fla (fla-core) is not importable ({e})") from e
  return torch, fused_recurrent_gated_delta_rule


def make_inputs(geo: gdn_decode.Geometry, batch: int, seed: int) -> dict:
  """One input set in fla's layout (T = 1): q, k [B, 1, Hk, K] (k L2-normalised), v [B, 1, Hv, V],
  beta [B, 1, Hv] in bf16; g [B, 1, Hv] float32 log decay in -[0.01, 0.5]."""
  kq, kk, kv, kg, kb = jax.random.split(jax.random.key(seed), 5)
  k = jax.random.normal(kk, (batch, 1, geo.hk, geo.kd), jnp.float32)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  return {"q": jax.random.normal(kq, (batch, 1, geo.hk, geo.kd), jnp.float32).astype(jnp.bfloat16),
          "k": k.astype(jnp.bfloat16),
          "v": jax.random.normal(kv, (batch, 1, geo.hv, geo.vd), jnp.float32).astype(jnp.bfloat16),
          "g": -jax.random.uniform(kg, (batch, 1, geo.hv), jnp.float32, 0.01, 0.5),
          "beta": jax.random.uniform(kb, (batch, 1, geo.hv), jnp.float32).astype(jnp.bfloat16)}


def make_state(geo: gdn_decode.Geometry, batch: int, seed: int):
  """One layer's states [B, Hv, V, K] float32, std 0.1."""
  return 0.1 * jax.random.normal(jax.random.key(seed), (batch, *geo.state_shape), jnp.float32)


def rel_l2(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def gate(torch, peer, inputs: dict, state, scale: float) -> dict:
  """The peer's step (output, state) against rs.gdn.decode(implementation="xla") on the same arrays."""
  t = {k: torch.from_dlpack(v) for k, v in inputs.items()}
  o, h = peer(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], scale=scale,
              initial_state=torch.from_dlpack(state), output_final_state=True, state_v_first=True)
  torch.cuda.synchronize()
  slots = jnp.arange(state.shape[0], dtype=jnp.int32)
  ref_o, ref_S = rs.gdn.decode(*(inputs[k][:, 0] for k in ("q", "k", "v", "g", "beta")), state, slots,
                               scale=scale, implementation="xla")
  errors = {"output": rel_l2(o[:, 0].float().cpu().numpy(), ref_o.astype(jnp.float32)),
            "state": rel_l2(h.cpu().numpy(), ref_S)}
  return {"rel_l2": errors, "tol": GATE_TOL, "passed": all(errors[k] <= GATE_TOL[k] for k in errors)}


def time_peer(torch, peer, bank: list, states: list, scale: float, *, reps: int,
              rep_seconds: float) -> dict:
  """ms per layer-step of the peer: one CUDA graph of len(bank) steps over the P layers (module doc)."""
  ins = [{k: torch.from_dlpack(v) for k, v in inputs.items()} for inputs in bank]
  h0 = [torch.from_dlpack(s) for s in states]
  layers = len(h0)
  keep = []   # every call's outputs stay alive: each writes memory of its own, as a model's would

  def steps():
    keep.clear()
    for t in range(len(ins)):
      for layer in range(layers):
        x = ins[(t + layer) % len(ins)]
        keep.append(peer(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], scale=scale,
                         initial_state=h0[layer], output_final_state=True, state_v_first=True))

  side = torch.cuda.Stream()   # warm-up (Triton compiles) off the capture stream, as PyTorch advises
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    steps()
  torch.cuda.current_stream().wait_stream(side)
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    steps()

  def run(m: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(m):
      graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (m * len(ins) * layers)   # ms per layer-step

  run(1)
  m = max(1, round(rep_seconds / max(run(1) * len(ins) * layers / 1e3, 1e-9)))
  per = [run(m) for _ in range(reps)]
  med, p20, p80 = common.quantiles(per)
  return {"ms_per_layer_step": per, "median_ms": med, "p20_ms": p20, "p80_ms": p80,
          "replays_per_rep": m, "layer_steps_per_replay": len(ins) * layers}


def peer_row(torch, peer, geo, batch: int, *, args) -> dict:
  layers = harness.layers_for(geo, batch, "float32", args.target_bytes, args.max_layers, args.min_layers)
  bytes_row = gdn_decode.bytes_model(geo, "conv", None, "float32", None, "bfloat16")
  row = {"arm": PEER, "batch": batch, "layers": layers, "state_dtype": "float32",
         "act_dtype": "bfloat16", "bytes_per_layer_step": batch * bytes_row["total"]}
  scale = geo.kd ** -0.5
  bank = [make_inputs(geo, batch, seed=args.seed * 1000 + i) for i in range(BANK)]
  states = [make_state(geo, batch, seed=args.seed * 1000 + 100 + layer) for layer in range(layers)]
  jax.block_until_ready((bank, states))   # PyTorch reads them through DLPack
  row["gate"] = gate(torch, peer, bank[0], states[0], scale)
  row.update(time_peer(torch, peer, bank, states, scale, reps=args.reps, rep_seconds=args.rep_seconds))
  row["status"] = "ok" if row["gate"]["passed"] else "gate-failed"
  return row


def compare(ours: list[dict], peers: list[dict], ceiling_gbps: float) -> list[dict]:
  """One row per batch: ours and the peer's medians, GB/s and % of the ceiling; ours / peer."""
  out = []
  for p in peers:
    mine = next((r for r in ours if r["batch"] == p["batch"] and r["arm"] == OURS), None)
    row = {"batch": p["batch"], "layers": p["layers"], "peer_ms": p["median_ms"],
           "peer_status": p["status"], "peer_gate_rel_l2": max(p["gate"]["rel_l2"].values())}
    row["peer_gbps"] = p["bytes_per_layer_step"] / (p["median_ms"] * 1e-3) / 1e9
    row["peer_pct_ceiling"] = 100 * row["peer_gbps"] / ceiling_gbps
    if mine is not None and mine.get("median_ms"):
      row.update(ours_ms=mine["median_ms"], ours_status=mine["status"], ours_gbps=mine["eff_gbps"],
                 ours_pct_ceiling=mine["pct_ceiling"])
      both_ok = mine["status"] == "ok" and p["status"] == "ok"
      row["ours_speedup_vs_peer"] = p["median_ms"] / mine["median_ms"] if both_ok else None
    out.append(row)
  return out


def table(rows: list[dict]) -> str:
  headers = ["B", "P", "fla fused_recurrent ms", "GB/s", "% ceiling", "ours (conv-pallas) ms", "GB/s",
             "% ceiling", "ours x fla", "fla gate rel L2"]
  f = common.fmt_float
  cells = [[str(r["batch"]), str(r["layers"]), f(r["peer_ms"], ".4f"), f(r["peer_gbps"], ".0f"),
            f(r["peer_pct_ceiling"], ".0f"), f(r.get("ours_ms"), ".4f"), f(r.get("ours_gbps"), ".0f"),
            f(r.get("ours_pct_ceiling"), ".0f"), f(r.get("ours_speedup_vs_peer"), ".2f"),
            f(r["peer_gate_rel_l2"], ".1e") + ("" if r["peer_status"] == "ok" else " FAILED")]
           for r in rows]
  return common.render_table(headers, cells, markdown=True)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m bench.peer_fla", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", default="32,256", help="comma-separated batch sizes")
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--rep-seconds", type=float, default=0.2)
  p.add_argument("--target-bytes", type=float, default=2**30, help="P layers: P·state pool >= this")
  p.add_argument("--max-layers", type=int, default=4096)
  p.add_argument("--min-layers", type=int, default=8, help="as bench.gdn_decode: P >= this")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-json", type=pathlib.Path, default=None)
  args = p.parse_args(argv)
  try:
    batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    p.error(f"--batches={args.batches!r}; expected comma-separated ints")
  meta = common.run_metadata(argv, "bench.peer_fla")
  try:
    torch, peer = load_peer()
  except ImportError as e:
    print(f"{PEER}: skipped: {e}")
    return {"meta": meta, "skipped": str(e)}
  meta["peer"] = {"torch": torch.__version__, "fla": _version("fla-core")}
  geo = gdn_decode.QWEN35_4B
  # Ours first, through the harness (which also measures the copy ceiling), then the peer.
  ours = gdn_decode.main(["--arms", OURS, "--state-dtypes", "float32", "--batches", args.batches,
                          "--reps", str(args.reps), "--rep-seconds", str(args.rep_seconds),
                          "--target-bytes", str(args.target_bytes), "--max-layers", str(args.max_layers),
                          "--min-layers", str(args.min_layers),
                          "--out-json", str(args.out_json.with_suffix(".ours.json") if args.out_json
                                            else pathlib.Path(os.devnull))])
  peers = []
  for batch in batches:
    peers.append(peer_row(torch, peer, geo, batch, args=args))
    common.log(f"{PEER} B={batch}: {peers[-1]['median_ms']:.4f} ms/layer-step, gate "
               f"{'ok' if peers[-1]['gate']['passed'] else 'FAILED'} {peers[-1]['gate']['rel_l2']}")
  ceiling = ours["ceiling"]["gbps"]
  rows = compare(ours["rows"], peers, ceiling)
  result = {"meta": meta, "ceiling_gbps": ceiling, "rows": rows, "peer_rows": peers}
  if args.out_json:
    common.write_json(args.out_json, result)
  print(table(rows))
  return result


def _version(dist: str) -> str | None:
  from importlib import metadata
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


if __name__ == "__main__":
  main()
