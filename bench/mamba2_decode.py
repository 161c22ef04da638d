"""Mamba2 decode benchmark: conventional vs ReplaySSM decode, Pallas-Triton vs XLA.

    python -m bench.mamba2_decode [--state-dtypes float32] [--buffer-lens 8] [--batches 1,8,...]
                                  [--arms ...] [--configs default,bv16w2] [--heads 4] [--markdown]
    python -m bench.mamba2_decode --smoke       # tiny CPU run (seconds); the test suite runs it
    python -m bench.mamba2_decode --from-json A.json --markdown   # re-render saved runs

Geometry: one Nemotron-3-Super Mamba2 layer (H=128 heads, P=64, N=128, G=8 groups), bf16
activations, ring in bf16 (``--ring-dtype``), state float32 and/or bfloat16 (``--state-dtypes``).
D, z gating, dt_bias and softplus are on, as in the model.

Arms (``--arms``): ``conv-pallas`` (rs.mamba2.decode, pallas_triton), ``replay-pallas-oo`` /
``replay-pallas-rc`` (rs.mamba2.replay_decode, pallas_triton, route output_only / reconstruct),
``conv-xla``, ``replay-xla`` (route output_only). XLA arms run only at ``--xla-batches``.
``replay-pallas-flushall`` (not in the default set): every step ``cursor.plan(flush_all=True)``,
the small-batch policy's plan, through the same replay kernel (every row takes its flush path).
``replay-pallas-copy`` / ``replay-xla-copy`` (not in the default set): output-only replay over
buffers with a 16-bit read copy of the float32 checkpoint (``--read-copy-dtype``), f32 rows only.
``conv-mosaic`` / ``replay-mosaic-rc`` (not in the default set): implementation="pallas_mosaic",
the Mosaic GPU decode and the reconstruct-route replay kernel. Peer arms ``peer-vllm-replay``
(bench/peer_vllm.py) and ``peer-mamba-ssm-conv`` (bench/peer_mamba_ssm.py) run those projects'
kernels through jax_triton on the same data; a peer that cannot run here is a skipped row.
``--configs`` adds one row per Pallas launch config: tokens ``bv`` (block_p, P rows per program),
``bk`` (block_n, N chunk of the rebuild), ``w`` (warps), ``s`` (stages), and for the output-only
route's fold pass ``fbv`` / ``fbk`` (its [P, N] tile), ``fw`` (warps), ``fr`` (row slots);
``--heads`` sets the replay step's heads per program. ``default`` = the config module's choice through the public op.

Method: as bench/gdn_decode.py (the shared harness is bench/harness.py). P layers with their own
state (P = max(``--min-layers``, ceil(``--target-bytes`` / pool)): P·pool ≥ 1 GiB and at least 8
layers share each step's cursor plan and commit), many steps inside one ``jax.jit`` with buffers
donated, honest full cycles of L steps (one ``cursor.plan`` per step shared by all layers,
``cursor.commit`` after; rows at staggered phases, every row flushes once per cycle, the fold
pass included). Random data everywhere (counter-based hash), a bank of ``--bank`` input
sets. Before timing, a gate: the arm's first step (layer 0) vs implementation="xla" (output and
written state/ring rows) and the first rows' output vs an independent float64 numpy oracle. After
timing: replay cursors back at their starting counts with bases advanced L per cycle. Copy
ceiling at start and end (``bench.common``).

Minimal bytes per row and layer-step, averaged over a full cycle (``bytes_model``):
  inputs x, z [H·P], dt [H], B, C [G·N] in the activation dtype; output y [H·P];
  conventional: state read + written, 2·H·P·N·s;
  replay: checkpoint read every step (H·P·N·s) and written once per L steps; the live window read
  once — on average (L-1)/2 entries — and one entry written, an entry being Δx [H·P] and B [G·N]
  in the ring dtype + ΔA [H] float32.
Not counted: slots/cursor metadata, parameters (A, D, dt_bias: 3·H floats).
"""
import dataclasses

