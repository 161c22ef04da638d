"""The demo job: a batch of prompts through the serving engine with ReplaySSM decode and with
conventional decode; the greedy tokens must be identical, and both report tokens/s.

Model: the repository's tiny Qwen3.5-architecture checkpoint (``tests/data/hf/qwen3_5``, written by
transformers' ``save_pretrained``: 8 layers, GatedDeltaNet ×3 then attention, twice; random
weights; vocab 128, so ASCII prompts are their own token ids), loaded with ``load_pretrained``, or
any local Hugging Face directory (``model_dir``; prompts are then byte-level ids, right only for
byte vocabularies). Requests have different lengths, so they join and finish at different steps
(continuous batching over ``max_running`` slots).
"""
import pathlib
import time

import jax
from tqdm.auto import tqdm

from replayssm_jax.models import load_pretrained
from replayssm_jax.serving import Engine, EngineConfig

DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "hf" / "qwen3_5"

PROMPTS = ("ReplaySSM keeps a checkpoint", "plus a short ring of inputs", "and writes the state",
           "once every L steps.", "Gated DeltaNet", "Mamba2", "speculative rollback is a cursor move",
           "JAX + Pallas")


def encode(text: str) -> list:
  """Byte-level tokens: the UTF-8 bytes of ``text`` (ids 0..255)."""
  return list(text.encode("utf-8"))


def run(*, model_dir=None, max_new_tokens: int = 40, max_running: int = 4, buffer_len: int = 16,
        implementation=None) -> int:
  model_dir = pathlib.Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
  if not (model_dir / "config.json").is_file():
    raise ValueError(f"model_dir={str(model_dir)!r} has no config.json; the default tiny checkpoint "
                     f"lives in the repository (tests/data/hf/qwen3_5): run from a checkout or pass "
                     f"--model-dir DIR")
  model, cfg = load_pretrained(model_dir, max_prompt_len=64)
  kinds = ", ".join(f"{cfg.layer_types.count(k)} {k}" for k in dict.fromkeys(cfg.layer_types))
  print(f"replayssm_jax demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): "
        f"{model_dir.name} via load_pretrained ({cfg.num_layers} layers: {kinds}; D {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}), {len(PROMPTS)} prompts, up to {max_new_tokens} new tokens each, "
        f"{max_running} slots, buffer_len L={buffer_len}")
  config = dict(max_running=max_running, batch_buckets=tuple(sorted({max(1, max_running // 2), max_running})),
                buffer_len=buffer_len, implementation=implementation, max_seq_len=64 + max_new_tokens)
  results = {}
  for replay in (True, False):
    name = "replay" if replay else "conventional"
    engine = Engine(model, EngineConfig(replay=replay, **config))
    # Compile outside the timing: every decode bucket (all rows, then half) and both prefill
    # widths (the admitted group, and a request admitted alone).
    for i in range(max_running):
      engine.submit(encode("warm-up"), max_new_tokens=2 + 2 * (i % 2))
    engine.run()
    engine.submit(encode("warm-up"), max_new_tokens=2)
    engine.run()
    steps0 = engine.steps
    ids = [engine.submit(encode(p), max_new_tokens=max_new_tokens - 3 * (i % 4))
           for i, p in enumerate(PROMPTS)]
    total = sum(max_new_tokens - 3 * (i % 4) for i in range(len(PROMPTS)))
    t0 = time.perf_counter()
    with tqdm(total=len(ids), desc=f"{name:>12}", unit="req") as bar:
      out = engine.run(progress=bar.update)
    elapsed = time.perf_counter() - t0
    tokens = [out[r] for r in ids]
    generated = sum(len(t) for t in tokens)
    results[name] = tokens
    ttft = sum(engine.stats(r).time_to_first_token_s for r in ids) / len(ids)
    print(f"{name:>12}: {generated / elapsed:8.1f} tokens/s ({generated}/{total} tokens, "
          f"{engine.steps - steps0} engine steps, mean time to first "
          f"token {1e3 * ttft:.1f} ms)")
  for p, tok in zip(PROMPTS[:3], results["replay"]):
    print(f"  {p!r} -> {tok[:12]} ...")
  assert results["replay"] == results["conventional"], "replay and conventional tokens differ"
  print(f"OK: replay and conventional decode produced identical tokens for all {len(PROMPTS)} requests")
  if jax.default_backend() != "gpu":
    print("note: on CPU the XLA fallback runs; replay saves HBM traffic, so its speed-up is a GPU "
          "result (bench/RESULTS.md)")
  return 0
