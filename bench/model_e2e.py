"""End-to-end decode of real architectures: replay vs conventional, and where the step's time goes.

Models: ``replayssm_jax.models.presets`` (Qwen3.5-4B, Nemotron-H-8B, Mamba-Codestral-7B,
Qwen3-Next-80B-A3B at a depth that fits one GPU), random weights, bf16 parameters and
activations, float32 recurrent state, bf16 rings. Every slot already holds ``--contexts`` tokens
in its KV cache (the attention layers read them every step; the KV capacity is context + L) and
the recurrent rows start at staggered cursor phases (row b has b mod (L-1) pending entries), so
every step mixes flushing and non-flushing rows. One program per (mode, B, context): a
``lax.fori_loop`` over whole flush cycles of L (``--buffer-len``, by default the library's 16)
decode steps (``LM.decode``, cache donated; each cycle rewinds the positions to the context, so
every cycle attends over the same number of tokens). The token fed back is the argmax shifted by a
hash of (row, step) modulo the vocabulary: the head's output stays live, and the tokens look
uniformly random in both modes, so MoE routing spreads over the experts as in real traffic and
alike in both modes (a random model's greedy streams collapse onto a few tokens, differently per
mode, and the grouped matmul's cost follows the routing). Timed by
``bench.common.time_loop`` (warm-up, calibration, median and p20/p80 of ``--reps`` timed calls).
tokens/s = B / (ms per step).

Per-part split (``--parts``): each kind of layer is timed alone at the same B and context, as a
loop of whole flush cycles of its own step, and multiplied by its count in the model: recurrent
mixers (GatedDeltaNet / Mamba2 decode with their conv state; replay and conventional), attention
(KV write + attention over context + t tokens), MLP or MoE, and the head (final norm, vocab
projection, argmax). Their sum next to the measured step shows what the rest (embedding, norms,
residuals, fusion across layers) costs.

    python -m bench.model_e2e --presets qwen3.5-4b,nemotron-h-8b --batches 1,8,32,128,256,512 --contexts 1024,8192 --parts 256
    python -m bench.model_e2e --smoke            # CPU: the tiny checkpoints' shapes (tests/data/hf)
    python -m bench.model_e2e --presets qwen3-next-80b-a3b --tp 4 --batches 256 --contexts 1024

``--tp N`` draws the model sharded over the first N devices (``make_sharded_model``: heads, KV
heads and expert widths split, each device only its shards), so a preset larger than one GPU
runs at full depth (``--num-layers`` cuts any preset); the step loop is the same, each step
under ``shard_map``; parts are not timed there.
"""
import argparse
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import common
from replayssm_jax import config as config_lib
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from replayssm_jax.models import make_model, make_sharded_model
from replayssm_jax.models import hf as hf_lib
from replayssm_jax.models.attention import AttentionLayerCache
from replayssm_jax.models.presets import preset

# Depth that fits one H200 with room for a batch-512 cache (512 experts per layer: 1.6B params each).
DEPTH = {"qwen3-next-80b-a3b": 12}
SMOKE = {"tiny-qwen3_5": "qwen3_5", "tiny-qwen3_5_mtp": "qwen3_5_mtp",
         "tiny-nemotron_h": "nemotron_h"}   # tests/data/hf directories
SMOKE_RUN = ("tiny-qwen3_5", "tiny-nemotron_h")   # what --smoke runs (the MTP head is not in a decode step)
MODES = {"conventional": False, "replay": True}
READ_COPY_MODE = "replay-read-copy"   # --read-copy: replay over caches with a bf16 read copy
MEMORY_BUDGET = 120 * 2**30     # bytes of parameters + cache a run may take on a 141 GB card


def model_config(name: str, num_layers: int | None = None):
  """The preset's LMConfig; ``num_layers`` None: ``DEPTH``'s cut where one GPU needs it (the
  tiny checkpoints' shapes of ``--smoke`` keep their layers)."""
  if name in SMOKE:
    data = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "hf" / SMOKE[name]
    return hf_lib._plan(hf_lib.read_config(data / "config.json"), dtype=jnp.float32, max_prompt_len=16)[1]
  return preset(name, num_layers=DEPTH.get(name) if num_layers is None else num_layers)