import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax.mamba2.buffers import ReplayBuffers

from bench import common
from bench import harness
from bench import peer_mamba_ssm
from bench import peer_vllm


@dataclasses.dataclass(frozen=True)
class Geometry:
  h: int  # heads
  g: int  # groups
  p: int  # head dim P
  n: int  # state dim N

  @property
  def state_shape(self) -> tuple:  # one slot's state [H, P, N]
    return (self.h, self.p, self.n)

  @property
  def out_shape(self) -> tuple:  # one row's output y [H, P]
    return (self.h, self.p)


NEMOTRON_SUPER = Geometry(h=128, g=8, p=64, n=128)
SMOKE = Geometry(h=4, g=2, p=8, n=16)
ARMS = harness.STANDARD_ARMS + ("replay-pallas-flushall", "conv-mosaic", "replay-mosaic-rc",
                                "replay-pallas-copy", "replay-xla-copy")
DEFAULT_ARMS = harness.STANDARD_ARMS
_KNOBS = {"block_v": "block_p", "block_k": "block_n", "num_warps": "num_warps",
          "num_stages": "num_stages", "fold_block_v": "fold_block_p", "fold_block_k": "fold_block_n",
          "fold_num_warps": "fold_num_warps", "fold_rows": "fold_rows", "fold_tiles": "fold_tiles"}


# ----------------------------------------------------------------------------------------------
# Byte model

def bytes_model(geo: Geometry, family: str, buffer_len: int | None, state_dtype, ring_dtype,
                act_dtype, read_copy_dtype=None) -> dict:
  """Minimal bytes per batch row and layer-step, averaged over a full cycle (module doc)."""
  a, s, r = (common.itemsize(d) for d in (act_dtype, state_dtype, ring_dtype))
  return harness.cycle_bytes(
      family, buffer_len, inputs=(2 * geo.h * geo.p + geo.h + 2 * geo.g * geo.n) * a,
      output=geo.h * geo.p * a, state=geo.h * geo.p * geo.n * s,
      entry=(geo.h * geo.p + geo.g * geo.n) * r + geo.h * 4,
      read_copy=None if read_copy_dtype is None else geo.h * geo.p * geo.n * common.itemsize(read_copy_dtype))


def donated_sizes(setup: harness.Setup) -> list[int]:
  """Bytes of the large donated arrays whose copy is looked for: the state pool (all P layers)
  and its read copy."""
  return [harness.pool_bytes(setup)] + harness.read_copy_bytes(setup)


# ----------------------------------------------------------------------------------------------
# Data

def _make_rings(setup: harness.Setup, state, streams):
  """Replay buffers around ``state``: full random rings Δ·x (Δ ≈ 0.05), B, ΔA ~ -U(0.01, 0.5)."""
  geo, N, R = setup.geo, setup.layers * setup.num_slots, setup.ring_size
  rdt = jnp.dtype(setup.ring_dtype)
  ring_x = (common.hash_normal(streams[0], (N, geo.h, R, geo.p)) * 0.05).astype(rdt)
  ring_B = common.hash_normal(streams[1], (N, geo.g, R, geo.n)).astype(rdt)
  ring_a = -common.hash_uniform(streams[2], (N, geo.h, R), 0.01, 0.5)
  copy = None if setup.read_copy_dtype is None else state.astype(setup.read_copy_dtype)
  return ReplayBuffers(state=state, ring_x=ring_x, ring_B=ring_B, ring_a=ring_a, read_copy=copy)


