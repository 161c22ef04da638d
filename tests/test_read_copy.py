"""The checkpoint's 16-bit read copy (``ReplayBuffers.create(read_copy_dtype=...)``), GDN and Mamba2.

Decode steps read the copy, every write of the checkpoint writes it: after every op the copy equals
``state.astype(copy dtype)``. Decode is checked against the float64 oracles on both sides of every
flush, for the XLA path and the Pallas-Triton kernels (interpreted on CPU); Mamba2's checkpoint must
equal the run without a copy bit for bit (its update never reads the state). Speculative verify
does not read the copy: its outputs and buffers must equal the copy-free run's on every
implementation and route (bit for bit on the CPU, to float32 rounding for compiled kernels).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import replayssm_jax as rs
from replayssm_jax import models
from replayssm_jax.models.attention import AttentionConfig
from tests import test_gdn_verify, test_mamba2_verify
from tests.helpers import gdn_step_f64, make_gdn_step, max_err, tolerance
from tests.test_mamba2_ops import make_params, make_step, mamba2_step_f64

f32, bf16 = jnp.float32, jnp.bfloat16
IMPLS = ("xla", "pallas_triton")
NUM_SLOTS, L = 6, 4
SLOTS = np.array([0, 3, -1, 5, 2], np.int32)        # a padding row; slots 1 and 4 unused


def _gdn_bufs(cursor, read_copy_dtype):
  return rs.gdn.ReplayBuffers.create(NUM_SLOTS, cursor, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                     head_v_dim=8, ring_dtype=bf16, read_copy_dtype=read_copy_dtype)


def _mamba2_bufs(cursor, read_copy_dtype):
  return rs.mamba2.ReplayBuffers.create(NUM_SLOTS, cursor, num_heads=4, head_dim=8, num_groups=2,
                                        state_dim=16, ring_dtype=bf16, read_copy_dtype=read_copy_dtype)


def _assert_copy_in_step(bufs, what):
  np.testing.assert_array_equal(np.asarray(bufs.read_copy.astype(f32)),
                                np.asarray(bufs.state.astype(bf16).astype(f32)), err_msg=what)


def _run(family, implementation, read_copy_dtype, *, steps=2 * L + 1, flush_all_at=(), seed=0):
  """Decodes ``steps`` tokens from a random prefilled state; returns per-step outputs, the final
  buffers, the float64 oracle's outputs and states, and whether the copy stayed in step."""
  rng = np.random.default_rng(seed)
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=L)
  mk, ops = (_gdn_bufs, rs.gdn) if family == "gdn" else (_mamba2_bufs, rs.mamba2)
  bufs = mk(cursor, read_copy_dtype)
  S0 = 0.5 * rng.normal(size=bufs.state.shape).astype(np.float32)
  bufs, cursor = ops.write_state(bufs, cursor, jnp.arange(NUM_SLOTS, dtype=jnp.int32), jnp.asarray(S0))
  exact = {s: S0[s].astype(np.float64)[None] for s in SLOTS if s >= 0}
  live = SLOTS >= 0
  params = make_params(rng, 4) if family == "mamba2" else None
  outs, oracle = [], []
  for t in range(steps):
    plan = cursor.plan(jnp.asarray(SLOTS), flush_all=t in flush_all_at)
    if family == "gdn":
      step = make_gdn_step(rng, len(SLOTS), 2, 4, 16, 8)
      o, bufs = ops.replay_decode(*step.as_jax(bf16), bufs, plan, implementation=implementation)
      seen = step.rounded(bf16)
      ref = {}
      for i, s in enumerate(SLOTS):
        if s >= 0:
          row = type(seen)(*(np.asarray(getattr(seen, f))[i:i + 1] for f in ("q", "k", "v", "g", "beta")))
          ref[s], exact[s] = gdn_step_f64(exact[s], row)
    else:
      step = make_step(rng, len(SLOTS), 4, 2, 8, 16)
      o, bufs = ops.replay_decode(**step.as_jax(bf16), A=jnp.asarray(params.A), bufs=bufs, plan=plan,
                                  D=jnp.asarray(params.D), dt_bias=jnp.asarray(params.dt_bias),
                                  implementation=implementation)
      seen = step.rounded(bf16)
      ref = {}
      for i, s in enumerate(SLOTS):
        if s >= 0:
          ref[s], exact[s] = mamba2_step_f64(exact[s], seen.map(lambda a, i=i: a[i:i + 1]), params)
    cursor = cursor.commit(plan)
    if read_copy_dtype is not None:
      _assert_copy_in_step(bufs, f"{family} {implementation}, step {t}")
    outs.append(np.asarray(o.astype(f32)))
    oracle.append({s: r[0] for s, r in ref.items()})
    assert np.all(outs[-1][~live] == 0)
  materialized = np.asarray(ops.materialize(bufs, cursor, jnp.asarray(SLOTS[live])))
  return outs, bufs, oracle, {s: exact[s][0] for s in exact}, materialized


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("implementation", IMPLS)
def test_read_copy_against_float64(family, implementation):
  outs, _, oracle, exact, materialized = _run(family, implementation, bf16)
  plain, _, _, _, plain_materialized = _run(family, implementation, None)
  live = [s for s in SLOTS if s >= 0]
  scale = max(np.max(np.abs(r)) for step in oracle for r in step.values())
  for t, (o, ref) in enumerate(zip(outs, oracle)):
    for i, s in enumerate(SLOTS):
      if s >= 0:
        err = np.max(np.abs(o[i] - ref[s])) / scale
        assert err < 2e-2, f"{family} {implementation} step {t} slot {s}: {err:.2e}"
  # The copy is what the step reads: the outputs differ from the exact checkpoint's, by about one
  # bf16 rounding.
  diff = max(np.max(np.abs(a - b)) for a, b in zip(outs, plain)) / scale
  assert 0 < diff < 2e-2, diff
  state_err = max(np.max(np.abs(materialized[j] - exact[s])) for j, s in enumerate(live))
  assert state_err < 2e-2 * max(np.max(np.abs(exact[s])) for s in live), state_err
  if family == "mamba2":   # the update never reads the state: the checkpoint is the exact run's
    np.testing.assert_array_equal(materialized, plain_materialized)


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_read_copy_kernel_matches_xla(family):
  """Pallas-Triton against XLA with a copy, through flushes and a plan where every row flushes
  (the small-batch policy's, which the kernel path steps and folds separately with a copy)."""
  runs = {impl: _run(family, impl, bf16, flush_all_at=(2,)) for impl in IMPLS}
  (xo, xb, *_), (to, tb, *_) = runs["xla"], runs["pallas_triton"]
  scale = max(np.max(np.abs(o)) for o in xo)
  assert max(np.max(np.abs(a - b)) for a, b in zip(xo, to)) / scale < 1e-2
  # The bf16 ring rounds the corrected values u of both paths: states agree to the ring's precision.
  np.testing.assert_allclose(np.asarray(tb.state), np.asarray(xb.state),
                             atol=1e-2 * float(np.max(np.abs(np.asarray(xb.state)))))


