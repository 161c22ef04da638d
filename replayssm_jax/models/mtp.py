"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints: a drafter that comes
with the weights.

At position p, with g_p the model's hidden state after its final norm and x_{p+1} the token that
follows (E the model's embedding, head the model's head):

    u_p = fc([norm_e(E · x_{p+1}) ; norm_h(g_p)])          fc: [2D] → [D], embedding half first
    u_p = Block(u_p)                                       one full-attention block (the model's
                                                           attention and MLP kind) over its own
                                                           KV cache, rotary position p
    m_p = norm(u_p);   logits_p = head(m_p)                a guess of x_{p+2}

Chained drafts feed the head's own m_p back as the next position's hidden: after the model covers
positions < n and emitted x_n, the head at position n − 1 (g_{n−1}, x_n) guesses d_1 ≈ x_{n+1},
then at position n (m_{n−1}, d_1) guesses d_2, and so on. The head's KV entry at position p holds
(g_p, x_{p+1}) once both are known; the chain's entries past the sequence are overwritten before
anything reads them, as rejected drafts' are in the model's own attention layers. g at the last
covered position is kept per slot, so a prefill that continues the sequence (a prefix-cache hit)
rewrites that entry with the token it actually continues with.

transformers does not build the head (it drops ``mtp.*`` tensors); vLLM and SGLang run it as above
(vLLM's ``qwen3_5_mtp.py``). The parity test composes transformers' own decoder layer, RMSNorm and
Linear in this order (``tests/data/make_hf_fixtures.py``, fixture ``qwen3_5_mtp``).
"""
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from replayssm_jax.models import lm as lm_lib
from replayssm_jax.models.attention import AttentionLayerCache


@flax.struct.dataclass
class MTPCache:
  """The MTP head's cache over the slot pool.

  Attributes:
    kv: the head's attention KV cache [N, S, Hkv, Dh] (S = the model's KV capacity plus the
      drafts, for the chain's entries past a full sequence).
    drafts: int32[N, k]: each slot's pending drafts, made after its last step (the tokens the
      next verify step checks).
    last_hidden: [N, D] each slot's final-normed hidden state g_p at its last covered position p
      (model dtype). A prefill that resumes the slot's sequence rewrites the head's entry at p
      from it and the prompt's first token: a prefix snapshot's entry there read the token that
      followed in the sequence it was taken from.
  """
  kv: AttentionLayerCache
  drafts: jax.Array
  last_hidden: jax.Array

  @property
  def num_drafts(self) -> int:
    return self.drafts.shape[1]


class MTPHead(nnx.Module):
  """``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, one attention ``block``
  (``lm.Block``, layer type "attention") and ``norm``; embedding and head are the model's."""

  def __init__(self, config: "lm_lib.LMConfig", *, rngs: nnx.Rngs):
    c = config
    norm = lambda: lm_lib.RMSNorm(c.hidden_size, eps=c.rms_eps, dtype=c.dtype, offset=c.norm_offset)
    self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = norm(), norm()
    self.fc = nnx.Linear(2 * c.hidden_size, c.hidden_size, use_bias=False, dtype=c.dtype,
                         param_dtype=c.dtype, rngs=rngs)
    self.block = lm_lib.Block(c, rngs=rngs, layer_type="attention", mlp_type=c.mtp_mlp)
    self.norm = norm()

  def __call__(self, embedded, hidden, kv: AttentionLayerCache, slots, start, valid, *,
               fresh=False, implementation=None):
    """T positions per row, ``start[b] + t``.

    Args:
      embedded: [B, T, D] embeddings of the tokens that follow each position (x_{p+1}).
      hidden: [B, T, D] the model's final-normed hidden states g_p (or the head's own m).
      kv: the head's AttentionLayerCache.
      slots, start, valid, fresh: as ``Attention.step`` (valid: bool[B, T], a prefix per row).
      implementation: the attention / MoE implementation (``_dispatch.without_mosaic``).

    Returns:
      (m [B, T, D] after ``norm``, kv).
    """
    b = self.block
    u = self.fc(jnp.concatenate([self.pre_fc_norm_embedding(embedded),
                                 self.pre_fc_norm_hidden(hidden)], axis=-1))
    y, kv = b.mixer.step(b.mixer_norm(u), kv, slots, start, valid, fresh=fresh,
                         implementation=implementation)
    u = u + y
    x = b.mlp_norm(u)
    u = u + (b.mlp(x, implementation=implementation) if b.mlp_type == "moe" else b.mlp(x))
    return self.norm(u), kv
