"""Decode attention over a slot-pool KV cache: the Pallas-Triton kernel against the XLA path.

One attention layer's read of its KV cache per decode (or verify) step, the part of
``Attention.step`` after the KV write: q [B, T, H, Dh] against the slots' rows of a bf16 pool
[N = B, S, Hkv, Dh], every row at the same position (``--contexts`` cached tokens, then the T new
ones; S = context + 16). Arms:

* ``kernel-identity``: ``pallas.attention_triton.decode_attention``, slot b = row b;
* ``kernel-permuted``: the same kernel, rows on a fixed permutation of the slots;
* ``xla-inplace``: ``models.attention.attend_xla`` with slot b = row b (the pool read in place);
* ``xla-gather``: ``attend_xla`` with permuted slots (the KV rows gathered first).

Geometries: Qwen3.5-4B's attention layers (H 16, Hkv 4, Dh 256) and Nemotron-H-8B's (H 32, Hkv 8,
Dh 128). Method (bench/common.py): P layers, each with its own pool, P·pool ≥ ``--target-bytes``
(at most 8), run in sequence per step; n steps inside one ``jax.jit`` (``lax.fori_loop``), the next
step's q depending on this step's outputs (nothing is hoisted), carry donated; ``time_loop`` warms
up, calibrates and times ``--reps`` calls; ms per layer-step = call time / (n · P), median and
p20–p80. Bandwidth counts the KV bytes a step must read, B · (context + T) · Hkv · Dh · 2 (K and
V) · 2 bytes, the same for every arm (the XLA path reads the whole S, and the gather writes and
reads a copy besides). Gate, before timing: layer 0's output of every arm against a float32
oracle (``_reference``) and, for the kernel arms, against ``attend_xla`` on the same slots
(relative L2 < 1e-2: both paths round the probabilities to bf16); a failed gate is recorded, the
arm still timed.

    python -m bench.attention_decode --out-json bench/results/attention_decode_h200.json   # GPU
    python -m bench.attention_decode --configs default,bk32w4,bk64w4,bk32w8,bk64w8s3 # kernel sweep
    python -m bench.attention_decode --smoke          # CPU, tiny shapes, kernel interpreted

Kernel configs (``--configs``): ``default`` (``config.attention_decode_config``) or tokens
``bk<block_kv>``, ``w<num_warps>``, ``s<num_stages>``, ``p<num_splits>``, e.g. ``bk64w8p2``.
"""
import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
from replayssm_jax.models.attention import attend_xla
from replayssm_jax.pallas import attention_triton

ARMS = ("kernel-identity", "kernel-permuted", "xla-inplace", "xla-gather")
GEOMETRIES = {"qwen35_4b": dict(h=16, hkv=4, dh=256), "nemotron_h_8b": dict(h=32, hkv=8, dh=128)}
SMOKE_GEOMETRY = {"smoke": dict(h=4, hkv=2, dh=64)}
GATE_TOL = 1e-2
_KNOBS = {"bk": "block_kv", "w": "num_warps", "s": "num_stages", "p": "num_splits"}


def parse_config(text: str) -> tuple:
  """``default`` → (); ``bk64w8p2`` → (("block_kv", 64), ("num_splits", 2), ("num_warps", 8))."""
  return common.parse_knobs(text, _KNOBS, example="bk64w8p2")


def kv_bytes(batch, context, t, hkv, dh, itemsize=2) -> int:
  """KV bytes one layer-step must read: every row's context + T positions, K and V."""
  return batch * (context + t) * hkv * dh * 2 * itemsize


