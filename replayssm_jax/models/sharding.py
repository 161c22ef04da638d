"""Tensor parallelism over heads: ``sharded = shard_model(model, mesh, axis="tp")``, or
``make_sharded_model(config, mesh)`` for random weights drawn per device.

Every mixer's heads are split evenly over the mesh axis (``jax.shard_map``): device d holds key
heads ``[d·Hk/tp, (d+1)·Hk/tp)`` and the value heads that read them (Mamba2: heads and B/C groups
likewise), so each device runs an ordinary ``LM`` built for the local head counts and the GDN /
Mamba2 kernels see local heads only. Per mixer:

* column-parallel: ``in_proj`` columns and the conv channels (q|k|v|z|b|a for GDN, z|x|B|C|dt for
  Mamba2) are regrouped device-major (each device's slice of every group, contiguous), per-head
  vectors (``A_log``, ``dt_bias``, ``D``, Mamba2 ``norm_weight``) split by head;
* attention: ``q_proj`` (per head [q | gate]), ``k_proj``, ``v_proj`` columns split by head
  (query heads and key/value heads alike), ``o_proj`` rows split by head; q/k norms replicated;
* a parallel block (Falcon-H1) shards its Mamba2 and its attention layer as above, each over its
  own heads; the two partial outputs are added, then summed over the devices once;
* mixture of experts: every expert's (and the shared expert's) intermediate dimension is split
  (``gate_up`` columns regrouped device-major as [gate | up], ``down`` rows), router, correction
  bias, shared gate and latent projections replicated; the partial outputs summed with ``psum``;
* row-parallel: ``out_proj`` / ``o_proj`` rows split by head, the partial outputs summed with
  ``psum``;
* replicated: embedding, norms, dense MLPs, head, the GDN gated-norm weight, the cursor and the
  slot positions.

The cache is sharded the same way: checkpoints and rings on their head axis, KV caches on their
key/value-head axis, the conv state on its (device-major) channel axis. ``shard_cache`` / ``unshard_cache`` convert between the
unsharded model's cache layout and the sharded one. Outputs equal the unsharded model's up to
float summation order (``psum`` of per-device partial ``out_proj`` products).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from replayssm_jax.models.attention import AttentionLayerCache
from replayssm_jax.models.gated_deltanet import GdnLayerCache
from replayssm_jax.models.lm import LM, LMCache, LMConfig, VerifyStep


def _regroup(x, dim, sizes, tp, *, to_device_major):
  """Splits ``dim`` into consecutive groups of ``sizes``; natural order (group-major) ↔
  device-major order (each device's 1/tp of every group, device by device)."""
  if to_device_major:
    groups = np.split(np.arange(x.shape[dim]), np.cumsum(sizes)[:-1])
    order = np.concatenate([g.reshape(tp, -1)[d] for d in range(tp) for g in groups])
  else:
    order = np.argsort(_regroup(np.arange(x.shape[dim]), 0, sizes, tp, to_device_major=True))
  if isinstance(x, np.ndarray):   # host arrays stay on the host (Engine.preempt / resume)
    return np.take(x, order, axis=dim)
  return jnp.take(x, jnp.asarray(order), axis=dim)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
  """Where a program over a ShardedLM runs (``ShardedLM.layout``; hashable, so jitted programs can
  be cached on it): the body runs per device under ``jax.shard_map`` over ``mesh``, on the
  device's parameter shards (``param_specs``, one per parameter leaf) and cache shards
  (``cache_specs``, the flattened specs of a cache with ``cache_treedef``); every other operand
  and every output but the cache is replicated. Outputs computed from the logits are replicated
  by construction (the logits are, after the mixers' psums), so every device samples the same
  tokens."""
  mesh: Mesh
  param_specs: tuple
  cache_specs: tuple
  cache_treedef: jax.tree_util.PyTreeDef

  def on_mesh(self, body, replicated_outputs: int, *, out_cache=None):
    """``body(param_leaves, cache, *args)`` → the same function run per device; ``body`` returns
    ``replicated_outputs`` replicated values, then the cache (only the cache when 0), whose specs
    are ``out_cache`` where they differ from the input's (``LM.verify`` returns a VerifyStep,
    ``LM.commit`` takes one)."""
    cache = jax.tree.unflatten(self.cache_treedef, self.cache_specs)
    out = cache if out_cache is None else out_cache

    def run(leaves, cache_in, *args):
      out_specs = (P(),) * replicated_outputs + (out,) if replicated_outputs else out
      # check_vma=False: the scans of the reference ops start from invariant zeros and carry
      # head-sharded (varying) values; the logits are replicated by construction (psum, then
      # replicated MLP and head).
      in_specs = (list(self.param_specs), cache) + (P(),) * len(args)
      return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)(list(leaves), cache_in, *args)
    return run