def cache_bytes(model, batch, max_len, buffer_len, read_copy_dtype=None) -> int:
  abstract = jax.eval_shape(lambda: model.init_cache(batch, buffer_len=buffer_len, max_len=max_len,
                                                     ring_dtype=jnp.bfloat16,
                                                     read_copy_dtype=read_copy_dtype))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def prepared_cache(model, batch, *, context, buffer_len, replay, read_copy_dtype=None):
  """Cache with ``context`` tokens per slot (KV entries zero: attention costs the same) and, in
  replay mode, staggered cursor windows of zero entries (an exact state); ``read_copy_dtype``: the
  recurrent checkpoints' read copy."""
  cache = model.init_cache(batch, buffer_len=buffer_len, max_len=context + buffer_len,
                           ring_dtype=jnp.bfloat16, read_copy_dtype=read_copy_dtype)
  count = jnp.arange(batch, dtype=jnp.int32) % max(1, buffer_len - 1) if replay else cache.cursor.count
  return cache.replace(cursor=cache.cursor.replace(count=count),
                       positions=jnp.full((batch,), context, jnp.int32))


def _decode_loop(decode, *, buffer_len, context):
  """jit(params, (tokens, cache), n) → n whole flush cycles of ``decode(params, tokens, cache,
  slots) → (logits, cache)``, each cycle rewinding the positions to ``context``."""
  def run(params, carry, n):
    slots = jnp.arange(carry[0].shape[0], dtype=jnp.int32)

    def step(t, c):
      tok, cache = c
      logits, cache = decode(params, tok, cache, slots)
      vocab = logits.shape[-1]
      shift = (common.mix32((slots * buffer_len + t).astype(jnp.uint32)) % vocab).astype(jnp.int32)
      return (jnp.argmax(logits, -1).astype(jnp.int32) + shift) % vocab, cache

    def cycle(_, c):
      tok, cache = c
      cache = cache.replace(positions=jnp.full_like(cache.positions, context))
      return jax.lax.fori_loop(0, buffer_len, step, (tok, cache))
    return jax.lax.fori_loop(0, n, cycle, carry)
  return jax.jit(run, donate_argnums=(1,))


def _step_loop(graphdef, *, replay, buffer_len, context):
  """The model step loop of an unsharded LM (``graphdef``; its params are the first argument)."""
  return _decode_loop(lambda params, tok, cache, slots: nnx.merge(graphdef, params).decode(
      tok, cache, slots, replay=replay), buffer_len=buffer_len, context=context)


def _sharded_step_loop(sharded, cache, *, replay, buffer_len, context):
  """The same loop over a ShardedLM (``cache``: the sharded cache's layout; params
  ``sharded.params``): each step runs per device under ``shard_map``."""
  decode = sharded.decode_step(cache, replay=replay)
  return _decode_loop(lambda params, tok, cache, slots: decode(
      params, cache, tok, slots, jnp.zeros(slots.shape, bool)), buffer_len=buffer_len,
      context=context)


def _on_mesh(sharded, cache):
  """``cache`` (a ShardedLM's, with replaced cursor and positions) placed by its specs; abstract
  leaves get the shardings as ShapeDtypeStructs (for lowering)."""
  shardings = sharded.cache_shardings(cache)
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(cache)):
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), cache,
                        shardings)
  return jax.device_put(cache, shardings)


# ---- parts, each timed alone -----------------------------------------------------------------

def _part_loop(graphdef, kind, *, replay, buffer_len, context):
  """A loop of whole cycles of one layer's step: (block params, carry, n) → carry."""
  def run(params, carry, n):
    block = nnx.merge(graphdef, params)
    x0, state = carry
    batch = x0.shape[0]
    slots = jnp.arange(batch, dtype=jnp.int32)

    def step(t, c):
      x, state = c
      if kind == "recurrent":
        lc, cursor = state
        plan = cursor.plan(slots)
        y, lc = block.mixer.decode(x, lc, plan, replay=replay)
        state = (lc, cursor.commit(plan) if replay else cursor)
      elif kind == "attention":
        start = jnp.full((batch,), context, jnp.int32) + t
        y, state = block.mixer.step(x[:, None], state, slots, start, jnp.ones((batch, 1), bool))
        y = y[:, 0]
      elif kind == "mlp":
        y = block.mlp(x)
      else:   # head
        logits = block.head(block.final_norm(x)).astype(jnp.float32)
        y = x + jnp.argmax(logits, -1)[:, None].astype(x.dtype) * 1e-6
      return (x + 1e-3 * y.astype(x.dtype)), state   # a data dependence from step to step

    return jax.lax.fori_loop(0, n, lambda _, c: jax.lax.fori_loop(0, buffer_len, step, c), carry)
  return jax.jit(run, donate_argnums=(1,))


@dataclasses.dataclass
class Part:
  kind: str          # "recurrent", "attention", "mlp", "head"
  label: str         # e.g. "gdn", "mamba2", "attention", "moe", "dense", "head"
  count: int         # layers of this kind in the model
  module: object     # the Block (or the LM for the head)
  layer: int | None  # index into cache.layers (mixers)


