"""Speculative verify benchmark: ReplaySSM replay_verify vs the conventional speculative baseline.

    python -m bench.verify_decode [--family gdn|mamba2] [--tokens 2,4,8] [--batches 1,32,128,256]
                                  [--buffer-len 16] [--state-dtypes float32,bfloat16]
                                  [--arms replay-pallas,replay-xla,conv-pallas,conv-xla,replay-pallas-copy]
                                  [--out-json F] [--markdown F]
    python -m bench.verify_decode --smoke      # tiny CPU run (seconds); the test suite runs it

Families (``--family``): ``gdn`` — one Qwen3.5-4B GDN layer (Hk 16, Hv 32, K = V = 128), ops
``rs.gdn.replay_verify`` / ``rs.gdn.verify_conventional``; ``mamba2`` — one Nemotron-3-Super layer
(H 128, P 64, N 128, G 8), ``rs.mamba2.replay_verify`` / ``rs.mamba2.verify_conventional``. Only the
public ops are called, with implementation "pallas_triton" (``*-pallas`` arms), "pallas_mosaic"
(``replay-mosaic``, speed-up against conv-pallas) or "xla"; ``replay-pallas-copy`` and
``replay-mosaic-copy`` are those arms over buffers with a bf16 read copy of the float32 checkpoint
(``read_copy_dtype``, float32 state only; verify does not read the copy, it writes it with the
checkpoint; the gate is the XLA op over the same buffers). An
implementation that is not available yet is recorded as a skipped row. Activations bf16, g / dt
float32, ring in ``--ring-dtype`` (bf16).

Method (bench/gdn_decode.py, DESIGN §8): one ``jax.jit`` runs n cycles (``lax.fori_loop``) of
``--cycle-steps`` honest steps of P layers (each with its own buffers, disjoint slot ranges of one
pool, P·pool ≥ ``--target-bytes`` so the state is far out of L2, P ≤ 128); the layers are unrolled
with their slots and inputs made once per call, as in bench/harness.py; carry donated.
* replay step: ``plan = cursor.plan(slots, num_tokens=T)`` → every layer ``replay_verify`` →
  ``cursor.commit(plan, accepted)`` with accepted counts uniform in [1, T] (a counter hash of step
  and row), so windows grow at the natural rate and rows flush when ``count + T > L - 1``.
  Cursors start at staggered phases; rings are random and full, so every window is real data.
* conventional step: every layer ``verify_conventional`` over a per-slot stack of T states, read at
  ``read_index`` and written at 0..T-1; then ``read_index = accepted - 1`` (same accepted counts).
* gate before timing: the arm's first step (layer 0) vs the XLA implementation of the same op on
  the same inputs (relative L2 of the outputs); a failed gate gets no speedup.
* timing: ``bench.common.time_loop`` (warm-up, calibration, ``--reps`` calls of ≈ ``--rep-seconds``);
  ms per layer-step = call time / (n · steps · P): median, p20, p80. Speedup = conventional median /
  replay median of the same implementation in the same run (and vs conv-pallas for replay-xla).
* memory per request and layer, from the buffer shapes: replay = checkpoint + rings (all leaves of
  the ReplayBuffers / N); conventional = the stack of T states / N, and the issue's accounting of
  T + 1 states (current + T drafts); ratio = replay / (T + 1 states).
"""
import argparse
import dataclasses
import math
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import replayssm_jax as rs

from bench import common
from bench.common import hash_normal, hash_uniform, l2_normalize

ARMS = ("replay-pallas", "replay-xla", "conv-pallas", "conv-xla", "replay-mosaic", "replay-pallas-copy",
        "replay-mosaic-copy")
DEFAULT_ARMS = ARMS[:4]   # replay-mosaic (Hopper; interpreted on CPU: slow) by name


