"""Command line: ``python -m replayssm_jax {demo, generate, bench}``.

* ``demo``: a batch of prompts through the serving engine with ReplaySSM decode and with
  conventional decode (the repository's tiny Qwen3.5 checkpoint, or ``--model-dir``); asserts
  identical tokens, prints tokens/s.
* ``generate``: greedy / sampled generation from a local Hugging Face directory
  (``--model-dir``, via ``models.load_pretrained``) or the tiny default, optionally speculative
  (``--speculative k``, drafts by n-gram or ``--drafter mtp``, the checkpoint's MTP head); the prompt is given as
  token ids (``--token-ids 1,2,3``) or as text encoded byte-level (``--prompt``: UTF-8 bytes as
  ids, for byte-level vocabularies such as the tiny default's; real checkpoints need token ids
  from their tokenizer).
* ``bench``: the GDN decode benchmark, ``python -m bench.gdn_decode`` with the remaining
  arguments passed through (run from the repository root).
"""
import argparse
import sys


def _generate(args) -> int:
  import numpy as np
  from replayssm_jax.models import LMConfig, generate, load_pretrained, make_model
  if args.model_dir:
    import jax.numpy as jnp
    model, config = load_pretrained(args.model_dir, dtype=jnp.dtype(args.dtype),
                                    max_prompt_len=args.max_prompt_len)
  else:
    model = make_model(LMConfig.tiny(max_prompt_len=args.max_prompt_len), seed=args.seed)
    config = model.config
  if (args.prompt is None) == (args.token_ids is None):
    raise ValueError("give exactly one of --prompt (byte-level text) or --token-ids (comma-separated ids)")
  try:
    ids = (list(args.prompt.encode("utf-8")) if args.prompt is not None
           else [int(t) for t in args.token_ids.split(",") if t.strip()])
  except ValueError:
    raise ValueError(f"--token-ids {args.token_ids!r}; expected comma-separated integers") from None
  tokens, num = generate(model, np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32),
                         max_new_tokens=args.max_new_tokens, replay=not args.conventional,
                         temperature=args.temperature, seed=args.seed, buffer_len=args.buffer_len,
                         stop_tokens=tuple(args.stop_tokens), speculative=args.speculative,
                         drafter=args.drafter)
  out = [int(t) for t in np.asarray(tokens)[0, :int(num[0])]]
  print(" ".join(map(str, out)))
  if args.prompt is not None and config.vocab_size <= 256:
    print(repr(bytes(out).decode("utf-8", errors="replace")))
  return 0


def _one_line_errors(job) -> int:
  """Runs ``job``; bad input or an unsupported checkpoint prints one line and exits with 2."""
  try:
    return job()
  except (ValueError, NotImplementedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m replayssm_jax", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="prompts through the serving engine, replay vs conventional")
  demo.add_argument("--model-dir", default=None,
                    help="local Hugging Face directory (default: the repository's tiny Qwen3.5 checkpoint)")
  demo.add_argument("--max-new-tokens", type=int, default=40)
  demo.add_argument("--max-running", type=int, default=4)
  demo.add_argument("--buffer-len", type=int, default=16)
  demo.add_argument("--implementation", default=None, choices=[None, "xla", "pallas_triton"])

  gen = sub.add_parser("generate", help="generate from a local HF directory or the tiny default")
  gen.add_argument("--model-dir", default=None, help="local Hugging Face directory (config.json + safetensors)")
  gen.add_argument("--prompt", default=None, help="text, encoded byte-level (UTF-8 bytes as token ids)")
  gen.add_argument("--token-ids", default=None, help="comma-separated prompt token ids")
  gen.add_argument("--max-new-tokens", type=int, default=32)
  gen.add_argument("--max-prompt-len", type=int, default=128)
  gen.add_argument("--temperature", type=float, default=0.0)
  gen.add_argument("--seed", type=int, default=0)
  gen.add_argument("--buffer-len", type=int, default=None,
                   help="ReplaySSM buffer length L (default: the library's for --speculative)")
  gen.add_argument("--speculative", type=int, default=0, help="drafts verified per step (0: off)")
  gen.add_argument("--drafter", default="ngram", choices=["ngram", "mtp"],
                   help="n-gram drafts, or the checkpoint's multi-token-prediction head")
  gen.add_argument("--stop-tokens", type=int, nargs="*", default=[])
  gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  gen.add_argument("--conventional", action="store_true", help="conventional decode instead of replay")

  bench = sub.add_parser("bench", help="python -m bench.gdn_decode with the remaining arguments",
                         add_help=False)
  bench.add_argument("rest", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  if args.command == "demo":
    from replayssm_jax import demo as demo_module
    job = lambda: demo_module.run(model_dir=args.model_dir, max_new_tokens=args.max_new_tokens,
                                  max_running=args.max_running, buffer_len=args.buffer_len,
                                  implementation=args.implementation)
    return _one_line_errors(job)
  if args.command == "generate":
    return _one_line_errors(lambda: _generate(args))
  try:
    from bench import gdn_decode
  except ImportError as e:
    raise SystemExit(f"bench needs the repository checkout (the bench/ package next to "
                     f"replayssm_jax/); run it from the repository root ({e})")
  gdn_decode.main(args.rest)
  return 0


if __name__ == "__main__":
  sys.exit(main())
