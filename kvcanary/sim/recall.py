"""Recall of the canary against injected faults: pair injections with the violations they cause.

``match(canary.injector.records, canary.flush())`` returns a ``RecallReport``: per kind,
how many injections touched a slot some check read later, how many of those were
detected (a violation with the kind's reason bit and launch phase on a slot the
injection perturbed, at or after its step), the detection latency in steps, and every
violation no injection explains (a false positive).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvcanary.format import FailReason as FR
from kvcanary.runtime.inject import KINDS, Injection
from kvcanary.runtime.report import Violation

_REAL_KV = int(FR.VERIFY_REAL_KV_HASH)


@dataclass(frozen=True)
class Expectation:
    """What a kind's injection must cause (``reason`` in ``phases``) and may cause (``allowed`` in ``seen_in``)."""

    reason: int
    phases: tuple[str, ...]
    allowed: int
    seen_in: tuple[str, ...]


EXPECTATIONS: dict[str, Expectation] = {
    # The overwritten cell's new slot fails its chain (and position / token) check, its successor the chain check.
    "table": Expectation(int(FR.VERIFY_CHAIN_HASH), ("head",),
                         int(FR.VERIFY_CHAIN_HASH | FR.VERIFY_POSITION | FR.VERIFY_TOKEN), ("head", "tail")),
    "kv": Expectation(_REAL_KV, ("tail",), _REAL_KV, ("tail", "sweep")),
    "cached": Expectation(_REAL_KV, ("sweep", "tail"), _REAL_KV, ("sweep", "tail")),
    "after": Expectation(_REAL_KV, ("tail", "sweep"), _REAL_KV, ("tail", "sweep")),
    "swap": Expectation(int(FR.WRITE_TOKEN), ("head",), int(FR.WRITE_TOKEN), ("head",)),
}