@dataclasses.dataclass(frozen=True)
class Family:
  """One layer family: geometry and the public ops of ``rs.gdn`` / ``rs.mamba2``."""
  name: str
  dims: tuple  # ((name, size), ...): hashable, so a Setup can be a static jit argument

  @property
  def geo(self) -> dict:
    return dict(self.dims)

  def state_shape(self):
    g = self.geo
    return (g["hv"], g["vd"], g["kd"]) if self.name == "gdn" else (g["h"], g["p"], g["n"])

  def buffers(self, num_slots, cursor, state_dtype, ring_dtype, read_copy_dtype=None):
    g = self.geo
    dtypes = dict(state_dtype=state_dtype, ring_dtype=ring_dtype, read_copy_dtype=read_copy_dtype)
    if self.name == "gdn":
      return rs.gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=g["hk"], num_v_heads=g["hv"],
                                         head_k_dim=g["kd"], head_v_dim=g["vd"], **dtypes)
    return rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=g["h"], head_dim=g["p"],
                                          num_groups=g["g"], state_dim=g["n"], **dtypes)

  def bank(self, seed, sets, batch, t, act_dtype):
    """``sets`` random input sets [S, B, T, ...] (activations in act_dtype, decays float32)."""
    g, adt, shp = self.geo, jnp.dtype(act_dtype), (sets, batch, t)
    if self.name == "gdn":
      q = hash_normal(seed, shp + (g["hk"], g["kd"])).astype(adt)
      k = l2_normalize(hash_normal(seed + 1, shp + (g["hk"], g["kd"]))).astype(adt)
      v = hash_normal(seed + 2, shp + (g["hv"], g["vd"])).astype(adt)
      gd = -hash_uniform(seed + 3, shp + (g["hv"],), 0.01, 0.5)
      beta = jax.nn.sigmoid(hash_normal(seed + 4, shp + (g["hv"],))).astype(adt)
      return q, k, v, gd, beta
    x = hash_normal(seed, shp + (g["h"], g["p"])).astype(adt)
    dt = hash_uniform(seed + 1, shp + (g["h"],), -3.0, 0.0)
    B = hash_normal(seed + 2, shp + (g["g"], g["n"])).astype(adt)
    C = hash_normal(seed + 3, shp + (g["g"], g["n"])).astype(adt)
    return x, dt, B, C

  def params(self):
    """Mamba2 per-head parameters (A < 0, D, dt_bias); none for GDN."""
    if self.name == "gdn":
      return {}
    h = self.geo["h"]
    return {"A": -jnp.linspace(1.0, 8.0, h), "D": jnp.ones((h,)), "dt_bias": jnp.zeros((h,))}

  def replay(self, inputs, bufs, plan, impl, knobs=()):
    """The op; with ``knobs`` (launch overrides) the Pallas wrapper of ``impl`` (Triton or Mosaic)
    is called directly, all tokens real."""
    lengths = jnp.full(inputs[0].shape[:1], plan.num_tokens, jnp.int32)
    if self.name == "gdn":
      if knobs:
        from replayssm_jax.pallas import gdn_mosaic, gdn_verify_triton
        kernels = gdn_mosaic if impl == "pallas_mosaic" else gdn_verify_triton
        return kernels.replay_verify(*inputs, bufs, plan, lengths, scale=self.geo["kd"] ** -0.5,
                                     **dict(knobs))
      return rs.gdn.replay_verify(*inputs, bufs, plan, implementation=impl)
    x, dt, B, C = inputs
    p = self.params()
    if knobs:
      from replayssm_jax.pallas import mamba2_mosaic, mamba2_verify_triton
      kernels = mamba2_mosaic if impl == "pallas_mosaic" else mamba2_verify_triton
      return kernels.replay_verify(x, dt, p["A"], B, C, bufs, plan, lengths, D=p["D"], z=None,
                                   dt_bias=p["dt_bias"], dt_softplus=True, **dict(knobs))
    return rs.mamba2.replay_verify(x, dt, p["A"], B, C, bufs, plan, D=p["D"], dt_bias=p["dt_bias"],
                                   implementation=impl)

  def launch_config(self, bufs, plan, knobs=()) -> str:
    """The Pallas replay verify's resolved launch config (route and tiles) for these buffers."""
    batch = plan.slots.shape[0]
    if self.name == "gdn":
      from replayssm_jax.pallas import gdn_verify_triton as kernels
    else:
      from replayssm_jax.pallas import mamba2_verify_triton as kernels
    return repr(kernels.verify_cfg("bench", bufs, plan, batch, **dict(knobs)))

  def conventional(self, inputs, stack, slots, read_index, impl):
    if self.name == "gdn":
      return rs.gdn.verify_conventional(*inputs, stack, slots, read_index, implementation=impl)
    x, dt, B, C = inputs
    p = self.params()
    return rs.mamba2.verify_conventional(x, dt, p["A"], B, C, stack, slots, read_index, D=p["D"],
                                         dt_bias=p["dt_bias"], implementation=impl)


