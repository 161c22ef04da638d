"""Jitted generation: prefill plus a ``lax.while_loop`` of decode steps in ONE ``jax.jit``.

``nnx.split`` runs outside the jit and ``nnx.merge`` inside; the cache is created outside and
donated (a ``ShardedLM`` runs the same body per device, ``MeshLayout.on_mesh``). Prompts are
padded to ``config.max_prompt_len`` and every cursor value is traced data, so one compilation
serves any prompts, prompt lengths and cursor phases for a given batch size and static options
(max_new_tokens, replay, temperature, stop_tokens, buffer_len, implementation, speculative,
ngram).

Speculative mode (``speculative=k``): each loop step drafts k tokens per row with an n-gram
lookup over the row's prompt + generated tokens, runs the last emitted token and the drafts
through ``LM.verify`` (T = k + 1), emits the accepted drafts plus one token of the model
(``sampling.speculative_sample``: greedy, or rejection sampling at temperature > 0) and commits
exactly the emitted count. ``replay=False`` verifies through the conventional state stacks
(``LM.verify(replay=False)``), the baseline.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import config as config_lib
from replayssm_jax.models import sampling
from replayssm_jax.models.lm import LM
from replayssm_jax.models.sharding import MeshLayout, ShardedLM

PAD_TOKEN = 0
MAX_DRAFTS = 7   # replay_verify takes T <= 8 tokens per row


def _sample(logits, key, temperature):
  """logits [B, vocab] → int32[B]: argmax at temperature 0, else categorical(logits / T)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


class GenerateStats(NamedTuple):
  """Per-row counters of one ``generate`` call (``return_stats=True``).

  Attributes:
    steps: int32[B] model steps after prefill in which the row was live (decode or verify).
    accepted: int32[B] tokens emitted beyond one per step, i.e. accepted drafts
      (``num_generated = 1 + steps + accepted``; always 0 without ``speculative``).
  """
  steps: jax.Array
  accepted: jax.Array


def ngram_drafts(history, length, *, num_drafts, ngram):
  """n-gram (prompt lookup) drafter: k = ``num_drafts`` guesses of each row's next tokens.

  Finds the most recent earlier occurrence of the row's last ``ngram`` tokens and proposes the
  k tokens that followed it. Where fewer than k known tokens follow (the occurrence ends s < k
  tokens before the end), the drafts continue the same period: draft i = history[p + n + i mod s]
  (p the occurrence start), which is what a repeating pattern would do next. Without an earlier
  occurrence every draft is the last token.

  Args:
    history: int32[B, H]; row b's tokens (prompt, then generated) at positions < length[b].
    length: int32[B] in [1, H].
    num_drafts: k >= 1.
    ngram: n >= 1.

  Returns:
    int32[B, k].
  """
  n, h = ngram, history.shape[1]
  last = jnp.take_along_axis(history, jnp.maximum(length[:, None] - n + jnp.arange(n), 0), axis=1)
  starts = jnp.arange(h - n + 1)
  grams = jnp.stack([history[:, j:j + h - n + 1] for j in range(n)], axis=-1)    # [B, H-n+1, n]
  # An earlier occurrence ends before the last token: p + n <= length - 1.
  found = jnp.all(grams == last[:, None, :], axis=-1) & (starts[None, :] + n < length[:, None])
  p = jnp.max(jnp.where(found, starts[None, :], -1), axis=1)                       # -1: no match
  period = jnp.maximum(length - p - n, 1)
  idx = p[:, None] + n + jnp.arange(num_drafts)[None, :] % period[:, None]
  drafts = jnp.take_along_axis(history, jnp.clip(idx, 0, h - 1), axis=1)
  last_tok = jnp.take_along_axis(history, (length - 1)[:, None], axis=1)
  return jnp.where((p >= 0)[:, None], drafts, last_tok)


