"""Methods the GatedDeltaNet and Mamba2 mixers share: input and cache checks, the speculative
commit (conv-state rewind) and the ``__call__`` alias. A mixer sets ``cache_type`` and defines
``config.hidden_size``, ``decode``."""
from replayssm_jax import _checks
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

  def _check_x(self, name, x, ndim, what):
    _checks.expect_float(name, x)
    _checks.expect_shape(name, x, (None,) * (ndim - 1) + (self.config.hidden_size,), what)

  def _check_cache(self, cache):
    if not isinstance(cache, self.cache_type):
      name = self.cache_type.__name__
      raise ValueError(f"cache must be a {name} (from init_cache); got {type(cache).__name__}")

  def commit(self, cache, window, plan: ReplayPlan, num_accepted):
    """After ``verify``: the conv state of each live row becomes its last W-1 inputs up to its
    ``num_accepted`` (int32[B] in [1, T]) accepted tokens; rejected drafts leave no trace. The
    ring needs nothing: the caller's ``cursor.commit(plan, num_accepted)`` is its rollback."""
    self._check_cache(cache)
    return cache.replace(conv_state=_conv.commit(cache.conv_state, window, plan.slots, num_accepted))

  def __call__(self, x, cache, plan, *, replay=True, implementation=None):
    """Alias of ``decode``."""
    return self.decode(x, cache, plan, replay=replay, implementation=implementation)
