"""``kvcanary fuzz``: a workload under perturbed schedules, compared with its unperturbed run (docs/fuzz.md).

Corruption that depends on the schedule (a free that races the next admission, a pool tight enough to
preempt, a chunk boundary on a page edge) hides from a run with one schedule. The fuzzer runs a seeded
workload once on the engine's usual schedule (the reference) and K times with a perturbed one (token
budget, batch cap, pool size and preemptions, scheduler, arrival order and steps), every run under the
canary; any violation, any request whose greedy tokens differ from the reference, or a failure the reference
does not have is a finding, printed with its workload and perturbation seeds and the command that replays it.

Example:
    >>> from kvcanary.fuzz import run_fuzz
    >>> summary = run_fuzz("sim", workloads=2, perturbations=3, seed=0)
    >>> summary["ok"], summary["runs"]
    (True, 8)

Modules: ``judge`` (a run, and the findings of a run against the reference), ``sim_fuzz`` and ``hf_fuzz``
(each engine's perturbations and runs), ``campaign`` (the loop and the summary).
"""

from kvcanary.fuzz.campaign import ENGINES, format_summary, parse_replay, replay_command, run_fuzz, run_workload

__all__ = ["ENGINES", "format_summary", "parse_replay", "replay_command", "run_fuzz", "run_workload"]
