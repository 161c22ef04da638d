"""The launch tables (replayssm_jax/_launch_tables.py) against the config rules that read them:
every table cites an existing result, covers every key and input the library promises, holds
valid values, every rule is reachable, and each config function returns the rule's entry."""
import dataclasses
import itertools
import pathlib
import re
import subprocess

import jax.numpy as jnp
import pytest

from replayssm_jax import _launch_tables as tables
from replayssm_jax import config

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
DEVICES = {"NVIDIA H200": tables.H200, "NVIDIA H100 80GB HBM3": tables.H100,
           "NVIDIA A100-SXM4-80GB": tables.OTHER_GPU, "cpu": tables.CPU}
STATES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
FAMILY_STATE = tuple(itertools.product(("gdn", "mamba2"), STATES))
# Inputs a ladder may bound, the values the grid below tries, and the value used where a ladder
# does not bound an input (B = 256 keeps every grid wide enough for the two-programs-per-SM rule).
GRID = {"batch": (1, 2, 7, 8, 9, 31, 32, 33, 127, 128, 129, 255, 256, 1024),
        "tokens": (1, 2, 3, 4, 5, 8), "buffer_len": (2, 4, 7, 8, 12, 16, 32),
        "ring_size": (4, 8, 15, 16, 32, 64), "head_dim": (16, 64, 128, 129, 256),
        "rows": (1, 16, 2560, 81920)}
DEFAULT = {"batch": 256, "tokens": 4, "buffer_len": 16, "ring_size": 16, "head_dim": 128,
           "rows": 2560}
V = K = 128                  # GDN head (Qwen3.5-4B): Hk 16, Hv 32
P, N, H, G = 64, 128, 128, 8   # Mamba2 head (Nemotron-3-Super)
# Keys each table must have (the library promises f32, bf16 and f16 state, both families, both
# routes); the rest have the single key ANY.
KEYS = {"gdn_decode": set(STATES), "gdn_flush_decode": set(STATES), "gdn_fold_tiles": set(STATES),
        "mamba2_decode": set(STATES), "mamba2_replay_route": set(STATES),
        "verify_mosaic": set(FAMILY_STATE), "replay_min_batch": set(FAMILY_STATE),
        "mamba2_replay_step": set(config.ROUTES)}


def _tables(device):
  return {f.name: getattr(device, f.name) for f in dataclasses.fields(device)
          if isinstance(getattr(device, f.name), tables.Table)}


ALL = [(kind, name, table) for kind, device in DEVICES.items()
       for name, table in _tables(device).items()]
ALL += [("any", name, getattr(tables, name))
        for name in ("BUFFER_LEN", "GDN_REPLAY_ROUTE", "FOLD_ROW_SLOTS")]
IDS = [f"{kind}-{name}" for kind, name, _ in ALL]