class ShardedLM:
  """An LM whose mixer heads are sharded over ``mesh`` axis ``axis`` (see the module docstring).

  ``prefill`` / ``decode`` / ``verify`` / ``commit`` have the signatures of the ``LM`` methods and
  take and return a sharded cache (from ``init_cache`` or ``shard_cache``; ``verify`` a
  ``VerifyStep`` holding one, its conv windows sharded like the conv states); they are jitted with
  the cache (the step) donated. ``serving.Engine`` takes a ShardedLM as it takes an LM.

  Built by ``shard_model`` (an LM's parameters, regrouped and placed leaf by leaf) or
  ``make_sharded_model`` (random weights drawn on the mesh). It keeps no unsharded copy:
  ``abstract_model`` is the unsharded LM's structure (shapes and dtypes), ``unshard_params`` its
  parameters gathered back to the host.

  The model's multi-token-prediction head is not sharded (``mtp`` is None): MTP drafting needs
  the unsharded LM. Its parameters are kept on the host, so ``unshard_params`` (and
  ``Engine.preempt``) lose nothing.
  """

  def __init__(self, config: LMConfig, mesh, axis: str, *, params=None, seed: int = 0):
    """Use ``shard_model`` (an LM's parameters) or ``make_sharded_model`` (drawn per device).

    ``params``: the unsharded model's parameter state (``nnx.split(model)[1]``; device or host
    arrays), regrouped and placed leaf by leaf; None: parameters drawn on the mesh from ``seed``
    (``make_sharded_model``)."""
    c = config
    if axis not in mesh.axis_names:
      raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    tp = mesh.shape[axis]
    types = set(c.layer_types)
    if "parallel" in types:   # a Mamba2 and an attention layer per block
      types |= {"mamba2", "attention"}
    local = {}
    checks = []
    if "gdn" in types:
      checks += [("num_k_heads", c.num_k_heads)]
      local.update(num_k_heads=c.num_k_heads // tp, num_v_heads=c.num_v_heads // tp)
    if "mamba2" in types:
      checks += [("mamba2_num_heads", c.mamba2_num_heads), ("mamba2_num_groups", c.mamba2_num_groups)]
      local.update(mamba2_num_heads=c.mamba2_num_heads // tp, mamba2_num_groups=c.mamba2_num_groups // tp)
    if "attention" in types:
      a = c.attention
      if a.bias:
        raise NotImplementedError("shard_model of attention layers with projection biases: the "
                                  "row-parallel o_proj would add its bias once per device")
      checks += [("attention.num_kv_heads", a.num_kv_heads)]
      local["attention"] = dataclasses.replace(a, num_heads=a.num_heads // tp,
                                               num_kv_heads=a.num_kv_heads // tp)
    if c.moe is not None and any(c.block_mlp(i) == "moe" for i in range(c.num_layers)):
      m = c.moe
      checks += [("moe.expert_intermediate_size", m.expert_intermediate_size),
                 ("moe.shared_intermediate_size", m.shared_intermediate_size)]
      local["moe"] = dataclasses.replace(m, expert_intermediate_size=m.expert_intermediate_size // tp,
                                         shared_intermediate_size=m.shared_intermediate_size // tp)
    for name, value in checks:
      if value % tp:
        raise ValueError(f"{name}={value} is not a multiple of the mesh axis {axis!r} size {tp}; "
                         f"heads (and Mamba2 groups, expert widths) must split evenly over the devices")
    self.mesh, self.axis, self.tp = mesh, axis, tp
    # The unsharded model's structure: shapes and dtypes, no arrays (``unshard_params`` has them).
    self.abstract_model = nnx.eval_shape(lambda: LM(c, rngs=nnx.Rngs(0)))
    # The MTP head drafts for generate / serving.Engine, which take an unsharded LM: not sharded.
    self.local_config = dataclasses.replace(c, **local, mtp_layers=0)
    local_model = nnx.eval_shape(lambda: LM(self.local_config, rngs=nnx.Rngs(0)))
    local_model.tp_axis = axis
    self._graphdef, local_state = nnx.split(local_model)
    full = jax.tree_util.tree_leaves_with_path(nnx.split(self.abstract_model)[1])
    self._layouts = [None if _is_mtp(path) else self._layout(path) for path, _ in full]
    leaves, mtp = (self._draw(seed) if params is None else
                   self._place(jax.tree.leaves(params, is_leaf=_is_array)))
    treedef = jax.tree.structure(local_state)
    self.params = jax.tree.unflatten(treedef, leaves)
    self._param_specs = jax.tree.unflatten(treedef, [spec for _, spec in filter(None, self._layouts)])
    self._mtp_params = mtp   # host arrays of the MTP head's leaves, kept for unshard_params
    self._steps = {}

  def _place(self, values):
    """(sharded leaves, MTP host leaves) from the unsharded parameter values, leaf by leaf."""
    if len(values) != len(self._layouts):
      raise ValueError(f"params has {len(values)} leaves; the model {len(self._layouts)}")
    leaves, mtp = [], []
    for x, layout in zip(values, self._layouts):
      if layout is None:
        mtp.append(np.asarray(x))
        continue
      regroup, spec = layout
      if regroup is not None:
        x = _regroup(x, *regroup, self.tp, to_device_major=True)
      leaves.append(jax.device_put(x, NamedSharding(self.mesh, spec)))
    return leaves, mtp

  def _draw(self, seed):
    """(sharded leaves, MTP host leaves) drawn by ``make_model(config, seed)``'s initializers
    (``_draw_program``)."""
    with jax.threefry_partitionable(True):
      leaves, mtp = _draw_program(self.abstract_model.config, self.mesh, self._layouts, seed)()
    return leaves, [np.asarray(x) for x in mtp]

  def unshard_params(self) -> nnx.State:
    """The unsharded model's parameters as host numpy arrays: each leaf gathered from its shards
    and put back in the natural order (conv and projection groups), the MTP head's as kept.
    ``nnx.merge(nnx.graphdef(sharded.abstract_model), sharded.unshard_params())`` is the LM
    (host arrays; ``jax.device_put`` it to run it on one device)."""
    sharded, mtp = iter(jax.tree.leaves(self.params)), iter(self._mtp_params)
    values = []
    for layout in self._layouts:
      if layout is None:
        values.append(next(mtp))
        continue
      x = next(sharded)
      if not x.is_fully_addressable:
        raise NotImplementedError("unshard_params over a mesh that spans processes: each process "
                                  "holds only its own shards")
      x, regroup = np.asarray(x), layout[0]
      values.append(x if regroup is None else _regroup(x, *regroup, self.tp, to_device_major=False))
    state = nnx.split(self.abstract_model)[1]
    return jax.tree.unflatten(jax.tree.structure(state, is_leaf=_is_array), values)

  @property
  def config(self):
    """The unsharded model's LMConfig (global head counts)."""
    return self.abstract_model.config

  @property
  def mtp(self):
    """None: the MTP head is not sharded."""
    return None

  @property
  def param_specs(self):
    """PartitionSpecs of ``params`` (the same tree)."""
    return self._param_specs

  def split(self):
    """(graphdef, params) of the per-device model, as ``nnx.split`` gives for an LM: inside a
    ``jax.shard_map`` over ``mesh`` with ``param_specs``, ``nnx.merge(graphdef, params)`` is the
    device's LM over its heads (its psums name ``axis``)."""
    return self._graphdef, self.params

  def layout(self, cache) -> MeshLayout:
    """The MeshLayout of programs over this model's parameters and ``cache`` (a sharded cache)."""
    specs, treedef = jax.tree.flatten(self.cache_specs(cache))
    return MeshLayout(self.mesh, tuple(jax.tree.leaves(self._param_specs)), tuple(specs), treedef)

  # ---- layouts -------------------------------------------------------------------------------

  def _groups(self, kind, what):
    """Group sizes of a mixer's column-parallel axis ``what`` ("in_proj" or "conv")."""
    c = self.abstract_model.config
    if kind == "gdn":
      kd, vd = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
      conv = [kd, kd, vd]
      return conv + [vd, c.num_v_heads, c.num_v_heads] if what == "in_proj" else conv
    m = c.mamba2_mixer()
    gn = m.num_groups * m.state_dim
    conv = [m.inner_dim, gn, gn]
    return [m.inner_dim] + conv + [m.num_heads] if what == "in_proj" else conv

  def _layout(self, path):
    """(regroup, PartitionSpec) of one parameter of the unsharded model: ``regroup`` = (dim, group
    sizes) for a leaf whose mesh layout puts each device's slice of every group together
    (``_regroup``), else None."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # drops the trailing .value
    a = self.axis
    block = self.abstract_model.blocks[keys[keys.index("blocks") + 1]] if "blocks" in keys else None
    if "mlp" in keys and block.mlp_type == "moe":
      return self._moe_layout(keys[-1])
    if "mixer" not in keys:
      return None, P()
    kind = block.layer_type
    rest = keys[keys.index("mixer") + 1:]
    if kind == "parallel":   # blocks.i.mixer.{mamba2,attention}.<name>
      kind, rest = rest[0], rest[1:]
    name = "/".join(str(k) for k in rest)
    if kind == "attention":
      # Head-major columns (q_proj: [q_h | gate_h] per head), so a contiguous split is by head.
      if name in ("q_proj/kernel", "k_proj/kernel", "v_proj/kernel"):
        return None, P(None, a)
      return None, (P(a, None) if name == "o_proj/kernel" else P())   # q_norm, k_norm
    if name == "in_proj/kernel":
      return (1, self._groups(kind, "in_proj")), P(None, a)
    if name == "conv_weight":
      return (1, self._groups(kind, "conv")), P(None, a)
    if name == "conv_bias":
      return (0, self._groups(kind, "conv")), P(a)
    if name == "out_proj/kernel":
      return None, P(a, None)
    if name == "norm_weight" and kind == "gdn":
      return None, P()                               # [V], shared by every value head
    return None, P(a)                                # A_log, dt_bias, D, Mamba2 norm_weight

  def _moe_layout(self, name):
    """Experts split along their intermediate dimension; routing and latent maps replicated."""
    a, m = self.axis, self.abstract_model.config.moe
    if name == "gate_up":
      return (2, [m.expert_intermediate_size] * 2), P(None, None, a)
    if name == "shared_gate_up":
      return (1, [m.shared_intermediate_size] * 2), P(None, a)
    specs = {"up": P(None, None, a), "down": P(None, a, None), "shared_up": P(None, a),
             "shared_down": P(a, None)}
    return None, specs.get(name, P())   # router, correction_bias, shared_expert_gate, latent_in/out

  def cache_specs(self, cache):
    """PartitionSpecs of a sharded LMCache (or of a VerifyStep: its cache, replicated plan, conv
    windows [B, W-1+T, C] on their device-major channel axis like the conv states)."""
    a = self.axis
    if isinstance(cache, VerifyStep):
      return self._verify_specs(cache.cache, cache.replay)
    layers = []
    for lc in cache.layers:
      if isinstance(lc, AttentionLayerCache):
        layers.append(AttentionLayerCache(k=P(None, None, a), v=P(None, None, a)))
        continue
      bufs = jax.tree.map(lambda _: P(None, a), lc.bufs)
      layers.append(lc.replace(conv_state=P(None, None, a), bufs=bufs))
    # Conventional verify's state stacks [N, T_max, heads, ...]: on their head axis.
    stacks = None if cache.stacks is None else tuple(None if s is None else P(None, None, a)
                                                     for s in cache.stacks)
    return LMCache(layers=tuple(layers), cursor=jax.tree.map(lambda _: P(), cache.cursor),
                   positions=P(), stacks=stacks, read_index=None if cache.read_index is None else P())

  def _convert_cache(self, cache, *, to_sharded):
    layers = []
    for lc in cache.layers:
      if isinstance(lc, AttentionLayerCache):
        layers.append(lc)
        continue
      kind = "gdn" if isinstance(lc, GdnLayerCache) else "mamba2"
      conv = _regroup(lc.conv_state, 2, self._groups(kind, "conv"), self.tp, to_device_major=to_sharded)
      layers.append(lc.replace(conv_state=conv))
    return cache.replace(layers=tuple(layers))

  def cache_shardings(self, cache):
    """``cache_specs`` as NamedShardings on the mesh (the same tree; arrays or abstract values)."""
    return jax.tree.map(lambda _, s: NamedSharding(self.mesh, s), cache, self.cache_specs(cache))

  def shard_cache(self, cache: LMCache) -> LMCache:
    """An unsharded model's cache → the sharded layout, placed on the mesh."""
    cache = self._convert_cache(cache, to_sharded=True)
    return jax.device_put(cache, self.cache_shardings(cache))

  def unshard_cache(self, cache: LMCache, *, host: bool = False) -> LMCache:
    """A sharded cache → the unsharded model's layout: single-device arrays, or with ``host``
    numpy arrays (nothing gathered on a device; ``shard_cache`` takes them back)."""
    cache = jax.tree.map(np.asarray if host else lambda x: jnp.asarray(np.asarray(x)), cache)
    return self._convert_cache(cache, to_sharded=False)

  def init_cache(self, num_slots: int, **kwargs) -> LMCache:
    """``LM.init_cache`` of the unsharded model, built sharded (each device allocates its own
    heads; nothing is built whole on one device)."""
    if kwargs.get("mtp_drafts"):
      raise NotImplementedError("init_cache(mtp_drafts>0) on a ShardedLM: the MTP head is not "
                                "sharded; draft with it on the unsharded LM")
    key = ("init_cache", num_slots, tuple(sorted(kwargs.items())))
    if key not in self._steps:   # compiled once per pool shape, as the steps are
      build = lambda: self._convert_cache(self.abstract_model.init_cache(num_slots, **kwargs),
                                            to_sharded=True)
      self._steps[key] = jax.jit(build, out_shardings=self.cache_shardings(jax.eval_shape(build)))
    return self._steps[key]()

  # ---- steps ---------------------------------------------------------------------------------

  def _step(self, method, cache, **static):
    key = (method, tuple(sorted(static.items())), jax.tree.structure(cache))
    if key not in self._steps:
      in_spec = self.cache_specs(cache)
      out_spec = self._verify_specs(cache, static["replay"]) if method == "verify" else (
          in_spec.cache if method == "commit" else in_spec)
      self._steps[key] = _sharded_step(self._graphdef, jax.tree.structure(self.params),
                                       self.layout(cache), method, static, out_spec)
    return self._steps[key]

  def _verify_specs(self, cache, replay):
    """Specs of ``LM.verify``'s VerifyStep over ``cache``: the cache's, the plan replicated, a conv
    window per recurrent layer (None for attention)."""
    windows = tuple(None if isinstance(lc, AttentionLayerCache) else P(None, None, self.axis)
                    for lc in cache.layers)
    return VerifyStep(cache=self.cache_specs(cache), plan=P(), windows=windows, replay=replay)

  def _run(self, method, cache, batch_args, **static):
    return self._step(method, cache, **static)(self.params, cache, *batch_args)

  def decode_step(self, cache, *, replay=True, implementation=None):
    """The jitted ``f(params, cache, tokens, slots, force_flush) → (logits, cache)`` behind
    ``decode``, for decode loops inside an outer ``jax.jit``: pass ``self.params`` as an argument
    (closing over them would embed every weight in the program as a constant). ``cache`` gives
    the layout (shapes only)."""
    return self._step("decode", cache, replay=replay, implementation=implementation)

  def prefill(self, tokens, cache, slots, lengths, *, resume=False):
    """``LM.prefill`` on the mesh: (logits [B, T, vocab] replicated, sharded cache)."""
    return self._run("prefill", cache, (tokens, slots, lengths), resume=resume)

  def decode(self, tokens, cache, slots, *, replay=True, implementation=None, force_flush=None):
    """``LM.decode`` on the mesh: (logits [B, vocab] replicated, sharded cache)."""
    if force_flush is None:
      force_flush = jnp.zeros(slots.shape, bool)
    return self._run("decode", cache, (tokens, slots, force_flush), replay=replay,
                     implementation=implementation)

  def verify(self, tokens, cache, slots, *, lengths=None, replay=True, implementation=None,
             force_flush=None):
    """``LM.verify`` on the mesh: (logits [B, T, vocab] replicated, VerifyStep over the sharded
    cache); pass the step to ``commit``."""
    if lengths is None:
      lengths = jnp.full(slots.shape, tokens.shape[1], jnp.int32)
    if force_flush is None:
      force_flush = jnp.zeros(slots.shape, bool)
    return self._run("verify", cache, (tokens, slots, lengths, force_flush), replay=replay,
                     implementation=implementation)

  def commit(self, step: VerifyStep, num_accepted) -> LMCache:
    """``LM.commit`` on the mesh: the sharded cache keeping the first ``num_accepted[b]`` tokens of
    each row of ``step`` (from ``verify``)."""
    if not isinstance(step, VerifyStep):
      raise ValueError(f"step must be the VerifyStep of ShardedLM.verify; got {type(step).__name__}")
    return self._run("commit", step, (num_accepted,))


def _sharded_step(graphdef, treedef, layout, method, static, out_spec):
  """jit(an LM method of the per-device model, on ``layout``'s mesh): ``f(params, cache or step,
  *batch)``, the second argument donated; ``out_spec`` the returned cache's (or step's)
  PartitionSpecs."""

  def body(leaves, cache, *batch):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    if method == "prefill":
      tokens, slots, lengths = batch
      return model.prefill(tokens, cache, slots, lengths, **static)
    if method == "verify":
      tokens, slots, lengths, force = batch
      return model.verify(tokens, cache, slots, lengths=lengths, force_flush=force, **static)
    if method == "commit":
      (num_accepted,) = batch
      return model.commit(cache, num_accepted)
    tokens, slots, force = batch
    return model.decode(tokens, cache, slots, force_flush=force, **static)

  run = layout.on_mesh(body, 0 if method == "commit" else 1, out_cache=out_spec)
  if method != "commit":
    return jax.jit(lambda params, cache, *batch: run(jax.tree.leaves(params), cache, *batch),
                   donate_argnums=(1,))
  # Commit donates the step's cache only: its plan and conv windows have no output to alias.
  commit = jax.jit(lambda params, cache, rest, *batch:
                   run(jax.tree.leaves(params), rest.replace(cache=cache), *batch),
                   donate_argnums=(1,))
  return lambda params, step, *batch: commit(params, step.cache, step.replace(cache=None), *batch)


def _draw_program(config, mesh, layouts, seed):
  """The jitted draw of an LM's parameters whose outputs are sharded by ``layouts`` (one per leaf:
  (regroup, spec), None for the MTP head's, which is replicated): each device computes only its
  own shards when traced under ``jax.threefry_partitionable(True)`` (counter-based bits). A
  column-parallel leaf is drawn in its device-major order (the regroup to it would need every
  device to draw the whole leaf), so ``unshard_params`` puts it back in the natural order."""
  def draw():
    values = jax.tree.leaves(nnx.split(LM(config, rngs=nnx.Rngs(seed)))[1], is_leaf=_is_array)
    return ([x for x, l in zip(values, layouts) if l is not None],
            [x for x, l in zip(values, layouts) if l is None])
  shardings = ([NamedSharding(mesh, l[1]) for l in layouts if l is not None],
               [NamedSharding(mesh, P()) for l in layouts if l is None])
  return jax.jit(draw, out_shardings=shardings)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def _is_mtp(path) -> bool:
  return getattr(path[0], "key", None) == "mtp"


def shard_model(model: LM, mesh, *, axis: str = "tp") -> ShardedLM:
  """Shards ``model``'s mixer heads over ``mesh`` axis ``axis`` (see ``ShardedLM``). The
  ShardedLM keeps no reference to ``model``: with host (numpy) parameters, as
  ``load_pretrained(mesh=)`` builds them, no device ever holds the whole model."""
  if not isinstance(model, LM):
    raise ValueError(f"model must be a replayssm_jax.models.LM; got {type(model).__name__}")
  return ShardedLM(model.config, mesh, axis, params=nnx.split(model)[1])


def make_sharded_model(config: LMConfig, mesh, *, axis: str = "tp", seed: int = 0) -> ShardedLM:
  """A ShardedLM with random weights drawn on the mesh: each device computes only its own
  shards, so a model larger than one device can be built (``make_model`` would build it whole
  first). The weights follow ``make_model(config, seed)``'s initializers; column-parallel
  matrices (mixer ``in_proj`` and conv, MoE ``gate_up``) are drawn in their mesh order, so the
  numbers differ from ``make_model``'s where ``mesh.shape[axis]`` > 1 (on one device they equal
  them to float32 rounding). ``unshard_params`` gives the unsharded model's parameters."""
  if not isinstance(config, LMConfig):
    raise ValueError(f"config must be a replayssm_jax.models.LMConfig; got {type(config).__name__}")
  return ShardedLM(config, mesh, axis, seed=seed)
