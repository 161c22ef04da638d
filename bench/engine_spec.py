"""Serving-engine throughput with and without speculative decoding, ReplaySSM vs conventional.

What a user of ``serving.Engine`` sees: B requests submitted at once, the engine admits them
(prefill), then steps until every request has its ``--new-tokens``. Four arms per prompt set and
B, each a fresh ``Engine`` with ``max_running = B`` and one batch bucket B:

  decode-replay   num_drafts = 0, replay = True      (standard ReplaySSM decode)
  decode-conv     num_drafts = 0, replay = False     (conventional decode)
  spec-replay     num_drafts = k, replay = True      (n-gram drafts, ReplaySSM verify)
  spec-conv       num_drafts = k, replay = False     (n-gram drafts, conventional verify:
                                                      k + 1 states per slot, ``verify_stacks``)

and, named in ``--arms`` only, ``decode-replay-overlap`` / ``decode-conv-overlap`` /
``spec-replay-overlap`` / ``spec-conv-overlap`` (those arms with ``EngineConfig.overlap``: each
step dispatched before the host reads the previous one's tokens; drafts made on the device), and
``decode-replay-overlap-copy`` / ``spec-replay-copy`` / ``spec-replay-overlap-copy`` (ReplaySSM
arms over a bf16 read copy of the float32 checkpoint, ``EngineConfig.read_copy_dtype``), and
``spec-mtp`` / ``spec-mtp-overlap`` / ``spec-mtp-conv-overlap`` (drafting by the model's
multi-token-prediction head, ``EngineConfig(drafter="mtp")``: synchronous and overlapped ReplaySSM
verify, overlapped conventional verify; the preset or smoke model needs an MTP head).

Timed: the decode phase, from the first step after the last request was admitted to the last
step, on the host clock (every step ends in a host read of its tokens, so the clock sees the
device's work). tokens/s = tokens generated in that window / its seconds. Acceptance rate =
accepted drafts / drafted tokens (``RequestStats``); tokens per step = generated / steps. Each
step's time splits into the jitted call (dispatch), the wait for its outputs (device) and the
rest (the engine's host work: scheduling, drafts, inputs, bookkeeping), as ms per step. Each arm
first runs the same requests once (compiling the prefill, decode and verify programs), then the
timed run, ``--reps`` times; the median run is reported.

Prompt sets (``--prompts``): ``random`` (uniform token ids), ``repetitive`` (a random phrase
of ``--phrase`` tokens repeated) and ``shared`` (one random prefix of ``--shared-len`` tokens, a
system prompt, then uniform ids). ``--prefix-block N`` turns on prefix caching
(``EngineConfig.prefix_block``, ``--prefix-slots`` snapshot slots); each row records the prompt
tokens the snapshots served (``prefix_hit_tokens``). Weights are random (bf16, float32 state, ``--ring-dtype`` bf16) unless
``--model looping``: the head is biased so that each token favours its successor in a block of
four ids and the mixers weigh ``--looping-scale`` against the embedding (``looping_model``): greedy streams fall into short cycles the drafter predicts, a
controlled high-acceptance case. Acceptance is a property of model and prompts: a random model
gives a lower bound of the speculative gain, ``looping`` an upper one; neither is a real
checkpoint's acceptance.

Gate: the greedy tokens of every arm are compared with the first arm's (decode-replay by
default); the fraction of requests with identical tokens is reported (replay and conventional round differently in bf16,
so a near-tie can flip an argmax; the smoke run, float32 throughout on CPU, must be identical).

    python -m bench.engine_spec --preset qwen3.5-4b --batches 32,256 --drafts 3 --new-tokens 128
    python -m bench.engine_spec --preset qwen3.5-4b --model looping --batches 256
    python -m bench.engine_spec --prompts shared --prefix-block 64 --arms decode-replay,decode-replay-overlap
    python -m bench.engine_spec --smoke        # CPU: the tiny Qwen3.5 (MTP) checkpoint's shape, B = 2
    python -m bench.engine_spec --tp 4 --arms decode-replay,decode-replay-overlap,spec-replay-overlap
"""
import argparse
import dataclasses
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from bench import common
from bench.model_e2e import model_config
from replayssm_jax.models import make_model, shard_model
from replayssm_jax.serving import Engine, EngineConfig

