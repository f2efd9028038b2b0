"""Graph replays issued from a helper thread, so the engine's thread does not pay for them.

Inside an engine's step the host's caches are cold (the forward's Python has evicted them), and one
CUDA-graph replay then costs the calling thread 68-139 us instead of 3-11 us in a warm loop
(``benchmarks/graph_launch.py``). torch's ``CUDAGraph.replay`` releases the GIL while the driver
launches the graph, so a helper thread can issue it while the engine's thread goes on: the engine's
thread only queues the job (``submit``). Each job is a few event records (the positions the graph's
first nodes wait for), the replay, then an event record on the replay's stream (the step's end, which the
engine's streams later wait for): all issued on the helper thread, in that order, before ``wait`` returns.

Ordering contract: whatever on the host depends on a submitted replay having been issued (a stream
waiting for its event, a host read of what it copies, the event's query or synchronize, the graph's
next submit) calls ``wait`` first. The device-side ordering is the graph's own (its first nodes wait
for events the caller recorded before ``submit``).

The helper runs only a few Python lines per job between two calls that release the GIL (the queue's
get and the replay), so it takes the GIL only briefly, while the engine's thread is inside a call that
released it.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable


class ReplayError(RuntimeError):
    """A replay or event record on the helper thread failed; ``__cause__`` is the original error."""


class GraphReplayer:
    """One helper thread that issues each submitted job (records, replay, record), in order.

    Args:
        record: ``record(event, stream)`` records ``event`` on ``stream`` (called on the helper thread).
        setup: called once on the helper thread before its first job (on CUDA: make the replays' stream
            the thread's current stream, which torch keeps per thread, and set its device).
        name: the thread's name.
    """

    def __init__(self, record: Callable, setup: Callable | None = None, name: str = "kvcanary-replay"):
        self._record, self._setup = record, setup
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # held from a submit until the helper issued that job: a plain lock (C calls only) that the helper
        # releases; one job in flight at most (a step's replay is joined before the next step's)
        self._busy = threading.Lock()
        self._error: BaseException | None = None
        self.jobs = 0  # jobs submitted (benchmarks, tests)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, replay: Callable, event, stream, before: tuple = ()) -> None:
        """Queue ``record(e, s)`` for each ``(e, s)`` of ``before``, then ``replay()``, then ``record(event,
        stream)`` (after any job before it has been issued)."""
        if self._thread is None:
            raise ReplayError("kv-canary: the replay thread was closed")
        self._busy.acquire()  # (free unless the last job is still being issued: then it waits for it)
        if self._error is not None:
            self._busy.release()
            self._raise_error()
        self.jobs += 1
        self._jobs.put((before, replay, event, stream))

    def wait(self) -> None:
        """Return once every submitted job has been issued; raises ``ReplayError`` if one failed."""
        busy = self._busy
        if busy.locked():
            busy.acquire()  # (releases the GIL while it blocks: the helper can finish)
            busy.release()
        self._raise_error()

    @property
    def busy(self) -> bool:
        return self._busy.locked()

    def close(self) -> None:
        """Issue what was submitted, then stop the thread (idempotent)."""
        if self._thread is None:
            return
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise ReplayError(f"kv-canary: a graph replay on the replay thread failed: {err!r}") from err

    def _run(self) -> None:
        try:
            if self._setup is not None:
                self._setup()
        except BaseException as e:  # (reported at the first wait or submit; jobs are then skipped)
            self._error = e
        get, record = self._jobs.get, self._record
        while True:
            job = get()
            if job is None:
                return
            if self._error is None:
                try:
                    for event, stream in job[0]:
                        record(event, stream)
                    job[1]()
                    record(job[2], job[3])
                except BaseException as e:
                    self._error = e
            self._busy.release()
