"""A simulated SGLang-style paged-KV engine driving the canary, and the planted-bug zoo.

``run_sim(SimConfig(...))`` plays a seeded workload through the engine and returns
what the canary reported; ``SimConfig(bug=name)`` plants one bug of ``BUGS``.
docs/zoo.md describes the engine, every bug and the measured zoo table.
"""

from kvcanary.sim.bugs import BUGS, Bug, BugSwitch
from kvcanary.sim.config import MATRIX, SimConfig, matrix
from kvcanary.sim.engine import SimEngine, SimResult, default_canary_config, run_sim

__all__ = ["BUGS", "MATRIX", "Bug", "BugSwitch", "SimConfig", "SimEngine", "SimResult", "default_canary_config",
           "matrix", "run_sim"]
