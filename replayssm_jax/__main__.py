"""Command line: ``python -m replayssm_jax demo``."""
import argparse
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m replayssm_jax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser("demo", help="GDN decode through replay and conventional from one prefilled state")
  demo.add_argument("--steps", type=int, default=320)
  demo.add_argument("--batch", type=int, default=8)
  demo.add_argument("--buffer-len", type=int, default=16)
  demo.add_argument("--prompt-len", type=int, default=64)
  demo.add_argument("--implementation", default=None, choices=[None, "xla", "pallas_triton"])
  args = parser.parse_args(argv)
  if args.command == "demo":
    from replayssm_jax import demo as demo_module
    return demo_module.run(steps=args.steps, batch=args.batch, buffer_len=args.buffer_len,
                           prompt_len=args.prompt_len, implementation=args.implementation)
  return 2


if __name__ == "__main__":
  sys.exit(main())