def _attend(arm, knobs, q, k, v, slots, start, scale):
  if arm.startswith("kernel"):
    return attention_triton.decode_attention(q, k, v, slots, start, scale=scale, **dict(knobs))
  pos = start[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  return attend_xla(q, k, v, slots, pos, scale=scale)


def _slots(arm, batch):
  if arm.endswith("identity") or arm.endswith("inplace"):
    return jnp.arange(batch, dtype=jnp.int32)
  return jnp.asarray(np.random.default_rng(0).permutation(batch), jnp.int32)


def _rel_l2(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference(q, k, v, slots, start, scale):
  """float32 oracle: the slots' rows gathered, q rounded to bf16 as the arms cast it, masked softmax
  over positions <= start + t, products at Precision.HIGHEST."""
  bsz, t, h, dh = q.shape
  hkv = k.shape[2]
  hp = lax.Precision.HIGHEST
  qf = q.astype(k.dtype).astype(jnp.float32).reshape(bsz, t, hkv, h // hkv, dh)
  kf, vf = (x[slots].astype(jnp.float32) for x in (k, v))                            # [B, S, Hkv, Dh]
  logits = jnp.einsum("btkgd,bskd->bkgts", qf, kf, precision=hp) * scale
  pos = start[:, None] + jnp.arange(t)[None, :]                                      # [B, T]
  keep = jnp.arange(k.shape[1])[None, None, :] <= pos[:, :, None]                    # [B, T, S]
  w = jax.nn.softmax(jnp.where(keep[:, None, None], logits, -jnp.inf), axis=-1)
  return jnp.einsum("bkgts,bskd->btkgd", w, vf, precision=hp).reshape(q.shape)


@functools.partial(jax.jit, static_argnames=("arm", "knobs", "scale"), donate_argnums=(0,))
def _run(q, pools, slots, start, n, *, arm, knobs, scale):
  def step(_, q):
    for k, v in pools:
      o = _attend(arm, knobs, q, k, v, slots, start, scale)
      q = (q + 1e-6 * o).astype(q.dtype)      # the next layer's q depends on this output
    return q
  return lax.fori_loop(0, n, step, q)


def measure(geo, *, batch, context, t, arm, knobs, target_bytes, reps, rep_seconds):
  h, hkv, dh = geo["h"], geo["hkv"], geo["dh"]
  seq = context + 16
  pool_bytes = 2 * batch * seq * hkv * dh * 2
  layers = int(min(8, max(1, math.ceil(target_bytes / pool_bytes))))
  pools = tuple((common.hash_normal(10 + 2 * i, (batch, seq, hkv, dh)).astype(jnp.bfloat16),
                 common.hash_normal(11 + 2 * i, (batch, seq, hkv, dh)).astype(jnp.bfloat16))
                for i in range(layers))
  q = common.hash_normal(1, (batch, t, h, dh)).astype(jnp.bfloat16)
  slots, start = _slots(arm, batch), jnp.full((batch,), context, jnp.int32)
  scale = dh ** -0.5
  k0, v0 = pools[0]
  o = np.asarray(_attend(arm, knobs, q, k0, v0, slots, start, scale), np.float64)
  errs = {"vs_f32": _rel_l2(o, _reference(q, k0, v0, slots, start, scale))}
  if arm.startswith("kernel"):
    errs["vs_xla"] = _rel_l2(o, _attend("xla", (), q, k0, v0, slots, start, scale))
  call = lambda carry, n: _run(carry, pools, slots, start, np.int32(n), arm=arm, knobs=knobs, scale=scale)
  _, timing = common.time_loop(call, q, reps=reps, rep_seconds=rep_seconds)
  stats = timing.ms_per(layers)
  moved = kv_bytes(batch, context, t, hkv, dh)
  return {"median_ms": stats["median_ms"], "p20_ms": stats["p20_ms"], "p80_ms": stats["p80_ms"],
          "n_cycles": stats["n_cycles"], "layers": layers, "kv_bytes": moved,
          "gbps": moved / (stats["median_ms"] * 1e-3) / 1e9, "gate_rel_l2": errs,
          "gate": "ok" if max(errs.values()) < GATE_TOL else "FAILED"}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.attention_decode", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny shapes for CPU (kernel interpreted)")
  parser.add_argument("--geometries", default=None, help=f"comma list of {sorted(GEOMETRIES)}")
  parser.add_argument("--batches", default=None, help="comma list (default 32,256)")
  parser.add_argument("--contexts", default=None, help="cached tokens per row (default 1024,8192)")
  parser.add_argument("--tokens", type=int, default=1, help="T new tokens per row (1: decode)")
  parser.add_argument("--arms", default=",".join(ARMS))
  parser.add_argument("--configs", default="default", help="kernel launch configs (module doc)")
  parser.add_argument("--target-bytes", type=float, default=1e9)
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--rep-seconds", type=float, default=None)
  parser.add_argument("--out-json", default=None)
  args = parser.parse_args(argv)
  smoke = args.smoke
  geos = SMOKE_GEOMETRY if smoke else GEOMETRIES
  if args.geometries and not smoke:
    geos = {g: GEOMETRIES[g] for g in args.geometries.split(",")}
  ints = lambda s, default: [int(x) for x in (s or default).split(",")]
  batches = ints(args.batches, "4" if smoke else "32,256")
  contexts = ints(args.contexts, "40" if smoke else "1024,8192")
  arms = args.arms.split(",")
  for a in arms:
    if a not in ARMS:
      raise ValueError(f"--arms: {a!r}; expected a comma list of {ARMS}")
  configs = [(c, parse_config(c)) for c in args.configs.split(",")]
  reps = args.reps or (2 if smoke else 7)
  rep_seconds = args.rep_seconds if args.rep_seconds is not None else (0.01 if smoke else 0.2)
  target = 0 if smoke else args.target_bytes
  ceiling = None if smoke else common.measure_copy_ceiling(2 * 10 ** 9)
  rows, skipped = [], []
  result = {"meta": common.run_metadata(argv, "bench.attention_decode"), "copy_ceiling": ceiling,
            "rows": rows, "skipped": skipped}
  for gname, geo in geos.items():
    for batch in batches:
      for context in contexts:
        for arm in arms:
          for cname, knobs in (configs if arm.startswith("kernel") else [("-", ())]):
            where = dict(geometry=gname, **geo, batch=batch, context=context, tokens=args.tokens,
                         arm=arm, config=cname)
            try:
              r = measure(geo, batch=batch, context=context, t=args.tokens, arm=arm, knobs=knobs,
                          target_bytes=target, reps=reps, rep_seconds=rep_seconds)
            except NotImplementedError as e:   # a shape the kernel cannot run: the arm is skipped
              skipped.append(dict(where, reason=str(e)))
              common.log(f"{gname} B={batch} ctx={context} {arm} {cname}: skipped ({e})")
              continue
            r.update(where)
            if ceiling:
              r["pct_ceiling"] = 100 * r["gbps"] / ceiling["gbps"]
            rows.append(r)
            common.log(f"{gname} B={batch} ctx={context} {arm} {cname}: {r['median_ms']:.4f} ms, "
                       f"{r['gbps']:.0f} GB/s, gate {r['gate']} {r['gate_rel_l2']}")
            if args.out_json:
              common.write_json(args.out_json, result)
  print(common.render_table(
      ["geometry", "B", "context", "T", "arm", "config", "ms/layer-step", "p20-p80", "GB/s",
       "% copy", "gate"],
      [[r["geometry"], str(r["batch"]), str(r["context"]), str(r["tokens"]), r["arm"], r["config"],
        f"{r['median_ms']:.4f}", f"{r['p20_ms']:.4f}-{r['p80_ms']:.4f}", f"{r['gbps']:.0f}",
        common.fmt_float(r.get("pct_ceiling"), ".0f"), r["gate"]] for r in rows],
      align_right={1, 2, 3, 6, 8, 9}))
  return result


if __name__ == "__main__":
  main()
