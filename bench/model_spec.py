"""Model-level speculative verify benchmark: one verify + commit step of a whole stack, per kernel.

The stacks, geometries, cache and timing are bench/model_decode.py's (Qwen3.5-4B-like GDN stack,
``--stack mamba2`` / ``hybrid`` with mamba2-2.7b's Mamba2 heads; bf16 parameters and ring, float32
state). Each timed step is one speculative verify step of the model, as ``generate``'s speculative
loop drives it: ``logits, step = LM.verify(tokens [B, T], cache, slots, implementation=...)``, then
``cache = LM.commit(step, accepted)``. Token 0 of a row is the greedy token at its last accepted
position of the previous step (fed back), tokens 1..T-1 are random drafts, and the accepted counts
are uniform in [1, T] per row and step (``jax.random`` with a carried key), so windows grow at the
natural rate and rows flush when ``count + T > L - 1``. Rows start at staggered cursor phases
(``model_decode.staggered_cache``). One ``jax.jit`` runs n cycles of L steps (``lax.fori_loop``,
cache donated); ``bench.common.time_loop`` warms up, calibrates and reports median / p20 / p80 ms
per step. L defaults to ``config.buffer_len_for(T)``, what ``generate`` uses.

Arms (``--implementations``): the ``implementation=`` passed to ``LM.verify`` (``LM.commit`` has
none: cursor and conv-state rollback are plain jnp): ``pallas_triton``, ``pallas_mosaic``, ``xla``,
``none`` (implementation=None, the library's choice). The question it answers: should None prefer
the Mosaic verify kernels inside a model (a kernel that wins alone can lose in the model).

Gate before timing: every arm first runs one cycle of the same compiled loop without feedback
(token 0 random too) from the same cache and key, so all arms see the same tokens and accepted
counts even where rounding would flip an argmax. Compared with the XLA arm's cycle (relative L2):
the sum over the cycle of the first ``DIGEST`` logits columns of every step, every layer's exact
state (``materialize``) and conv state; the cursors must be equal. Tolerance: ``gate_tolerance``
(the ring is bf16, so arms differ at bf16 rounding). A failed gate or a non-finite state gives
status ``gate-failed`` (still timed) and no speed-up. Speed-up = the pallas_triton arm's median /
the arm's median, same stack, T, B and L. The timing continues from the gate's cache.

    python -m bench.model_spec --stack gdn --tokens 4 --batches 32,256 \\
        --implementations pallas_triton,pallas_mosaic              # GPU
    python -m bench.model_spec --stack mamba2 --tokens 2,4,8 --implementations none,pallas_triton,pallas_mosaic
    python -m bench.model_spec --smoke                             # CPU: tiny stack, xla + pallas_triton
"""
import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import replayssm_jax as rs

from bench import common
from bench.model_decode import STACKS, stack_geometry, staggered_cache
from replayssm_jax import config as config_lib
from replayssm_jax.models import LMConfig, make_model

IMPLEMENTATIONS = ("none", "xla", "pallas_triton", "pallas_mosaic")   # "none": implementation=None
BASELINE = "pallas_triton"
MAX_TOKENS = 8   # replay_verify takes T <= 8 tokens per row
DIGEST = 16      # logits columns summed into the carry: the gate's view of every step's logits


def _impl(name: str):
  return None if name == "none" else name


def _loop(graphdef, *, num_tokens, buffer_len, implementation):
  """``run(params, carry, n, feedback)``: n cycles of L verify + commit steps, carry donated.

  carry = (token 0 int32[B], key, LMCache, digest f32[B, T, DIGEST]). Each step draws the T-1
  drafts and the accepted counts (uniform in [1, T]) from the key, verifies token 0 + drafts,
  commits the accepted counts and adds the logits' first DIGEST columns to the digest. The next
  token 0 is, with ``feedback`` (timing), the greedy token at the row's last accepted position, as in
  ``generate``; without (the gate), a random id, so arms see the same tokens even where rounding
  would flip an argmax. ``feedback`` is traced: the gate and the timing share one compilation.
  """
  def run(params, carry, n, feedback):
    model = nnx.merge(graphdef, params)
    batch, vocab = carry[0].shape[0], model.config.vocab_size
    slots = jnp.arange(batch, dtype=jnp.int32)

    def step(_, c):
      tok, key, cache, digest = c
      key, k_draft, k_accept, k_next = jax.random.split(key, 4)
      drafts = jax.random.randint(k_draft, (batch, num_tokens - 1), 0, vocab, jnp.int32)
      accepted = jax.random.randint(k_accept, (batch,), 1, num_tokens + 1, jnp.int32)
      logits, vstep = model.verify(jnp.concatenate([tok[:, None], drafts], axis=1), cache, slots,
                                   implementation=implementation)
      cache = model.commit(vstep, accepted)
      greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      greedy = jnp.take_along_axis(greedy, (accepted - 1)[:, None], axis=1)[:, 0]
      tok = jnp.where(feedback, greedy, jax.random.randint(k_next, (batch,), 0, vocab, jnp.int32))
      return tok, key, cache, digest + logits[:, :, :DIGEST]
    return jax.lax.fori_loop(0, n * buffer_len, step, carry)
  return jax.jit(run, donate_argnums=(1,))   # n traced: one compilation for every n


