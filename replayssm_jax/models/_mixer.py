"""Methods the GatedDeltaNet and Mamba2 mixers share: input and cache checks, decode, the
speculative verify and commit (conv-state rewind) and the ``__call__`` alias. A mixer sets
``cache_type`` and ``ops`` (its family's module, ``gdn`` or ``mamba2``) and defines
``config.hidden_size``, ``_op_inputs`` and ``_output``."""
import jax.numpy as jnp

from replayssm_jax import _checks, _dispatch
from replayssm_jax.cursor import ReplayPlan
from replayssm_jax.models import _conv


def check_conventional(bufs) -> None:
  """Conventional decode (``replay=False``) writes the checkpoint pool every step and would leave a
  read copy stale: refused."""
  if bufs.read_copy is not None:
    raise ValueError("decode(replay=False) with a cache made with read_copy_dtype: conventional "
                     "decode would leave the read copy stale; use replay=True or a cache without one")


class ConvMixer:
  cache_type: type
  ops: object   # the family's module: decode, replay_decode, replay_verify, verify_conventional

  def _check_x(self, name, x, ndim, what):
    _checks.expect_float(name, x)
    _checks.expect_shape(name, x, (None,) * (ndim - 1) + (self.config.hidden_size,), what)

  def _check_cache(self, cache):
    if not isinstance(cache, self.cache_type):
      name = self.cache_type.__name__
      raise ValueError(f"cache must be a {name} (from init_cache); got {type(cache).__name__}")

  def decode(self, x, cache, plan: ReplayPlan, *, replay=True, implementation=None):
    """One decode token per row.

    Args:
      x: [B, D] activations of the current token.
      cache: this layer's cache (``cache_type``).
      plan: ReplayPlan from the model's shared ``cursor.plan(slots)``. With ``replay=False`` only
        ``plan.slots`` is used (conventional decode never reads the cursor or the ring).
      replay: True → ``ops.replay_decode`` on checkpoint + ring; False → ``ops.decode`` on the
        checkpoint pool (read + write the state every step).
      implementation: forwarded to the family's op and, as ``_dispatch.without_mosaic`` maps it,
        the conv step (None = fastest available).

    Returns:
      (y [B, D] in the layer dtype, zeros on padding rows; cache). The caller commits the
      cursor once for all layers (replay mode only).
    """
    self._check_x("x", x, 2, "([B, D])")
    self._check_cache(cache)
    slots = _conv.plan_slots(plan, x.shape[0])
    conv_impl = _dispatch.without_mosaic(implementation)
    args, kwargs, z, conv_state = self._op_inputs(
        x, lambda inputs, weight, bias: _conv.step(inputs, weight, bias, cache.conv_state, slots,
                                                   implementation=conv_impl))
    if replay:
      out, bufs = self.ops.replay_decode(*args, cache.bufs, plan, implementation=implementation,
                                         **kwargs)
    else:
      check_conventional(cache.bufs)
      out, state = self.ops.decode(*args, cache.bufs.state, slots, implementation=implementation,
                                   **kwargs)
      bufs = cache.bufs.replace(state=state)
    y = jnp.where((slots >= 0)[:, None], self._output(out, z), 0)
    return y, cache.replace(conv_state=conv_state, bufs=bufs)

  def verify(self, x, cache, plan: ReplayPlan, *, lengths=None, implementation=None):
    """T tokens per row in one step (token 0 = the emitted token, then T-1 drafts), ReplaySSM only.

    The T tokens go through the causal conv (continuing the slot's stored inputs) and
    ``ops.replay_verify``: the ring gets all T entries past the live window, the cursor and the
    conv state stay as they are. ``commit`` then keeps the accepted prefix (the model commits the
    shared cursor once for all layers).

    Args:
      x: [B, T, D] activations, T = ``plan.num_tokens``.
      cache: this layer's cache (``cache_type``).
      plan: ReplayPlan from the model's shared ``cursor.plan(slots, num_tokens=T)``.
      lengths: optional int32[B] real tokens per row in [1, T] (None: all T); padded lanes are
        inert. Commit at most ``lengths[b]`` tokens.
      implementation: forwarded to ``ops.replay_verify`` (None = fastest available).

    Returns:
      (y [B, T, D] in the layer dtype, zeros on padding rows; cache with the ring written;
      window [B, W-1+T, C], the conv inputs ``commit`` needs to roll the conv state forward).
    """
    self._check_x("x", x, 3, "([B, T, D])")
    self._check_cache(cache)
    slots = _conv.plan_slots(plan, x.shape[0])
    args, kwargs, z, window = self._verify_inputs(x, cache, slots)
    out, bufs = self.ops.replay_verify(*args, cache.bufs, plan, lengths=lengths,
                                       implementation=implementation, **kwargs)
    y = jnp.where((slots >= 0)[:, None, None], self._output(out, z), 0)
    return y, cache.replace(bufs=bufs), window

  def _verify_inputs(self, x, cache, slots):
    """T tokens per row through the projections and the conv (continuing the slot's stored
    inputs): (op arguments, op keywords, z, conv window), shared by ReplaySSM verify and the
    conventional speculative baseline (``models._stack_verify``)."""
    return self._op_inputs(
        x, lambda inputs, weight, bias: _conv.verify(inputs, weight, bias, cache.conv_state, slots))

  def commit(self, cache, window, plan: ReplayPlan, num_accepted):
    """After ``verify``: the conv state of each live row becomes its last W-1 inputs up to its
    ``num_accepted`` (int32[B] in [1, T]) accepted tokens; rejected drafts leave no trace. The
    ring needs nothing: the caller's ``cursor.commit(plan, num_accepted)`` is its rollback."""
    self._check_cache(cache)
    return cache.replace(conv_state=_conv.commit(cache.conv_state, window, plan.slots, num_accepted))

  def __call__(self, x, cache, plan, *, replay=True, implementation=None):
    """Alias of ``decode``."""
    return self.decode(x, cache, plan, replay=replay, implementation=implementation)
