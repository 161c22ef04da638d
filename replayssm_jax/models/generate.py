"""Jitted generation: prefill plus a ``lax.while_loop`` of decode steps in ONE ``jax.jit``.

``nnx.split`` runs outside the jit and ``nnx.merge`` inside; the cache is created outside and
donated. Prompts are padded to ``config.max_prompt_len`` and every cursor value is traced data,
so one compilation serves any prompts, prompt lengths and cursor phases for a given batch size
and static options (max_new_tokens, replay, temperature, stop_tokens, buffer_len, implementation).
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax.models.lm import LM

PAD_TOKEN = 0


def _sample(logits, key, temperature):
  """logits [B, vocab] → int32[B]: argmax at temperature 0, else categorical(logits / T)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def _generate_impl(graphdef, params, cache, prompts, lengths, key, *, max_new_tokens, replay,
                   temperature, stop_tokens, implementation):
  """Traced body. prompts int32[B, T], lengths int32[B] → (tokens [B, M], num_generated [B], cache)."""
  model = nnx.merge(graphdef, params)
  bsz = prompts.shape[0]
  slots = jnp.arange(bsz, dtype=jnp.int32)
  stops = jnp.asarray(stop_tokens if stop_tokens else (-1,), jnp.int32)  # -1 never matches a token

  def is_stop(tok):
    return jnp.any(tok[:, None] == stops[None, :], axis=-1)

  logits, cache = model.prefill(prompts, cache, slots, lengths)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, vocab]
  tok = _sample(last, jax.random.fold_in(key, 0), temperature)
  out = jnp.full((bsz, max_new_tokens), PAD_TOKEN, jnp.int32).at[:, 0].set(tok)
  done = is_stop(tok)                       # a stop token is emitted and counted, then the row stops
  num = jnp.ones((bsz,), jnp.int32)

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
  return out, num, cache


_generate_jit = jax.jit(
    _generate_impl, donate_argnames=("cache",),
    static_argnames=("graphdef", "max_new_tokens", "replay", "temperature", "stop_tokens", "implementation"))


def _as_int(name, value, lo):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
    raise ValueError(f"{name}={value!r}; expected an int >= {lo}")
  return int(value)


def generate(model: LM, prompts, lengths, *, max_new_tokens, replay=True, temperature=0.0,
             stop_tokens=(), seed=0, buffer_len=16, implementation=None):
  """Generates ``max_new_tokens`` tokens per row after right-padded prompts.

  The first token comes from the prefill logits at position ``lengths[b] - 1``; each further token
  from one decode step (ReplaySSM with ``replay=True``, conventional decode otherwise — the same
  recurrence, so greedy tokens agree at float32). A row that emits a stop token keeps that token,
  then emits ``PAD_TOKEN`` (0) for the rest of the output and stops updating its cache; the loop
  ends early once every row stopped.

  Args:
    model: an LM (e.g. ``make_model(LMConfig.tiny(), seed)``).
    prompts: int32[B, T] with T <= ``model.config.max_prompt_len``; row b uses ``prompts[b, :lengths[b]]``.
    lengths: int32[B] in [1, T].
    max_new_tokens: M >= 1.
    replay: ReplaySSM decode (True) or conventional decode (False).
    temperature: 0 → greedy argmax; > 0 → categorical sampling of logits / temperature.
    stop_tokens: token ids that end a row.
    seed: PRNG seed for sampling (same seed → same tokens).
    buffer_len: ReplaySSM buffer length L (the checkpoint is written every L steps).
    implementation: forwarded to the GDN decode ops (None = fastest available).

  Returns:
    (tokens int32[B, M], num_generated int32[B]: tokens before the padding, stop token included).
  """
  if not isinstance(model, LM):
    raise ValueError(f"model must be a replayssm_jax.models.LM; got {type(model).__name__}")
  cfg = model.config
  max_new_tokens = _as_int("max_new_tokens", max_new_tokens, 1)
  buffer_len = _as_int("buffer_len", buffer_len, 1)
  _as_int("seed", seed, 0)
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
    raise ValueError(f"temperature={temperature!r}; expected a float >= 0")
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
  graphdef, params = nnx.split(model)
  cache = model.init_cache(bsz, buffer_len=buffer_len)
  tokens, num, _ = _generate_jit(
      graphdef, params, cache, jnp.asarray(padded), jnp.asarray(lengths_np), jax.random.PRNGKey(seed),
      max_new_tokens=max_new_tokens, replay=bool(replay), temperature=float(temperature),
      stop_tokens=stop_tokens, implementation=implementation)
  return tokens, num
