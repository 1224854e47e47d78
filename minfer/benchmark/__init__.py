"""Benchmark code: random-weight shapes, workloads and bounds, ``minfer bench`` (offline.py) and
``minfer bench-serve`` (serve.py, its report, the server launcher and a stdlib SSE client).

Scripts that reproduce the README's figures with it are in the repository's ``benchmarks/``.
"""
