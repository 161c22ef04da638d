"""Tensor parallelism over heads: ``sharded = shard_model(model, mesh, axis="tp")``.

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
from replayssm_jax.models.lm import LM, LMCache, VerifyStep


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

  The model's multi-token-prediction head is not sharded (``mtp`` is None): MTP drafting needs
  the unsharded LM.
  """

  def __init__(self, model: LM, mesh, axis: str):
    c = model.config
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
    self.model, self.mesh, self.axis, self.tp = model, mesh, axis, tp
    # The MTP head drafts for generate / serving.Engine, which take an unsharded LM: not sharded.
    self.local_config = dataclasses.replace(c, **local, mtp_layers=0)
    local_model = nnx.eval_shape(lambda: LM(self.local_config, rngs=nnx.Rngs(0)))
    local_model.tp_axis = axis
    self._graphdef, local_state = nnx.split(local_model)
    _, full_state = nnx.split(model)
    leaves, specs = [], []
    for path, x in jax.tree_util.tree_leaves_with_path(full_state):
      if getattr(path[0], "key", None) == "mtp":
        continue
      value, spec = self._param(path, x)
      leaves.append(jax.device_put(value, NamedSharding(mesh, spec)))
      specs.append(spec)
    treedef = jax.tree.structure(local_state)
    self.params = jax.tree.unflatten(treedef, leaves)
    self._param_specs = jax.tree.unflatten(treedef, specs)
    self._steps = {}

  @property
  def config(self):
    """The unsharded model's LMConfig (global head counts)."""
    return self.model.config

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
    c = self.model.config
    if kind == "gdn":
      kd, vd = c.num_k_heads * c.head_k_dim, c.num_v_heads * c.head_v_dim
      conv = [kd, kd, vd]
      return conv + [vd, c.num_v_heads, c.num_v_heads] if what == "in_proj" else conv
    m = c.mamba2_mixer()
    gn = m.num_groups * m.state_dim
    conv = [m.inner_dim, gn, gn]
    return [m.inner_dim] + conv + [m.num_heads] if what == "in_proj" else conv

  def _param(self, path, x):
    """(global value, PartitionSpec) of one parameter of the unsharded model."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # drops the trailing .value
    a = self.axis
    if "mlp" in keys and self.model.blocks[keys[keys.index("blocks") + 1]].mlp_type == "moe":
      return self._moe_param(keys[-1], x)
    if "mixer" not in keys:
      return x, P()
    kind = self.model.blocks[keys[keys.index("blocks") + 1]].layer_type
    rest = keys[keys.index("mixer") + 1:]
    if kind == "parallel":   # blocks.i.mixer.{mamba2,attention}.<name>
      kind, rest = rest[0], rest[1:]
    name = "/".join(str(k) for k in rest)
    if kind == "attention":
      # Head-major columns (q_proj: [q_h | gate_h] per head), so a contiguous split is by head.
      if name in ("q_proj/kernel", "k_proj/kernel", "v_proj/kernel"):
        return x, P(None, a)
      return (x, P(a, None)) if name == "o_proj/kernel" else (x, P())   # q_norm, k_norm
    if name == "in_proj/kernel":
      return _regroup(x, 1, self._groups(kind, "in_proj"), self.tp, to_device_major=True), P(None, a)
    if name == "conv_weight":
      return _regroup(x, 1, self._groups(kind, "conv"), self.tp, to_device_major=True), P(None, a)
    if name == "conv_bias":
      return _regroup(x, 0, self._groups(kind, "conv"), self.tp, to_device_major=True), P(a)
    if name == "out_proj/kernel":
      return x, P(a, None)
    if name == "norm_weight" and kind == "gdn":
      return x, P()                                  # [V], shared by every value head
    return x, P(a)                                   # A_log, dt_bias, D, Mamba2 norm_weight

  def _moe_param(self, name, x):
    """Experts split along their intermediate dimension; routing and latent maps replicated."""
    a, m = self.axis, self.model.config.moe
    if name == "gate_up":
      i = m.expert_intermediate_size
      return _regroup(x, 2, [i, i], self.tp, to_device_major=True), P(None, None, a)
    if name == "shared_gate_up":
      sz = m.shared_intermediate_size
      return _regroup(x, 1, [sz, sz], self.tp, to_device_major=True), P(None, a)
    specs = {"up": P(None, None, a), "down": P(None, a, None), "shared_up": P(None, a),
             "shared_down": P(a, None)}
    return x, specs.get(name, P())   # router, correction_bias, shared_expert_gate, latent_in/out

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

  def shard_cache(self, cache: LMCache) -> LMCache:
    """An unsharded model's cache → the sharded layout, placed on the mesh."""
    cache = self._convert_cache(cache, to_sharded=True)
    specs = self.cache_specs(cache)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), cache, specs)

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
      build = lambda: self._convert_cache(self.model.init_cache(num_slots, **kwargs), to_sharded=True)
      abstract = jax.eval_shape(build)
      shardings = jax.tree.map(lambda _, s: NamedSharding(self.mesh, s), abstract,
                               self.cache_specs(abstract))
      self._steps[key] = jax.jit(build, out_shardings=shardings)
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
  return jax.jit(lambda params, cache, *batch: run(jax.tree.leaves(params), cache, *batch),
                 donate_argnums=(1,))


def shard_model(model: LM, mesh, *, axis: str = "tp") -> ShardedLM:
  """Shards ``model``'s mixer heads over ``mesh`` axis ``axis`` (see ``ShardedLM``)."""
  if not isinstance(model, LM):
    raise ValueError(f"model must be a replayssm_jax.models.LM; got {type(model).__name__}")
  return ShardedLM(model, mesh, axis)
