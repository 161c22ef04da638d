"""GDN decode benchmark: conventional vs ReplaySSM decode, Pallas-Triton vs XLA.

    python -m bench.gdn_decode [--state-dtypes float32] [--buffer-lens 16] [--batches 1,8,...]
                               [--arms ...] [--configs default,bv32w2] [--out-json F] [--markdown] [--plot]
    python -m bench.gdn_decode --smoke          # tiny CPU run (< 1 min); the test suite runs it
    python -m bench.gdn_decode --from-json A.json B.json --markdown --plot   # re-render saved runs

Geometry: one Qwen3.5-4B GDN layer (Hk=16, Hv=32, K=V=128), bf16 activations, g float32, ring in
bf16 (``--ring-dtype``), state float32 and/or bfloat16 (``--state-dtypes``).

Arms (``--arms``): ``conv-pallas`` (rs.gdn.decode, pallas_triton), ``replay-pallas-oo`` /
``replay-pallas-rc`` (rs.gdn.replay_decode, pallas_triton, route output_only / reconstruct),
``conv-xla``, ``replay-xla`` (route output_only); opt-in ``replay-xla-rc``,
and the Pallas Mosaic GPU arms ``conv-mosaic`` / ``replay-mosaic`` (implementation="pallas_mosaic",
output-only route, flush fold fused; config module defaults) to time Mosaic vs Triton in one run.
Peer arms (``peer-sglang-replay``, ``peer-sglang-conv``: bench/peer_sglang.py) run SGLang's
kernels through jax_triton on the same data; a peer that cannot run here is a skipped row.
Opt-in ``replay-pallas-copy`` / ``replay-xla-copy``: the same replay decode over buffers with a
16-bit read copy of the float32 checkpoint (``--read-copy-dtype``, ``ReplayBuffers.read_copy``),
float32 state rows only. XLA arms run only at ``--xla-batches``. ``--configs bv32w2,bv64w4`` adds one row per Pallas launch
config (calls ``replayssm_jax.pallas.gdn_triton`` with keyword overrides; ``default`` = the config
module's choice through the public op).

Method (DESIGN §8, notes/pallas-gpu.md "Calibration", .library/device/METHOD.md; the code is
bench/harness.py, shared with bench/mamba2_decode.py):

* Layers. A step runs P layers, each with its own state (and ring) — well over the 60 MB L2:
  P = max(--min-layers, ceil(--target-bytes / state bytes of one layer's pool)), so P·pool ≥ 1 GiB
  and, like a model, at least 8 layers share each step's cursor plan and commit. Layers
  are disjoint slot ranges of one pool array (layer l uses slots l·N + s, N = B slots per layer):
  the same memory traffic as P separate arrays. P ≤ 128 (``common.MAX_UNROLLED_LAYERS``).
* Steps. One ``jax.jit`` runs ``n`` cycles (a dynamic ``fori_loop``) of ``L`` steps (a
  ``fori_loop``; conventional arms use ``--conv-cycle`` steps) of P layers, unrolled, with every
  layer's slots and inputs made once per call outside the loops: a layer-step is its kernels alone
  (a loop over the layers cost ~7.5 µs per layer-step on the H200), and dispatch and the
  loops' host round trips are amortized. Buffers, cursor and the last output are the donated carry,
  threaded from call to call. Replay: one ``cursor.plan(slots)`` per step shared by all layers,
  ``cursor.commit(plan)`` after: honest full cycles, every row flushes once per L steps.
* Data. Random, never zeros (a counter-based hash, uniform): checkpoints of std 0.1, rings
  (L2-normalised k, u of unit variance, g ~ -U(0.01, 0.5)) filled at every index; each slot starts at a staggered phase (cursor counts
  spread over [0, L-1], random bases); a bank of ``--bank`` random input sets, layer l of step t
  reads set l mod bank. Slots are a random permutation. At least one row flushes on the
  first step, so the gate always covers a flush fold.
* Gate, before timing: the arm's first step (layer 0) vs implementation="xla" on the same inputs
  (output and written state/ring rows: max abs and relative L2 error), and the first rows' output
  vs an independent float64 numpy oracle. A row whose gate fails gets no speedup.
* Timing: compile, one untimed call, a calibration call, then ``--reps`` calls of ``n`` cycles
  (≈ ``--rep-seconds`` each) with block_until_ready; ms per layer-step = call time / (n·steps·P):
  median, p20, p80. ``--repeat-arm`` is timed a second time at the end of each (dtype, B) group
  (row ``<arm>#2``): the run-to-run noise. After timing, each replay cursor must be back at its
  starting count and its base advanced by L per cycle (flushes happened), and outputs finite.
* In-place check: the optimized HLO of each timed program is searched for copies as large as a
  donated array (state pool, ring_k, ring_u); any are listed in the row (``big_copies``, ``+copy``
  in the table): such a program pays a full copy per layer-step.
* Copy ceiling, at the start and end of the run: ``bench.common.measure_copy_ceiling``
  (≥ 2 GB in place, bytes read + written / time); the larger median is the ceiling.

Minimal bytes per row and layer-step, averaged over a full cycle (``bytes_model``):
  inputs q, k [Hk·K], v [Hv·V], beta [Hv] in the activation dtype, g [Hv] float32; output o [Hv·V];
  conventional: state read + written: 2·Hv·V·K·s;
  replay: checkpoint read every step (Hv·V·K·s) and written once per L steps (Hv·V·K·s / L);
  ring: the live window read once — on average (L-1)/2 entries — and one entry written, an entry
  being k [Hk·K] (per key head) + u [Hv·V] in the ring dtype + g [Hv] float32.
  Effective bandwidth = B · bytes per row / (ms per layer-step); % of the copy ceiling.
  Not counted: slots/cursor metadata (a few bytes per row), the fold pass re-reading the window.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import replayssm_jax as rs
from replayssm_jax.gdn.buffers import ReplayBuffers

from bench import common
from bench import harness
from bench import peer_sglang


@dataclasses.dataclass(frozen=True)
class Geometry:
  hk: int  # key heads
  hv: int  # value heads
  kd: int  # K
  vd: int  # V

  @property
  def group(self) -> int:
    return self.hv // self.hk

  @property
  def state_shape(self) -> tuple:  # one slot's state [Hv, V, K]
    return (self.hv, self.vd, self.kd)

  @property
  def out_shape(self) -> tuple:  # one row's output o [Hv, V]
    return (self.hv, self.vd)


QWEN35_4B = Geometry(hk=16, hv=32, kd=128, vd=128)
SMOKE = Geometry(hk=2, hv=4, kd=16, vd=16)
DEFAULT_ARMS = harness.STANDARD_ARMS


# ----------------------------------------------------------------------------------------------
# Byte model

def bytes_model(geo: Geometry, family: str, buffer_len: int | None, state_dtype, ring_dtype,
                act_dtype, read_copy_dtype=None) -> dict:
  """Minimal bytes per batch row and layer-step, averaged over a full cycle (module doc)."""
  a, s, r = (common.itemsize(d) for d in (act_dtype, state_dtype, ring_dtype))
  return harness.cycle_bytes(
      family, buffer_len, inputs=(2 * geo.hk * geo.kd + geo.hv * geo.vd + geo.hv) * a + geo.hv * 4,
      output=geo.hv * geo.vd * a, state=geo.hv * geo.vd * geo.kd * s,
      entry=geo.hk * geo.kd * r + geo.hv * geo.vd * r + geo.hv * 4,
      read_copy=None if read_copy_dtype is None else geo.hv * geo.vd * geo.kd * common.itemsize(read_copy_dtype))


def donated_sizes(setup: harness.Setup) -> list[int]:
  """Bytes of the large donated arrays (all P layers): state pool (and its read copy); ring_k and
  ring_u for replay."""
  geo, slots = setup.geo, setup.layers * setup.num_slots
  sizes = [harness.pool_bytes(setup)] + harness.read_copy_bytes(setup)
  if setup.family == "replay":
    r = common.itemsize(setup.ring_dtype)
    sizes += [slots * geo.hk * setup.ring_size * geo.kd * r, slots * geo.hv * setup.ring_size * geo.vd * r]
  return sizes


# ----------------------------------------------------------------------------------------------
# Data

def _make_rings(setup: harness.Setup, state, streams):
  """Replay buffers around ``state``: full random rings, L2-normalised k, u of unit variance,
  g ~ -U(0.01, 0.5)."""
  geo, N, R = setup.geo, setup.layers * setup.num_slots, setup.ring_size
  rdt = jnp.dtype(setup.ring_dtype)
  ring_k = common.l2_normalize(common.hash_normal(streams[0], (N, geo.hk, R, geo.kd))).astype(rdt)
  ring_u = common.hash_normal(streams[1], (N, geo.hv, R, geo.vd)).astype(rdt)
  ring_g = -common.hash_uniform(streams[2], (N, geo.hv, R), 0.01, 0.5)
  copy = None if setup.read_copy_dtype is None else state.astype(setup.read_copy_dtype)
  return ReplayBuffers(state=state, ring_k=ring_k, ring_u=ring_u, ring_g=ring_g, read_copy=copy)


def _make_bank(setup: harness.Setup, streams):
  """``bank`` random input sets: q, k (L2-normalised) [S, B, Hk, K], v [S, B, Hv, V], g (float32,
  ≤ 0) and beta (sigmoid) [S, B, Hv]; activations in the activation dtype. No parameters."""
  geo, S, B = setup.geo, setup.bank, setup.batch
  adt = jnp.dtype(setup.act_dtype)
  q = common.hash_normal(streams[0], (S, B, geo.hk, geo.kd)).astype(adt)
  k = common.l2_normalize(common.hash_normal(streams[1], (S, B, geo.hk, geo.kd))).astype(adt)
  v = common.hash_normal(streams[2], (S, B, geo.hv, geo.vd)).astype(adt)
  g = -common.hash_uniform(streams[3], (S, B, geo.hv), 0.01, 0.5)
  beta = jax.nn.sigmoid(common.hash_normal(streams[4], (S, B, geo.hv))).astype(adt)
  return (q, k, v, g, beta), None


# ----------------------------------------------------------------------------------------------
# Programs

def layer_op(arm: harness.Arm, cfg: common.LaunchConfig, scale: float):
  """``op(q, k, v, g, beta, buf, slots_or_plan) -> (o, buf)`` for one layer."""
  if arm.impl == "pallas_triton" and not cfg.is_default:
    from replayssm_jax.pallas import gdn_triton  # noqa: PLC0415
    if arm.family == "conv":
      kw = cfg.kwargs(harness.STEP_KNOBS)
      return lambda q, k, v, g, b, pool, slots: gdn_triton.decode(q, k, v, g, b, pool, slots,
                                                                  scale=scale, **kw)
    kw = cfg.kwargs()
    return lambda q, k, v, g, b, bufs, plan: gdn_triton.replay_decode(
        q, k, v, g, b, bufs, plan, scale=scale, route=arm.route, **kw)
  if arm.impl == "pallas_mosaic" and not cfg.is_default:   # rows (harness._arm_configs)
    from replayssm_jax.pallas import gdn_mosaic  # noqa: PLC0415
    if arm.family == "conv":
      return lambda q, k, v, g, b, pool, slots: gdn_mosaic.decode(q, k, v, g, b, pool, slots,
                                                                  scale=scale, **cfg.kwargs())
    return lambda q, k, v, g, b, bufs, plan: gdn_mosaic.replay_decode(
        q, k, v, g, b, bufs, plan, scale=scale, route=arm.route, **cfg.kwargs())
  if arm.family == "conv":
    return lambda q, k, v, g, b, pool, slots: rs.gdn.decode(q, k, v, g, b, pool, slots, scale=scale,
                                                            implementation=arm.impl)
  return lambda q, k, v, g, b, bufs, plan: rs.gdn.replay_decode(
      q, k, v, g, b, bufs, plan, scale=scale, route=arm.route, implementation=arm.impl)


def _layer(case: harness.Case):
  """The harness's ``op(inputs, params, buf, slots_or_plan)``: ``layer_op`` (GDN has no params)."""
  op = layer_op(case.arm, case.cfg, case.setup.geo.kd ** -0.5)
  return lambda inputs, params, buf, index: op(*inputs, buf, index)