def _make_bank(setup: harness.Setup, streams):
  """``bank`` input sets x, dt, B, C, z: x, z [S, B, H, P], dt [S, B, H], B, C [S, B, G, N]
  (activation dtype); parameters A (negative), D, dt_bias [H] float32 (dt + dt_bias ≈ -4: Δ ≈ 0.02)."""
  geo, S, Bt = setup.geo, setup.bank, setup.batch
  adt = jnp.dtype(setup.act_dtype)
  ks = streams
  bank = (common.hash_normal(ks[0], (S, Bt, geo.h, geo.p)).astype(adt),
          common.hash_normal(ks[1], (S, Bt, geo.h)).astype(adt),
          common.hash_normal(ks[2], (S, Bt, geo.g, geo.n)).astype(adt),
          common.hash_normal(ks[3], (S, Bt, geo.g, geo.n)).astype(adt),
          common.hash_normal(ks[4], (S, Bt, geo.h, geo.p)).astype(adt))
  params = {"A": -common.hash_uniform(ks[5], (geo.h,), 1.0, 2.0), "D": common.hash_normal(ks[6], (geo.h,)),
            "dt_bias": common.hash_uniform(ks[7], (geo.h,), -4.0, -3.0)}
  return bank, params


# ----------------------------------------------------------------------------------------------
# Programs

def layer_op(case: harness.Case):
  """``op(x, dt, B, C, z, params, buf, slots_or_plan) -> (y, buf)`` for one layer."""
  arm, cfg = case.arm, case.cfg
  if arm.impl == "pallas_triton" and not (cfg.is_default and case.heads is None):
    from replayssm_jax.pallas import mamba2_triton  # noqa: PLC0415
    unknown = sorted(set(cfg.kwargs()) - set(_KNOBS))
    if unknown:
      raise ValueError(f"--configs {cfg.name!r}: {unknown} have no Mamba2 kernel knob")
    kw = {_KNOBS[k]: v for k, v in cfg.kwargs(_KNOBS).items()}
    if arm.family == "conv":  # one [BP, N] tile: no rebuild chunk, no fold pass
      kw = {k: v for k, v in kw.items() if k in ("block_p", "num_warps", "num_stages")}
      return lambda x, dt, B, C, z, pr, pool, slots: mamba2_triton.decode(
          x, dt, pr["A"], B, C, pool, slots, D=pr["D"], z=z, dt_bias=pr["dt_bias"],
          dt_softplus=True, **kw)
    return lambda x, dt, B, C, z, pr, bufs, plan: mamba2_triton.replay_decode(
        x, dt, pr["A"], B, C, bufs, plan, D=pr["D"], z=z, dt_bias=pr["dt_bias"], dt_softplus=True,
        route=arm.route, heads=case.heads, **kw)
  if arm.impl == "pallas_mosaic" and not cfg.is_default:   # rows (harness._arm_configs)
    from replayssm_jax.pallas import mamba2_mosaic  # noqa: PLC0415
    if arm.family == "conv":
      return lambda x, dt, B, C, z, pr, pool, slots: mamba2_mosaic.decode(
          x, dt, pr["A"], B, C, pool, slots, D=pr["D"], z=z, dt_bias=pr["dt_bias"],
          dt_softplus=True, **cfg.kwargs())
    return lambda x, dt, B, C, z, pr, bufs, plan: mamba2_mosaic.replay_decode(
        x, dt, pr["A"], B, C, bufs, plan, D=pr["D"], z=z, dt_bias=pr["dt_bias"], dt_softplus=True,
        route=arm.route, **cfg.kwargs())
  if arm.family == "conv":
    return lambda x, dt, B, C, z, pr, pool, slots: rs.mamba2.decode(
        x, dt, pr["A"], B, C, pool, slots, D=pr["D"], z=z, dt_bias=pr["dt_bias"],
        implementation=arm.impl)
  return lambda x, dt, B, C, z, pr, bufs, plan: rs.mamba2.replay_decode(
      x, dt, pr["A"], B, C, bufs, plan, D=pr["D"], z=z, dt_bias=pr["dt_bias"], route=arm.route,
      implementation=arm.impl)


def _layer(case: harness.Case):
  """The harness's ``op(inputs, params, buf, slots_or_plan)``: ``layer_op`` with the parameters."""
  op = layer_op(case)
  return lambda inputs, params, buf, index: op(*inputs, params, buf, index)


# float64 oracle (numpy; independent of the library's jnp code) -----------------------------------