def model_parts(model) -> list:
  c = model.config
  parts, seen = [], {}
  mixer_index = {id(b): i for i, b in enumerate(model.mixer_blocks)}
  for i, b in enumerate(model.blocks):
    if b.layer_type == "parallel":
      raise NotImplementedError("model_parts: timing a parallel (Mamba2 + attention) block's parts alone")
    if b.has_mixer:
      kind = "attention" if b.layer_type == "attention" else "recurrent"
      key = (kind, b.layer_type)
      if key not in seen:
        seen[key] = Part(kind, b.layer_type, 0, b, mixer_index[id(b)])
        parts.append(seen[key])
      seen[key].count += 1
    if b.has_mlp:
      key = ("mlp", c.block_mlp(i))
      if key not in seen:
        seen[key] = Part("mlp", c.block_mlp(i), 0, b, None)
        parts.append(seen[key])
      seen[key].count += 1
  parts.append(Part("head", "head", 1, model, None))
  return parts


def _part_state(model, part, cache):
  if part.kind == "recurrent":
    return cache.layers[part.layer], cache.cursor
  if part.kind == "attention":
    return cache.layers[part.layer]
  return jnp.zeros((), jnp.int32)


def _compiled(programs: dict, workers: int) -> dict:
  """{key: compiled} from {key: (jitted fn, abstract args)}: lowered here, compiled in parallel."""
  lowered = {k: fn.lower(*args) for k, (fn, args) in programs.items()}
  out = {}
  for key, (res, _) in common.compile_all(lowered, workers).items():
    if isinstance(res, Exception):
      raise res
    out[key] = res
  return out


def _timed(compiled, params, carry, *, buffer_len, reps, rep_seconds):
  _, timing = common.time_loop(lambda c, n: compiled(params, c, jnp.int32(n)), carry, reps=reps,
                               rep_seconds=rep_seconds)
  med, p20, p80 = common.quantiles([1e3 * t / buffer_len for t in timing.per_cycle()])
  return med, p20, p80, timing.n_cycles


# ---- the run ---------------------------------------------------------------------------------