def _generate_impl(graphdef, treedef, leaves, cache, prompts, lengths, key, *, max_new_tokens,
                   replay, temperature, stop_tokens, implementation, speculative, ngram, drafter):
  """Traced body. leaves: the parameters flattened (``treedef``); prompts int32[B, P], lengths
  int32[B] → (tokens [B, M], num_generated [B], GenerateStats, cache)."""
  model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
  bsz = prompts.shape[0]
  slots = jnp.arange(bsz, dtype=jnp.int32)
  stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)  # -1 never matches a token

  def is_stop(tok):
    return jnp.any(tok[..., None] == stops, axis=-1)

  mtp = drafter == "mtp"
  logits, cache, *hidden = model.prefill(prompts, cache, slots, lengths, return_hidden=mtp)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, vocab]
  if speculative:
    # Per-row keys (sampling.speculative_sample): row b's token at position j draws from
    # fold_in(fold_in(key, b), j), the first token included.
    temps = jnp.full((bsz,), temperature, jnp.float32)
    keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(slots)
    tok = sampling.sample(last, temps, keys, jnp.zeros((bsz,), jnp.int32))
  else:
    tok = _sample(last, jax.random.fold_in(key, 0), temperature)
  out = jnp.full((bsz, max_new_tokens), PAD_TOKEN, jnp.int32).at[:, 0].set(tok)
  done = is_stop(tok)                       # a stop token is emitted and counted, then the row stops
  num = jnp.ones((bsz,), jnp.int32)
  if mtp:   # the head drafts after the prompt: position p with token p + 1, the first token last
    cache = model.mtp_draft_after_prefill(cache, hidden[0], prompts, tok, slots, lengths,
                                          implementation=implementation)
  if speculative:
    return _speculative_loop(model, cache, prompts, lengths, tok, out, done, num, is_stop, temps, keys,
                             max_new_tokens=max_new_tokens, implementation=implementation,
                             num_drafts=speculative, ngram=ngram, replay=replay, mtp=mtp)

  def cond(carry):
    i, _, _, done, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    i, tok, out, done, num, cache = carry
    # Finished rows become padding rows (slot -1): their caches stay as they were.
    step_slots = jnp.where(done, -1, slots)
    logits, cache = model.decode(tok, cache, step_slots, replay=replay, implementation=implementation)
    new = _sample(logits, jax.random.fold_in(key, i), temperature)
    new = jnp.where(done, PAD_TOKEN, new)
    out = out.at[:, i].set(new)
    num = num + (~done).astype(jnp.int32)
    done = done | is_stop(new)
    return i + 1, new, out, done, num, cache

  _, _, out, _, num, cache = jax.lax.while_loop(cond, body, (jnp.int32(1), tok, out, done, num, cache))
  return out, num, GenerateStats(steps=num - 1, accepted=jnp.zeros_like(num)), cache