def oracle_output(setup: harness.Setup, carry, consts, host, rows: int):
  """float64 output of the first step for the first ``rows`` batch rows (layer 0)."""
  (x, dt, B, C, z), params, _ = consts
  sl = host["slots"][:rows]
  f = harness.f64
  x, dt, B, C, z = (f(a[0][:rows]) for a in (x, dt, B, C, z))
  A, D, bias = (f(params[k]) for k in ("A", "D", "dt_bias"))
  group = np.arange(setup.geo.h) // (setup.geo.h // setup.geo.g)
  if setup.family == "conv":
    S = f(carry[0][sl])
  else:   # S = e^{Σa} S_c + Σ_j e^{Σ_{i>j} a_i} Δx_j B_jᵀ over each row's window
    bufs = carry[0]
    S = f(bufs.state[sl])
    rx, rB, ra = f(bufs.ring_x[sl]), f(bufs.ring_B[sl]), f(bufs.ring_a[sl])
    for b in range(rows):
      idx = (int(host["base"][sl[b]]) + np.arange(int(host["count"][sl[b]]))) % setup.ring_size
      if idx.size:
        a = ra[b][:, idx]                                        # [H, n]
        total = a.sum(-1)
        suffix = total[:, None] - np.cumsum(a, axis=-1)
        S[b] = (np.exp(total)[:, None, None] * S[b]
                + np.einsum("hj,hjp,hjn->hpn", np.exp(suffix), rx[b][:, idx], rB[b][group][:, idx]))
  delta = np.logaddexp(0.0, dt + bias)
  S = (np.exp(delta * A)[..., None, None] * S
       + (delta[..., None] * x)[..., :, None] * B[:, group][:, :, None, :])
  y = np.einsum("bhpn,bhn->bhp", S, C[:, group]) + D[:, None] * x
  return y * z / (1.0 + np.exp(-z))


def _summary(meta: dict, ceil: str) -> str:
  geo = meta.get("geometry", {})
  return (f"Geometry H={geo.get('h')} P={geo.get('p')} N={geo.get('n')} G={geo.get('g')}; jax "
          f"{meta.get('jax_version')}, commit `{(meta.get('git_commit') or 'unknown')[:12]}`, source "
          f"digest `{meta.get('source_digest')}`; copy ceiling {ceil} GB/s. Bytes and method: "
          f"bench/mamba2_decode.py docstring.")


BENCH = harness.LayerBench(
    name="mamba2_decode", title="Mamba2 decode", description=__doc__.split("\n\n")[0],
    geometry=NEMOTRON_SUPER, smoke_geometry=SMOKE, arms=ARMS, default_arms=DEFAULT_ARMS,
    default_buffer_lens=(4, 8, 16), plot_L=8,
    smoke_help="tiny CPU-sized run (H=4, G=2, P=8, N=16, B=2, L=4, float32 state)",
    configs_help="Pallas launch configs: bv (block_p) bk (block_n) w s tokens, e.g. default,bv16w2",
    pallas_module="replayssm_jax.pallas.mamba2_triton", mosaic_knobs=("rows",),
    bytes_model=bytes_model,
    bytes_model_doc={
        "unit": "bytes per batch row and layer-step, averaged over a full cycle",
        "conv": "inputs (x, z, dt, B, C; act dtype) + output y + state read + state write",
        "replay": "inputs + output + checkpoint read + checkpoint write / L + ring window read "
                  "((L-1)/2 entries) + one entry written; entry = Δx[H,P] + B[G,N] (ring dtype) + "
                  "ΔA[H] f32",
        "not_counted": "slot/cursor metadata; parameters A, D, dt_bias",
    },
    donated_sizes=donated_sizes, make_rings=_make_rings, make_bank=_make_bank, layer=_layer,
    oracle_output=oracle_output, summary=_summary, heads_option=True,
    peer_arms=peer_vllm.ARMS + peer_mamba_ssm.ARMS)


def main(argv=None) -> dict:
  """``python -m bench.mamba2_decode``: see the module doc and ``--help``."""
  return harness.main(BENCH, argv)


if __name__ == "__main__":
  main()