def _verify_run(family, implementation, read_copy_dtype, *, steps=14, num_tokens=3, geometry=None):
  """The verify harness of tests/test_{gdn,mamba2}_verify.py (random accepts, short rows with NaN
  lanes, a padding row, forced flushes), with a read copy if ``read_copy_dtype``, the copy checked
  after every step; returns (harness, outputs per step)."""
  module = test_gdn_verify if family == "gdn" else test_mamba2_verify
  h = module.VerifyHarness(max_tokens=num_tokens, buffer_len=L, seed=3, conventional=False,
                           read_copy_dtype=read_copy_dtype, implementation=implementation,
                           geometry=geometry)
  rng = np.random.default_rng(11)
  h.prefill(range(6))
  outs = []
  for t in range(steps):
    lengths = np.where(rng.random(4) < 0.3, rng.integers(1, num_tokens + 1, size=4), num_tokens)
    outs.append(h.step(module._staggered_rows(rng, 6, 4, t), num_tokens, lengths=lengths,
                       force=rng.random(4) < 0.15))
    if read_copy_dtype is not None:
      _assert_copy_in_step(h.bufs, f"{family} {implementation} verify step {t}")
  return h, outs


def force_verify_route(monkeypatch, family, route):
  """Makes the Pallas-Triton verify of ``family`` take ``route`` (None: the device's)."""
  from replayssm_jax import config as config_lib  # noqa: PLC0415
  if route is None:
    return
  name = "verify_config" if family == "gdn" else "mamba2_verify_config"
  real = getattr(config_lib, name)
  monkeypatch.setattr(config_lib, name, lambda **kw: real(**{**kw, "route": route}))


VERIFY_CASES = [("xla", None), ("pallas_triton", "output_only"), ("pallas_triton", "reconstruct"),
                ("pallas_mosaic", None)]


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("implementation,route", VERIFY_CASES, ids=lambda x: str(x))
def test_read_copy_verify(family, implementation, route, monkeypatch):
  force_verify_route(monkeypatch, family, route)
  check_read_copy_verify(family, implementation,
                         steps=8 if implementation == "pallas_mosaic" else 14)