FAMILIES = {
    "gdn": Family("gdn", (("hk", 16), ("hv", 32), ("kd", 128), ("vd", 128))),   # Qwen3.5-4B
    "mamba2": Family("mamba2", (("h", 128), ("p", 64), ("n", 128), ("g", 8))),  # Nemotron-3-Super
}
SMOKE = {"gdn": Family("gdn", (("hk", 2), ("hv", 4), ("kd", 16), ("vd", 16))),
         "mamba2": Family("mamba2", (("h", 4), ("p", 16), ("n", 16), ("g", 2)))}


@dataclasses.dataclass(frozen=True)
class Setup:
  family: Family
  batch: int
  num_tokens: int
  buffer_len: int
  layers: int
  state_dtype: str
  ring_dtype: str
  act_dtype: str
  bank: int
  cycle_steps: int
  seed: int
  knobs: tuple = ()   # launch overrides of the replay-pallas or replay-mosaic arm, sorted pairs
  read_copy_dtype: str | None = None   # replay-pallas-copy: the checkpoint's read copy


READ_COPY_DTYPE = "bfloat16"


def memory_per_request(family: Family, t: int, buffer_len: int, state_dtype: str, ring_dtype: str,
                       read_copy_dtype=None) -> dict:
  """Bytes per request and layer from the buffer shapes (module doc; the read copy counts as ring-
  side bytes of the replay buffers)."""
  cursor = rs.ReplayCursor.create(1, buffer_len=buffer_len, max_draft=t - 1)
  bufs = jax.eval_shape(lambda: family.buffers(1, cursor, state_dtype, ring_dtype, read_copy_dtype))
  replay = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(bufs))
  state = math.prod(family.state_shape()) * common.itemsize(state_dtype)
  return {"replay": replay, "replay_state": state, "replay_rings": replay - state,
          "ring_size": cursor.ring_size, "conv_stack": t * state, "conv_t_plus_1": (t + 1) * state,
          "ratio_vs_t_plus_1": replay / ((t + 1) * state), "ratio_vs_stack": replay / (t * state)}


def _accepted(step, batch, t):
  """Accepted counts uniform in [1, T] per row: a counter hash of (step, row)."""
  x = (lax.iota(jnp.uint32, batch) + jnp.uint32(7919) * step.astype(jnp.uint32)) * jnp.uint32(0x9E3779B1)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  return (1 + (x >> 8) % jnp.uint32(t)).astype(jnp.int32)