# name: (drafter, or None for plain decode; replay; overlap; read copy)
ARMS = {"decode-replay": (None, True, False, False), "decode-conv": (None, False, False, False),
        "spec-replay": ("ngram", True, False, False), "spec-conv": ("ngram", False, False, False),
        "decode-replay-overlap": (None, True, True, False),
        "decode-conv-overlap": (None, False, True, False),
        "spec-replay-overlap": ("ngram", True, True, False),
        "spec-conv-overlap": ("ngram", False, True, False),
        "decode-replay-overlap-copy": (None, True, True, True),
        "spec-replay-copy": ("ngram", True, False, True),
        "spec-replay-overlap-copy": ("ngram", True, True, True),
        "spec-mtp": ("mtp", True, False, False), "spec-mtp-overlap": ("mtp", True, True, False),
        "spec-mtp-conv-overlap": ("mtp", False, True, False)}
DEFAULT_ARMS = ("decode-replay", "decode-conv", "spec-replay", "spec-conv")


def looping_model(model, *, strength=20.0, mixer_scale=0.2, period=4):
  """Adds ``strength`` · (successor map) to the head — token t favours the next token of its
  block of ``period`` ids — and scales the embedding by 1 / ``mixer_scale``, which (every block
  and the head read the residual stream through an RMSNorm) weighs the mixer / MLP outputs by
  ``mixer_scale`` against it: greedy streams fall into short cycles (the n-gram drafter hits) but
  still depend on every layer's state. A multi-token-prediction head (``model.mtp``) is made to
  guess the same map one token further: ``fc`` passes the next token's normed embedding through
  and its attention output and dense MLP output are scaled by ``mixer_scale``. Modifies and returns
  ``model``."""
  emb = np.asarray(model.embed.embedding[...], np.float32)
  vocab = emb.shape[0]
  succ = (np.arange(vocab) // period) * period + (np.arange(vocab) + 1) % period
  pred = np.empty(vocab, np.int64)
  pred[succ] = np.arange(vocab)
  unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
  head = model.head.kernel
  head[...] = (head[...].astype(jnp.float32) + strength * jnp.asarray(unit[pred].T)).astype(head.dtype)
  embedding = model.embed.embedding
  embedding[...] = (embedding[...].astype(jnp.float32) / mixer_scale).astype(embedding.dtype)
  if model.mtp is not None:
    d = emb.shape[1]
    fc = model.mtp.fc.kernel
    fc[...] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))]).astype(fc.dtype)   # [embedding | hidden] → D
    block = model.mtp.block
    for out in (block.mixer.o_proj.kernel, block.mlp.down.kernel if block.mlp_type == "dense" else None):
      if out is not None:
        out[...] = (out[...].astype(jnp.float32) * mixer_scale).astype(out.dtype)
  return model