# float64 oracle (numpy; independent of the library's jnp code) -----------------------------------

def oracle_step(S, q, k, v, g, beta, scale, group):
  """One exact GDN step from S [m, Hv, V, K]: the output o [m, Hv, V]."""
  qh = np.repeat(q, group, axis=1) * scale
  kh = np.repeat(k, group, axis=1)
  alpha = np.exp(g)[..., None, None]
  St = alpha * S
  u = beta[..., None] * (v - np.einsum("bhvk,bhk->bhv", St, kh))
  Sn = St + u[..., :, None] * kh[..., None, :]
  return np.einsum("bhvk,bhk->bhv", Sn, qh)


def oracle_rebuild(Sc, rk, ru, rg, base, count, group):
  """S = e^{Σg} S_c + Σ_j e^{Σ_{i>j} g_i} u_j k_jᵀ over each row's window (DESIGN §2)."""
  S = np.array(Sc)
  R = rg.shape[-1]
  for b in range(S.shape[0]):
    idx = (int(base[b]) + np.arange(int(count[b]))) % R
    if idx.size == 0:
      continue
    G = rg[b][:, idx]                                  # [Hv, n]
    total = G.sum(-1)
    suffix = total[:, None] - np.cumsum(G, axis=-1)    # Σ_{i>j} g_i
    kk = np.repeat(rk[b][:, idx], group, axis=0)       # [Hv, n, K]
    S[b] = (np.exp(total)[:, None, None] * Sc[b]
            + np.einsum("hj,hjv,hjk->hvk", np.exp(suffix), ru[b][:, idx], kk))
  return S