def init(setup: Setup, family_kind: str):
  """(carry, consts): random buffers / stack for P layers, staggered cursors, input bank, slots."""
  f, P, B, t = setup.family, setup.layers, setup.batch, setup.num_tokens
  rng = np.random.default_rng([setup.seed, B, t])
  slots = jnp.asarray(rng.permutation(B).astype(np.int32))
  sdt = jnp.dtype(setup.state_dtype)
  seed = 64 * setup.seed + 8 * t
  bank = f.bank(seed, setup.bank, B, t, setup.act_dtype)
  state = (hash_normal(seed + 5, (P * B,) + f.state_shape()) * 0.1).astype(sdt)
  o = jnp.zeros(bank[0].shape[1:3] + f.state_shape()[:2], setup.act_dtype)
  step = jnp.zeros((), jnp.int32)
  if family_kind == "conv":
    stack = jnp.broadcast_to(state[:, None], (P * B, t) + state.shape[1:])
    read_index = jnp.asarray(rng.integers(0, t, size=B).astype(np.int32))
    return (stack, read_index, o, step), (bank, slots)
  cursor = rs.ReplayCursor.create(P * B, buffer_len=setup.buffer_len, max_draft=t - 1)
  bufs = f.buffers(P * B, cursor, setup.state_dtype, setup.ring_dtype, setup.read_copy_dtype)
  R = cursor.ring_size
  rings = {}
  for i, name in enumerate(x for x in ("ring_k", "ring_u", "ring_x", "ring_B") if getattr(bufs, x, None) is not None):
    ring = getattr(bufs, name)
    rings[name] = (l2_normalize(hash_normal(seed + 6 + i, ring.shape)) if name in ("ring_k", "ring_B")
                   else hash_normal(seed + 6 + i, ring.shape)).astype(ring.dtype)
  decay = "ring_g" if f.name == "gdn" else "ring_a"
  rings[decay] = -hash_uniform(seed + 9, getattr(bufs, decay).shape, 0.01, 0.5)
  bufs = bufs.replace(state=state, **rings)
  if bufs.read_copy is not None:   # the copy is the rounded checkpoint
    bufs = bufs.replace(read_copy=state.astype(bufs.read_copy.dtype))
  # Staggered phases: counts spread over [0, L-1], random bases (every slot of every layer).
  count = jnp.asarray(rng.integers(0, setup.buffer_len, size=P * B).astype(np.int32))
  base = jnp.asarray(rng.integers(0, R, size=P * B).astype(np.int32))
  cursor = cursor.replace(base=base, count=count)
  return (bufs, cursor, o, step), (bank, slots)


def make_runner(setup: Setup, kind: str, impl: str):
  f, P, B, t, nb = setup.family, setup.layers, setup.batch, setup.num_tokens, setup.bank

  def run(carry, consts, n_cycles):
    bank, slots = consts
    # Operands made once per call and the layers unrolled, as in bench/harness.make_runner.
    sets = [tuple(x[j] for x in bank) for j in range(min(nb, P))]
    layer_slots = [slots + l * B for l in range(P)]

    def step(_, c):
      buf, meta, o, s = c
      accepted = _accepted(s, B, t)
      if kind == "conv":
        for l in range(P):
          o, buf = f.conventional(sets[l % nb], buf, layer_slots[l], meta, impl)
        return buf, accepted - 1, o, s + 1
      plan = meta.plan(slots, num_tokens=t)
      for l in range(P):
        o, buf = f.replay(sets[l % nb], buf, plan.replace(slots=layer_slots[l]), impl, setup.knobs)
      return buf, meta.commit(plan, accepted), o, s + 1

    return lax.fori_loop(0, n_cycles, lambda _, c: lax.fori_loop(0, setup.cycle_steps, step, c), carry)
  return run


def first_output(setup: Setup, kind: str, impl: str, carry, consts):
  """Layer 0's first step (not donated): the gate compares it across implementations."""
  f = setup.family
  bank, slots = consts
  inp = tuple(x[0] for x in bank)
  if kind == "conv":
    return f.conventional(inp, carry[0], slots, carry[1], impl)[0]
  knobs = setup.knobs if impl != "xla" else ()
  return f.replay(inp, carry[0], carry[1].plan(slots, num_tokens=setup.num_tokens), impl, knobs)[0]


