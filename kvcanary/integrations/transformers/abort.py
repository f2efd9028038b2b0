"""Mode "abort" on transformers continuous batching: the canary's ``on_abort`` fails one request through
the batch processor's own error path (docs/transformers.md, "Mode abort").

The canary names a request while a step's hooks run (its drain), when the engine has not yet taken that
step's outputs: failing it then would leave ``update_batch`` a failed request to update. So ``request``
only queues it, and ``apply``, run by the session's ``update_batch`` hook after the engine's update,
fails each queued request that is still live: its output is delivered with the error (``FAILED``, the
tokens generated so far), and it is cancelled, so the scheduler frees its blocks before the next batch.
"""

from __future__ import annotations

from kvcanary.runtime.abort import KvCanaryAbortError


class EngineAborts:
    """The session's abort queue (``Canary(on_abort=self.request)``)."""

    def __init__(self, session):
        self.session = session
        self.pending: dict[int, tuple] = {}

    def request(self, request_id: int, violations: tuple) -> None:
        """The canary's ``on_abort``: queue ``request_id`` (a canary id, ``Session.request_id``)."""
        self.pending[request_id] = violations

    def apply(self) -> None:
        """Fail the queued requests that are still active or waiting (a finished one keeps its output)."""
        if not self.pending:
            return
        with self.session.lock:  # (a drain on another thread, handle.flush, may queue meanwhile)
            pending, self.pending = self.pending, {}
        bp = self.session.bp
        names = {rid: name for name, rid in self.session.ids.items()}
        scheduler = bp.scheduler
        for rid, violations in pending.items():
            name = names.get(rid)
            state = scheduler.active_requests.get(name) or scheduler.waiting_requests.get(name)
            if state is None:  # (finished: finish_request took it off the active requests)
                continue
            bp._handle_request_error(KvCanaryAbortError(rid, violations, name), state)
            # The cancellation path removes it from the queues and frees its blocks (and any offloaded copy)
            # at the start of the next step, before anything is scheduled.
            scheduler.set_request_cancellation(name)
            self.session.events["failed_requests"] += 1  # (stats: the requests the engine failed)
