"""The multi-token-prediction head (``models.mtp``): parity with transformers' own modules composed
as the head (fixtures ``qwen3_5_mtp`` and ``qwen3_next_mtp``, whose head's block has the MoE MLP;
tests/data/make_hf_fixtures.py), the loader's handling of head configs, and the cache logic of
``LM.mtp_draft`` (prefill, verify steps and chained drafts) against one no-cache pass."""
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax.models import generate, load_pretrained
from replayssm_jax.models.attention import AttentionConfig
from replayssm_jax.models.lm import LMConfig, make_model

DATA = pathlib.Path(__file__).resolve().parent / "data" / "hf"
K = 3   # drafts


@pytest.fixture(autouse=True)
def _highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="module", params=["qwen3_5_mtp", "qwen3_next_mtp"])
def fixture(request):
  model, config = load_pretrained(DATA / request.param, max_prompt_len=64)
  assert config.mtp_mlp == ("moe" if request.param == "qwen3_next_mtp" else "dense")
  return model, config, np.load(DATA / request.param / "reference.npz")


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _one_pass(model, hidden, next_tokens):
  """The head over one whole sequence per row from position 0, no earlier cache."""
  bsz, t = next_tokens.shape
  cache = model.init_cache(bsz, max_len=t, mtp_drafts=1)
  slots = jnp.arange(bsz, dtype=jnp.int32)
  logits, m, _ = model.mtp_forward(hidden, next_tokens, cache, slots, jnp.zeros((bsz,), jnp.int32),
                                   jnp.ones((bsz, t), bool), fresh=True)
  return logits, m


def test_head_matches_transformers_modules(fixture):
  """Teacher-forced over prompt + 32 greedy tokens: the model's final-normed hidden states and the
  head's logits at every position (relative L2 <= 1e-5)."""
  model, _, ref = fixture
  for p in range(2):
    seq = np.concatenate([ref[f"prompt_{p}"], ref[f"greedy_{p}"]]).astype(np.int32)
    tokens = jnp.asarray(seq[None, :-1])
    cache = model.init_cache(1, max_len=len(seq))
    _, _, hidden = model.prefill(tokens, cache, jnp.zeros((1,), jnp.int32),
                                 jnp.array([len(seq) - 1], jnp.int32), return_hidden=True)
    assert _rel(np.asarray(hidden[0]), ref[f"mtp_hidden_{p}"]) <= 1e-5
    logits, _ = _one_pass(model, hidden, jnp.asarray(seq[None, 1:]))
    assert _rel(np.asarray(logits[0]), ref[f"mtp_logits_{p}"]) <= 1e-5


def test_drafts_after_prefill_match_transformers(fixture):
  """Both prompts in one prefill (right-padded, slots 2 and 0): the head's three chained drafts
  after each prompt and its first token are transformers' (``mtp_chain_p``)."""
  model, _, ref = fixture
  prompts = [ref["prompt_0"], ref["prompt_1"]]
  width = max(len(p) for p in prompts)
  tokens = np.zeros((2, width), np.int32)
  nxt = np.zeros((2, width), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, :len(prompt)] = prompt
    nxt[b, :len(prompt)] = np.append(prompt[1:], ref[f"greedy_{b}"][0])
  cache = model.init_cache(3, max_len=64, max_draft=K, mtp_drafts=K)
  slots, lengths = jnp.array([2, 0], jnp.int32), jnp.array([len(p) for p in prompts], jnp.int32)
  _, cache, hidden = model.prefill(jnp.asarray(tokens), cache, slots, lengths, return_hidden=True)
  cache = model.mtp_draft(cache, hidden, jnp.asarray(nxt), slots, jnp.zeros((2,), jnp.int32), lengths,
                          fresh=True)
  drafts = np.asarray(cache.mtp.drafts)
  assert drafts[2].tolist() == ref["mtp_chain_0"].tolist()
  assert drafts[0].tolist() == ref["mtp_chain_1"].tolist()


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "conventional"])
def test_generate_with_mtp_drafts_gives_transformers_greedy_tokens(fixture, replay):
  """``generate(speculative=3, drafter="mtp")``: both prompts in one batch, transformers' 32 greedy
  tokens, ReplaySSM and conventional verify."""
  model, _, ref = fixture
  prompts = np.zeros((2, 16), np.int32)
  for b in range(2):
    prompts[b, :len(ref[f"prompt_{b}"])] = ref[f"prompt_{b}"]
  lengths = np.array([len(ref["prompt_0"]), len(ref["prompt_1"])], np.int32)
  tokens, num = generate(model, prompts, lengths, max_new_tokens=32, speculative=K, drafter="mtp",
                         replay=replay)
  assert np.asarray(num).tolist() == [32, 32]
  for b in range(2):
    assert np.asarray(tokens[b]).tolist() == ref[f"greedy_{b}"].tolist(), b