def check_read_copy_verify(family, implementation, geometry=None, steps=14):
  """replay_verify over buffers with a read copy does not read it: every output, the checkpoint
  and the rings equal the same run's without a copy, through natural and forced flushes, and the
  copy equals the checkpoint's rounding after every verify. Bit for bit on the CPU (XLA and the
  interpreted kernels); a compiled kernel that also stores the copy may contract its float32
  arithmetic differently (seen on an H100: 2e-5 relative at step 0), so on a GPU to float32
  rounding, where reading the copy would differ by its bf16 rounding (~4e-3 relative).
  ``geometry``: the harness's (None: its small one)."""
  (h, outs), (plain, plain_outs) = (_verify_run(family, implementation, dtype, steps=steps,
                                                geometry=geometry) for dtype in (bf16, None))
  assert h.natural >= 1 and h.forced >= 1, (implementation, h.natural, h.forced)
  exact = jax.default_backend() == "cpu"

  def same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    if exact:
      np.testing.assert_array_equal(a, b, err_msg=what)
    else:
      assert max_err(a, b) <= tolerance("float32", "float32") * max(1.0, np.max(np.abs(b))), what

  for t, (a, b) in enumerate(zip(outs, plain_outs)):
    same(a, b, f"{family} {implementation} output, step {t}")
  for field in ("state",) + tuple(h.rings()):
    same(getattr(h.bufs, field), getattr(plain.bufs, field), f"{family} {implementation} {field}")


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_write_state_and_copy_slots_keep_the_copy(family):
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=L)
  mk, ops = (_gdn_bufs, rs.gdn) if family == "gdn" else (_mamba2_bufs, rs.mamba2)
  bufs = mk(cursor, bf16)
  S = jax.random.normal(jax.random.PRNGKey(0), (2,) + bufs.state.shape[1:])
  bufs, cursor = ops.write_state(bufs, cursor, jnp.array([1, 4], jnp.int32), S)
  _assert_copy_in_step(bufs, "write_state")
  assert bool(jnp.any(bufs.read_copy[1] != 0))
  bufs, cursor = ops.copy_slots(bufs, cursor, jnp.array([4], jnp.int32), jnp.array([0], jnp.int32))
  _assert_copy_in_step(bufs, "copy_slots")
  np.testing.assert_array_equal(np.asarray(bufs.read_copy[0]), np.asarray(bufs.read_copy[4]))


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_read_copy_errors(family):
  cursor = rs.ReplayCursor.create(NUM_SLOTS, buffer_len=L, max_draft=1)
  mk, ops = (_gdn_bufs, rs.gdn) if family == "gdn" else (_mamba2_bufs, rs.mamba2)
  create = rs.gdn.ReplayBuffers.create if family == "gdn" else rs.mamba2.ReplayBuffers.create
  dims = (dict(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8) if family == "gdn" else
          dict(num_heads=4, head_dim=8, num_groups=2, state_dim=16))
  with pytest.raises(ValueError, match="read_copy_dtype=float32"):
    create(NUM_SLOTS, cursor, **dims, read_copy_dtype=f32)
  with pytest.raises(ValueError, match="state_dtype=bfloat16"):
    create(NUM_SLOTS, cursor, **dims, state_dtype=bf16, read_copy_dtype=bf16)
  bufs = mk(cursor, bf16)
  slots = jnp.array([0, 1], jnp.int32)
  if family == "gdn":
    step = make_gdn_step(np.random.default_rng(0), 2, 2, 4, 16, 8).as_jax(bf16)
    decode = lambda plan, **kw: rs.gdn.replay_decode(*step, bufs, plan, **kw)
  else:
    rng = np.random.default_rng(0)
    st, p = make_step(rng, 2, 4, 2, 8, 16).as_jax(bf16), make_params(rng, 4)
    kw0 = dict(A=jnp.asarray(p.A), D=jnp.asarray(p.D), dt_bias=jnp.asarray(p.dt_bias))
    decode = lambda plan, **kw: rs.mamba2.replay_decode(**st, **kw0, bufs=bufs, plan=plan, **kw)
  for impl in (None, "xla", "pallas_triton"):
    with pytest.raises(NotImplementedError, match="reconstruct"):
      decode(cursor.plan(slots), route="reconstruct", implementation=impl)
  with pytest.raises(NotImplementedError, match="read copy"):
    decode(cursor.plan(slots), implementation="pallas_mosaic")