def run_preset(name, *, batches, contexts, parts, reps, rep_seconds, workers, buffer_len=None,
               read_copy=False, tp=0, num_layers=None):
  """Lowers every (context, B, mode) step program and part, compiles them in parallel, then times
  them one after the other. ``buffer_len`` None: the library's decode default
  (``config.DECODE_BUFFER_LEN``, what a cache made without one gets). ``read_copy``: a third mode,
  replay over caches whose float32 checkpoints have a bf16 read copy. ``tp`` >= 1: the model is
  drawn sharded over the first ``tp`` devices (``make_sharded_model``, heads split; no parts);
  ``num_layers``: the depth (None: ``model_config``'s)."""
  modes = {name: (replay, None) for name, replay in MODES.items()}
  if read_copy:
    modes[READ_COPY_MODE] = (True, jnp.bfloat16)
  config = model_config(name, num_layers)
  buffer_len = config_lib.DECODE_BUFFER_LEN if buffer_len is None else buffer_len
  if tp:
    model = make_sharded_model(config, Mesh(np.array(jax.devices()[:tp]), ("tp",)), seed=0)
    params, unsharded = model.params, model.abstract_model
    # Per device: its parameter shards (replicated leaves whole).
    param_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(params))
  else:
    model = unsharded = make_model(config, seed=0)
    graphdef, params = nnx.split(model)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  kinds = ", ".join(f"{config.layer_types.count(k)} {k}" for k in dict.fromkeys(config.layer_types))
  common.log(f"{name}: {config.num_layers} layers ({kinds}), {param_bytes / 2**30:.1f} GiB of parameters"
             f"{f' per device, {tp} devices' if tp else ''}, L={buffer_len}")
  the_parts = [] if tp else model_parts(model)
  rows, part_rows, programs, shapes = [], [], {}, []
  for context in contexts:
    for batch in batches:
      need = param_bytes + cache_bytes(unsharded, batch, context + buffer_len, buffer_len,
                                       jnp.bfloat16 if read_copy else None) // max(tp, 1)
      if need > MEMORY_BUDGET:
        common.log(f"  C={context} B={batch}: skipped, {need / 2**30:.0f} GiB > {MEMORY_BUDGET / 2**30:.0f} GiB")
        rows.append({"preset": name, "batch": batch, "context": context, "skipped": "memory", "bytes": need})
        continue
      shapes.append((context, batch))
      tok = jax.ShapeDtypeStruct((batch,), jnp.int32)
      x = jax.ShapeDtypeStruct((batch, config.hidden_size), config.dtype)
      for mode, (replay, copy) in modes.items():
        cache = jax.eval_shape(lambda: prepared_cache(unsharded, batch, context=context, buffer_len=buffer_len,
                                                      replay=replay, read_copy_dtype=copy))
        if tp:
          cache = _on_mesh(model, cache)
          fn = _sharded_step_loop(model, cache, replay=replay, buffer_len=buffer_len, context=context)
          tok = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(model.mesh, P()))
        else:
          fn = _step_loop(graphdef, replay=replay, buffer_len=buffer_len, context=context)
        programs[("step", context, batch, mode)] = (fn, (params, (tok, cache), jnp.int32(1)))
        for i, part in enumerate(the_parts if parts is True or (parts and batch in parts) else []):
          if part.kind == "recurrent" or mode == "conventional":
            pg, pp = nnx.split(part.module)
            fn = _part_loop(pg, part.kind, replay=replay, buffer_len=buffer_len, context=context)
            programs[("part", context, batch, mode, i)] = (
                fn, (pp, (x, _part_state(model, part, cache)), jnp.int32(1)))
  t0 = common.elapsed()
  compiled = _compiled(programs, workers)
  common.log(f"  compiled {len(compiled)} programs in {common.elapsed() - t0:.0f} s ({workers} workers)")
  timed = lambda key, params, carry: _timed(compiled[key], params, carry, buffer_len=buffer_len, reps=reps,
                                            rep_seconds=rep_seconds)
  for context, batch in shapes:
    group = []
    for mode, (replay, copy) in modes.items():
      cache = prepared_cache(model, batch, context=context, buffer_len=buffer_len, replay=replay,
                             read_copy_dtype=copy)
      tok = jnp.ones((batch,), jnp.int32)
      if tp:
        cache, tok = _on_mesh(model, cache), jax.device_put(tok, NamedSharding(model.mesh, P()))
      med, p20, p80, cycles = timed(("step", context, batch, mode), params, (tok, cache))
      group.append({"preset": name, "mode": mode, "batch": batch, "context": context, "buffer_len": buffer_len,
                    "median_ms": med, "p20_ms": p20, "p80_ms": p80, "tokens_per_s": batch / (med / 1e3),
                    "cycles": cycles, "tp": tp})
      for i, part in enumerate(the_parts):
        key = ("part", context, batch, mode, i)
        if key not in compiled:
          continue
        # One layer's cache (the rest of the model's cache is freed at once).
        state = _part_state(model, part, prepared_cache(model, batch, context=context, buffer_len=buffer_len,
                                                        replay=replay, read_copy_dtype=copy))
        x = common.hash_normal(7, (batch, config.hidden_size)).astype(config.dtype)
        med_p, p20_p, p80_p, _ = timed(key, nnx.split(part.module)[1], (x, state))
        part_rows.append({"preset": name, "batch": batch, "context": context, "part": part.label,
                          "kind": part.kind, "layers": part.count, "ms_per_layer": med_p,
                          "ms_per_step": med_p * part.count, "p20_ms_per_layer": p20_p,
                          "p80_ms_per_layer": p80_p, "mode": mode if part.kind == "recurrent" else "both"})
    for r in group[1:]:
      r["speedup_vs_conv"] = group[0]["median_ms"] / r["median_ms"]
      common.log(f"  C={context} B={batch}: conventional {group[0]['median_ms']:.3f} ms, {r['mode']} "
                 f"{r['median_ms']:.3f} ms/step ({r['speedup_vs_conv']:.2f}x), {r['tokens_per_s']:.0f} tokens/s")
    rows += group
  return {"preset": name, "config": config.to_dict(), "buffer_len": buffer_len, "tp": tp,
          "param_bytes": param_bytes, "rows": rows, "parts": part_rows}