def initial_carry(model, batch, *, num_tokens, buffer_len, seed=0):
  """Token 0 = 1, a fixed key, a staggered cache (row b has b mod (L-1) pending entries), zero digest."""
  cache = staggered_cache(model, batch, replay=True, buffer_len=buffer_len, max_draft=num_tokens - 1)
  digest = jnp.zeros((batch, num_tokens, min(DIGEST, model.config.vocab_size)), jnp.float32)
  return jnp.ones((batch,), jnp.int32), jax.random.key(seed), cache, digest


def gate_view(model, carry) -> dict:
  """What the gate compares after one cycle: the logits digest, every layer's exact state
  (checkpoint ⊕ window, ``materialize`` by XLA) and conv state, and the cursor."""
  _, _, cache, digest = carry
  slots = jnp.arange(digest.shape[0], dtype=jnp.int32)
  ops = {"GdnLayerCache": rs.gdn, "Mamba2LayerCache": rs.mamba2}
  # Copies: the carry is donated to the timed calls afterwards.
  view = {"digest": jnp.array(digest, copy=True),
          "cursor": (np.asarray(cache.cursor.base), np.asarray(cache.cursor.count))}
  for i, lc in enumerate(cache.layers):
    view[f"state{i}"] = ops[type(lc).__name__].materialize(lc.bufs, cache.cursor, slots, implementation="xla")
    view[f"conv{i}"] = jnp.array(lc.conv_state, jnp.float32, copy=True)
  return view


@jax.jit
def _rel_l2(x, ref):
  return jnp.linalg.norm((x - ref).ravel()) / jnp.maximum(jnp.linalg.norm(ref.ravel()), 1e-30)


def compare(view, ref, tol) -> dict:
  """Relative L2 of each array vs the reference view; the cursors must match exactly."""
  rel = {k: float(_rel_l2(v, ref[k])) for k, v in view.items() if k != "cursor"}
  finite = all(bool(jnp.all(jnp.isfinite(v))) for k, v in view.items() if k != "cursor")
  cursor = all(np.array_equal(a, b) for a, b in zip(view["cursor"], ref["cursor"]))
  worst = max(rel, key=rel.get)
  return {"passed": bool(finite and cursor and rel[worst] <= tol), "max_rel_vs_xla": rel[worst],
          "worst": worst, "digest_rel": rel["digest"], "tol_rel": tol, "finite": finite,
          "cursor_equal": cursor, "rel": rel}


def gate_tolerance(dtype) -> float:
  """Relative L2 vs XLA after one cycle. The ring is bf16, so the arms' entries (u, Δx computed in
  different orders) round apart at bf16's 2^-9: f32 stack 1e-2, as verify_decode's bf16 layer gate;
  bf16 stack 5e-2 (bf16 activations through every layer and step)."""
  return 1e-2 if jnp.dtype(dtype) == jnp.float32 else 5e-2


def compiled_loop(model, carry, *, name, num_tokens, buffer_len):
  """``(run(carry, n, feedback) -> carry, compiled)``: the arm's loop, compiled once."""
  graphdef, params = nnx.split(model)
  fn = _loop(graphdef, num_tokens=num_tokens, buffer_len=buffer_len, implementation=_impl(name))
  compiled = fn.lower(params, carry, jnp.int32(1), jnp.bool_(False)).compile()
  return (lambda c, n, feedback: compiled(params, c, np.int32(n), np.bool_(feedback))), compiled


_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "s32"}


