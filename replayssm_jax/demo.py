"""The demo job: a batch of prompts through the serving engine with ReplaySSM decode and with
conventional decode; the greedy tokens must be identical, and both report tokens/s.

Model: the embedded tiny default (``LMConfig.tiny()``, seeded random weights, byte-level vocab of
256: prompts are UTF-8 bytes). Requests have different lengths, so they join and finish at
different steps (continuous batching over ``max_running`` slots).
"""
import time

import jax
from tqdm.auto import tqdm

from replayssm_jax.models import LMConfig, make_model
from replayssm_jax.serving import Engine, EngineConfig

PROMPTS = ("ReplaySSM keeps a checkpoint", "plus a short ring of inputs", "and writes the state",
           "once every L steps.", "Gated DeltaNet", "Mamba2", "speculative rollback is a cursor move",
           "JAX + Pallas")


def encode(text: str) -> list:
  """Byte-level tokens: the UTF-8 bytes of ``text`` (ids 0..255)."""
  return list(text.encode("utf-8"))


def run(*, max_new_tokens: int = 40, max_running: int = 4, buffer_len: int = 16,
        implementation=None) -> int:
  model = make_model(LMConfig.tiny(), seed=0)
  print(f"replayssm_jax demo on {jax.devices()[0].device_kind} ({jax.default_backend()}): tiny GDN LM "
        f"(2 layers, D 64, Hk 2, Hv 4, K = V = 16, seeded random weights), {len(PROMPTS)} byte-level "
        f"prompts, up to {max_new_tokens} new tokens each, {max_running} slots, buffer_len L={buffer_len}")
  config = dict(max_running=max_running, batch_buckets=tuple(sorted({max(1, max_running // 2), max_running})),
                buffer_len=buffer_len, implementation=implementation)
  results = {}
  for replay in (True, False):
    name = "replay" if replay else "conventional"
    engine = Engine(model, EngineConfig(replay=replay, **config))
    for i in range(max_running):  # compile every bucket outside the timing: all rows, then half
      engine.submit(encode("warm-up"), max_new_tokens=2 + 2 * (i % 2))
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
