"""One run of a fuzzed workload, and how a perturbed run is judged against the unperturbed reference.

Both engines' drivers (``sim_fuzz``, ``hf_fuzz``) describe a run the same way, a ``Run``: the greedy tokens
of each request, the requests the engine failed or left unfinished, the canary's count and first lines,
problems the canary reported besides violations (health, a refused forward, an exception in a hook), and
an exception that ended the run. ``judge`` turns a perturbed run and the reference into findings: the
contract of ``kvcanary fuzz`` in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# near_tie(request, index, reference token, other token) -> the logit margin between the two tokens at that
# point when it is a near tie (a divergence that batch-variant arithmetic explains), else None (hf_fuzz)
NearTie = Callable[[str, int, int, int], "float | None"]


@dataclass
class Run:
    """What one run (the reference, or one perturbation) did.

    Attributes:
        perturbation: the perturbation's seed; 0 for the unperturbed reference.
        params: the schedule it ran with (the engine's knobs; JSON-friendly).
        tokens: greedy tokens per request key (prompt and output on the sim, output on transformers), of the
            requests that completed.
        failed: request key -> why it did not complete (the engine's error, "unfinished ...").
        aborted: keys of the requests their client aborted (their output depends on timing: not compared).
        violations: the canary's violation count.
        first_violations: the first violation lines.
        problems: canary-side reports other than violations (health, a refused forward, a hook's exception).
        error: the exception that ended the run, as "Type: message" (None: it ran to the end).
        events: engine events (preemptions, offloads, prefix hits ...) that show what the schedule did.
        seconds: wall time of the run.
    """

    perturbation: int
    params: dict = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    violations: int = 0
    first_violations: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    events: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Verdict:
    """``judge``'s answer: findings fail the campaign; the rest is listed apart."""

    findings: list[str] = field(default_factory=list)
    # greedy divergences at a near tie of the logits (benign: class J of BUGS.md), as "key@index (margin m)"
    benign: list[str] = field(default_factory=list)
    # an exception the reference run has too: the engine's own failure on this workload, not the schedule's
    engine_failure: str | None = None


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def judge(ref: Run, run: Run, near_tie: NearTie | None = None) -> Verdict:
    """Findings of ``run`` against the reference ``ref`` (``run is ref``: the reference's own findings).

    A finding is any violation or canary problem; an exception the reference does not raise; a request the
    engine fails or leaves unfinished that the reference completes; a request that completed in both runs
    with different greedy tokens, unless ``near_tie`` says the first differing token was a near tie.
    """
    v = Verdict()
    if run.violations:
        v.findings.append(f"violations: {run.violations}")
    v.findings += run.problems
    if run.error is not None:
        if run is ref or ref.error is not None:
            v.engine_failure = run.error
        else:
            v.findings.append(f"error: {run.error} (the reference ran to the end)")
    if run is ref or ref.error is not None or run.error is not None:
        return v
    new_failures = sorted(k for k in run.failed if k not in ref.failed and k in ref.tokens)
    if new_failures:
        k = new_failures[0]
        v.findings.append(f"failed requests the reference completes: {len(new_failures)} ({k}: {run.failed[k]})")
    missing = sorted(k for k in ref.tokens if k not in run.tokens and k not in run.failed and k not in run.aborted)
    if missing:
        v.findings.append(f"requests without an output: {len(missing)} ({missing[0]})")
    differ = []
    for k, want in ref.tokens.items():
        got = run.tokens.get(k)
        if got is None or got == want:
            continue
        i = first_divergence(want, got)
        margin = near_tie(k, i, want[i], got[i]) if near_tie and i < min(len(want), len(got)) else None
        if margin is not None:
            v.benign.append(f"{k}@{i} (margin {margin:.1e})")
        else:
            differ.append(f"{k}@{i}")
    if differ:
        v.findings.append(f"tokens: {len(differ)} requests differ from the reference (first at {differ[0]})")
    return v