def test_generate_with_mtp_drafts_accepts_them():
  """The looping model whose head guesses its successor map (bench.engine_spec.looping_model):
  greedy tokens of plain decoding, most drafts accepted, fewer model steps; a stop token inside an
  accepted run ends the row there. Two drafts per step: the map's period is 4, so with three a
  head that never drafted again would still be right."""
  from bench.engine_spec import looping_model
  model = looping_model(_tiny_mtp_model(), mixer_scale=0.02)
  prompts = np.random.default_rng(4).integers(1, 256, (3, 8)).astype(np.int32)
  lengths = np.array([8, 5, 3], np.int32)
  plain, _ = generate(model, prompts, lengths, max_new_tokens=20)
  tokens, num, stats = generate(model, prompts, lengths, max_new_tokens=20, speculative=2, drafter="mtp",
                                return_stats=True)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(plain))
  assert int(stats.accepted.sum()) >= 0.8 * 2 * int(stats.steps.sum()), stats
  stop = int(plain[0, 5])
  cut, n = generate(model, prompts, lengths, max_new_tokens=20, speculative=2, drafter="mtp",
                    stop_tokens=(stop,))
  first = int(np.argmax(np.asarray(plain[0]) == stop))
  assert int(n[0]) == first + 1 and np.asarray(cut[0, :first + 1]).tolist() == np.asarray(plain[0, :first + 1]).tolist()


def _tiny_mtp_model(seed=0):
  attention = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8, qk_norm=True,
                              norm_offset=1.0, output_gate=True)
  config = LMConfig.tiny(num_layers=4, layer_types=("gdn", "attention", "gdn", "attention"),
                         attention=attention, norm_offset=1.0, mtp_layers=1)
  return make_model(config, seed=seed)


def _chain_by_one_pass(model, hidden, seq, n):
  """Drafts after a row covers positions < n and emitted seq[n]: one no-cache pass per draft."""
  states, ids, drafts = hidden[:, :n], jnp.asarray(seq[None, 1:n + 1]), []
  for _ in range(K):
    logits, m = _one_pass(model, states, ids)
    drafts.append(int(jnp.argmax(logits[0, -1])))
    states = jnp.concatenate([states, m[:, -1:]], axis=1)
    ids = jnp.concatenate([ids, jnp.array([[drafts[-1]]], jnp.int32)], axis=1)
  return drafts


def test_drafts_after_verify_steps_equal_one_pass():
  """Prefill, then verify steps that accept 1..T tokens (rows of their own lengths, a padding row):
  after every commit the stored drafts are those of one no-cache pass of the head over the row's
  true history, so the KV entries of rejected lanes and of earlier chains are never read."""
  model = _tiny_mtp_model()
  rng = np.random.default_rng(3)
  seqs = [rng.integers(1, 256, size=40).astype(np.int32) for _ in range(2)]
  n0 = [7, 4]
  cache = model.init_cache(4, max_len=48, max_draft=K, mtp_drafts=K)
  slots = jnp.array([1, 3, -1], jnp.int32)
  tokens = np.zeros((3, 8), np.int32)
  nxt = np.zeros((3, 8), np.int32)
  for b in range(2):
    tokens[b, :n0[b]] = seqs[b][:n0[b]]
    nxt[b, :n0[b]] = seqs[b][1:n0[b] + 1]
  lengths = jnp.array(n0 + [0], jnp.int32)
  _, cache, hidden = model.prefill(jnp.asarray(tokens), cache, slots, lengths, return_hidden=True)
  cache = model.mtp_draft(cache, hidden, jnp.asarray(nxt), slots, jnp.zeros((3,), jnp.int32), lengths,
                          fresh=True)
  covered = list(n0)
  for step, accepts in enumerate([(1, 3), (4, 2), (2, 1), (3, 4)]):
    for b in range(2):   # the stored drafts vs one pass over the row's history
      full = np.asarray(seqs[b])
      ref_hidden = _hidden(model, full, covered[b])
      assert np.asarray(cache.mtp.drafts)[[1, 3][b]].tolist() == _chain_by_one_pass(
          model, ref_hidden, full, covered[b]), (step, b)
    # A verify step over the true tokens (as if the drafts were these), accepting ``accepts``.
    t = 1 + K
    vt = np.zeros((3, t), np.int32)
    run = np.zeros((3, t), np.int32)
    for b in range(2):
      vt[b] = seqs[b][covered[b]:covered[b] + t]
      run[b] = seqs[b][covered[b] + 1:covered[b] + 1 + t]
    start = model._start(cache, slots)
    _, vstep = model.verify(jnp.asarray(vt), cache, slots, return_hidden=True)
    accepted = jnp.array(list(accepts) + [1], jnp.int32)
    cache = model.commit(vstep, accepted)
    cache = model.mtp_draft(cache, vstep.hidden, jnp.asarray(run), slots, start, accepted)
    covered = [c + a for c, a in zip(covered, accepts)]