def cache_copies(compiled, cache) -> list[str] | None:
  """Copy instructions in the optimized HLO shaped like a cache array (checkpoints, rings, conv
  states): a donated cache updated in place has none.
  Recorded, not gated (XLA:CPU copies rings). None if the HLO text is unavailable."""
  shapes = {f"{_HLO_DTYPES.get(x.dtype.name, x.dtype.name)}[{','.join(map(str, x.shape))}]"
            for x in jax.tree.leaves(cache) if x.ndim >= 2}
  found = common.big_copies(compiled, 0)
  return None if found is None else [c for c in found if c in shapes]


def reference_view(model, batch, *, num_tokens, buffer_len) -> dict:
  """The XLA arm's gate view (one cycle without feedback from the initial carry)."""
  carry = initial_carry(model, batch, num_tokens=num_tokens, buffer_len=buffer_len)
  run, _ = compiled_loop(model, carry, name="xla", num_tokens=num_tokens, buffer_len=buffer_len)
  return gate_view(model, run(carry, 1, False))


def measure(model, batch, *, name, num_tokens, buffer_len, ref, tol, reps, rep_seconds):
  """One arm at one (T, B, L): one cycle without feedback from the initial carry, compared with
  the XLA arm's gate view ``ref`` (None: this arm is the reference), then the timing (feedback
  on) continues from there. Returns (row, this arm's gate view or None)."""
  row = {"implementation": name, "batch": batch, "num_tokens": num_tokens, "buffer_len": buffer_len,
         "status": "pending", "error": None}
  try:
    t0 = time.perf_counter()
    carry = initial_carry(model, batch, num_tokens=num_tokens, buffer_len=buffer_len)
    run, compiled = compiled_loop(model, carry, name=name, num_tokens=num_tokens, buffer_len=buffer_len)
    row["compile_s"] = time.perf_counter() - t0
    row["cache_copies"] = cache_copies(compiled, carry[2])
    carry = run(carry, 1, False)
    view = gate_view(model, carry)
    row["gate"] = compare(view, view if ref is None else ref, tol)
    carry, timing = common.time_loop(lambda c, n: run(c, n, True), carry, reps=reps, rep_seconds=rep_seconds)
    finite = all(bool(jnp.all(jnp.isfinite(lc.bufs.state))) for lc in carry[2].layers)
    del carry
  except Exception as e:  # noqa: BLE001  (recorded per arm; the run goes on)
    row.update(status="skipped" if isinstance(e, NotImplementedError) else "error",
               error=f"{type(e).__name__}: {e}")
    return row, None
  summary = timing.ms_per(buffer_len)
  row.update(ms_per_step=summary.pop("ms"), **summary, state_finite=finite,
             status="ok" if (row["gate"]["passed"] and finite) else "gate-failed")
  return row, view


def _gate_summary(gate) -> str:
  return (f"max rel {gate['max_rel_vs_xla']:.2e} ({gate['worst']}) > tol {gate['tol_rel']:.0e}, "
          f"finite {gate['finite']}, cursor equal {gate['cursor_equal']}")


def derive(rows) -> None:
  """``speedup_vs_triton`` = pallas_triton median / the row's median (same stack, T, B, L), on
  rows whose gate passed and where the pallas_triton row of that config passed too."""
  key = lambda r: (r["stack"], r["num_tokens"], r["batch"], r["buffer_len"])
  base = {key(r): r["median_ms"] for r in rows if r["implementation"] == BASELINE and r["status"] == "ok"}
  for r in rows:
    b = base.get(key(r))
    r["speedup_vs_triton"] = b / r["median_ms"] if (b is not None and r["status"] == "ok") else None


def table(rows) -> str:
  headers = ["stack", "T", "B", "L", "implementation", "ms/step (median)", "p20–p80", "speed-up vs triton",
             "gate rel", "status"]
  cells = []
  for r in rows:
    timed = "median_ms" in r
    cells.append([r["stack"], str(r["num_tokens"]), str(r["batch"]), str(r["buffer_len"]), r["implementation"],
                  f"{r['median_ms']:.3f}" if timed else "-",
                  f"{r['p20_ms']:.3f}–{r['p80_ms']:.3f}" if timed else "-",
                  common.fmt_float(r.get("speedup_vs_triton"), ".2f"),
                  common.fmt_float(r.get("gate", {}).get("max_rel_vs_xla"), ".1e"), r["status"]])
  return common.render_table(headers, cells, markdown=True)


