"""The step runner: the canary around one forward of an engine source (``runtime/engine.py``), eager,
captured or fused.

- ``runner``: ``StepRunner``, which takes each step on the path it allows;
- ``tables``: the step's ``ForwardBatch``, its read table and the new tokens' read check;
- ``staging``: the host part's pinned buffers and their copies;
- ``graphs``, ``fused``: captured steps (a graph per batch shape) and fused steady decode steps;
- ``kernels``: the index work as Triton kernels (its numba loops: ``ops/read_table_ops.py``).
"""

from kvcanary.runtime.step.runner import StepRunner

__all__ = ["StepRunner"]