def _speculative_loop(model, cache, prompts, lengths, tok, out, done, num, is_stop, temps, keys, *,
                      max_new_tokens, implementation, num_drafts, ngram, replay, mtp):
  """Draft-and-verify loop after prefill (the first token is already in ``out``); ``mtp``: the
  drafts are the MTP head's (``LMCache.mtp``), which drafts again after each commit."""
  bsz, m, t = prompts.shape[0], max_new_tokens, num_drafts + 1
  rows, lane = jnp.arange(bsz)[:, None], jnp.arange(t)[None, :]
  slots = jnp.arange(bsz, dtype=jnp.int32)
  # Prompt + generated tokens, contiguous per row: generated token j sits at lengths[b] + j.
  history = jnp.zeros((bsz, prompts.shape[1] + m), jnp.int32).at[:, :prompts.shape[1]].set(prompts)
  history = history.at[slots, lengths].set(tok)
  done = done | (num >= m)
  zeros = jnp.zeros((bsz,), jnp.int32)

  def body(carry):
    tok, out, history, done, num, steps, accepted, cache = carry
    live = ~done
    if mtp:
      drafts, start = cache.mtp.drafts, model._start(cache, slots)                         # [B, k]
    else:
      drafts = ngram_drafts(history, lengths + num, num_drafts=num_drafts, ngram=ngram)   # [B, k]
    # Finished rows become padding rows (slot -1): their caches stay as they were.
    step_slots = jnp.where(done, -1, slots)
    logits, step = model.verify(jnp.concatenate([tok[:, None], drafts], axis=1), cache, step_slots,
                                replay=replay, implementation=implementation, return_hidden=mtp)
    # The run: the accepted drafts, then the model's own token at the first lane that did not
    # accept. It is cut after the first stop token and at the row's remaining budget.
    run, n_run = sampling.speculative_sample(logits, drafts, jnp.full((bsz,), num_drafts, jnp.int32),
                                             temps, keys, num)
    stop = is_stop(run)
    stopped_before = (jnp.cumsum(stop, axis=1) - stop) > 0
    keep = live[:, None] & (lane < n_run[:, None]) & (lane < (m - num)[:, None]) & ~stopped_before
    emit = jnp.sum(keep, axis=1, dtype=jnp.int32)
    out = out.at[rows, jnp.where(keep, num[:, None] + lane, m)].set(run, mode="drop")
    history = history.at[rows, jnp.where(keep, (lengths + num)[:, None] + lane, history.shape[1])].set(
        run, mode="drop")
    # The emitted tokens but the last were inputs of this step (token 0 and accepted drafts):
    # exactly `emit` inputs commit; the last emitted token is the next step's token 0.
    cache = model.commit(step, jnp.maximum(emit, 1))
    if mtp:
      cache = model.mtp_draft(cache, step.hidden, run, step_slots, start, jnp.maximum(emit, 1),
                              implementation=implementation)
    tok = jnp.where(live, jnp.take_along_axis(run, jnp.maximum(emit - 1, 0)[:, None], axis=1)[:, 0], tok)
    num = num + emit
    steps = steps + live.astype(jnp.int32)
    accepted = accepted + jnp.maximum(emit - 1, 0)
    done = done | jnp.any(keep & stop, axis=1) | (num >= m)
    return tok, out, history, done, num, steps, accepted, cache

  carry = (tok, out, history, done, num, zeros, zeros, cache)
  _, out, _, _, num, steps, accepted, cache = jax.lax.while_loop(
      lambda c: ~jnp.all(c[3]), body, carry)
  return out, num, GenerateStats(steps=steps, accepted=accepted), cache


def _generate_run(graphdef, treedef, leaves, cache, prompts, lengths, key, *,
                  layout: MeshLayout | None, **options):
  body = functools.partial(_generate_impl, graphdef, treedef, **options)
  if layout is not None:
    body = layout.on_mesh(body, 3)
  return body(leaves, cache, prompts, lengths, key)


_generate_jit = jax.jit(
    _generate_run, donate_argnames=("cache",),
    static_argnames=("graphdef", "treedef", "layout", "max_new_tokens", "replay", "temperature",
                     "stop_tokens", "implementation", "speculative", "ngram", "drafter"))


def _as_int(name, value, lo):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
    raise ValueError(f"{name}={value!r}; expected an int >= {lo}")
  return int(value)