def _parse_ints(parser, text, what, lo, hi):
  try:
    values = [int(x) for x in text.split(",")]
  except ValueError:
    values = []
  if not values or any(not lo <= v <= hi for v in values):
    parser.error(f"{what}={text!r}; expected comma-separated ints in [{lo}, {hi}]")
  return values


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(prog="python -m bench.model_spec", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="tiny stack for CPU")
  parser.add_argument("--stack", choices=STACKS, default="gdn",
                      help="mixers: all GatedDeltaNet, all Mamba2 (mamba2-2.7b heads) or alternating")
  parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 32,256; smoke 8)")
  parser.add_argument("--tokens", default="4", help=f"comma-separated T per verify step, 1 <= T <= {MAX_TOKENS}")
  parser.add_argument("--buffer-len", type=int, default=None,
                      help="L for every T (default: config.buffer_len_for(T), what generate uses)")
  parser.add_argument("--implementations", default=None,
                      help=f"comma-separated arms of {', '.join(IMPLEMENTATIONS)} ('none' = implementation=None; "
                           f"default pallas_triton,pallas_mosaic; smoke xla,pallas_triton)")
  parser.add_argument("--reps", type=int, default=None)
  parser.add_argument("--rep-seconds", type=float, default=None)
  parser.add_argument("--out-json", default=None)
  parser.add_argument("--markdown", default=None, help="write the table to this markdown file")
  args = parser.parse_args(argv)
  batches = _parse_ints(parser, args.batches or ("8" if args.smoke else "32,256"), "--batches", 1, 1 << 20)
  token_counts = _parse_ints(parser, args.tokens, "--tokens", 1, MAX_TOKENS)
  names = (args.implementations or ("xla,pallas_triton" if args.smoke else "pallas_triton,pallas_mosaic")).split(",")
  if not names or any(n not in IMPLEMENTATIONS for n in names) or len(set(names)) != len(names):
    parser.error(f"--implementations={args.implementations!r}; expected distinct names of {IMPLEMENTATIONS}")
  if args.buffer_len is not None and args.buffer_len < max(token_counts):
    parser.error(f"--buffer-len={args.buffer_len} with T={max(token_counts)}; expected L >= T (a flushed "
                 f"row's tokens must fit its window)")
  reps = args.reps or (5 if args.smoke else 7)
  rep_seconds = args.rep_seconds if args.rep_seconds is not None else (0.02 if args.smoke else 0.5)
  dtype = jnp.float32 if args.smoke else jnp.bfloat16
  tol = gate_tolerance(dtype)
  geometry = stack_geometry(args.stack, args.smoke)
  model = make_model(LMConfig(**geometry, dtype=dtype), seed=0)
  rows = []
  for t in token_counts:
    buffer_len = args.buffer_len or config_lib.buffer_len_for(t)
    for batch in batches:
      opts = dict(num_tokens=t, buffer_len=buffer_len, tol=tol, reps=reps, rep_seconds=rep_seconds)
      # The gate's reference is the XLA arm's view; computed untimed when "xla" is not an arm.
      group, ref = {}, None
      if "xla" in names:
        group["xla"], ref = measure(model, batch, name="xla", ref=None, **opts)
      else:
        ref = reference_view(model, batch, num_tokens=t, buffer_len=buffer_len)
      for name in names:
        if name == "xla":
          continue
        if ref is None:   # never pass a gate against itself
          group[name] = {"implementation": name, "batch": batch, "num_tokens": t, "buffer_len": buffer_len,
                         "status": "skipped", "error": f"no XLA reference: {group['xla']['error']}"}
        else:
          group[name] = measure(model, batch, name=name, ref=ref, **opts)[0]
      del ref
      group = [group[name] for name in names]
      for r in group:
        r["stack"] = args.stack
      derive(group)
      rows += group
      common.log(f"{args.stack} T={t} B={batch} L={buffer_len}: " + ", ".join(
          f"{r['implementation']} " + (f"{r['median_ms']:.3f} ms/step" if "median_ms" in r else "")
          + (f" ({r['speedup_vs_triton']:.2f}x)" if r.get("speedup_vs_triton") is not None else "")
          + (f" [{r['status']}: {r['error'] or _gate_summary(r['gate'])}]" if r["status"] != "ok" else "")
          for r in group))
  text = table(rows)
  result = {"meta": common.run_metadata(argv, "bench.model_spec"),
            "stack": args.stack, "geometry": geometry, "dtype": jnp.dtype(dtype).name,
            "ring_dtype": "bfloat16", "state_dtype": "float32", "rows": rows}
  if args.out_json:
    common.write_json(args.out_json, result)
  if args.markdown:
    pathlib.Path(args.markdown).write_text(f"## Model speculative verify ({args.stack} stack)\n\n" + text + "\n")
  print(text)
  return result


if __name__ == "__main__":
  main()