@pytest.mark.parametrize("layer_types", [("gdn", "mamba2", "attention")])
def test_model_decode_with_a_read_copy(layer_types):
  """An LM whose cache has read copies: replay decode runs (XLA on CPU) close to the exact cache;
  conventional decode refuses it."""
  config = models.LMConfig(vocab_size=64, hidden_size=32, num_layers=3, layer_types=layer_types,
                           num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                           mamba2_num_heads=4, mamba2_head_dim=8, mamba2_num_groups=2,
                           mamba2_state_dim=8, intermediate_size=64, max_prompt_len=8,
                           attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=8))
  model = models.LM(config, rngs=nnx.Rngs(0))
  tokens = jnp.array([[1, 2, 3, 4], [5, 6, 0, 0]], jnp.int32)
  lengths = jnp.array([4, 2], jnp.int32)
  slots = jnp.array([0, 1], jnp.int32)
  logits = {}
  for copy in (None, bf16):
    cache = model.init_cache(2, buffer_len=2, max_len=16, read_copy_dtype=copy)
    _, cache = model.prefill(tokens, cache, slots, lengths)
    out = []
    tok = jnp.array([7, 8], jnp.int32)
    for _ in range(5):          # through two flushes at L = 2
      lg, cache = model.decode(tok, cache, slots)
      out.append(np.asarray(lg, np.float32))
      tok = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    logits[copy] = np.stack(out)
    if copy is not None:
      with pytest.raises(ValueError, match="read_copy_dtype"):
        model.decode(tok, cache, slots, replay=False)
  a, b = logits[None], logits[bf16]
  assert 0 < np.max(np.abs(a - b)) < 5e-2 * np.max(np.abs(a))


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("num_tokens,implementation", [(1, "pallas_triton"), (4, "pallas_triton"),
                                                       (4, "pallas_mosaic")],
                         ids=["decode", "verify", "verify-mosaic"])
def test_read_copy_lowers_for_h200(family, num_tokens, implementation):
  """Decode and verify over buffers with a read copy, built for an abstract H200 at served head
  sizes (Qwen3.5-4B GDN; Nemotron-3-Super Mamba2), the checkpoint, the three rings and the copy in
  place. Decode: the output-only step and the fold pass (the H200's reconstruct defaults give
  way). Verify: the H200's one-launch reconstruct kernel, Triton or Mosaic, storing the copy with
  the checkpoint."""
  from tests.helpers import lower_for_h200  # noqa: PLC0415
  batch, num_slots = 8, 16
  slots = jnp.asarray(np.r_[np.arange(batch - 1), -1], jnp.int32)
  cursor = rs.ReplayCursor.create(num_slots, buffer_len=16, max_draft=num_tokens - 1)
  rows = (batch, num_tokens) if num_tokens > 1 else (batch,)
  if family == "gdn":
    hk, hv, kd, vd = 16, 32, 128, 128
    bufs = rs.gdn.ReplayBuffers.create(num_slots, cursor, num_k_heads=hk, num_v_heads=hv, head_k_dim=kd,
                                       head_v_dim=vd, ring_dtype=bf16, read_copy_dtype=bf16)
    x = (jnp.zeros(rows + (hk, kd), bf16), jnp.zeros(rows + (hk, kd), bf16),
         jnp.zeros(rows + (hv, vd), bf16), jnp.zeros(rows + (hv,), f32), jnp.zeros(rows + (hv,), bf16))
    op = rs.gdn.replay_decode if num_tokens == 1 else rs.gdn.replay_verify
    fn = lambda b, p, *x: op(*x, b, p, implementation=implementation)
  else:
    h, g, p, n = 128, 8, 64, 128
    bufs = rs.mamba2.ReplayBuffers.create(num_slots, cursor, num_heads=h, head_dim=p, num_groups=g,
                                          state_dim=n, ring_dtype=bf16, read_copy_dtype=bf16)
    x = (jnp.zeros(rows + (h, p), bf16), jnp.zeros(rows + (h,), bf16), jnp.zeros((h,), f32),
         jnp.zeros(rows + (g, n), bf16), jnp.zeros(rows + (g, n), bf16))
    op = rs.mamba2.replay_decode if num_tokens == 1 else rs.mamba2.replay_verify
    kw = dict(D=jnp.zeros((h,), f32), dt_bias=jnp.zeros((h,), f32), implementation=implementation)
    fn = lambda b, p_, *x: op(*x, b, p_, **kw)
  text = lower_for_h200(fn, (0,), bufs, cursor.plan(slots, num_tokens=num_tokens), *x,
                        strict=implementation == "pallas_mosaic")
  if implementation == "pallas_mosaic":
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" not in text
  else:   # decode: the step and the fold pass; verify: the reconstruct kernel alone
    assert text.count("__gpu$xla.gpu.triton") == (2 if num_tokens == 1 else 1)
  assert text.count("tf.aliasing_output") == 5             # checkpoint, three rings, read copy