def generate(model: LM | ShardedLM, prompts, lengths, *, max_new_tokens, replay=True,
             temperature=0.0, stop_tokens=(), seed=0, buffer_len=None, implementation=None,
             speculative=0, ngram=2, drafter="ngram", return_stats=False):
  """Generates ``max_new_tokens`` tokens per row after right-padded prompts.

  The first token comes from the prefill logits at position ``lengths[b] - 1``; each further token
  from one decode step (ReplaySSM with ``replay=True``, conventional decode otherwise — the same
  recurrence, so greedy tokens agree at float32). A row that emits a stop token keeps that token,
  then emits ``PAD_TOKEN`` (0) for the rest of the output and stops updating its cache; the loop
  ends early once every row stopped.

  With ``speculative=k`` each step drafts k tokens per row (``ngram_drafts``: what followed the
  last earlier occurrence of the row's last ``ngram`` tokens), verifies the last token + drafts in
  one ``LM.verify`` step, emits the accepted drafts and the model's next token, and commits that
  many tokens (``LM.commit``: cursor + conv-state rollback). Greedy: the tokens are those of
  ``speculative=0`` greedy decoding (up to float32 rounding). Temperature > 0: rejection sampling
  (``sampling.speculative_sample``), so every token has the distribution of plain sampling, with
  per-row keys ``fold_in(fold_in(PRNGKey(seed), row), position)`` (other draws than
  ``speculative=0`` makes, same distribution). Stop tokens and ``max_new_tokens`` cut a run of
  accepted drafts exactly. Steps per row shrink by the accepted drafts (``return_stats``).
  ``replay=False`` verifies through conventional state stacks (``LM.verify(replay=False)``, the
  baseline): the same tokens. ``drafter="mtp"`` drafts with the model's multi-token-prediction
  head instead (``models.mtp``; greedy drafts made after the prefill and after every commit).

  Args:
    model: an LM (e.g. ``make_model(LMConfig.tiny(), seed)``), or a ShardedLM (``shard_model``:
      the same tokens up to the psums' float summation order; no MTP drafter).
    prompts: int32[B, T] with T <= ``model.config.max_prompt_len``; row b uses ``prompts[b, :lengths[b]]``.
    lengths: int32[B] in [1, T].
    max_new_tokens: M >= 1.
    replay: ReplaySSM decode (True) or conventional decode (False).
    temperature: 0 → greedy argmax; > 0 → categorical sampling of logits / temperature.
    stop_tokens: token ids that end a row.
    seed: PRNG seed for sampling (same seed → same tokens).
    buffer_len: ReplaySSM buffer length L (the checkpoint is written every L steps); None: the
      measured default ``config.buffer_len_for(speculative + 1)`` (16 without speculative
      decoding; 4 / 8 / 8 for 1 / 3 / 7 drafts).
    implementation: forwarded to the GDN / Mamba2 decode and verify ops (None = fastest available).
    speculative: k drafts per step, 0 <= k <= 7 (0: one token per step). Needs
      ``buffer_len >= k + 1``.
    ngram: n-gram length the drafter matches (speculative mode).
    drafter: "ngram" or "mtp" (the model's MTP head; needs ``speculative >= 1`` and a model with
      ``mtp_layers``).
    return_stats: also return a ``GenerateStats`` (model steps and accepted drafts per row).

  Returns:
    (tokens int32[B, M], num_generated int32[B]: tokens before the padding, stop token included),
    plus ``GenerateStats`` with ``return_stats=True``.
  """
  if not isinstance(model, (LM, ShardedLM)):
    raise ValueError(f"model must be a replayssm_jax.models.LM or a ShardedLM (shard_model); got "
                     f"{type(model).__name__}")
  cfg = model.config
  max_new_tokens = _as_int("max_new_tokens", max_new_tokens, 1)
  _as_int("seed", seed, 0)
  if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
      or not 0 <= temperature < float("inf")):
    raise ValueError(f"temperature={temperature!r}; expected a finite float >= 0")
  speculative = _as_int("speculative", speculative, 0)
  if buffer_len is None:
    buffer_len = config_lib.buffer_len_for(speculative + 1)
  buffer_len = _as_int("buffer_len", buffer_len, 1)
  ngram = _as_int("ngram", ngram, 1)
  if speculative > MAX_DRAFTS:
    raise ValueError(f"speculative={speculative}; expected at most {MAX_DRAFTS} drafts per step "
                     f"(verify runs T = speculative + 1 <= {MAX_DRAFTS + 1} tokens)")
  if speculative and buffer_len < speculative + 1:
    raise ValueError(f"buffer_len={buffer_len} with speculative={speculative}; expected buffer_len "
                     f">= speculative + 1 (a flushed row's drafts must fit its window)")
  if drafter not in ("ngram", "mtp"):
    raise ValueError(f"drafter={drafter!r}; expected 'ngram' or 'mtp'")
  if drafter == "mtp" and isinstance(model, ShardedLM):
    raise NotImplementedError("drafter='mtp' with a ShardedLM: the MTP head is not sharded; draft "
                              "with drafter='ngram', or generate with the unsharded LM")
  if drafter == "mtp" and (not speculative or model.mtp is None):
    raise ValueError(f"drafter='mtp' with speculative={speculative} and mtp_layers={cfg.mtp_layers}; "
                     f"expected speculative >= 1 and a model with a multi-token-prediction head")
  stop_tokens = tuple(int(_as_int("stop_tokens", s, 0)) for s in stop_tokens)
  if any(s >= cfg.vocab_size for s in stop_tokens):
    raise ValueError(f"stop_tokens={stop_tokens}; expected ids in [0, {cfg.vocab_size})")

  prompts_np, lengths_np = np.asarray(prompts), np.asarray(lengths)
  if prompts_np.dtype != np.int32 or prompts_np.ndim != 2:
    raise ValueError(f"prompts has dtype {prompts_np.dtype} and shape {list(prompts_np.shape)}; "
                     f"expected int32[B, T]")
  bsz, t = prompts_np.shape
  if bsz < 1 or not 1 <= t <= cfg.max_prompt_len:
    raise ValueError(f"prompts has shape {list(prompts_np.shape)}; expected [B >= 1, T] with "
                     f"1 <= T <= max_prompt_len = {cfg.max_prompt_len}")
  if prompts_np.min() < 0 or prompts_np.max() >= cfg.vocab_size:
    raise ValueError(f"prompts holds ids in [{prompts_np.min()}, {prompts_np.max()}]; expected "
                     f"[0, {cfg.vocab_size})")
  if lengths_np.dtype != np.int32 or lengths_np.shape != (bsz,):
    raise ValueError(f"lengths has dtype {lengths_np.dtype} and shape {list(lengths_np.shape)}; "
                     f"expected int32[{bsz}]")
  if lengths_np.min() < 1 or lengths_np.max() > t:
    raise ValueError(f"lengths={lengths_np.tolist()}; expected values in [1, T = {t}]")

  # Pad every prompt batch to max_prompt_len: the padding is inert, and one shape means one compile.
  padded = np.zeros((bsz, cfg.max_prompt_len), np.int32)
  padded[:, :t] = prompts_np
  graphdef, params = model.split() if isinstance(model, ShardedLM) else nnx.split(model)
  leaves, treedef = jax.tree.flatten(params)
  # KV capacity: the longest prompt, every generated token and one step's drafts.
  cache = model.init_cache(bsz, buffer_len=buffer_len, max_draft=speculative,
                           max_len=cfg.max_prompt_len + max_new_tokens + speculative,
                           verify_stacks=bool(speculative) and not replay,
                           mtp_drafts=speculative if drafter == "mtp" else 0)
  layout = model.layout(cache) if isinstance(model, ShardedLM) else None
  tokens, num, stats, _ = _generate_jit(
      graphdef, treedef, leaves, cache, jnp.asarray(padded), jnp.asarray(lengths_np),
      jax.random.PRNGKey(seed), layout=layout, max_new_tokens=max_new_tokens, replay=bool(replay),
      temperature=float(temperature), stop_tokens=stop_tokens, implementation=implementation,
      speculative=speculative, ngram=ngram, drafter=drafter)
  return (tokens, num, stats) if return_stats else (tokens, num)