def oracle_output(setup: harness.Setup, carry, consts, host, rows: int):
  """float64 output of the first step for the first ``rows`` batch rows (layer 0)."""
  bank, _, _ = consts
  sl = host["slots"][:rows]
  f = harness.f64
  q, k, v, g, beta = (f(x[0][:rows]) for x in bank)
  geo = setup.geo
  if setup.family == "conv":
    S = f(carry[0][sl])
  else:
    bufs = carry[0]
    S = oracle_rebuild(f(bufs.state[sl]), f(bufs.ring_k[sl]), f(bufs.ring_u[sl]), f(bufs.ring_g[sl]),
                       host["base"][sl], host["count"][sl], geo.group)
  return oracle_step(S, q, k, v, g, beta, geo.kd ** -0.5, geo.group)


def _summary(meta: dict, ceil: str) -> str:
  return (f"jax {meta.get('jax_version')} / jaxlib {meta.get('jaxlib_version')}, commit "
          f"`{(meta.get('git_commit') or 'unknown')[:12]}`, source digest `{meta.get('source_digest')}`; "
          f"copy ceiling {ceil} GB/s.")


BENCH = harness.LayerBench(
    name="gdn_decode", title="GDN decode", description=__doc__.split("\n\n")[0],
    geometry=QWEN35_4B, smoke_geometry=SMOKE, arms=tuple(harness.ARMS), default_arms=DEFAULT_ARMS,
    default_buffer_lens=(8, 16, 32), plot_L=16,
    smoke_help="tiny CPU-sized run (Hk=2, Hv=4, K=V=16, B=2, L=4, float32 state unless "
               "--state-dtypes is given): checks the harness end to end",
    configs_help="Pallas launch configs, e.g. default,bv32w2,bv64w4s2,bv32w2fbv64fw4 (Triton arms) "
                 "or r2,r4 (batch rows per program of the Mosaic arms)",
    pallas_module="replayssm_jax.pallas.gdn_triton", mosaic_knobs=("rows",),
    bytes_model=bytes_model,
    bytes_model_doc={
        "unit": "bytes per batch row and layer-step, averaged over a full cycle",
        "conv": "inputs (q,k,v,beta act dtype; g f32) + output + state read + state write",
        "replay": "inputs + output + checkpoint read + checkpoint write / L + ring window read "
                  "((L-1)/2 entries) + one ring entry written; entry = k[Hk,K] + u[Hv,V] (ring dtype) "
                  "+ g[Hv] f32",
        "not_counted": "slot/cursor metadata; the fold pass re-reading the window on flush rows",
    },
    donated_sizes=donated_sizes, make_rings=_make_rings, make_bank=_make_bank, layer=_layer,
    oracle_output=oracle_output, summary=_summary, peer_arms=peer_sglang.ARMS)


def main(argv=None) -> dict:
  """``python -m bench.gdn_decode``: see the module doc and ``--help``."""
  return harness.main(BENCH, argv)


if __name__ == "__main__":
  main()
