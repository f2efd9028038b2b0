"""The bug zoo: every planted bug in every configuration where it applies, plus clean baselines.

``run_zoo`` runs the matrix (``kvcanary.sim.config.MATRIX``) for each seed: one clean
run per configuration, and one run per (bug, configuration) where the bug applies.
A bug run counts as detected when its mistake took effect (the engine hit it) and
the canary reported at least one violation, none before the step it took effect.
A clean run must report nothing. ``format_table`` prints the result one row per bug.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcanary.sim.bugs import BUGS
from kvcanary.sim.config import MATRIX, SimConfig
from kvcanary.sim.engine import SimResult, run_sim

SHORT_REASONS = {"verify_chain_hash": "chain", "verify_position": "pos", "verify_real_kv_hash": "real_kv",
                 "verify_token": "token", "write_token": "w_token", "write_position": "w_pos",
                 "shared_req_row": "row", "reserved_slot_read": "reserved", "reserved_slot_write": "w_reserved",
                 "nonfinite_kv": "nonfinite", "read_past_length": "past_len",
                 "live_block_free": "live_free", "free_list_duplicate": "free_dup",
                 "refcount_mismatch": "refcount", "free_block_write": "free_write", "shared_write_slot": "shared_write"}


def run_verdict(r: SimResult) -> str:
    """'clean' / 'FALSE ALARM' for clean runs; 'detected' / 'MISSED' / 'NOT PLANTED' / 'EARLY' for bug runs."""
    if r.bug is None:
        return "clean" if not r.detected and not r.health_problems else "FALSE ALARM"
    if r.planted_step is None:
        return "NOT PLANTED"
    if not r.detected:
        return "MISSED"
    if r.first_detected_step is not None and r.first_detected_step < r.planted_step:
        return "EARLY"
    return "detected"


@dataclass
class ZooReport:
    """Every run of a zoo invocation, grouped per bug (None = the clean baseline)."""

    runs: dict[str | None, list[SimResult]] = field(default_factory=dict)
    wall_s: float = 0.0
    seeds: int = 1

    @property
    def ok(self) -> bool:
        good = {None: "clean"}
        return all(run_verdict(r) == good.get(bug, "detected") for bug, rs in self.runs.items() for r in rs)

    def rows(self) -> list[dict]:
        """One summary row per bug (clean baseline first)."""
        out = []
        for bug, rs in self.runs.items():
            verdicts = [run_verdict(r) for r in rs]
            good = "clean" if bug is None else "detected"
            n_good = sum(v == good for v in verdicts)
            bad = sorted({v for v in verdicts if v != good})
            first = rs[0]
            lags = [r.first_detected_step - r.planted_step for r in rs
                    if r.first_detected_step is not None and r.planted_step is not None]
            info = BUGS.get(bug) if bug else None
            out.append({
                "bug": bug or "(clean)",
                "class": info.cls if info else "J",
                "applies": info.needs_text if info else "all",
                "configs": sorted({r.config for r in rs}, key=list(MATRIX).index),
                "result": f"{good} {n_good}/{len(rs)}" + (f" ({', '.join(bad)})" if bad else ""),
                "ok": n_good == len(rs),
                "planted_step": first.planted_step,
                "detected_step": first.first_detected_step,
                "max_lag": max(lags) if lags else None,
                "reasons": sorted({x for r in rs for x in r.reasons}),
                "violations": sum(r.violations for r in rs),
            })
        return out

    def to_dict(self) -> dict:
        return {"ok": self.ok, "wall_s": round(self.wall_s, 2), "seeds": self.seeds, "matrix":
                {name: cfg.features() for name, cfg in MATRIX.items()}, "bugs": self.rows(),
                "runs": [r.to_dict() for rs in self.runs.values() for r in rs]}


def plan_runs(bugs: list[str] | None = None, seeds: int = 1, configs: list[str] | None = None,
              clean: bool = True) -> list[SimConfig]:
    """The configurations the zoo runs: clean baselines, then each bug where it applies, per seed."""
    names = list(MATRIX) if configs is None else configs
    for name in names:
        if name not in MATRIX:
            raise ValueError(f"kv-canary: zoo config must be one of {list(MATRIX)}, got {name!r}")
    bug_names = list(BUGS) if bugs is None else bugs
    for b in bug_names:
        if b not in BUGS:
            raise ValueError(f"kv-canary: zoo bug must be one of {sorted(BUGS)}, got {b!r}")
    if seeds < 1:
        raise ValueError(f"kv-canary: zoo seeds must be >= 1, got {seeds}")
    out = []
    for bug in ([None] if clean else []) + bug_names:
        for seed in range(seeds):
            for name in names:
                cfg = MATRIX[name].replace(seed=seed, bug=bug)
                if bug is None or BUGS[bug].applies(cfg):
                    out.append(cfg)
    return out


@contextlib.contextmanager
def quiet_and_single_threaded() -> Iterator[None]:
    """Silence per-violation log lines and use one torch thread (small ops run faster) for the duration."""
    logger = logging.getLogger("kvcanary")
    level, threads = logger.level, torch.get_num_threads()
    logger.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        logger.setLevel(level)
        torch.set_num_threads(threads)


def run_zoo(bugs: list[str] | None = None, seeds: int = 1, configs: list[str] | None = None, clean: bool = True,
            progress: Callable[[int, int, SimResult], None] | None = None,
            stop_after: int | None = None) -> ZooReport:
    """Run the zoo; ``progress(i, total, result)`` is called after each run.

    ``stop_after``: end a bug run that many steps after its first violation (None: play it out;
    violation counts then cover the whole run).
    """
    cfgs = plan_runs(bugs, seeds, configs, clean)
    report = ZooReport(seeds=seeds)
    t0 = time.perf_counter()
    with quiet_and_single_threaded():
        for i, cfg in enumerate(cfgs, 1):
            result = run_sim(cfg, stop_after=stop_after if cfg.bug else None)
            report.runs.setdefault(cfg.bug, []).append(result)
            if progress is not None:
                progress(i, len(cfgs), result)
    report.wall_s = time.perf_counter() - t0
    return report


def format_table(report: ZooReport) -> str:
    """The zoo table: one row per bug, then the matrix legend and the verdict."""
    head = ("bug", "class", "applies", "result", "planted", "detected", "max lag", "reasons", "violations")
    rows = []
    for row in report.rows():
        reasons = ",".join(SHORT_REASONS.get(x, x) for x in row["reasons"]) or "-"
        rows.append((row["bug"], row["class"], row["applies"], row["result"],
                     _step(row["planted_step"]), _step(row["detected_step"]), _step(row["max_lag"]), reasons,
                     str(row["violations"])))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("")
    out.append("planted/detected: steps of the first run (seed 0, first config where the bug applies); "
               "max lag: largest detected - planted over all runs")
    out.append("reasons: " + ", ".join(f"{v}={k}" for k, v in SHORT_REASONS.items()))
    out.append("configs: " + "; ".join(f"{name} ({cfg.features()})" for name, cfg in MATRIX.items()))
    n_runs = sum(len(rs) for rs in report.runs.values())
    verdict = "OK" if report.ok else "FAILED"
    out.append(f"{verdict}: {n_runs} runs, {report.seeds} seed(s), {report.wall_s:.1f} s")
    return "\n".join(out)


def format_markdown(report: ZooReport) -> str:
    """The zoo table as Markdown, one row per bug with its mistake in words, for the README and docs.

    It leaves out the violation count: a whole run's count follows every later consequence of the
    one mistake and moves with any change to the workload, while the columns kept say what was caught.
    """
    head = ("bug", "class", "applies", "the mistake", "result", "planted", "detected", "max lag", "reasons")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report.rows():
        info = BUGS.get(row["bug"])
        reasons = ", ".join(SHORT_REASONS.get(x, x) for x in row["reasons"]) or "-"
        cells = (f"`{row['bug']}`" if info else row["bug"], row["class"], row["applies"],
                 info.summary if info else "no bug planted: nothing may be reported", row["result"],
                 _step(row["planted_step"]), _step(row["detected_step"]), _step(row["max_lag"]), reasons)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def _step(x: int | None) -> str:
    return "-" if x is None else str(x)
