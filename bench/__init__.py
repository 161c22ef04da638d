"""Benchmarks for replayssm_jax (run as modules from the repository root, e.g. ``python -m bench.gdn_decode``).

``bench.common`` holds what every benchmark shares: run metadata, the timing loop, the copy
ceiling, launch-config parsing, tables and result files. ``bench.harness`` runs the layer
benchmarks (``bench.gdn_decode``, ``bench.mamba2_decode``): each declares its geometry, arms, byte
model, data and float64 oracle, and the harness does the rest. ``bench.peer_*`` add other
projects' kernels as arms of the same harness, through jax_triton. ``bench/RESULTS.md`` collects
published runs.
"""
