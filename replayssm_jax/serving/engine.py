"""A continuous-batching decode engine over one slot pool (host scheduler + jitted steps).

Pool layout: slots ``[0, max_running)`` hold running requests, slots ``[max_running,
max_running + prefix_slots)`` hold prefix snapshots. Each engine ``step()``:

1. admits waiting requests into free slots: prefill (``LM.prefill`` of up to ``prefill_tokens //
   max_prompt_len`` requests at once, prompts padded to ``max_prompt_len``: one compiled width; one request at a
   time with prefix caching) and the first token from the prefill logits;
2. runs ONE model step for every running request in a fixed batch bucket (the smallest of
   ``batch_buckets`` that holds them; the other rows are padding rows, slot −1), so there is one
   compiled step per bucket (and verify width) whatever requests join, finish or sit in which
   slot: a decode step (one token per row) or, with speculative decoding, a verify step;
3. retires requests that hit a stop token or ``max_new_tokens``; their slots are free at once.

Speculative decoding (``num_drafts = k > 0``): every running request gets up to k drafts per step
from its own n-gram drafter (``drafter.NgramDrafter``: what followed the latest earlier occurrence
of its last ``ngram`` tokens in its prompt + generated tokens) — or, with ``drafter="mtp"``, from
the model's multi-token-prediction head (``models.mtp``), which drafts on the device after every
prefill and verify step from that step's hidden states and keeps each slot's k drafts in
``LMCache.mtp`` (every step of a drafting request is then a verify step, so the head's KV cache
covers each position) — and the step verifies the last
emitted token plus the drafts (``LM.verify``, T = 1 + the largest ``num_drafts`` of the running
requests; one compiled program per bucket and T). Rows share the step with different draft
counts through ``lengths``: a row with d < T - 1 drafts (none, for ``num_drafts=0`` requests or
rows cut to 0) is a (d + 1)-token lane, its padded lanes inert. Each row emits its accepted drafts
plus one model token (``models.sampling.speculative_sample``: greedy, or rejection sampling at
temperature > 0) and commits exactly that many inputs (``LM.commit``: cursor, conv-state and KV
rollback). A step in which no row has a draft is a plain decode step. Drafts are cut per row so
that the emitted run never passes ``max_new_tokens`` (so the KV capacity of ``submit`` holds) nor
a prefix-cache block boundary (below). Greedy tokens are those of ``num_drafts=0`` (up to float32
rounding: verify and decode sum in other orders); sampled tokens have the same distribution (not
the same draws). ``replay=False`` with ``num_drafts > 0`` verifies conventionally: the recurrent
states live in per-slot stacks of T_max = k + 1 states (``LM.init_cache(verify_stacks=True)``)
and the rollback picks the state at the accepted index, the baseline for ReplaySSM verify.

Prefix caching (``prefix_block > 0``): a prompt is prefilled in blocks of ``prefix_block`` tokens
(``LM.prefill(..., resume=True)`` continues a slot's sequence) and after each full block the slot
is snapshotted into a prefix slot (``copy_slots`` of every layer plus its conv state), keyed by the
token prefix. During decode, a row whose sequence reaches a block boundary below max_prompt_len
gets a *forced flush* (``cursor.plan(force_flush=...)`` through ``LM.decode`` / ``LM.verify``;
cached or not, so a request's flushes depend on it alone) so its checkpoint is exactly the state
there with an empty ring window, then it is snapshotted too unless that prefix is cached. A
snapshot is only taken between steps, when the slot's state covers exactly a block boundary, so
speculative rows never jump over one: their drafts are cut to end on the next boundary below
max_prompt_len (cached or not, so a request's draft counts depend on the request alone). A row
whose last emitted token reaches a boundary is a one-token lane (forced flush, as in decode); a run
of accepted drafts that ends on a boundary is snapshotted with its ring window (``copy_slots``
copies checkpoint, ring and cursor, so that snapshot is exact too). A later request whose prompt
starts with a cached prefix (at least one token must remain to produce logits) copies the snapshot
into its slot and prefills only the rest. Snapshots are evicted least-recently-used. With the MTP
drafter a snapshot also holds the head's KV cache and the hidden state at its last covered
position, from which a resumed prefill rewrites the head's entry there with the prompt's own next
token (``LM.mtp_draft_after_prefill(resume=True)``); decode boundaries are snapshotted only for
drafting requests (the others' plain decode steps skip the head). If caching is
on, prompts were looked up, and nothing ever hit, ``run()`` warns (``RuntimeWarning`` + log).

Preemption: ``preempt(directory)`` writes params and cache with Orbax (a synchronous ``Checkpointer``)
plus the host scheduler state (requests, slots, snapshots, clocks) as JSON and closes the engine;
``Engine.resume(directory)`` rebuilds it and continues bit for bit: the same compiled programs
see the same arrays (the drafters are rebuilt from each request's tokens: they are a function of
them).

Overlapped steps (the default; ``overlap=False`` turns them off): a step is dispatched before the
host reads the tokens of the one before, from those tokens on the device, so the host's work
(reading tokens, stop and length checks, bookkeeping) runs while the device computes the next step.
While requests wait for a slot, the engine collects first and admits as usual. A row that reaches
``max_new_tokens`` in the step in flight is a padding row of the next; one that hits a stop token
there computes one more step into the slot it frees, which nobody reads (the next request in that
slot starts from a fresh prefill). With drafting the device keeps each row's token history (prompt +
``max_new_tokens`` must fit ``max_seq_len``), drafts with ``models.generate.ngram_drafts`` (what the
host drafter proposes), applies the same draft cuts, and makes a row that reached its budget a
padding row (no stop-token list on the device: its shape would vary with the requests). Tokens and
drafts are those of synchronous steps; ``step()`` reports a request finished one call later. With
prefix caching a row's decode-boundary snapshot is taken at the start of the next ``step()``, before
anything else touches its slot (the flush is planned by position alone, and by then the host holds
every token its state covers). When drafting, only the device knows in time whether a row's accepted
run ends on a boundary: it makes the draft cuts and forced flushes of synchronous steps, and holds
such a row out of the next step (a padding row there, its slot untouched) while the host, collecting
the step, snapshots it; a row so costs one step per block boundary it reaches below max_prompt_len.
``preempt`` collects the step in flight first.

Tensor parallel: ``Engine(shard_model(model, mesh))`` runs every program per device under
``jax.shard_map`` (``MeshLayout``): each device holds its heads' parameters and cache, the
host-side scheduler is unchanged, and the replicated logits give every device the same tokens,
those of the unsharded model up to the psums' summation order. MTP drafting needs the unsharded
LM (the head is not sharded). ``preempt`` writes the unsharded layout; ``resume(mesh=...)``
shards it again.

Sampling: greedy (temperature 0) or categorical with key ``fold_in(PRNGKey(seed), position)`` per
request, so tokens never depend on the batch a request shares (speculative draws derive from the
same per-position key, ``models.sampling``). Stats per request: prompt and
generated tokens, prefix-hit tokens, drafts proposed and accepted, time to first token, decode
tokens/s (engine clock: time spent preempted is not counted).
"""
import collections
import dataclasses
import functools
import json
import logging
import pathlib
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import _slots
from replayssm_jax import config as config_lib
from replayssm_jax.models import sampling
from replayssm_jax.models.generate import MAX_DRAFTS, ngram_drafts
from replayssm_jax.models.lm import LM, LMConfig
from replayssm_jax.models.sharding import MeshLayout, ShardedLM, shard_model
from replayssm_jax.serving.drafter import NgramDrafter

