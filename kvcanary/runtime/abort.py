"""Mode "abort": fail the requests that read wrong KV, not the server (docs/runtime.md, "Mode abort").

For each drained violation the runtime names the request to fail: the reader for a verify row (the
request whose table maps the slot in a way that fails the row's checks), the writer for a write-time
row (the request that fed a wrong token or position). The engine's ``on_abort(request_id,
violations)`` is called once per request, ever: a request named again (its in-flight forward read the
same KV again before the abort landed) is reported, not aborted twice. Sweep rows name no request (no
forward read the slot); the next request that reads it is aborted at its own verify.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from kvcanary.runtime.report import Violation

log = logging.getLogger("kvcanary")

AbortHandler = Callable[[int, "tuple[Violation, ...]"], None]


class KvCanaryAbortError(RuntimeError):
    """The error an engine puts in the output of a request the canary aborted.

    Attributes:
        request_id: the canary's int id of the request (``ForwardBatch.request_ids``); ``name``, optional:
            the engine's own id of it, for the message.
        violations: the violations that named it, in the drain that aborted it.
    """

    def __init__(self, request_id: int, violations: tuple[Violation, ...], name: str | None = None):
        self.request_id, self.violations = request_id, tuple(violations)
        first = self.violations[0].log_line() if self.violations else "(no row kept)"
        named = f"{request_id} ({name!r})" if name is not None else str(request_id)
        super().__init__(f"kv-canary: request {named} aborted: {len(self.violations)} violation(s) of the KV it "
                         f"{'wrote' if self.violations and self.violations[0].is_write_check else 'read'}; "
                         f"first: {first}")


def abort_target(v: Violation) -> int | None:
    """The request id a violation fails: the writer of a write-time row, else the reader (None: no request
    to fail, as for a sweep row or one the runtime could not attribute)."""
    if v.launch_tag.startswith("SWEEP"):
        return None
    rid = v.writer_request if v.is_write_check else v.reader_request
    return rid if rid is not None and rid >= 0 else None


class Aborts:
    """Who was aborted, and the counters ``Canary.stats()`` and the health check report."""

    def __init__(self, handler: AbortHandler | None):
        self.handler = handler
        self.aborted: set[int] = set()
        self.by_reason: Counter = Counter()  # aborted requests per fail reason label of their violations
        self.unattributed = 0  # verify and write rows that named no request to fail (sweep rows name none)
        self.handler_errors = 0
        self.since_health = 0  # requests aborted since the last health check
        self.problems: list[str] = []  # handler failures, for the next health check

    def dispatch(self, violations: list[Violation]) -> None:
        """Call the handler once for each request ``violations`` name that was not aborted before."""
        named: dict[int, list[Violation]] = {}
        for v in violations:
            rid = abort_target(v)
            if rid is None:
                self.unattributed += not v.launch_tag.startswith("SWEEP")
            elif rid not in self.aborted:
                named.setdefault(rid, []).append(v)
        for rid, vs in named.items():
            # Marked before the call: a handler that fails is not called again for the same request.
            self.aborted.add(rid)
            self.since_health += 1
            self.by_reason.update({label for v in vs for label in v.reasons})
            log.warning("kv_canary abort: request %d (%d violation(s), %s)", rid, len(vs), vs[0].reason_label)
            try:
                self.handler(rid, tuple(vs))
            except Exception as e:  # the engine's error path failed: report it, keep serving
                self.handler_errors += 1
                problem = f"abort handler failed for request {rid} ({type(e).__name__}: {e})"
                self.problems.append(problem)
                log.error("kv_canary abort: %s", problem)

    def take_health(self) -> tuple[int, list[str]]:
        """Requests aborted and handler failures since the last health check (then reset)."""
        n, problems = self.since_health, self.problems
        self.since_health, self.problems = 0, []
        return n, problems

    def stats(self) -> dict:
        return {"aborted_requests": len(self.aborted), "aborts_by_reason": dict(self.by_reason),
                "abort_unattributed": self.unattributed, "abort_handler_errors": self.handler_errors}


def check_abort_handler(mode: str, handler: object) -> None:
    """``Canary``'s check: mode "abort" needs the engine's handler; any handler given must be callable."""
    if handler is not None and not callable(handler):
        raise TypeError(f"kv-canary: Canary on_abort must be a callable or None, got {handler!r}")
    if mode == "abort" and handler is None:
        raise ValueError("kv-canary: Canary on_abort must be a callable in mode 'abort' (the engine's error path "
                         "for one request: on_abort(request_id, violations)), got None; an engine without one "
                         "runs in mode 'log' or 'raise'")