def run_arm(setup: Setup, arm: str, args) -> dict:
  kind, impl, *copy = arm.split("-")
  impl = {"pallas": "pallas_triton", "xla": "xla", "mosaic": "pallas_mosaic"}[impl]
  if copy:
    setup = dataclasses.replace(setup, read_copy_dtype=READ_COPY_DTYPE)
  if setup.knobs:
    arm = f"{arm}[{' '.join(f'{k}={v}' for k, v in setup.knobs)}]"
  row = {"arm": arm, "family": setup.family.name, "kind": kind, "impl": impl, "batch": setup.batch,
         "num_tokens": setup.num_tokens, "buffer_len": setup.buffer_len, "state_dtype": setup.state_dtype,
         "ring_dtype": setup.ring_dtype, "layers": setup.layers, "cycle_steps": setup.cycle_steps,
         "read_copy_dtype": setup.read_copy_dtype, "status": "pending", "error": None}
  if copy and setup.state_dtype != "float32":
    row.update(status="skipped", error=f"a read copy needs a float32 checkpoint, not {setup.state_dtype}")
    return row
  try:
    t0 = time.perf_counter()
    carry, consts = jax.jit(init, static_argnums=(0, 1))(setup, kind)
    o = first_output(setup, kind, impl, carry, consts)
    ref = o if impl == "xla" else first_output(setup, kind, "xla", carry, consts)
    o, ref = np.asarray(o, np.float64), np.asarray(ref, np.float64)
    rel = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
    tol = 1e-2 if "bfloat16" in (setup.state_dtype, setup.act_dtype, setup.ring_dtype) else 2e-3
    row["gate"] = {"passed": bool(np.all(np.isfinite(o)) and rel <= tol), "o_rel_vs_xla": rel, "tol_rel": tol}
    if kind == "replay" and impl == "pallas_triton":
      bank, slots = consts
      row["launch_config"] = setup.family.launch_config(
          carry[0], carry[1].plan(slots, num_tokens=setup.num_tokens), setup.knobs)
    runner = jax.jit(make_runner(setup, kind, impl), donate_argnums=(0,))
    compiled = runner.lower(carry, consts, jnp.int32(1)).compile()
    row["compile_s"] = time.perf_counter() - t0
    carry, timing = common.time_loop(lambda c, n: compiled(c, consts, np.int32(n)), carry,
                                     reps=args.reps, rep_seconds=args.rep_seconds)
    finite = bool(jnp.all(jnp.isfinite(carry[2].astype(jnp.float32))))
  except NotImplementedError as e:
    row.update(status="skipped", error=f"{type(e).__name__}: {e}")
    return row
  summary = timing.ms_per(setup.cycle_steps * setup.layers)   # per layer-step
  row.update(ms_per_layer_step=summary.pop("ms"), **summary, finite=finite,
             status="ok" if (row["gate"]["passed"] and finite) else "gate-failed")
  return row


def derive(rows):
  """Speedups of the replay arms over the conventional arm of the same implementation (and conv-pallas).
  Mosaic has no conventional verify: its replay arm's ``speedup_vs_conv`` is against conv-pallas."""
  key = lambda r: (r["family"], r["state_dtype"], r["num_tokens"], r["batch"])
  conv = {(key(r), r["impl"]): r["median_ms"] for r in rows if r["kind"] == "conv" and r["status"] == "ok"}
  for r in rows:
    ok = r["kind"] == "replay" and r["status"] == "ok"
    same, pallas = conv.get((key(r), r["impl"])), conv.get((key(r), "pallas_triton"))
    same = same if r["impl"] != "pallas_mosaic" else pallas
    r["speedup_vs_conv"] = same / r["median_ms"] if ok and same else None
    r["speedup_vs_conv_pallas"] = pallas / r["median_ms"] if ok and pallas else None


