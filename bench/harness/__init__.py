"""The benchmark harness: what every family shares to measure and report, and nothing about what is measured.

``context`` (sizes and scratch space of a run), ``results`` (statistics, ``Result``, results.json), ``machine``,
``report`` (docs/benchmarks.md's generated blocks), ``processes`` (children in their own sessions).
"""