def prompt_sets(names, *, batch, length, phrase, vocab, shared_len=None, seed=0) -> dict:
  """{name: list of ``batch`` prompts of ``length`` token ids in [1, vocab)}; ``shared``: the
  first ``shared_len`` (default length // 2) tokens are the same in every prompt."""
  rng = np.random.RandomState(seed)
  out = {}
  for name in names:
    if name == "random":
      out[name] = rng.randint(1, vocab, (batch, length)).tolist()
    elif name == "repetitive":
      phrases = rng.randint(1, vocab, (batch, phrase))
      out[name] = np.tile(phrases, (1, -(-length // phrase)))[:, :length].tolist()
    elif name == "shared":
      head = length // 2 if shared_len is None else shared_len
      if not 0 <= head <= length:
        raise ValueError(f"--shared-len {head}; expected 0 to --prompt-len = {length}")
      tails = rng.randint(1, vocab, (batch, length - head))
      out[name] = np.concatenate([np.tile(rng.randint(1, vocab, head), (batch, 1)), tails], 1).tolist()
    else:
      raise ValueError(f"--prompts entry {name!r}; expected 'random', 'repetitive' or 'shared'")
  return out


class _StepClock:
  """Wraps a jitted engine step: seconds in the call (dispatch) and waiting for its outputs (the
  device; a synchronous engine reads them on the host right after, so the wait moves, nothing is
  added). ``wait=False`` (overlapped steps, whose outputs are read a step later) times the call
  only."""

  def __init__(self, fn, *, wait):
    self.fn, self.blocks, self.dispatch, self.wait = fn, wait, 0.0, 0.0

  def __call__(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = self.fn(*args, **kwargs)
    t1 = time.perf_counter()
    if self.blocks:
      jax.block_until_ready(out)
    self.dispatch, self.wait = self.dispatch + t1 - t0, self.wait + time.perf_counter() - t1
    return out


def _serve(model, config, prompts, new_tokens):
  """One run: returns (tokens per request, decode-phase seconds, steps, drafted, accepted,
  {dispatch, device wait, host: seconds of the decode phase}, prefix-hit prompt tokens)."""
  engine = Engine(model, config)
  ids = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]
  engine.step()                      # admits (prefills) every request, then one step
  first = sum(len(engine.outputs()[i]) for i in ids)
  clocks = {name: _StepClock(getattr(engine._programs, name), wait=not config.overlapped)
            for name in ("decode", "verify", "speculate")}
  engine._programs = dataclasses.replace(engine._programs, **clocks)
  steps, t0 = 0, time.perf_counter()
  while not engine.idle:
    engine.step()
    steps += 1
  seconds = time.perf_counter() - t0
  dispatch, wait = (sum(getattr(c, k) for c in clocks.values()) for k in ("dispatch", "wait"))
  out = engine.outputs()
  stats = [engine.stats(i) for i in ids]
  tokens = [out[i] for i in ids]
  return (tokens, seconds, steps, sum(len(t) for t in tokens) - first,
          sum(s.drafted_tokens for s in stats), sum(s.accepted_drafts for s in stats),
          {"dispatch": dispatch, "device_wait": wait, "host": seconds - dispatch - wait},
          sum(s.prefix_hit_tokens for s in stats))


def run_arm(model, arm, prompts, *, batch, drafts, new_tokens, buffer_len, ring_dtype, reps,
            prefill_tokens, prefix_block=0, prefix_slots=0):
  drafter, replay, overlap, copy = ARMS[arm]
  k = drafts if drafter else 0
  config = EngineConfig(max_running=batch, batch_buckets=(batch,), replay=replay, num_drafts=k,
                        overlap=overlap, prefix_block=prefix_block, prefix_slots=prefix_slots,
                        prefill_tokens=prefill_tokens,
                        buffer_len=buffer_len, max_prompt_len=len(prompts[0]),
                        max_seq_len=len(prompts[0]) + new_tokens, ring_dtype=ring_dtype,
                        read_copy_dtype="bfloat16" if copy else None, drafter=drafter or "ngram")
  _serve(model, config, prompts, new_tokens)       # compiles prefill, decode and verify
  runs = sorted((_serve(model, config, prompts, new_tokens) for _ in range(reps)), key=lambda r: r[1])
  tokens, seconds, steps, generated, drafted, accepted, split, hits = runs[len(runs) // 2]
  return {"arm": arm, "replay": replay, "num_drafts": k, "drafter": drafter, "buffer_len": config.buffer_len,
          "read_copy_dtype": config.read_copy_dtype,
          "overlapped": config.overlapped, "prefix_block": prefix_block, "prefix_hit_tokens": hits,
          "seconds": seconds, "all_seconds": [r[1] for r in runs], "steps": steps,
          "generated": generated, "tokens_per_s": generated / seconds,
          "tokens_per_step": generated / max(steps, 1) / batch,
          "ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in split.items()},
          "drafted": drafted, "accepted": accepted,
          "acceptance": accepted / drafted if drafted else None}, tokens


def run(name, *, model_kind, looping_scale, prompt_names, batches, drafts, new_tokens, prompt_len,
        phrase, reps, buffer_len, ring_dtype, arms=DEFAULT_ARMS, prefill_tokens=8192, shared_len=None,
        prefix_block=0, prefix_slots=None, tp=0, on_arm=None):
  """Every arm of ``arms`` (keys of ARMS; the first is the token baseline) on every batch and
  prompt set; ``on_arm(result so far)`` after each arm. ``prefix_slots`` None: one per request.
  ``tp`` >= 1: the engine serves the model sharded over the first ``tp`` devices (``shard_model``;
  1: a one-device mesh, the sharded path's own cost); 0: the unsharded LM."""
  config = model_config(name)
  model = make_model(config, seed=0)
  if model_kind == "looping":
    model = looping_model(model, mixer_scale=looping_scale)
  if tp:
    model = shard_model(model, Mesh(np.array(jax.devices()[:tp]), ("tp",)), axis="tp")
  common.log(f"{name} ({model_kind} weights): {config.num_layers} layers, vocabulary "
             f"{config.vocab_size}" + (f", sharded over {tp} device(s)" if tp else ""))
  rows = []
  result = {"preset": name, "model": model_kind, "config": config.to_dict(), "tp": tp, "rows": rows}
  for batch in batches:
    sets = prompt_sets(prompt_names, batch=batch, length=prompt_len, phrase=phrase,
                       vocab=config.vocab_size, shared_len=shared_len)
    slots = (batch if prefix_slots is None else prefix_slots) if prefix_block else 0
    for prompt_name, prompts in sets.items():
      group, reference = [], None
      for arm in arms:
        row, tokens = run_arm(model, arm, prompts, batch=batch, drafts=drafts, new_tokens=new_tokens,
                              buffer_len=buffer_len, ring_dtype=ring_dtype, reps=reps,
                              prefill_tokens=prefill_tokens, prefix_block=prefix_block,
                              prefix_slots=slots)
        reference = tokens if reference is None else reference
        row.update(preset=name, model=model_kind, prompts=prompt_name, batch=batch,
                   identical_to_baseline=float(np.mean([a == b for a, b in zip(tokens, reference)])))
        group.append(row)
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        ms = row["ms_per_step"]
        common.log(f"  B={batch} {prompt_name:10s} {arm:21s} {row['tokens_per_s']:9.0f} tokens/s, "
                   f"{row['tokens_per_step']:.2f} tokens/step/request, acceptance {acc}; ms/step: "
                   f"dispatch {ms['dispatch']:.2f}, device wait {ms['device_wait']:.2f}, host {ms['host']:.2f}")
        if on_arm is not None:
          on_arm(dict(result, rows=rows + group))
      base = {r["arm"]: r["tokens_per_s"] for r in group}
      for row in group:
        for ref in ("decode-replay", "decode-conv"):
          key = "speedup_vs_" + ref.replace("-", "_")
          row[key] = row["tokens_per_s"] / base[ref] if ref in base else None
      rows += group
  return result


def _table(result) -> str:
  rows = [[str(r["batch"]), r["prompts"], r["arm"], f"{r['tokens_per_s']:.0f}",
           f"{r['tokens_per_step']:.2f}", common.fmt_float(r["acceptance"], ".2f"),
           common.fmt_float(r["speedup_vs_decode_conv"], ".2f"),
           common.fmt_float(r["speedup_vs_decode_replay"], ".2f"),
           f"{r['identical_to_baseline']:.2f}"] for r in result["rows"]]
  return common.render_table(["B", "prompts", "arm", "tokens/s", "tokens/step", "acceptance",
                              "vs decode-conv", "vs decode-replay", "same tokens"], rows, markdown=True)


def plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = list(dict.fromkeys((r["batch"], r["prompts"]) for r in result["rows"]))
  fig, ax = plt.subplots(figsize=(7, 4.2))
  arms = list(dict.fromkeys(r["arm"] for r in result["rows"]))
  width = 0.8 / len(arms)
  for j, arm in enumerate(arms):
    values = [next(r["tokens_per_s"] for r in result["rows"] if (r["batch"], r["prompts"]) == g
                   and r["arm"] == arm) for g in groups]
    ax.bar(np.arange(len(groups)) + (j - (len(arms) - 1) / 2) * width, values, width, label=arm)
  ax.set_xticks(np.arange(len(groups)), [f"B={b}\n{name}" for b, name in groups])
  ax.set_ylabel("generated tokens/s")
  ax.set_title(f"serving.Engine, {result['preset']} ({result['model']} weights)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m bench.engine_spec", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="CPU: the tiny Qwen3.5 checkpoint's shape with its MTP head, B = 2")
  p.add_argument("--preset", default="qwen3.5-4b")
  p.add_argument("--model", choices=("random", "looping"), default="random")
  p.add_argument("--looping-scale", type=float, default=0.1,
                 help="looping_model's mixer_scale: smaller = stronger cycles, less state dependence")
  p.add_argument("--prompts", default="random,repetitive")
  p.add_argument("--batches", default="32,256")
  p.add_argument("--drafts", type=int, default=3, help="k, drafts per request and step")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--phrase", type=int, default=8, help="length of the repeated phrase")
  p.add_argument("--buffer-len", type=int, default=None,
                 help="ReplaySSM L (None: the engine's default for each T)")
  p.add_argument("--ring-dtype", default="bfloat16", help="ReplaySSM ring dtype ('none': the model's)")
  p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated subset of {', '.join(ARMS)}")
  p.add_argument("--prefill-tokens", type=int, default=8192, help="EngineConfig.prefill_tokens")
  p.add_argument("--shared-len", type=int, default=None,
                 help="tokens every 'shared' prompt starts with (default: half of --prompt-len)")
  p.add_argument("--prefix-block", type=int, default=0, help="EngineConfig.prefix_block (0: off)")
  p.add_argument("--prefix-slots", type=int, default=None,
                 help="EngineConfig.prefix_slots with --prefix-block (default: one per request)")
  p.add_argument("--tp", type=int, default=0,
                 help="devices to shard the model's heads over (shard_model; 1: a one-device mesh; "
                      "0: unsharded; no MTP arm when sharded)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out-json", default=None)
  p.add_argument("--plot", default=None, help="write the tokens/s plot (PNG) here")
  args = p.parse_args(argv)
  if args.smoke:
    args.preset, args.batches, args.new_tokens, args.prompt_len, args.reps = "tiny-qwen3_5_mtp", "2", 16, 12, 1
    args.ring_dtype = "none"
  if args.drafts < 1:
    p.error(f"--drafts={args.drafts}; expected >= 1")
  if args.shared_len is not None and not 0 <= args.shared_len <= args.prompt_len:
    p.error(f"--shared-len {args.shared_len}; expected 0 to --prompt-len = {args.prompt_len}")
  if args.prefix_block < 0 or (args.prefix_slots is not None and args.prefix_slots < 1):
    p.error(f"--prefix-block {args.prefix_block}, --prefix-slots {args.prefix_slots}; expected "
            f"a block >= 0 (0: off) and, if given, slots >= 1")
  arms = tuple(args.arms.split(","))
  if not arms or any(a not in ARMS for a in arms):
    p.error(f"--arms={args.arms!r}; expected a comma-separated subset of {', '.join(ARMS)}")
  if not 0 <= args.tp <= jax.device_count():
    p.error(f"--tp {args.tp}; expected 0 to the {jax.device_count()} device(s) present")
  if args.tp and any(ARMS[a][0] == "mtp" for a in arms):
    p.error(f"--tp {args.tp} with an MTP arm ({args.arms}); the MTP head drafts on one device only")
  meta = common.run_metadata(sys.argv[1:] if argv is None else argv, "bench.engine_spec")
  save = lambda result: args.out_json and common.write_json(args.out_json, {"meta": meta, "result": result})
  result = run(args.preset, model_kind=args.model, looping_scale=args.looping_scale, prompt_names=args.prompts.split(","),
               batches=[int(b) for b in args.batches.split(",")], drafts=args.drafts,
               new_tokens=args.new_tokens, prompt_len=args.prompt_len, phrase=args.phrase,
               reps=args.reps, buffer_len=args.buffer_len,
               ring_dtype=None if args.ring_dtype == "none" else args.ring_dtype, arms=arms,
               prefill_tokens=args.prefill_tokens, shared_len=args.shared_len,
               prefix_block=args.prefix_block, prefix_slots=args.prefix_slots, tp=args.tp,
               on_arm=save)
  print(_table(result))
  out = {"meta": meta, "result": result}
  save(result)
  if args.plot:
    plot(result, args.plot)
  return out


if __name__ == "__main__":
  main()
