"""Benchmarks for replayssm_jax (run as modules from the repository root, e.g. ``python -m bench.gdn_decode``).

``bench.common`` holds what every benchmark shares: run metadata, the timing loop, the copy
ceiling, launch-config parsing, tables and result files. Each ``bench.<op>`` module defines its
arms, its byte model and its correctness gate; ``bench/RESULTS.md`` collects published runs.
"""