@dataclass
class KindRecall:
    """One kind's row: injections, those a later check read (touched), those detected, latencies."""

    kind: str
    injections: int = 0
    touched: int = 0
    detected: int = 0
    latencies: list[int] = field(default_factory=list)

    @property
    def recall(self) -> float | None:
        return self.detected / self.touched if self.touched else None

    @property
    def median_latency(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    @property
    def max_latency(self) -> int | None:
        return max(self.latencies) if self.latencies else None


@dataclass
class RecallReport:
    """Result of ``match``.

    Attributes:
        kinds: per kind (every kind of ``KINDS`` present, zeros when not injected).
        detections: (injection, first violation that detects it) per detected injection.
        missed: touched injections no violation detected.
        false_positives: violations no injection explains.
    """

    kinds: dict[str, KindRecall]
    detections: list[tuple[Injection, Violation]]
    missed: list[Injection]
    false_positives: list[Violation]

    @property
    def total(self) -> KindRecall:
        out = KindRecall("all")
        for k in self.kinds.values():
            out.injections += k.injections
            out.touched += k.touched
            out.detected += k.detected
            out.latencies += k.latencies
        return out

    @property
    def recall(self) -> float | None:
        return self.total.recall

    @classmethod
    def merge(cls, reports: Iterable[RecallReport]) -> RecallReport:
        """One report over several runs (e.g. every configuration of the sim matrix)."""
        out = cls({k: KindRecall(k) for k in KINDS}, [], [], [])
        for rep in reports:
            for k, r in rep.kinds.items():
                o = out.kinds[k]
                o.injections, o.touched, o.detected = o.injections + r.injections, o.touched + r.touched, \
                    o.detected + r.detected
                o.latencies += r.latencies
            out.detections += rep.detections
            out.missed += rep.missed
            out.false_positives += rep.false_positives
        return out

    def to_dict(self) -> dict:
        return {"kinds": {k: _row(r) for k, r in self.kinds.items()}, "total": _row(self.total),
                "false_positives": len(self.false_positives),
                "missed": [m.log_line() for m in self.missed]}


def phase_of(v: Violation) -> str:
    """'head' | 'tail' | 'sweep' from the launch tag."""
    return v.launch_tag.split("_")[0].lower()


def group_of(v: Violation) -> str:
    return v.launch_tag.rsplit("_", 1)[-1].lower()


def touches(rec: Injection, v: Violation) -> bool:
    """Whether ``v`` is on a slot ``rec`` perturbed, while perturbed, in a phase its effects show in."""
    if v.step < rec.step or phase_of(v) not in EXPECTATIONS[rec.kind].seen_in:
        return False
    if (rec.kind == "swap" and rec.position >= 0 and v.writer_request == rec.request
            and v.position == rec.position):
        return True  # the swapped token stays in the request's history: a recompute feeds it again
    if (group_of(v), v.slot) not in rec.watch:
        return False
    return rec.end_step is None or v.step <= rec.end_step


def match(injections: Iterable[Injection], violations: Iterable[Violation]) -> RecallReport:
    """Pair injections with violations; see the module docstring for the rules.

    A violation is explained when the injections it touches allow all its reason bits
    together (a row can carry two faults at once, e.g. a flipped slot a table fault
    points at); it detects an injection when it is explained, touches it, and carries
    the kind's reason bit in the kind's phase.
    """
    injections, violations = list(injections), list(violations)
    touching = [[r for r in injections if touches(r, v)] for v in violations]
    explained = []
    for v, recs in zip(violations, touching):
        allowed = 0
        for r in recs:
            allowed |= EXPECTATIONS[r.kind].allowed
        explained.append(bool(recs) and not v.fail_reason & ~allowed)
    kinds = {k: KindRecall(k) for k in KINDS}
    detections, missed = [], []
    for rec in injections:
        row = kinds[rec.kind]
        row.injections += 1
        if rec.read_step is None:
            continue
        row.touched += 1
        exp = EXPECTATIONS[rec.kind]
        hits = [v for v, recs, ok in zip(violations, touching, explained)
                if ok and any(r is rec for r in recs) and v.fail_reason & exp.reason and phase_of(v) in exp.phases]
        if not hits:
            missed.append(rec)
            continue
        first = min(hits, key=lambda v: v.step)
        row.detected += 1
        row.latencies.append(first.step - rec.step)
        detections.append((rec, first))
    false_positives = [v for v, ok in zip(violations, explained) if not ok]
    return RecallReport(kinds, detections, missed, false_positives)


def recall_table(reports: dict[str, RecallReport], markdown: bool = True) -> str:
    """The perturbation recall table, one row per named run (e.g. one per kind, then all kinds at once)."""
    head = ["run", "injections", "touched", "detected", "recall", "median latency", "max latency",
            "false positives"]
    rows = []
    for name, rep in reports.items():
        t = rep.total
        rows.append([name, str(t.injections), str(t.touched), str(t.detected),
                     "-" if t.recall is None else f"{100 * t.recall:.1f}%",
                     "-" if t.median_latency is None else f"{t.median_latency:g}",
                     "-" if t.max_latency is None else str(t.max_latency), str(len(rep.false_positives))])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def measure(run: Callable[[dict], tuple[list[Injection], list[Violation]]], prob: float = 0.2,
            kinds: Iterable[str] = KINDS, seed: int = 0, warmup: int = 2) -> dict[str, RecallReport]:
    """One run per kind alone, then one with every kind at once; returns the reports by run name.

    Args:
        run: takes ``CanaryConfig`` overrides (``inject_*`` fields), drives an engine, returns
            (injector records, violations), e.g. ``(canary.injector.records, canary.flush())``.
        prob: probability of each kind per step; seed, warmup: ``inject_seed``, ``inject_warmup``.
    """
    kinds = list(kinds)
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kv-canary: kinds must be among {KINDS}, got {kinds}")
    base = {"inject_seed": seed, "inject_warmup": warmup}
    reports = {}
    for kind in kinds:
        reports[kind] = match(*run({**base, f"inject_{kind}_prob": prob}))
    if len(kinds) > 1:
        reports["all"] = match(*run({**base, **{f"inject_{k}_prob": prob for k in kinds}}))
    return reports


def sim_runner(sim_config, **canary_overrides) -> Callable[[dict], tuple[list[Injection], list[Violation]]]:
    """A ``measure`` runner playing ``sim_config`` (a ``kvcanary.sim.SimConfig``) through the simulated engine."""

    def run(inject: dict) -> tuple[list[Injection], list[Violation]]:
        from kvcanary.sim import SimEngine, default_canary_config

        config = default_canary_config(sim_config).replace(ring_capacity=1024, **canary_overrides, **inject)
        engine = SimEngine(sim_config, config)
        if not getattr(engine, "routes_samples", False):
            _route_samples(engine)
        engine.run()
        return engine.canary.injector.records, engine.canary.flush()

    return run


def _route_samples(engine) -> None:
    """Pass each step's sampled next tokens through ``Canary.perturb_next_tokens`` (the sim samples
    inside ``Scheduler.complete``; this wraps it on the instance)."""
    sched, canary = engine.sched, engine.canary
    complete = sched.complete

    def routed(works):
        before = {w.req.rid: len(w.req.tokens) for w in works}
        complete(works)
        grew = [w.req for w in works if len(w.req.tokens) > before[w.req.rid]]
        if len(grew) < 2:
            return
        tokens = canary.perturb_next_tokens([r.rid for r in grew], [r.tokens[-1] for r in grew],
                                            [len(r.tokens) - 1 for r in grew])
        for r, token in zip(grew, tokens):
            r.tokens[-1] = token

    sched.complete = routed


def measure_sim(sim_configs, prob: float = 0.2, kinds: Iterable[str] = KINDS, seed: int = 0,
                warmup: int = 2) -> dict[str, RecallReport]:
    """``measure`` on every sim configuration (injection seed ``seed + i`` for the i-th), merged per run name."""
    per_config = [measure(sim_runner(cfg), prob, kinds, seed + i, warmup) for i, cfg in enumerate(sim_configs)]
    return {name: RecallReport.merge(r[name] for r in per_config) for name in per_config[0]}


def _row(r: KindRecall) -> dict:
    return {"injections": r.injections, "touched": r.touched, "detected": r.detected, "recall": r.recall,
            "median_latency": r.median_latency, "max_latency": r.max_latency}