def render(rows, memory) -> str:
  headers = ["family", "state", "T", "B", "arm", "ms/layer-step", "p20-p80", "speedup vs conv", "status"]
  body = [[r["family"], r["state_dtype"], str(r["num_tokens"]), str(r["batch"]), r["arm"],
           common.fmt_float(r.get("median_ms"), ".4f"),
           f"{common.fmt_float(r.get('p20_ms'), '.4f')}-{common.fmt_float(r.get('p80_ms'), '.4f')}",
           common.fmt_float(r.get("speedup_vs_conv"), ".2f"), r["status"]] for r in rows]
  mem_headers = ["family", "state", "T", "R", "replay MiB (ckpt + rings)", "conv MiB (T+1 states)", "ratio"]
  mem_body = [[m["family"], m["state_dtype"], str(m["num_tokens"]), str(m["ring_size"]),
               f"{m['replay'] / 2**20:.3f}", f"{m['conv_t_plus_1'] / 2**20:.3f}",
               f"{100 * m['ratio_vs_t_plus_1']:.1f} %"] for m in memory]
  return ("## Speculative verify (ms per layer-step)\n\n"
          + common.render_table(headers, body, markdown=True, align_right={2, 3, 5, 6, 7})
          + "\n\n## Memory per request and layer\n\n"
          + common.render_table(mem_headers, mem_body, markdown=True, align_right={2, 3, 4, 5, 6}) + "\n")


def _ints(text):
  return [int(x) for x in text.split(",") if x]


def _value(text):
  """'32' → 32, 'true'/'false' → bool, else the string."""
  if text.isdigit():
    return int(text)
  return {"true": True, "false": False}.get(text.lower(), text)


def _variants(text):
  """'a=1:b=x,c=2' → [(('a', 1), ('b', 'x')), (('c', 2),)]; an empty item is the default config."""
  out = []
  for item in text.split(","):
    pairs = [kv.split("=", 1) for kv in item.split(":") if kv]
    out.append(tuple(sorted((k, _value(v)) for k, v in pairs)))
  return out


# Launch knobs of the Mosaic verify wrappers (the state tile's rows; batch rows per program).
MOSAIC_KNOBS = ("block_v", "block_p", "rows")


def arm_variants(arm: str, variants) -> list:
  """The ``--variants`` an arm runs: replay-pallas those without a Mosaic-only knob (rows),
  replay-mosaic those made of ``MOSAIC_KNOBS``, other arms the default."""
  keys = lambda v: {k for k, _ in v}
  if arm == "replay-pallas":
    return [v for v in variants if "rows" not in keys(v)]
  if arm == "replay-mosaic":
    return [v for v in variants if keys(v) <= set(MOSAIC_KNOBS)]
  return [()]


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m bench.verify_decode", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="tiny CPU run: small geometry, B=2, T=2, L=4")
  p.add_argument("--family", choices=sorted(FAMILIES), default="gdn")
  p.add_argument("--tokens", type=_ints, default=[2, 4, 8], help="T values (tokens per row and step)")
  p.add_argument("--batches", type=_ints, default=[1, 32, 128, 256])
  p.add_argument("--xla-batches", type=_ints, default=None, help="batches for the XLA arms (default: all)")
  p.add_argument("--buffer-len", type=int, default=16)
  p.add_argument("--state-dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
  p.add_argument("--ring-dtype", default="bfloat16")
  p.add_argument("--act-dtype", default="bfloat16")
  p.add_argument("--arms", type=lambda s: s.split(","), default=list(DEFAULT_ARMS))
  p.add_argument("--variants", type=_variants, default=[()],
                 help="launch variants of the replay-pallas and replay-mosaic arms, comma-"
                      "separated, each key=value[:key=value...], e.g. route=reconstruct:block_v=16 "
                      "or rows=4 (Mosaic; '' = the config's)")
  p.add_argument("--target-bytes", type=float, default=2**30, help="P layers: P·state pool >= this")
  p.add_argument("--max-layers", type=int, default=64)
  p.add_argument("--cycle-steps", type=int, default=16, help="honest steps per timed cycle")
  p.add_argument("--bank", type=int, default=4)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--rep-seconds", type=float, default=0.2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out-json", type=pathlib.Path, default=None)
  p.add_argument("--markdown", type=pathlib.Path, default=None, help="write the markdown tables here")
  args = p.parse_args(argv)
  unknown = set(args.arms) - set(ARMS)
  if unknown:
    p.error(f"--arms: unknown {sorted(unknown)}; expected some of {ARMS}")
  unused = [v for v in args.variants if v and not any(v in arm_variants(a, [v]) for a in args.arms)]
  if unused:
    p.error(f"--variants {unused}: no arm of {args.arms} takes these knobs (replay-pallas takes "
            f"the Triton ones, replay-mosaic only {list(MOSAIC_KNOBS)})")
  if args.smoke:
    args.tokens, args.batches, args.buffer_len = [2], [2], 4
    args.state_dtypes = args.state_dtypes if "--state-dtypes" in argv else ["float32"]
    args.target_bytes, args.max_layers, args.cycle_steps = 0, 2, 4
    args.reps, args.rep_seconds, args.bank = 2, 0.01, 2
  return args


