"""The step runner: the canary around one forward of an engine source (``runtime/engine.py``), eager,
captured or fused.

- ``plans``: the recorded step (its design note): one key per step, one cache of plans (eager -> recorded ->
  replayed), two recorders, one close;
- ``runner``: ``StepRunner``, which takes each step on the path it allows;
- ``tables``: the step's ``ForwardBatch``, its read table and the new tokens' read check;
- ``staging``: the host part's pinned buffers and their copies;
- ``graphs``, ``fused``: captured steps (a graph per batch shape) and fused steady decode steps (the CUDA-graph
  recorder); ``steady``: the CPU's bound plans (the CPU recorder);
- ``kernels``: the index work as Triton kernels (its numba loops: ``ops/read_table_ops.py``).
"""

from kvcanary.runtime.step.runner import StepRunner

__all__ = ["StepRunner"]