def _hidden(model, seq, n):
  """Final-normed hidden states of seq[:n] from a fresh prefill."""
  cache = model.init_cache(1, max_len=64)
  _, _, hidden = model.prefill(jnp.asarray(seq[None, :n]), cache, jnp.zeros((1,), jnp.int32),
                               jnp.array([n], jnp.int32), return_hidden=True)
  return hidden


def test_copy_slots_copies_the_head_cache():
  model = _tiny_mtp_model()
  cache = model.init_cache(3, max_len=16, mtp_drafts=K)
  cache = cache.replace(mtp=cache.mtp.replace(drafts=cache.mtp.drafts.at[0].set(jnp.array([5, 6, 7])),
                                              kv=cache.mtp.kv.replace(k=cache.mtp.kv.k.at[0].set(1.0))))
  out = model.copy_slots(cache, jnp.array([0], jnp.int32), jnp.array([2], jnp.int32))
  assert np.asarray(out.mtp.drafts[2]).tolist() == [5, 6, 7]
  assert float(out.mtp.kv.k[2].min()) == 1.0 and float(out.mtp.kv.k[1].max()) == 0.0


def test_bad_mtp_arguments():
  with pytest.raises(ValueError, match="mtp_drafts=2 but the model has no MTP head"):
    make_model(LMConfig.tiny()).init_cache(2, mtp_drafts=2)
  with pytest.raises(ValueError, match="init_cache\\(mtp_drafts=k\\)"):
    model = _tiny_mtp_model()
    cache = model.init_cache(2, max_len=8)
    model.mtp_forward(jnp.zeros((1, 1, 64)), jnp.zeros((1, 1), jnp.int32), cache, jnp.zeros((1,), jnp.int32),
                      jnp.zeros((1,), jnp.int32), jnp.ones((1, 1), bool))
  with pytest.raises(ValueError, match="expected an AttentionConfig"):
    LMConfig.tiny(mtp_layers=1)
  with pytest.raises(NotImplementedError, match="more than one layer"):
    dataclasses.replace(_tiny_mtp_model().config, mtp_layers=2)
  prompts, lengths = np.ones((1, 4), np.int32), np.array([4], np.int32)
  with pytest.raises(ValueError, match="drafter='mtp' with speculative=0"):
    generate(_tiny_mtp_model(), prompts, lengths, max_new_tokens=2, drafter="mtp")
  with pytest.raises(ValueError, match="mtp_layers=0"):
    generate(make_model(LMConfig.tiny()), prompts, lengths, max_new_tokens=2, speculative=2, drafter="mtp")
  with pytest.raises(ValueError, match="drafter='beam'"):
    generate(make_model(LMConfig.tiny()), prompts, lengths, max_new_tokens=2, drafter="beam")


def _copy(tmp_path, edit=None, drop_mtp_file=False):
  import json
  import shutil
  path = tmp_path / "qwen3_5_mtp"
  shutil.copytree(DATA / "qwen3_5_mtp", path)
  if drop_mtp_file:
    (path / "mtp.safetensors").unlink()
  if edit is not None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
  return path


def test_declared_head_without_tensors_loads_without_it(tmp_path, caplog):
  """transformers' save_pretrained keeps mtp_num_hidden_layers and drops mtp.*: the model loads,
  without a head, and says so."""
  import logging
  with caplog.at_level(logging.INFO, logger="replayssm_jax.models.hf"):
    model, config = load_pretrained(_copy(tmp_path, drop_mtp_file=True), max_prompt_len=16)
  assert config.mtp_layers == 0 and model.mtp is None
  assert "no mtp.* tensor is present" in caplog.text


def test_head_tensors_without_a_declared_head_load_without_it(tmp_path):
  """A config without mtp_num_hidden_layers: the mtp.* tensors are ignored (as before heads were
  loaded), the model has no head."""
  _, config = load_pretrained(_copy(tmp_path, lambda c: c.pop("mtp_num_hidden_layers")), max_prompt_len=16)
  assert config.mtp_layers == 0


@pytest.mark.parametrize("edit, error, match", [
    (lambda c: c.update(mtp_num_hidden_layers=2), NotImplementedError, "mtp_num_hidden_layers=2"),
    (lambda c: c.update(mtp_use_dedicated_embeddings=True), NotImplementedError,
     "mtp_use_dedicated_embeddings=true"),
    (lambda c: c.update(mtp_num_hidden_layers="one"), ValueError, "mtp_num_hidden_layers='one'"),
], ids=["two-layers", "dedicated-embeddings", "not-an-int"])
def test_head_configs_the_library_cannot_load(tmp_path, edit, error, match):
  with pytest.raises(error, match=match):
    load_pretrained(_copy(tmp_path, edit))


def test_missing_head_tensor_is_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  path = _copy(tmp_path)
  tensors = load_file(path / "mtp.safetensors")
  del tensors["mtp.fc.weight"]
  save_file(tensors, path / "mtp.safetensors")
  with pytest.raises(ValueError, match=r"missing tensor 'mtp.fc.weight'; expected shape \[64, 128\]"):
    load_pretrained(path)
