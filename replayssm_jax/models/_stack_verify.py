"""Conventional speculative verify of the recurrent mixers: the baseline ReplaySSM verify is
measured against (``LM.verify(..., replay=False)``).

Each recurrent layer keeps a state stack ``[N, T_max, ...]`` per slot and ``LMCache.read_index[n]``
names the entry with slot n's current state. A verify step reads that state, steps it token by
token through the T tokens and writes the state after token i to entry i
(``gdn.verify_conventional`` / ``mamba2.verify_conventional``: T full states written per row); the
rollback is ``read_index = num_accepted - 1``. Projections, conv and output are the mixers' own
(``_verify_inputs``, shared with their ``verify``); the conv rollback is the mixers' ``commit``.
"""
import jax.numpy as jnp

from replayssm_jax import _slots

f32 = jnp.float32


def verify(mixer, x, cache, stack, slots, read_index, *, lengths=None, implementation=None):
  """T tokens per row through a GatedDeltaNet or Mamba2 mixer, the state stepped in ``stack``.

  Args:
    mixer: a GatedDeltaNet or Mamba2 layer.
    x: [B, T, D] activations.
    cache: the layer's cache (its conv state is read; nothing in it is written).
    stack: [N, T_max, ...state] with T_max >= T.
    slots: int32[B] (negative = padding row).
    read_index: int32[B] the stack entry holding each row's state.
    lengths: optional int32[B] real tokens per row in [1, T].
    implementation: forwarded to ``verify_conventional``.

  Returns:
    (y [B, T, D] in the layer dtype, zeros on padding rows; stack; window [B, W-1+T, C] for the
    mixer's ``commit``).
  """
  args, kwargs, z, window = mixer._verify_inputs(x, cache, slots)
  o, stack = mixer.ops.verify_conventional(*args, stack, slots, read_index, lengths=lengths,
                                           implementation=implementation, **kwargs)
  y = jnp.where((slots >= 0)[:, None, None], mixer._output(o, z), 0)
  return y, stack, window


def current_state(stack, read_index, slots):
  """float32 [B, ...state]: each row's state ``stack[slot, read_index[slot]]`` (zeros on padding rows)."""
  rows = _slots.gather(stack, slots)                                        # [B, T_max, ...]
  idx = _slots.gather(read_index, slots)
  state = jnp.take_along_axis(rows, idx.reshape((-1,) + (1,) * (rows.ndim - 1)), axis=1)[:, 0]
  return jnp.where((slots >= 0).reshape((-1,) + (1,) * (state.ndim - 1)), state, 0).astype(f32)


def put_state(stack, slots, pool):
  """stack[slot, 0] = pool[slot] for the live rows (prefill's state becomes entry 0)."""
  rows = _slots.gather(stack, slots).at[:, 0].set(_slots.gather(pool, slots).astype(stack.dtype))
  return _slots.scatter_rows(stack, slots, rows)