def layers_for(state_elements: int, batch: int, state_dtype: str, target_bytes: float,
               max_layers: int) -> int:
  """P = max(2, ceil(target_bytes / one layer's state pool)), at most ``max_layers``, at most
  ``common.MAX_UNROLLED_LAYERS`` (the layers are unrolled)."""
  pool = batch * state_elements * common.itemsize(state_dtype)
  return int(min(max_layers, common.MAX_UNROLLED_LAYERS, max(2, math.ceil(target_bytes / pool))))


def main(argv=None) -> dict:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  rs.set_checks(False)
  warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")
  family = (SMOKE if args.smoke else FAMILIES)[args.family]
  meta = common.run_metadata(argv, "bench.verify_decode")
  meta["geometry"] = family.geo
  meta["options"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
  common.log(f"{meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, family {family.name}")
  rows, memory = [], []
  state_bytes = math.prod(family.state_shape())
  for sdt in args.state_dtypes:
    for t in args.tokens:
      mem = memory_per_request(family, t, args.buffer_len, sdt, args.ring_dtype)
      memory.append({"family": family.name, "state_dtype": sdt, "num_tokens": t, **mem})
      mem_copy = (memory_per_request(family, t, args.buffer_len, sdt, args.ring_dtype, READ_COPY_DTYPE)
                  if any(a.endswith("-copy") for a in args.arms) and sdt == "float32" else None)
      for B in args.batches:
        P = layers_for(state_bytes, B, sdt, args.target_bytes, args.max_layers)
        setup = Setup(family, B, t, args.buffer_len, P, sdt, args.ring_dtype, args.act_dtype, args.bank,
                      args.cycle_steps, args.seed)
        runs = [(arm, knobs) for arm in args.arms for knobs in arm_variants(arm, args.variants)]
        for arm, knobs in runs:
          if arm.endswith("xla") and args.xla_batches is not None and B not in args.xla_batches:
            continue
          row = run_arm(dataclasses.replace(setup, knobs=knobs), arm, args)
          used = mem_copy if row["read_copy_dtype"] and mem_copy else mem
          row.update(memory_per_request=used["replay" if row["kind"] == "replay" else "conv_t_plus_1"])
          rows.append(row)
          common.log(f"{family.name} {sdt} T={t} B={B} P={P} {row['arm']}: {row['status']} "
                     f"{common.fmt_float(row.get('median_ms'), '.4f')} ms/layer-step"
                     + (f" ({row['error']})" if row["error"] else ""))
  derive(rows)
  meta["elapsed_s"] = common.elapsed()
  result = {"meta": meta, "memory": memory, "rows": rows}
  text = render(rows, memory)
  print(text)
  if args.out_json:
    common.write_json(args.out_json, result)
  if args.markdown:
    args.markdown.write_text("# Speculative verify benchmark\n\n" + text)
  return result


if __name__ == "__main__":
  main()
