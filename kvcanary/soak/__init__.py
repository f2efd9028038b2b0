"""``kvcanary soak``: campaigns of seeded clean workloads that must report nothing (docs/soak.md).

A sanitizer that cries wolf gets switched off. A soak campaign runs many seeded clean workloads, on
transformers continuous batching (each without and with the canary: zero violations, and the same greedy
tokens) or on the simulated engine's clean configurations (zero violations, no health problem), and
lists every finding with the seed that replays it.

Example:
    >>> from kvcanary.soak import run_campaign
    >>> summary = run_campaign("sim", workloads=20, seed=0)
    >>> summary["ok"], summary["violations"]
    (True, 0)

Modules: ``hf_workload`` (the transformers workload generator), ``hf_engine`` (what the driver knows of
one transformers version), ``hf_run`` (one workload, without and with the canary), ``sim_workload``
(simulated-engine configurations), ``campaign`` (the loop, the progress bar, the summary).
"""

from kvcanary.soak.campaign import ENGINES, describe, format_summary, run_campaign, run_one, summarize
from kvcanary.soak.hf_run import Outcome

__all__ = ["ENGINES", "Outcome", "describe", "format_summary", "run_campaign", "run_one", "summarize"]