def _tables(results) -> str:
  out = []
  step_rows = []
  for res in results:
    for r in res["rows"]:
      if "skipped" in r:
        step_rows.append([r["preset"], str(r["context"]), str(r["batch"]), "-", "-", "-", "-",
                          f"skipped ({r['bytes'] / 2**30:.0f} GiB)"])
      elif r["mode"] != "conventional":
        conv = next(x for x in res["rows"] if x.get("mode") == "conventional" and x["batch"] == r["batch"]
                    and x["context"] == r["context"])
        label = r["preset"] + (" (bf16 read copy)" if r["mode"] == READ_COPY_MODE else "")
        step_rows.append([label, str(r["context"]), str(r["batch"]), f"{conv['median_ms']:.3f}",
                          f"{r['median_ms']:.3f}", f"{conv['tokens_per_s']:.0f}", f"{r['tokens_per_s']:.0f}",
                          f"{r['speedup_vs_conv']:.2f}x"])
  out.append(common.render_table(["preset", "context", "B", "conv ms/step", "replay ms/step", "conv tok/s",
                                  "replay tok/s", "replay speed-up"], step_rows, markdown=True))
  part_rows = []
  for res in results:
    for r in res["parts"]:
      part_rows.append([r["preset"], str(r["context"]), str(r["batch"]), f"{r['part']} ×{r['layers']}",
                        r["mode"], f"{r['ms_per_layer']:.4f}", f"{r['ms_per_step']:.3f}"])
  if part_rows:
    out.append(common.render_table(["preset", "context", "B", "part", "mode", "ms per layer", "ms per step"],
                                   part_rows, markdown=True))
  return "\n\n".join(out)


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for res in results:
    for context in sorted({r["context"] for r in res["rows"]}):
      pts = sorted((r["batch"], r["speedup_vs_conv"]) for r in res["rows"]
                   if r.get("mode") == "replay" and r["context"] == context)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=f"{res['preset']}, {context} context")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch (requests decoding at once)")
  ax.set_ylabel("ReplaySSM tokens/s ÷ conventional")
  ax.set_title("End-to-end decode, random weights, bf16, f32 state")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m bench.model_e2e", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="CPU: the tiny checkpoints' shapes, B = 2, context 8")
  p.add_argument("--presets", default="qwen3.5-4b,nemotron-h-8b", help="comma-separated preset names")
  p.add_argument("--batches", default="1,8,32,128,256,512")
  p.add_argument("--contexts", default="1024,8192", help="tokens already in each slot's KV cache")
  p.add_argument("--parts", nargs="?", const="all", default=None,
                 help="also time each kind of layer alone: at every batch, or at the comma-separated ones given")
  p.add_argument("--buffer-len", type=int, default=None,
                 help="ReplaySSM buffer length L (default: the library's decode default, 16)")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--rep-seconds", type=float, default=0.25)
  p.add_argument("--compile-workers", type=int, default=8, help="programs compiled at once")
  p.add_argument("--read-copy", action="store_true",
                 help="also time replay over caches whose float32 checkpoints have a bf16 read copy")
  p.add_argument("--tp", type=int, default=0,
                 help="shard the model over the first N devices (make_sharded_model; 0: one device, unsharded)")
  p.add_argument("--num-layers", type=int, default=None,
                 help="depth of every preset (default: all layers, or the cut one GPU needs: DEPTH)")
  p.add_argument("--out-json", default=None)
  p.add_argument("--plot", default=None, help="write the speed-up plot (PNG) here")
  args = p.parse_args(argv)
  if not 0 <= args.tp <= jax.device_count():
    p.error(f"--tp {args.tp}; expected 0 to the {jax.device_count()} device(s) present")
  if args.tp and args.parts:
    p.error("--parts with --tp: the parts are timed on one device, unsharded")
  if args.num_layers is not None and args.smoke:
    p.error("--num-layers with --smoke: the tiny checkpoints' shapes keep their layers")
  if args.buffer_len is not None and args.buffer_len < 1:
    p.error(f"--buffer-len {args.buffer_len}: expected an int >= 1")
  names = list(SMOKE_RUN) if args.smoke else args.presets.split(",")
  batches = [2] if args.smoke else [int(b) for b in args.batches.split(",")]
  contexts = [8] if args.smoke else [int(c) for c in args.contexts.split(",")]
  reps, rep_seconds = (2, 0.01) if args.smoke else (args.reps, args.rep_seconds)
  parts = True if (args.smoke and not args.tp) or args.parts == "all" else (
      {int(b) for b in args.parts.split(",")} if args.parts else False)
  results = [run_preset(n, batches=batches, contexts=contexts, parts=parts, reps=reps,
                        rep_seconds=rep_seconds, workers=args.compile_workers,
                        buffer_len=args.buffer_len, read_copy=args.read_copy, tp=args.tp,
                        num_layers=args.num_layers) for n in names]
  print(_tables(results))
  out = {"meta": common.run_metadata(sys.argv[1:] if argv is None else argv, "bench.model_e2e"),
         "results": results}
  if args.out_json:
    pathlib.Path(args.out_json).write_text(json.dumps(common.to_jsonable(out), indent=1))
  if args.plot:
    plot(results, args.plot)
  return out


if __name__ == "__main__":
  main()