def _check_in_history(commit, path):
  """The cited file exists at that commit (checked where the clone has the history)."""
  root = RESULTS.parent.parent
  have = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
  if have.returncode:
    pytest.skip(f"commit {commit} is not in this clone (shallow?)")
  found = subprocess.run(["git", "-C", str(root), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
  assert found.returncode == 0, f"{path} is not in commit {commit}"


@pytest.mark.parametrize("kind,name,table", ALL, ids=IDS)
def test_table_cites_its_source(kind, name, table):
  """Result files exist in bench/results/ (or, for runs whose files left the tree, in the git
  history: ``git show <commit>:bench/results/<file>``); anything else is a dated command, or says
  why the value is not measured (untuned, interpret mode, CPU)."""
  assert table.source and isinstance(table.source, tuple)
  for cited in table.source:
    old = re.fullmatch(r"git show ([0-9a-f]{7,40}):(bench/results/[\w.-]+\.(?:json|log|txt))", cited)
    if re.fullmatch(r"[\w.-]+\.(json|log|txt)", cited):
      assert (RESULTS / cited).is_file(), f"{name} cites bench/results/{cited}, which is missing"
    elif old:
      _check_in_history(*old.groups())
    else:
      assert (re.match(r"(untuned|interpret mode|CPU)\b", cited)
              or re.match(r"H200 \d{4}-\d{2}-\d{2}, .*python -m bench\.", cited)), cited


@pytest.mark.parametrize("kind,name,table", ALL, ids=IDS)
def test_ladders_are_complete(kind, name, table):
  """Every promised key is there; every ladder ends in an unconditional rule and bounds only
  known inputs with (lo, hi) ranges."""
  if kind != "any":
    assert set(table.rows) == KEYS.get(name, {tables.ANY})
  for ladder in table.rows.values():
    assert ladder and ladder[-1][0] == {}, "the last rule must hold everywhere"
    for when, _ in ladder:
      assert set(when) <= set(GRID)
      for lo, hi in when.values():
        assert lo is not None or hi is not None
        assert lo is None or hi is None or lo <= hi


def _first_rules(ladder):
  """Indices of the ladder's rules that decide some grid point, with such a point each."""
  names = sorted({n for when, _ in ladder for n in when})
  found = {}
  for values in itertools.product(*(GRID[n] for n in names)):
    point = {**DEFAULT, **dict(zip(names, values))}
    for i, (when, _) in enumerate(ladder):
      if all((lo is None or point[n] >= lo) and (hi is None or point[n] <= hi)
             for n, (lo, hi) in when.items()):
        found.setdefault(i, point)
        break
  return found


@pytest.mark.parametrize("kind,name,table", ALL, ids=IDS)
def test_every_rule_decides_some_input(kind, name, table):
  for ladder in table.rows.values():
    assert sorted(_first_rules(ladder)) == list(range(len(ladder)))


def _gdn_kw(kind, state, point):
  return dict(device_kind=kind, state_dtype=STATES[state], head_k_dim=K, head_v_dim=V,
              num_k_heads=16, batch=point["batch"], buffer_len=point["buffer_len"],
              ring_size=point["ring_size"])


def _m2_kw(kind, state, point):
  return dict(device_kind=kind, state_dtype=STATES[state], head_dim=P, state_dim=N, num_heads=H,
              num_groups=G, batch=point["batch"], buffer_len=point["buffer_len"],
              ring_size=point["ring_size"])


def _decode(kind, state, point):
  return config.decode_config(device_kind=kind, state_dtype=STATES[state], head_k_dim=K,
                              head_v_dim=V, batch=point["batch"])


def _m2_decode(kind, state, point):
  return config.mamba2_decode_config(device_kind=kind, state_dtype=STATES[state], head_dim=P,
                                     state_dim=N, batch=point["batch"])


def _verify(kind, point, route):
  return config.verify_config(**_gdn_kw(kind, "f32", point), num_tokens=point["tokens"],
                              route=route)


def _m2_verify(kind, point, route):
  return config.mamba2_verify_config(**_m2_kw(kind, "f32", point), num_tokens=point["tokens"],
                                     route=route)


def _gdn_tile(entry, *head):
  return config._kernel(entry, K).fit(*head)


def _m2_tile(entry):
  return config._mamba2(entry, P, N).fit(P, N, H // G)


def _attention_launch(kind, key, point):
  """Block, warps and stages (the splits follow a rule, tested below) at a Qwen3.5-4B layer."""
  cfg = config.attention_decode_config(device_kind=kind, head_dim=point["head_dim"],
                                       batch=point["batch"], num_kv_heads=4, seq_len=1040)
  return cfg.block_kv, cfg.num_warps, cfg.num_stages


# Per table: (the config functions' answer at a grid point for a key, the answer the rule's
# entry gives at that point).
CHECKS = {
    "gdn_decode": (_decode, lambda e, kind, key, pt: _gdn_tile(e, V)),
    "gdn_flush_decode": (
        lambda kind, key, pt: config.flush_decode_config(
            device_kind=kind, state_dtype=STATES[key], head_k_dim=K, head_v_dim=V,
            ring_size=pt["ring_size"], batch=pt["batch"]),
        lambda e, kind, key, pt: _gdn_tile(e, V)),
    "gdn_replay_step": (lambda kind, key, pt: config.replay_config(**_gdn_kw(kind, "f32", pt)).step,
                        lambda e, kind, key, pt: _gdn_tile(e, V, K)),
    "gdn_fold": (lambda kind, key, pt: (config.replay_config(**_gdn_kw(kind, "f32", pt)).fold,
                                        config.materialize_config(
                                            device_kind=kind, head_k_dim=K, head_v_dim=V,
                                            ring_size=pt["ring_size"])),
                 lambda e, kind, key, pt: (_gdn_tile(e, V, K),) * 2),
    "gdn_fold_tiles": (
        lambda kind, key, pt: config.replay_config(**_gdn_kw(kind, key, pt)).fold_tiles,
        lambda e, kind, key, pt: e),
    "verify_route": (lambda kind, key, pt: (_verify(kind, pt, None).route,
                                            _m2_verify(kind, pt, None).route),
                     lambda e, kind, key, pt: (e, e)),
    "gdn_verify_reconstruct": (
        lambda kind, key, pt: _verify(kind, pt, "reconstruct").step,
        lambda e, kind, key, pt: _decode(kind, "f32", pt) if e is None else config.KernelConfig(**e)),
    "gdn_verify_output_only": (
        lambda kind, key, pt: _verify(kind, pt, "output_only").step,
        lambda e, kind, key, pt: (config.replay_config(**_gdn_kw(kind, "f32", pt)).step
                                  if e is None else _gdn_tile(e, V, K))),
    "verify_mosaic": (
        lambda kind, key, pt: config.verify_implementations(
            device_kind=kind, family=key[0], state_dtype=STATES[key[1]], num_tokens=pt["tokens"],
            batch=pt["batch"]),
        lambda e, kind, key, pt: ("pallas_mosaic",) if e else ()),
    "replay_min_batch": (
        lambda kind, key, pt: config.replay_min_batch(
            device_kind=kind, state_dtype=STATES[key[1]], buffer_len=pt["buffer_len"],
            family=key[0]),
        lambda e, kind, key, pt: e),
    "mamba2_decode": (_m2_decode, lambda e, kind, key, pt: config._mamba2(e, P, N).fit(P, N)),
    "mamba2_flush_block_n": (
        lambda kind, key, pt: config.mamba2_flush_decode_config(
            device_kind=kind, state_dtype=jnp.float32, head_dim=P, state_dim=N,
            batch=pt["batch"]).block_n,
        lambda e, kind, key, pt: config._size(e, N)),
    "mamba2_replay_route": (
        lambda kind, key, pt: config.mamba2_replay_config(**_m2_kw(kind, key, pt)).route,
        lambda e, kind, key, pt: e),
    "mamba2_replay_step": (
        lambda kind, key, pt: config.mamba2_replay_config(**_m2_kw(kind, "f32", pt),
                                                          route=key).step,
        lambda e, kind, key, pt: _m2_tile(e)),
    "mamba2_fold": (
        lambda kind, key, pt: config.mamba2_replay_config(**_m2_kw(kind, "f32", pt),
                                                          route="output_only").fold,
        lambda e, kind, key, pt: (config._gdn_fold(DEVICES[kind], N, pt["ring_size"])
                                  if e is None else config._kernel(e, N)).fit(P, N)),
    "mamba2_fold_tiles": (
        lambda kind, key, pt: config.mamba2_replay_config(**_m2_kw(kind, "f32", pt),
                                                          route="output_only").fold_tiles,
        lambda e, kind, key, pt: e),
    "mamba2_verify_reconstruct": (
        lambda kind, key, pt: _m2_verify(kind, pt, "reconstruct").step,
        lambda e, kind, key, pt: (_m2_decode(kind, "f32", pt) if e is None
                                  else config._mamba2(e, P, N).fit(P, N))),
    "mamba2_verify_output_only": (lambda kind, key, pt: _m2_verify(kind, pt, "output_only").step,
                                  lambda e, kind, key, pt: _m2_tile(e)),
    "mamba2_materialize": (
        lambda kind, key, pt: config.mamba2_materialize_config(device_kind=kind, head_dim=P,
                                                               state_dim=N),
        lambda e, kind, key, pt: config._mamba2(e, P, N).fit(P, N)),
    "mosaic": (
        lambda kind, key, pt: (config.mosaic_decode_config(device_kind=kind, state_dtype=jnp.float32,
                                                           head_v_dim=V),
                               config.mosaic_mamba2_verify_config(device_kind=kind, head_dim=P)),
        lambda e, kind, key, pt: (config.MosaicConfig(**e),) * 2),
    "gdn_verify_mosaic_rows": (
        lambda kind, key, pt: config.mosaic_verify_config(
            device_kind=kind, head_v_dim=V, batch=pt["batch"], num_tokens=pt["tokens"]).rows,
        lambda e, kind, key, pt: e),
    "attention_decode": (_attention_launch,
                         lambda e, kind, key, pt: (e["block_kv"], e["num_warps"], e["num_stages"])),
    "grouped_matmul": (lambda kind, key, pt: config.grouped_matmul_config(device_kind=kind,
                                                                          rows=pt["rows"]),
                       lambda e, kind, key, pt: config.GroupedMatmulConfig(**e)),
}


def test_every_table_is_checked():
  assert set(CHECKS) == set(_tables(tables.H200))


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_selection_returns_the_tables_entry(kind, name):
  """At a grid point decided by each rule, the config function returns that rule's entry."""
  table = getattr(DEVICES[kind], name)
  actual, expected = CHECKS[name]
  for key, ladder in table.rows.items():
    for i, point in _first_rules(ladder).items():
      assert actual(kind, key, point) == expected(ladder[i][1], kind, key, point), (key, i, point)


def test_device_independent_tables_are_what_the_rules_use():
  assert config.buffer_len_for(1) == config.DECODE_BUFFER_LEN == 16
  assert [config.buffer_len_for(t) for t in (2, 4, 8, 16)] == [4, 8, 8, 16]
  for kind in DEVICES:
    assert config.replay_config(**_gdn_kw(kind, "f32", DEFAULT)).route == "output_only"
  # Decode fold rows: one slot per expected flushing row (B / L), verify twice the expectation.
  assert config._decode_fold_rows(256, 16) == 16 and config._decode_fold_rows(256, 8) == 32
  assert config._verify_fold_rows(256, 8, 4) == 256 and config._verify_fold_rows(64, 16, 2) == 16


def test_values_are_valid():
  """Tiles build valid configs; GPU Mosaic tiles are lowerable (64-row WGMMA tiles); the other
  values are in their domain."""
  for kind, device in DEVICES.items():
    for name, table in _tables(device).items():
      for ladder in table.rows.values():
        for _, value in ladder:
          if name in ("verify_route", "mamba2_replay_route"):
            assert value in config.ROUTES
          elif name in ("gdn_fold_tiles", "mamba2_fold_tiles", "gdn_verify_mosaic_rows"):
            assert config._pow2(value)
          elif name == "verify_mosaic":
            assert isinstance(value, bool)
          elif name == "replay_min_batch":
            assert isinstance(value, int) and value >= 0
          elif name == "mamba2_flush_block_n":
            assert config._pow2(config._size(value, N))
          elif name == "attention_decode":
            assert all(config._pow2(value[k]) for k in ("block_kv", "num_warps"))
            assert value["num_stages"] >= 1 and value["min_programs"] >= 1
          elif name == "grouped_matmul":
            config.GroupedMatmulConfig(**value)
          elif name == "mosaic":
            cfg = config.MosaicConfig(**value)
            assert kind == "cpu" or cfg.block_v % 64 == 0
          elif value is not None and "block_p" in value:
            config._mamba2(value, P, N)
          elif value is not None:
            assert isinstance(value["block_v"], int)   # only K chunks may depend on the head
            config._kernel(value, K)


@pytest.mark.parametrize("batch,seq,splits", [(256, 1040, 1), (32, 1040, 2), (1, 1040, 4),
                                              (1, 100, 1)])
def test_attention_splits_fill_the_grid_but_keep_eight_blocks_each(batch, seq, splits):
  cfg = config.attention_decode_config(device_kind="NVIDIA H200", head_dim=256, batch=batch,
                                       num_kv_heads=4, seq_len=seq)
  assert (cfg.block_kv, cfg.num_splits, cfg.num_warps, cfg.num_stages) == (32, splits, 4, 2)
