"""Benchmarks of the canary: ``ops`` (op throughput, ``kvcanary bench``), ``engine`` (one transformers
continuous-batching workload without and with the canary, ``python -m kvcanary.bench.engine``) and
``suite`` (the registered engine workloads, one process each, with trace attribution, table and plot:
``kvcanary bench --engine``). Scripts under ``benchmarks/`` in a checkout call these modules.
"""
