"""Token choice shared by ``generate`` and the serving engine: plain sampling and speculative
acceptance (greedy, or rejection sampling against a deterministic drafter).

Keys: every row has a base key (the engine: ``PRNGKey(seed)`` of the request; speculative
``generate``: ``fold_in(PRNGKey(seed), row)``). The token at position j of a row (its index among
the row's generated tokens, 0 = the token from the prefill logits) draws from
``key_j = fold_in(base, j)``; the speculative draws at j derive from key_j by purpose:
``fold_in(key_j, ACCEPT)`` for the acceptance test of a draft, ``fold_in(key_j, RESIDUAL)`` for
the replacement of a rejected draft, and key_j itself for a lane without a draft. So a row's
tokens depend on its key, its history and its own draft counts only, never on the batch, and each
emitted token uses the key of its own position: draws of lanes past a rejection are thrown away
and their positions are drawn afresh by the next step, with nothing emitted having seen them.

Speculative sampling with a deterministic drafter (the n-gram drafter proposes one token d, so
its distribution is q = one-hot(d)): with p = softmax(logits / temperature) at the lane, d is
accepted with probability min(1, p(d) / q(d)) = p(d); on rejection the token is drawn from the
residual norm(max(p − q, 0)), which is p with d removed and renormalised. Then

    P(emit y) = p(d)·[y = d] + (1 − p(d)) · p(y)·[y ≠ d] / (1 − p(d)) = p(y),

so every emitted token has the model's distribution given the tokens before it. If every draft
of a row is accepted, the lane after the last draft is a plain draw from p (the bonus token).
Greedy rows (temperature 0) accept d iff d = argmax p and emit the argmax otherwise.
"""
import jax
import jax.numpy as jnp

ACCEPT, RESIDUAL = 1, 2          # fold_in purposes below a position's key


def seed_keys(seeds):
  """int32[B] seeds → uint32[B, 2] base keys ``PRNGKey(seed)``."""
  return jax.vmap(jax.random.PRNGKey)(seeds)


def sample(logits, temperatures, keys, positions):
  """One token per row: argmax where the temperature is 0, else categorical(logits / t) with key
  ``fold_in(keys[b], positions[b])``.

  Args:
    logits: [B, V].
    temperatures: float32[B] >= 0.
    keys: uint32[B, 2] base keys (``seed_keys``).
    positions: int32[B] position of the drawn token.

  Returns:
    int32[B].
  """
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  safe = jnp.where(temperatures > 0, temperatures, 1.0)

  def draw(row, t, key, pos):
    return jax.random.categorical(jax.random.fold_in(key, pos), row / t).astype(jnp.int32)
  sampled = jax.vmap(draw)(logits, safe, keys, positions)
  return jnp.where(temperatures > 0, sampled, greedy)


def speculative_sample(logits, drafts, num_drafts, temperatures, keys, positions):
  """The emitted run of one verify step per row (see the module docstring for the rule).

  Lane i of a row (its input token i: the emitted token, then drafts) predicts the token at
  position ``positions[b] + i``; lanes ``i < num_drafts[b]`` judge draft ``drafts[b, i]``, lane
  ``num_drafts[b]`` draws without a draft. The run is the accepted drafts, then the token of the
  first lane that did not accept (its replacement or its plain draw).

  Args:
    logits: [B, T, V] float32 verify logits.
    drafts: int32[B, T-1] draft tokens (entries past ``num_drafts`` are ignored).
    num_drafts: int32[B] in [0, T-1].
    temperatures: float32[B] >= 0 (0: greedy).
    keys: uint32[B, 2] base keys.
    positions: int32[B] position of the token lane 0 emits.

  Returns:
    (tokens int32[B, T], num_emitted int32[B] in [1, num_drafts + 1]): row b emits
    ``tokens[b, :num_emitted[b]]``; it accepted ``num_emitted - 1`` drafts, so a verify step
    commits ``num_emitted`` inputs.
  """
  bsz, t, vocab = logits.shape
  lane = jnp.arange(t, dtype=jnp.int32)
  has_draft = lane[None, :] < num_drafts[:, None]                          # [B, T]
  judged = jnp.concatenate([drafts, jnp.zeros((bsz, 1), jnp.int32)], axis=1)  # draft lane i judges
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  sampled = temperatures > 0

  def rejection(_):
    scaled = logits / jnp.where(sampled, temperatures, 1.0)[:, None, None]
    lane_keys = jax.vmap(lambda key, p: jax.vmap(lambda i: jax.random.fold_in(key, p + i))(lane))(
        keys, positions)                                                     # [B, T, 2]

    def draw(row, d, draft_lane, key):
      p_d = jax.nn.softmax(row)[d]
      u = jax.random.uniform(jax.random.fold_in(key, ACCEPT))
      # Residual of a rejected draft: p without d, renormalised (categorical renormalises);
      # a lane without a draft draws from p itself, with the position's own key.
      masked = jnp.where(draft_lane & (jnp.arange(vocab) == d), -jnp.inf, row)
      pick = jax.random.categorical(jnp.where(draft_lane, jax.random.fold_in(key, RESIDUAL), key), masked)
      return u < p_d, pick.astype(jnp.int32)
    accept, pick = jax.vmap(jax.vmap(draw))(scaled, judged, has_draft, lane_keys)
    return (jnp.where(sampled[:, None], accept, judged == greedy),
            jnp.where(sampled[:, None], pick, greedy))

  def argmax_only(_):
    return judged == greedy, greedy

  # Greedy-only batches skip the random draws over [B, T, V].
  accept, replacement = jax.lax.cond(jnp.any(sampled), rejection, argmax_only, None)
  accept = accept & has_draft
  tokens = jnp.where(accept, judged, replacement)
  run = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)      # leading accepted drafts
  return tokens, (run + 1).astype(jnp.int32)