logger = logging.getLogger(__name__)
PAD_TOKEN = 0
DRAFTERS = ("ngram", "mtp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Engine shape and policy.

  Attributes:
    max_running: request slots: how many requests decode at once.
    batch_buckets: decode batch sizes, increasing; the last must be >= max_running. Each bucket
      is one compiled decode step (and, drafting, one verify step per T).
    buffer_len: ReplaySSM buffer length L (checkpoint written every L tokens); None: the
      measured default ``config.buffer_len_for(num_drafts + 1)`` (16 without drafts). At least
      num_drafts + 1.
    replay: ReplaySSM decode and verify (True) or conventional decode and verify (False).
    num_drafts: speculative decoding (see the module docstring): up to k n-gram drafts per
      request and step, verified with the last token in one step of T = k + 1 tokens;
      0 <= k <= 7 (0: off). A request may ask for fewer (``submit(num_drafts=)``). With
      ``replay=False`` the verify is conventional: every recurrent layer keeps k + 1 states per
      slot (``LM.init_cache(verify_stacks=True)``), the baseline to time ReplaySSM verify against.
    drafter: "ngram" (each request's own n-gram drafter) or "mtp": the model's multi-token-
      prediction head (``models.mtp``; a Qwen3.5 / Qwen3-Next checkpoint's ``mtp.*``), which
      drafts on the device after every prefill and verify step from the model's hidden states
      (greedy drafts, kept per slot in ``LMCache.mtp``). "mtp" needs ``num_drafts >= 1`` and a
      model with ``mtp_layers``; with prefix caching, snapshots carry the head's cache (see the
      module docstring).
    ngram: n-gram length the n-gram drafter matches.
    prefill_tokens: token budget of one prefill (without prefix caching): the requests a step
      admits go through the prefill in groups of R = max(1, min(max_running, prefill_tokens //
      max_prompt_len)) rows (prompts padded to max_prompt_len), one compiled width R (a lone
      request runs at width 1). Prefill activations scale with R · max_prompt_len tokens.
    prefix_block: prefix-cache block in tokens; 0 turns prefix caching off.
    prefix_slots: pool slots for prefix snapshots (>= 1 when prefix_block > 0).
    max_prompt_len: longest prompt accepted; None = the model's ``config.max_prompt_len``.
    max_seq_len: tokens per request (prompt + generated) the KV cache of each slot holds, for
      models with attention layers; None = max_prompt_len + 1024. A request that could exceed
      it is refused at ``submit``.
    state_dtype, ring_dtype: cache dtypes (see ``LM.init_cache``).
    read_copy_dtype: None, or "bfloat16" / "float16": a 16-bit read copy of every float32
      checkpoint that decode steps read (``LM.init_cache(read_copy_dtype=)``, bench/RESULTS.md
      "Read copy"); verify steps read the checkpoint and keep the copy in step. ReplaySSM only
      (``replay=True``).
    implementation: forwarded to the GDN / Mamba2 ops (None = fastest available).
    overlap: dispatch each step from the previous step's tokens on the device before the host
      reads them, so the host's bookkeeping of step t runs while step t + 1 computes (see the
      module docstring); with drafting the drafts are made on the device too, and every
      request must fit ``max_seq_len`` (its device token history). None (the default): on.
      Measured on the H200 (bench/RESULTS.md "serving.Engine end to
      end"): Qwen3.5-4B preset, B = 32 3510 → 7575 tokens/s, B = 256 15841 → 23337; drafting
      k = 3 (looping weights) B = 32 6477 → 12702, B = 256 17365 → 21164.
  """
  max_running: int = 4
  batch_buckets: tuple = (1, 2, 4)
  buffer_len: int | None = None
  replay: bool = True
  num_drafts: int = 0
  drafter: str = "ngram"
  ngram: int = 2
  prefill_tokens: int = 8192
  prefix_block: int = 0
  prefix_slots: int = 0
  max_prompt_len: int | None = None
  max_seq_len: int | None = None
  state_dtype: str = "float32"
  ring_dtype: str | None = None
  read_copy_dtype: str | None = None
  implementation: str | None = None
  overlap: bool | None = None

  def __post_init__(self):
    for name, lo in (("max_running", 1), ("prefill_tokens", 1), ("prefix_block", 0), ("prefix_slots", 0),
                     ("num_drafts", 0), ("ngram", 1)):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}={value!r}; expected an int >= {lo}")
    if self.num_drafts > MAX_DRAFTS:
      raise ValueError(f"num_drafts={self.num_drafts}; expected at most {MAX_DRAFTS} (verify runs "
                       f"T = num_drafts + 1 <= {MAX_DRAFTS + 1} tokens per row)")
    if self.buffer_len is None:
      object.__setattr__(self, "buffer_len", config_lib.buffer_len_for(self.num_drafts + 1))
    if not isinstance(self.buffer_len, int) or isinstance(self.buffer_len, bool) or self.buffer_len < 1:
      raise ValueError(f"buffer_len={self.buffer_len!r}; expected None or an int >= 1")
    if self.buffer_len < self.num_drafts + 1:
      raise ValueError(f"buffer_len={self.buffer_len} with num_drafts={self.num_drafts}; expected "
                       f"buffer_len >= num_drafts + 1 (a flushed row's drafts must fit its window)")
    buckets = tuple(self.batch_buckets)
    if (not buckets or any(not isinstance(b, int) or b < 1 for b in buckets)
        or list(buckets) != sorted(set(buckets)) or buckets[-1] < self.max_running):
      raise ValueError(f"batch_buckets={self.batch_buckets!r}; expected increasing ints >= 1 whose "
                       f"last entry is >= max_running = {self.max_running}")
    object.__setattr__(self, "batch_buckets", buckets)
    if self.prefix_block and not self.prefix_slots:
      raise ValueError(f"prefix_block={self.prefix_block} with prefix_slots=0; expected prefix_slots "
                       f">= 1 to hold the snapshots")
    for name in ("max_prompt_len", "max_seq_len"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name}={value!r}; expected None or an int >= 1")
    if not isinstance(self.replay, bool):
      raise ValueError(f"replay={self.replay!r}; expected a bool")
    if self.read_copy_dtype is not None and not self.replay:
      raise ValueError(f"read_copy_dtype={self.read_copy_dtype!r} with replay=False: only ReplaySSM "
                       f"steps keep the copy in step (conventional steps would leave it stale)")
    if self.drafter not in DRAFTERS:
      raise ValueError(f"drafter={self.drafter!r}; expected one of {DRAFTERS}")
    if self.drafter == "mtp" and not self.num_drafts:
      raise ValueError("drafter='mtp' with num_drafts=0; expected num_drafts >= 1 (the drafts the "
                       "head makes per step)")
    if self.overlap is not None and not isinstance(self.overlap, bool):
      raise ValueError(f"overlap={self.overlap!r}; expected None or a bool")

  @property
  def overlapped(self) -> bool:
    """Whether steps overlap (``overlap`` resolved: None means on)."""
    return True if self.overlap is None else self.overlap

  @property
  def num_slots(self) -> int:
    """Pool size N = request slots + prefix snapshot slots."""
    return self.max_running + self.prefix_slots


@dataclasses.dataclass(frozen=True)
class RequestStats:
  """Per-request statistics (seconds on the engine clock). ``drafted_tokens``: drafts verified for
  the request; ``accepted_drafts``: those the model accepted (acceptance rate = their ratio)."""
  request_id: str
  slot: int
  prompt_tokens: int
  generated_tokens: int
  prefix_hit_tokens: int
  drafted_tokens: int
  accepted_drafts: int
  time_to_first_token_s: float
  decode_tokens_per_s: float
  total_s: float


@dataclasses.dataclass
class _InFlight:
  """A dispatched decode step whose tokens the host has not read: row i is ``reqs[i]`` where
  ``live[i]`` (else a padding row), ``tokens`` int32[width] on the device; ``covered[i]``: the
  sequence tokens row i's state covers after the step (prefix snapshots)."""
  reqs: list
  live: list
  tokens: jax.Array
  covered: list


@dataclasses.dataclass
class _InFlightVerify:
  """A dispatched speculative step (drafted on the device): row i emits ``run[i, :emitted[i]]``
  after ``drafted[i]`` drafts, for ``reqs[i]`` where ``live[i]``; ``carry`` (history, length,
  generated, done, held), the device's per-row state the next chained step starts from."""
  reqs: list
  live: list
  run: jax.Array
  emitted: jax.Array
  drafted: jax.Array
  carry: tuple


@dataclasses.dataclass
class _Request:
  rid: str
  prompt: list
  max_new_tokens: int
  stop_tokens: list
  temperature: float
  seed: int
  t_submit: float
  num_drafts: int = 0
  slot: int = -1
  generated: list = dataclasses.field(default_factory=list)
  done: bool = False
  prefix_hit: int = 0
  drafted: int = 0
  accepted: int = 0
  t_first: float | None = None
  t_done: float | None = None


def _merge(graphdef, treedef, leaves) -> LM:
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _prefill_impl(graphdef, treedef, leaves, cache, tokens, slots, lengths, temps, seeds, *, resume,
                  mtp=False):
  """First tokens of right-padded prompts; with ``mtp`` the head's KV entries and drafts after
  them too (``LM.mtp_draft_after_prefill``)."""
  model = _merge(graphdef, treedef, leaves)
  last_at = jnp.maximum(lengths - 1, 0)
  if not mtp:
    last, cache = model.prefill(tokens, cache, slots, lengths, resume=resume, logits_at=last_at)
    return sampling.sample(last, temps, sampling.seed_keys(seeds), jnp.zeros_like(seeds)), cache
  last, cache, hidden = model.prefill(tokens, cache, slots, lengths, resume=resume, logits_at=last_at,
                                      return_hidden=True)
  first = sampling.sample(last, temps, sampling.seed_keys(seeds), jnp.zeros_like(seeds))
  return first, model.mtp_draft_after_prefill(cache, hidden, tokens, first, slots, lengths,
                                              resume=resume)


def _decode_impl(graphdef, treedef, leaves, cache, tokens, slots, force, temps, seeds, positions, *,
                 replay, implementation):
  model = _merge(graphdef, treedef, leaves)
  logits, cache = model.decode(tokens, cache, slots, replay=replay, implementation=implementation,
                               force_flush=force)
  return sampling.sample(logits, temps, sampling.seed_keys(seeds), positions), cache


def _verify_impl(graphdef, treedef, leaves, cache, tokens, lengths, slots, force, temps, seeds,
                 positions, *, replay, implementation, mtp=False):
  """tokens int32[B, T] (last emitted token, drafts, padding), lengths int32[B] →
  (run int32[B, T], num_emitted int32[B], cache): row b emits ``run[b, :num_emitted[b]]`` and
  commits as many inputs. With ``mtp`` the drafts are the MTP head's, read from the cache (the
  tokens' lanes 1.. are ignored), and the head drafts again after the commit."""
  model = _merge(graphdef, treedef, leaves)
  if mtp:
    t = tokens.shape[1]
    pending = _slots.gather(cache.mtp.drafts, slots)[:, :t - 1]
    tokens = jnp.concatenate([tokens[:, :1], pending], axis=1)
    start = model._start(cache, slots)
  logits, step = model.verify(tokens, cache, slots, lengths=lengths, replay=replay,
                              implementation=implementation, force_flush=force, return_hidden=mtp)
  run, emitted = sampling.speculative_sample(logits, tokens[:, 1:], lengths - 1, temps,
                                             sampling.seed_keys(seeds), positions)
  cache = model.commit(step, emitted)
  if mtp:
    cache = model.mtp_draft(cache, step.hidden, run, slots, start, emitted,
                            implementation=implementation)
  return run, emitted, cache


def _on_boundary(n, *, block: int, max_prompt_len: int):
  """Whether a state covering n tokens sits on a prefix-cache block boundary below
  max_prompt_len (no snapshot is kept at max_prompt_len or beyond). Elementwise: Python ints on
  the host, int32 arrays on the device (``_speculate_impl``), one rule for both."""
  if not block:
    return n < 0   # never (n >= 0): False, or an all-False array
  return (n % block == 0) & (n < max_prompt_len)


def _draft_limit(n, drafts, remaining, *, block: int, max_prompt_len: int, xp=np):
  """Drafts a row verifies when token 0 is its n-th token (its state covers n - 1): ``drafts``
  cut to ``remaining`` - 1 (the run emits at most drafts + 1 tokens) and, with prefix caching,
  so that the state after the step covers at most the next block boundary b >= n below
  max_prompt_len (a snapshot needs a step that ends there): 0 drafts when token 0 reaches b.
  Elementwise with ``xp`` = np (host ints) or jnp (device arrays)."""
  k = xp.minimum(drafts, remaining - 1)
  if block:
    boundary = -(-n // block) * block
    k = xp.where(boundary < max_prompt_len, xp.minimum(k, boundary - n), k)
  return xp.maximum(k, 0)


def _speculate_impl(graphdef, treedef, leaves, cache, history, length, generated, done, held, slots,
                    budget, drafts_per_row, temps, seeds, *, num_tokens, ngram, replay,
                    implementation, mtp=False, prefix_block=0, max_prompt_len=0):
  """A speculative step drafted on the device (overlapped steps): the synchronous path's verify
  step, with ``models.generate.ngram_drafts`` (what the host drafter proposes) as the drafter, or
  with ``mtp`` the MTP head's drafts in the cache.

  Carried per row: history int32[B, S] (prompt and generated tokens at positions < length[b]),
  length, generated (tokens generated so far) int32[B], done bool[B] (budget reached on the
  device: a padding row from then on; a row past a stop token runs on, unread, as in plain
  overlapped decode), held bool[B] (prefix caching: the row's state reached a block boundary in
  the step before, so it sits this step out — a padding row — while the host snapshots it).
  Per request: slots (negative: padding), budget (max_new_tokens), drafts_per_row (its
  num_drafts) int32[B], temps, seeds. With ``prefix_block`` > 0 the drafts are cut and token-0
  boundaries flushed by the host's rule (``_draft_limit``, ``_on_boundary``; static
  ``prefix_block``, ``max_prompt_len``). Returns (run int32[B, T], emitted int32[B] (0 on
  padding and held rows), drafted int32[B], carry, cache).
  """
  bsz, capacity = history.shape
  live = (slots >= 0) & ~done & ~held
  # The synchronous path's draft cuts and boundary flushes (``Engine._drafts``, ``Engine._decode``).
  rule = dict(block=prefix_block, max_prompt_len=max_prompt_len)
  limit = _draft_limit(length, drafts_per_row, budget - generated, **rule, xp=jnp)
  force = live & _on_boundary(length, **rule)
  drafted = jnp.where(live, jnp.minimum(limit, num_tokens - 1), 0)
  tokens = jnp.take_along_axis(history, (length - 1)[:, None], axis=1)
  if num_tokens > 1 and mtp:   # lanes 1.. are read from the cache by _verify_impl
    tokens = jnp.concatenate([tokens, jnp.full((bsz, num_tokens - 1), PAD_TOKEN, jnp.int32)], axis=1)
  elif num_tokens > 1:
    tokens = jnp.concatenate(
        [tokens, ngram_drafts(history, length, num_drafts=num_tokens - 1, ngram=ngram)], axis=1)
  lane = jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
  tokens = jnp.where(lane <= drafted[:, None], tokens, PAD_TOKEN)
  run, emitted, cache = _verify_impl(
      graphdef, treedef, leaves, cache, tokens, 1 + drafted, jnp.where(live, slots, -1),
      force, temps, seeds, generated, replay=replay, implementation=implementation, mtp=mtp)
  emitted = jnp.where(live, emitted, 0)
  kept = lane < emitted[:, None]
  where = jnp.where(kept, length[:, None] + lane, capacity)          # capacity: dropped
  history = history.at[jnp.arange(bsz)[:, None], where].set(run, mode="drop")
  generated, length = generated + emitted, length + emitted
  done = done | (live & (generated >= budget))
  # The state covers length - 1 tokens: on a boundary, the host snapshots it (held a step).
  held = live & ~done & _on_boundary(length - 1, **rule)
  return run, emitted, drafted, (history, length, generated, done, held), cache


def _copy_impl(graphdef, treedef, leaves, cache, src, dst):
  """Every layer's cache and the slot state of slot src[0] → dst[0] (``LM.copy_slots``)."""
  return _merge(graphdef, treedef, leaves).copy_slots(cache, src, dst)


@dataclasses.dataclass(frozen=True)
class _Programs:
  """The engine's jitted steps for one model structure; each takes the parameter leaves (a flat
  list: jit's C++ dispatch flattens it without calling back into Python) and the cache (donated)."""
  prefill: Callable
  decode: Callable
  verify: Callable
  speculate: Callable
  copy: Callable


@functools.lru_cache(maxsize=16)
def _programs(graphdef, treedef, layout: MeshLayout | None = None) -> _Programs:
  """One set of programs per (graphdef, parameter treedef, mesh layout), shared by every engine of
  that model structure (a resumed engine reuses what the first compiled). The graphdef is bound
  here rather than passed as a static argument: hashing it costs milliseconds (4.5 ms for a
  32-layer model on this project's CPU host), which a static argument pays on every call."""

  def program(impl, replicated_outputs, donate=(1,), static=()):
    def run(leaves, cache, *args, **options):
      body = functools.partial(impl, graphdef, treedef, **options)
      if layout is not None:
        body = layout.on_mesh(body, replicated_outputs)
      return body(leaves, cache, *args)
    return jax.jit(run, donate_argnums=donate, static_argnames=static)

  kernel_options = ("replay", "implementation")
  return _Programs(
      prefill=program(_prefill_impl, 1, static=("resume", "mtp")),
      decode=program(_decode_impl, 1, static=kernel_options),
      verify=program(_verify_impl, 2, static=kernel_options + ("mtp",)),
      speculate=program(_speculate_impl, 4, donate=(1, 2),   # the cache and the token history
                        static=kernel_options + ("num_tokens", "ngram", "mtp", "prefix_block",
                                                 "max_prompt_len")),
      copy=program(_copy_impl, 0))


class Engine:
  """Continuous batching over a slot pool (see the module docstring).

  Usage::

      engine = Engine(model, EngineConfig(max_running=4, batch_buckets=(1, 2, 4)))
      rid = engine.submit([1, 2, 3], max_new_tokens=32)
      tokens = engine.run()[rid]          # or engine.step() in your own loop
      engine.stats(rid)                   # RequestStats
  """

  def __init__(self, model: LM | ShardedLM, config: EngineConfig | None = None, *, _cache=None):
    if not isinstance(model, (LM, ShardedLM)):
      raise ValueError(f"model must be a replayssm_jax.models.LM or a ShardedLM (shard_model); got "
                       f"{type(model).__name__}")
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
      raise ValueError(f"config must be an EngineConfig; got {type(config).__name__}")
    if config.drafter == "mtp" and isinstance(model, ShardedLM):
      raise NotImplementedError("EngineConfig(drafter='mtp') over a ShardedLM: the MTP head is not "
                                "sharded; draft with drafter='ngram', or serve the unsharded LM")
    if config.drafter == "mtp" and model.mtp is None:
      raise ValueError("EngineConfig(drafter='mtp') but the model has no multi-token-prediction "
                       "head (LMConfig.mtp_layers=0; load a checkpoint with mtp.* tensors)")
    self.model, self.config = model, config
    self._mtp = config.drafter == "mtp"
    self.max_prompt_len = config.max_prompt_len or model.config.max_prompt_len
    self.prefill_rows = max(1, min(config.max_running, config.prefill_tokens // self.max_prompt_len))
    if config.prefix_block and config.prefix_block > self.max_prompt_len:
      raise ValueError(f"prefix_block={config.prefix_block} exceeds max_prompt_len={self.max_prompt_len}")
    # KV capacity per slot (attention layers only): a request's prompt and generated tokens.
    self.max_seq_len = config.max_seq_len or self.max_prompt_len + 1024
    if model.config.has_attention and self.max_seq_len < self.max_prompt_len + 1:
      raise ValueError(f"max_seq_len={self.max_seq_len} leaves no room to generate after a prompt "
                       f"of max_prompt_len={self.max_prompt_len} tokens")
    sharded = isinstance(model, ShardedLM)
    graphdef, params = model.split() if sharded else nnx.split(model)
    cache = _cache if _cache is not None else _init_cache(model, config, self.max_seq_len)
    # Committed to their devices, as Orbax restores them: jit keys its programs on commitment, so
    # a resumed engine reuses the compiled programs instead of compiling them again.
    self._params, self._cache = _committed(params), _committed(cache)
    self._leaves, treedef = jax.tree.flatten(self._params)
    self._programs = _programs(graphdef, treedef, model.layout(self._cache) if sharded else None)
    self._requests: dict[str, _Request] = {}
    self._waiting: collections.deque = collections.deque()
    self._running: list[str] = []
    self._free = list(range(config.max_running))
    self._snapshots: collections.OrderedDict = collections.OrderedDict()   # prefix tuple → slot
    self._free_snapshots = list(range(config.max_running, config.num_slots))
    self._drafters: dict[str, NgramDrafter] = {}   # rebuilt from the tokens when missing (resume)
    self.prefix_lookups = self.prefix_hits = self.steps = 0
    self._warned = False
    self._clock_base, self._t0 = 0.0, time.perf_counter()
    self._closed = False
    self._inflight: _InFlight | _InFlightVerify | None = None

  # ---- public API ----------------------------------------------------------------------------

  def submit(self, prompt, *, max_new_tokens: int, stop_tokens=(), temperature: float = 0.0,
             seed: int = 0, num_drafts: int | None = None, request_id: str | None = None) -> str:
    """Queues a request; returns its id.

    Args:
      prompt: token ids, a flat sequence of ints (1 to max_prompt_len of them).
      max_new_tokens: tokens to generate at most (>= 1); with attention layers, prompt +
        max_new_tokens must fit ``max_seq_len``.
      stop_tokens: ids that end the request (the stop token is emitted).
      temperature: 0 = greedy, else sampling from softmax(logits / temperature); finite.
      seed: sampling seed (tokens do not depend on the batch).
      num_drafts: drafts per step for this request, 0 to ``EngineConfig.num_drafts`` (0: no
        drafting); None = ``EngineConfig.num_drafts``.
      request_id: optional id (default ``req<N>``).
    """
    self._check_open()
    prompt = _token_ids("prompt", prompt)
    vocab = self.model.config.vocab_size
    if not 1 <= len(prompt) <= self.max_prompt_len:
      raise ValueError(f"prompt has {len(prompt)} tokens; expected 1 to max_prompt_len = "
                       f"{self.max_prompt_len} (EngineConfig.max_prompt_len / LMConfig.max_prompt_len)")
    if min(prompt) < 0 or max(prompt) >= vocab:
      raise ValueError(f"prompt holds ids in [{min(prompt)}, {max(prompt)}]; expected [0, {vocab})")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens!r}; expected an int >= 1")
    device_history = self.config.overlapped and self.config.num_drafts > 0
    if ((self.model.config.has_attention or device_history)
        and len(prompt) + max_new_tokens > self.max_seq_len):
      holds, fix = ("the KV cache capacity", "") if self.model.config.has_attention else (
          "the device token history of overlapped drafting", ", or overlap=False")
      raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens={max_new_tokens} exceeds "
                       f"max_seq_len={self.max_seq_len}, {holds} per request "
                       f"(EngineConfig.max_seq_len{fix})")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
        or not 0 <= temperature < float("inf")):
      raise ValueError(f"temperature={temperature!r}; expected a finite float >= 0")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**31:
      raise ValueError(f"seed={seed!r}; expected an int in [0, 2**31)")
    k_max = self.config.num_drafts
    num_drafts = k_max if num_drafts is None else num_drafts
    if (not isinstance(num_drafts, (int, np.integer)) or isinstance(num_drafts, bool)
        or not 0 <= num_drafts <= k_max):
      raise ValueError(f"num_drafts={num_drafts!r}; expected None or an int in [0, {k_max}] "
                       f"(EngineConfig.num_drafts)")
    stops = _token_ids("stop_tokens", stop_tokens)
    if any(not 0 <= s < vocab for s in stops):
      raise ValueError(f"stop_tokens={stops}; expected ids in [0, {vocab})")
    rid = request_id if request_id is not None else f"req{len(self._requests)}"
    if rid in self._requests:
      raise ValueError(f"request_id={rid!r} was already submitted")
    self._requests[rid] = _Request(rid=rid, prompt=prompt, max_new_tokens=max_new_tokens,
                                   stop_tokens=stops, temperature=float(temperature), seed=int(seed),
                                   num_drafts=int(num_drafts), t_submit=self._clock())
    self._waiting.append(rid)
    return rid

  @property
  def idle(self) -> bool:
    """No request waiting or running (and, with ``overlap``, no step in flight)."""
    return not self._waiting and not self._running and self._inflight is None

  def step(self) -> list:
    """Admits waiting requests, runs one decode (or verify) step for every running request;
    returns the ids that finished during this step."""
    self._check_open()
    if self.config.overlapped:
      finished = self._overlapped_step()
    else:
      finished = self._admit()
      if self._running:
        finished += self._decode()
    self.steps += 1
    return finished

  def run(self, *, progress=None) -> dict:
    """Steps until idle; returns {request id: generated token ids} for every request so far.

    ``progress``: an optional callable ``progress(num_finished_this_step)`` (e.g. a tqdm bar's
    ``update``)."""
    while not self.idle:
      done = self.step()
      if progress is not None:
        progress(len(done))
    self._warn_if_cache_useless()
    return self.outputs()

  def outputs(self) -> dict:
    """{request id: generated token ids so far}."""
    return {rid: list(r.generated) for rid, r in self._requests.items()}

  def stats(self, request_id: str) -> RequestStats:
    r = self._requests[request_id]
    end = r.t_done if r.t_done is not None else self._clock()
    ttft = (r.t_first - r.t_submit) if r.t_first is not None else float("nan")
    decode_s = end - r.t_first if r.t_first is not None else 0.0
    rate = (len(r.generated) - 1) / decode_s if decode_s > 0 and len(r.generated) > 1 else float("nan")
    return RequestStats(request_id=r.rid, slot=r.slot, prompt_tokens=len(r.prompt),
                        generated_tokens=len(r.generated), prefix_hit_tokens=r.prefix_hit,
                        drafted_tokens=r.drafted, accepted_drafts=r.accepted, time_to_first_token_s=ttft, decode_tokens_per_s=rate, total_s=end - r.t_submit)

  @property
  def cache(self):
    """The LMCache (pool of ``config.num_slots`` slots). Donated on each step: do not keep it."""
    return self._cache

  # ---- scheduling ----------------------------------------------------------------------------

  def _clock(self) -> float:
    return self._clock_base + time.perf_counter() - self._t0

  def _check_open(self):
    if self._closed:
      raise RuntimeError("this engine was preempted; continue with Engine.resume(directory)")

  def _admit(self) -> list:
    admitted = []
    while self._waiting and self._free:
      r = self._requests[self._waiting.popleft()]
      r.slot = self._free.pop(0)
      admitted.append(r)
    group = self.prefill_rows
    if self.config.prefix_block:   # one by one: a request may hit the snapshots of the one before
      firsts = [self._prefill(r) for r in admitted]
    else:
      firsts = [tok for i in range(0, len(admitted), group) for tok in self._prefill_group(admitted[i:i + group])]
    finished = []
    for r, first in zip(admitted, firsts):
      r.t_first = self._clock()
      if self._append(r, first):
        finished.append(r.rid)
      else:
        self._running.append(r.rid)
    return finished

  def _rows(self, values, width, fill, dtype):
    """``values`` padded with ``fill`` to ``width``: a host array (the jitted step moves it to the
    device in its C++ dispatch, cheaper than a ``jnp.asarray`` per input)."""
    out = np.full((width,), fill, dtype)
    out[:len(values)] = values
    return out

  def _prefill_group(self, reqs: list) -> list:
    """Whole prompts of ``reqs`` in one prefill (width 1 or ``prefill_rows``); first tokens."""
    width = 1 if len(reqs) == 1 else self.prefill_rows
    tokens = np.full((width, self.max_prompt_len), PAD_TOKEN, np.int32)
    for i, r in enumerate(reqs):
      tokens[i, :len(r.prompt)] = r.prompt
    rows = lambda values, fill, dtype: self._rows(values, width, fill, dtype)
    tok, self._cache = self._programs.prefill(
        self._leaves, self._cache, tokens, rows([r.slot for r in reqs], -1, np.int32),
        rows([len(r.prompt) for r in reqs], 0, np.int32), rows([r.temperature for r in reqs], 0.0, np.float32),
        rows([r.seed for r in reqs], 0, np.int32), resume=False, mtp=self._mtp)
    return np.asarray(tok)[:len(reqs)].tolist()

  def _prefill(self, r: _Request) -> int:
    """One request's prompt in blocks of ``prefix_block`` (prefix caching); its first token."""
    cfg, p = self.config, r.prompt
    temps, seeds = jnp.array([r.temperature], jnp.float32), jnp.array([r.seed], jnp.int32)
    slots = jnp.array([r.slot], jnp.int32)
    block, start = cfg.prefix_block, 0
    self.prefix_lookups += 1
    for k in range((len(p) - 1) // block * block, 0, -block):
      hit = self._snapshots.get(tuple(p[:k]))
      if hit is not None:
        self._snapshots.move_to_end(tuple(p[:k]))
        self._cache = self._programs.copy(self._leaves, self._cache, jnp.array([hit], jnp.int32),
                                          slots)
        self.prefix_hits += 1
        r.prefix_hit = start = k
        break
    tok = None
    for s in range(start, len(p), block):
      tok = self._prefill_chunk(p[s:s + block], block, slots, temps, seeds, resume=s > 0)
      if s + block <= len(p):
        self._snapshot(r.slot, p[:s + block])
    return tok

  def _prefill_chunk(self, tokens, width, slots, temps, seeds, *, resume) -> int:
    toks = self._rows(tokens, width, PAD_TOKEN, np.int32)[None]
    tok, self._cache = self._programs.prefill(self._leaves, self._cache, toks, slots,
                                              jnp.array([len(tokens)], jnp.int32), temps, seeds,
                                              resume=resume, mtp=self._mtp)
    return int(tok[0])

  def _snapshot(self, slot: int, prefix) -> None:
    """Copies ``slot`` into a prefix slot keyed by ``prefix`` (LRU eviction)."""
    key = tuple(prefix)
    if key in self._snapshots or len(key) >= self.max_prompt_len:
      return  # already cached, or no prompt could extend it
    if not self._free_snapshots:
      _, evicted = self._snapshots.popitem(last=False)
      self._free_snapshots.append(evicted)
    dst = self._free_snapshots.pop(0)
    self._cache = self._programs.copy(self._leaves, self._cache, jnp.array([slot], jnp.int32),
                                      jnp.array([dst], jnp.int32))
    self._snapshots[key] = dst

  def _at_boundary(self, n: int) -> bool:
    """Whether a state covering n tokens sits on a prefix-cache block boundary below
    max_prompt_len (``_on_boundary``). Decode flushes such rows (so a snapshot there has an empty
    ring window) by position alone, cached or not: a request's flushes depend on it alone, and an
    overlapped step knows them before the host has its input token."""
    return bool(_on_boundary(n, block=self.config.prefix_block, max_prompt_len=self.max_prompt_len))

  def _snapshot_due(self, r: _Request, n: int, run=()) -> bool:
    """A slot whose state covers the first n tokens of ``r.prompt + r.generated + run`` is
    snapshotted there: a block boundary below max_prompt_len, not cached yet. (The tokens are
    only gathered at a boundary: O(1) per row and step elsewhere.) With the MTP head only
    drafting requests are: every step of theirs runs the head, so its KV cache covers the
    sequence (a request without drafts decodes without it while no drafting request runs)."""
    if self._mtp and not r.num_drafts:
      return False
    return (self._at_boundary(n)
            and tuple((r.prompt + r.generated + list(run))[:n]) not in self._snapshots)

  def _snapshot_step(self, step: "_InFlight | _InFlightVerify | None") -> None:
    """Snapshots the rows of a dispatched decode step whose state then sits on a block boundary
    (prefix caching with overlapped steps). Called before anything else is dispatched on their
    slots; by then the host holds every token the states cover (the step's input token is the
    output of the step before, collected already)."""
    if not self.config.prefix_block or not isinstance(step, _InFlight):
      return
    for r, ok, n in zip(step.reqs, step.live, step.covered):
      if ok and not r.done and self._snapshot_due(r, n):
        assert len(r.prompt) + len(r.generated) >= n, (r.rid, n)
        self._snapshot(r.slot, (r.prompt + r.generated)[:n])

  def _draft_count(self, r: _Request, n: int) -> int:
    """Drafts row r verifies this step (its state covers its first n - 1 tokens; token 0 is the
    n-th): ``_draft_limit``. The cut depends on the request alone (not on what is cached), so its
    tokens stay independent of the other requests."""
    return int(_draft_limit(n, r.num_drafts, r.max_new_tokens - len(r.generated),
                            block=self.config.prefix_block, max_prompt_len=self.max_prompt_len))

  def _drafts(self, r: _Request, n: int) -> list:
    k = self._draft_count(r, n) if self.config.num_drafts else 0
    if not k:
      return []
    if self._mtp:   # placeholders: the verify step reads the head's drafts from the cache
      return [PAD_TOKEN] * k
    if r.rid not in self._drafters:
      self._drafters[r.rid] = NgramDrafter(r.prompt + r.generated, ngram=self.config.ngram)
    return self._drafters[r.rid].drafts(k)

  def _decode(self) -> list:
    cfg = self.config
    reqs = [self._requests[rid] for rid in self._running]
    width = next(b for b in cfg.batch_buckets if b >= len(reqs))
    lens = [len(r.prompt) + len(r.generated) for r in reqs]
    # A row whose last token reaches a block boundary flushes, so a snapshot's window is empty.
    force = [self._at_boundary(n) for n in lens]
    drafts = [self._drafts(r, n) for r, n in zip(reqs, lens)]
    # With the MTP head every step of a drafting request verifies: the head drafts after it.
    if (any(drafts) or self._cache.stacks is not None
        or (self._mtp and any(r.num_drafts for r in reqs))):
      rows = lambda values, fill, dtype: self._rows(values, width, fill, dtype)
      per_row = (rows([r.slot for r in reqs], -1, np.int32), rows(force, False, bool),
                 rows([r.temperature for r in reqs], 0.0, np.float32),
                 rows([r.seed for r in reqs], 0, np.int32),
                 rows([len(r.generated) for r in reqs], 0, np.int32))
      # One program per (bucket, T): T from the requests' draft counts, not from this step's cuts.
      t = 1 + max(r.num_drafts for r in reqs)
      tokens = np.full((width, t), PAD_TOKEN, np.int32)
      for i, (r, d) in enumerate(zip(reqs, drafts)):
        tokens[i, :1 + len(d)] = [r.generated[-1]] + d
      run, emitted, self._cache = self._programs.verify(
          self._leaves, self._cache, tokens,
          rows([1 + len(d) for d in drafts], 1, np.int32), *per_row,
          replay=cfg.replay, implementation=cfg.implementation, mtp=self._mtp)
      run, emitted = np.asarray(run), np.asarray(emitted)
      runs = [run[i, :emitted[i]].tolist() for i in range(len(reqs))]
    else:
      step = self._dispatch(reqs, [True] * len(reqs), [r.generated[-1] for r in reqs],
                            [len(r.generated) for r in reqs])
      runs = [[tok] for tok in np.asarray(step.tokens)[:len(reqs)].tolist()]
    for r, n, run in zip(reqs, lens, runs):
      covered = n - 1 + len(run)          # the state covers token 0 and the accepted drafts
      if self._snapshot_due(r, covered, run):
        self._snapshot(r.slot, (r.prompt + r.generated + run)[:covered])
    finished = []
    for r, d, run in zip(reqs, drafts, runs):
      r.drafted += len(d)
      r.accepted += len(run) - 1
      # A stop token ends the run; the tokens after it were committed but the slot is freed.
      if any(self._append(r, tok) for tok in run):
        finished.append(r.rid)
        self._running.remove(r.rid)
        self._drafters.pop(r.rid, None)
      elif r.rid in self._drafters:
        self._drafters[r.rid].extend(run)
    return finished

  def _overlapped_step(self) -> list:
    """Collects the step in flight and dispatches the next. While no request waits, the next
    step is dispatched first, from the device tokens of the one in flight (with drafting, its
    device carry: token history, lengths, budgets) (same rows; a row that reaches max_new_tokens
    there becomes a padding row, one that hits a stop token there computes a step nobody reads,
    into the slot it frees); otherwise the host collects, admits, and dispatches from its own
    tokens."""
    prev, self._inflight, finished = self._inflight, None, []
    drafting = bool(self.config.num_drafts)
    self._snapshot_step(prev)
    if prev is not None and not self._waiting:
      # Rows that may still run after prev, which emits at least one token per row — except, with
      # prefix caching, a drafting row it holds on a block boundary (the device's own budget flag
      # makes a finished row a padding row).
      least = 0 if drafting and self.config.prefix_block else 1
      live = [ok and not r.done and len(r.generated) + least < r.max_new_tokens
              for r, ok in zip(prev.reqs, prev.live)]
      if any(live) and drafting:
        self._inflight = self._speculate(prev.reqs, live, carry=prev.carry)
      elif any(live):
        self._inflight = self._dispatch(prev.reqs, live, prev.tokens,
                                        [len(r.generated) + 1 for r in prev.reqs])
    if prev is not None:
      finished = self._collect(prev)
    if self._inflight is None:
      finished += self._admit()
      if self._running:
        reqs = [self._requests[rid] for rid in self._running]
        if drafting:
          self._inflight = self._speculate(reqs, [True] * len(reqs))
        else:
          self._inflight = self._dispatch(reqs, [True] * len(reqs),
                                          [r.generated[-1] for r in reqs],
                                          [len(r.generated) for r in reqs])
    return finished

  def _speculate(self, reqs, live, carry=None) -> _InFlightVerify:
    """One speculative step of ``reqs`` drafted on the device (``live`` False: padding rows),
    from ``carry`` (the device state of the chained step before) or, None, from the host's
    tokens; not waited for."""
    cfg = self.config
    width = next(b for b in cfg.batch_buckets if b >= len(reqs))
    rows = lambda values, fill, dtype: self._rows(values, width, fill, dtype)
    if carry is None:
      history = np.full((width, self.max_seq_len), PAD_TOKEN, np.int32)
      for i, r in enumerate(reqs):
        seq = r.prompt + r.generated
        history[i, :len(seq)] = seq
      carry = (history, rows([len(r.prompt) + len(r.generated) for r in reqs], 1, np.int32),
               rows([len(r.generated) for r in reqs], 0, np.int32),
               rows([False] * len(reqs), False, bool), rows([False] * len(reqs), False, bool))
      # Committed like the carry a chained step passes, so both share one compiled program.
      carry = jax.device_put(carry, self._cache.positions.sharding)
    run, emitted, drafted, carry, self._cache = self._programs.speculate(
        self._leaves, self._cache, *carry,
        rows([r.slot if ok else -1 for r, ok in zip(reqs, live)], -1, np.int32),
        rows([r.max_new_tokens for r in reqs], 1, np.int32),
        rows([r.num_drafts for r in reqs], 0, np.int32),
        rows([r.temperature for r in reqs], 0.0, np.float32), rows([r.seed for r in reqs], 0, np.int32),
        num_tokens=1 + max(r.num_drafts for r in reqs), ngram=cfg.ngram, replay=cfg.replay,
        implementation=cfg.implementation, mtp=self._mtp, prefix_block=cfg.prefix_block,
        max_prompt_len=self.max_prompt_len if cfg.prefix_block else 0)
    return _InFlightVerify(reqs=reqs, live=live, run=run, emitted=emitted, drafted=drafted,
                           carry=carry)

  def _dispatch(self, reqs, live, tokens, positions) -> _InFlight:
    """One decode step of ``reqs`` (rows with ``live`` False are padding rows) from ``tokens`` (a
    host list, or the device tokens of the step before) at ``positions`` (tokens generated
    before the step's output), not waited for. Rows whose state then covers a prefix-cache
    block boundary flush (``_at_boundary``)."""
    cfg = self.config
    covered = [len(r.prompt) + p for r, p in zip(reqs, positions)]
    force = [ok and self._at_boundary(n) for ok, n in zip(live, covered)]
    width = next(b for b in cfg.batch_buckets if b >= len(reqs))
    rows = lambda values, fill, dtype: self._rows(values, width, fill, dtype)
    if not isinstance(tokens, jax.Array):
      # Committed like the device tokens a chained step passes: jit keys its programs on
      # commitment, so host and device tokens then share one compiled step.
      tokens = jax.device_put(rows(tokens, PAD_TOKEN, np.int32), self._cache.positions.sharding)
    slots = rows([r.slot if ok else -1 for r, ok in zip(reqs, live)], -1, np.int32)
    nxt, self._cache = self._programs.decode(
        self._leaves, self._cache, tokens, slots, rows(force, False, bool),
        rows([r.temperature for r in reqs], 0.0, np.float32), rows([r.seed for r in reqs], 0, np.int32),
        rows(positions, 0, np.int32), replay=cfg.replay, implementation=cfg.implementation)
    return _InFlight(reqs=reqs, live=live, tokens=nxt, covered=covered)

  def _collect(self, step: "_InFlight | _InFlightVerify") -> list:
    """Reads a dispatched step's tokens and appends them to its live, unfinished rows (a
    speculative run up to its first stop token, as in ``_decode``). A speculative row whose state
    then sits on a block boundary is snapshotted first, as ``_decode`` does: the device holds it
    in the chained step already dispatched (``_speculate_impl``), so its slot is unchanged."""
    if isinstance(step, _InFlightVerify):
      run, emitted, drafted = (np.asarray(x) for x in (step.run, step.emitted, step.drafted))
      runs = [run[i, :emitted[i]].tolist() for i in range(len(step.reqs))]
      drafted = drafted.tolist()
    else:
      runs = [[tok] for tok in np.asarray(step.tokens).tolist()]
      drafted = [0] * len(step.reqs)
    finished = []
    for r, ok, toks, d in zip(step.reqs, step.live, runs, drafted):
      if not ok or r.done or not toks:   # (no tokens: held on a boundary, or budget reached)
        continue
      n = len(r.prompt) + len(r.generated)   # the state covered n - 1 tokens before the step
      if isinstance(step, _InFlightVerify) and self._snapshot_due(r, n - 1 + len(toks), toks):
        self._snapshot(r.slot, (r.prompt + r.generated + toks)[:n - 1 + len(toks)])
      r.drafted += d
      r.accepted += len(toks) - 1
      if any(self._append(r, tok) for tok in toks):
        finished.append(r.rid)
        self._running.remove(r.rid)
    return finished

  def _append(self, r: _Request, token: int) -> bool:
    """Records a generated token; retires the request (frees its slot) when it is done."""
    r.generated.append(token)
    if token in r.stop_tokens or len(r.generated) >= r.max_new_tokens:
      r.done, r.t_done = True, self._clock()
      self._free.append(r.slot)
      self._free.sort()
      return True
    return False

  def _warn_if_cache_useless(self):
    if self.config.prefix_block and self.prefix_lookups and not self.prefix_hits and not self._warned:
      self._warned = True
      msg = (f"prefix caching is on (prefix_block={self.config.prefix_block}, prefix_slots="
             f"{self.config.prefix_slots}) but 0 of {self.prefix_lookups} prompt lookups hit: the "
             f"snapshots cost copies and pool slots for nothing; turn it off (prefix_block=0) or "
             f"share prompt prefixes of at least prefix_block tokens")
      logger.warning(msg)
      warnings.warn(msg, RuntimeWarning, stacklevel=3)

  # ---- preemption ----------------------------------------------------------------------------

  def preempt(self, directory) -> None:
    """Writes params, cache (Orbax) and scheduler state (JSON) to ``directory``; closes the engine."""
    import orbax.checkpoint as ocp
    self._check_open()
    if self._inflight is not None:   # the state on disk covers every dispatched step
      self._snapshot_step(self._inflight)
      self._collect(self._inflight)
      self._inflight = None
    path = pathlib.Path(directory).absolute()
    path.mkdir(parents=True, exist_ok=True)
    params, cache, tensor_parallel = self._params, self._cache, None
    if isinstance(self.model, ShardedLM):
      # Saved in the unsharded layout (the cache through the host, gathered on no device), so
      # ``resume`` may shard it over any mesh the heads divide, or not at all.
      params, cache = self.model.unshard_params(), self.model.unshard_cache(cache, host=True)
      tensor_parallel = {"axis": self.model.axis, "size": self.model.tp}
    # A synchronous checkpointer, closed on exit: no background commit thread outlives the call.
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      ckptr.save(path / "params", args=ocp.args.StandardSave(params))
      ckptr.save(path / "cache", args=ocp.args.StandardSave(cache))
    state = {
        "model_config": self.model.config.to_dict(), "engine_config": dataclasses.asdict(self.config),
        "tensor_parallel": tensor_parallel,
        "requests": [dataclasses.asdict(r) for r in self._requests.values()],
        "waiting": list(self._waiting), "running": self._running, "free": self._free,
        "snapshots": [[list(k), v] for k, v in self._snapshots.items()],
        "free_snapshots": self._free_snapshots, "clock": self._clock(),
        "counters": [self.prefix_lookups, self.prefix_hits, self.steps, self._warned],
    }
    (path / "engine.json").write_text(json.dumps(state))
    self._closed, self._cache = True, None

  @classmethod
  def resume(cls, directory, *, mesh=None, axis: str | None = None) -> "Engine":
    """Rebuilds a preempted engine (model, cache, requests) from ``directory`` and continues.

    With ``mesh`` the model and cache are sharded over its axis ``axis`` (``shard_model``; None:
    the axis the preempted engine used, else "tp"), whatever the preempted engine ran on (the
    checkpoint is unsharded); without, the engine runs unsharded. Tokens are the same up to the
    float summation order of the mixers' psums (bit for bit on the same layout)."""
    import orbax.checkpoint as ocp
    path = pathlib.Path(directory).absolute()
    state_file = path / "engine.json"
    if not state_file.is_file():
      raise ValueError(f"directory={str(path)!r} has no engine.json; expected a directory written "
                       f"by Engine.preempt")
    try:
      state = json.loads(state_file.read_text())
      model_config = LMConfig.from_dict(state["model_config"])
      ec = dict(state["engine_config"])
      ec["batch_buckets"] = tuple(ec["batch_buckets"])
      config = EngineConfig(**ec)
      requests = {r["rid"]: _Request(**r) for r in state["requests"]}
      scheduler = [state[k] for k in ("waiting", "running", "free", "snapshots", "free_snapshots",
                                      "clock", "counters")]
      saved_axis = (state.get("tensor_parallel") or {}).get("axis", "tp")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{state_file} is not a valid engine state written by Engine.preempt "
                       f"({type(e).__name__}: {e})") from None
    waiting, running, free, snapshots, free_snapshots, clock, counters = scheduler
    abstract = nnx.eval_shape(lambda: LM(model_config, rngs=nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract)
    host = mesh is not None   # restored on the host: each device then takes only its shards
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
      # Compared before restoring: a restore that fails part-way leaves Orbax's reads pending.
      _check_saved(ckptr, path, "params", abstract_params)
      params = ckptr.restore(path / "params",
                             args=ocp.args.StandardRestore(_targets(abstract_params, host)))
      if not host:   # what a sharded engine saved from the host, Orbax restores as numpy arrays
        params = jax.tree.map(jnp.asarray, params)
      unsharded = nnx.merge(graphdef, params)
      model = shard_model(unsharded, mesh, axis=axis or saved_axis) if host else unsharded
      max_seq_len = config.max_seq_len or (config.max_prompt_len or model_config.max_prompt_len) + 1024
      abstract_cache = jax.eval_shape(lambda: _init_cache(unsharded, config, max_seq_len))
      _check_saved(ckptr, path, "cache", abstract_cache)
      cache = ckptr.restore(path / "cache",
                            args=ocp.args.StandardRestore(_targets(abstract_cache, host)))
    cache = model.shard_cache(cache) if host else jax.tree.map(jnp.asarray, cache)
    engine = cls(model, config, _cache=cache)
    engine._requests = requests
    engine._waiting = collections.deque(waiting)
    engine._running, engine._free = running, free
    engine._snapshots = collections.OrderedDict((tuple(k), v) for k, v in snapshots)
    engine._free_snapshots = free_snapshots
    engine._clock_base, engine._t0 = clock, time.perf_counter()
    engine.prefix_lookups, engine.prefix_hits, engine.steps, engine._warned = counters
    return engine


def _check_saved(ckptr, path, what: str, abstract) -> None:
  """Raises ValueError unless ``path / what`` (an Orbax checkpoint written by ``Engine.preempt``)
  holds the arrays of ``abstract``: the same names, shapes and dtypes."""
  try:
    metadata = ckptr.metadata(path / what)
  except (FileNotFoundError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"{path / what} is not a checkpoint written by Engine.preempt "
                     f"({type(e).__name__}: {e})") from None
  metadata = getattr(metadata, "item_metadata", metadata)
  saved = {m.name: (tuple(m.shape), str(m.dtype)) for m in jax.tree.leaves(metadata)}
  if not saved:
    raise ValueError(f"{path / what} holds no checkpoint written by Engine.preempt")

  def name(key_path):
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in key_path)
  expected = {name(p): (tuple(x.shape), str(x.dtype))
              for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  for leaf in sorted(saved.keys() | expected.keys()):
    if saved.get(leaf) != expected.get(leaf):
      raise ValueError(f"{path}: the saved {what} does not match the model and engine config of "
                       f"its engine.json (written by another version of replayssm_jax?): {leaf} "
                       f"saved as {saved.get(leaf)}, expected {expected.get(leaf)} (shape, dtype)")


def _targets(abstract, host: bool):
  """Orbax restore targets: ``abstract`` (device arrays), or with ``host`` numpy arrays of its
  shapes and dtypes (Orbax then restores on the host)."""
  return jax.tree.map(lambda x: np.empty(x.shape, x.dtype), abstract) if host else abstract


def _committed(tree):
  """Every array of ``tree`` committed to its current sharding (no copy)."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


def _init_cache(model: LM, config: EngineConfig, max_seq_len: int):
  return model.init_cache(
      config.num_slots, buffer_len=config.buffer_len, max_draft=config.num_drafts,
      state_dtype=jnp.dtype(config.state_dtype),
      ring_dtype=None if config.ring_dtype is None else jnp.dtype(config.ring_dtype),
      read_copy_dtype=None if config.read_copy_dtype is None else jnp.dtype(config.read_copy_dtype),
      max_len=max_seq_len, verify_stacks=not config.replay and config.num_drafts > 0,
      mtp_drafts=config.num_drafts if config.drafter == "mtp" else 0)


def _token_ids(name: str, ids) -> list:
  """A flat sequence of integer token ids (possibly empty) → list[int]; anything else
  (floats, nested or ragged lists, strings) is a ValueError."""
  try:
    array = np.asarray(ids)
  except (ValueError, TypeError):
    array = None
  if array is None or array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
    shown = repr(ids) if len(repr(ids)) < 80 else repr(ids)[:77] + "..."
    raise ValueError(f"{name}={shown}; expected a flat sequence of integer token ids")
  return [int(t) for t in array]
