"""The ``vllm.general_plugins`` entry point: how kv-canary gets into every vLLM process.

vLLM calls ``register()`` once in each process that may run a model (the engine core, every worker of the
multiprocess executor, the calling process of an in-process engine). It does nothing unless
``KV_CANARY_VLLM`` is set to a true value; then it checks the environment (the vLLM version, the
``KV_CANARY_*`` configuration) and wraps four methods of vLLM's V1 model runner class (the CPU runner
subclasses it, so GPU and CPU runs take the same hooks) and adds one method to its worker base class:

  GPUModelRunner.initialize_kv_cache   after: build the process's ``Session`` (checks the engine, then the canary)
  GPUModelRunner.execute_model         around: the scheduler's step (its events, KV block copies), then the check
                                       that the step's forward was guarded
  GPUModelRunner._model_forward        around the model: before_forward / after_forward
  GPUModelRunner.shutdown              before: the session's final drain and report
  WorkerBase.kvcanary_report           the report of this worker (``LLM.collective_rpc("kvcanary_report")``)
  Scheduler.__init__                   after: this process's scheduler, for the allocator check (allocator.py)
  Scheduler.update_from_output         mode abort: before the step's outputs, the requests the canary named join
                                       the scheduler's own per-request error path (finish reason "error")

The hooks live on the classes, not on instances: vLLM builds its runners inside worker processes that no user
code reaches, and the plugin runs before any of them exists. ``unregister()`` restores the classes exactly.
"""

from __future__ import annotations

import functools
import logging
import os

from kvcanary.ops.validate import parse_bool

log = logging.getLogger("kvcanary")

ENABLE_VARIABLE = "KV_CANARY_VLLM"
REPORT_DIR_VARIABLE = "KV_CANARY_VLLM_REPORT_DIR"
TP_INTERVAL_VARIABLE = "KV_CANARY_VLLM_TP_INTERVAL"
ALLOCATOR_INTERVAL_VARIABLE = "KV_CANARY_VLLM_ALLOCATOR_INTERVAL"
# (first, first unsupported) vLLM versions whose model runner internals the hooks were written and tested on
SUPPORTED_VERSIONS = ((0, 32), (0, 33))
SUPPORTED_RANGE = ">=0.32,<0.33"

_undo: list[tuple[type, str, object]] = []  # (class, name, what it held before: None = nothing of its own)


def enabled(environ=None) -> bool:
    """Whether ``KV_CANARY_VLLM`` asks for the canary (unset: no); a value that is not a boolean raises."""
    raw = (os.environ if environ is None else environ).get(ENABLE_VARIABLE)
    return raw is not None and parse_bool(ENABLE_VARIABLE, raw)


def register() -> None:
    """vLLM's plugin hook: install the canary's hooks when ``KV_CANARY_VLLM`` is true, else nothing.

    Raises (at vLLM's start-up, in the process that loads plugins) for an unsupported vLLM version or a bad
    ``KV_CANARY_*`` value, so a misconfigured canary never lets an unguarded engine run.
    """
    if not enabled():
        return
    if _undo:
        return  # (vLLM may load plugins more than once per process; the hooks go in once)
    check_version()
    from kvcanary.integrations.vllm.settings import Settings

    Settings.from_env()  # a bad KV_CANARY_* value fails here, in every process, before any model loads
    _install()


def unregister() -> None:
    """Remove the hooks (tests; a process that turns the canary off again). Live sessions stay as they are."""
    while _undo:
        cls, name, old = _undo.pop()
        if old is None:
            delattr(cls, name)
        else:
            setattr(cls, name, old)


def installed() -> bool:
    return bool(_undo)


def check_version(version: str | None = None) -> str:
    """vLLM's version; ``RuntimeError`` outside ``SUPPORTED_RANGE`` (other versions have other runner internals)."""
    if version is None:
        import vllm

        version = vllm.__version__
    parts = (version.split("+")[0].split(".") + ["0", "0"])[:2]
    try:
        ver = tuple(int("".join(c for c in p if c.isdigit()) or "0") for p in parts)
    except ValueError:
        ver = (0, 0)
    lo, hi = SUPPORTED_VERSIONS
    if not lo <= ver < hi:
        raise RuntimeError(f"kv-canary: vLLM must be {SUPPORTED_RANGE} (the model runner internals the hooks were "
                           f"written and tested on), got {version}; unset {ENABLE_VARIABLE} to run unguarded")
    return version


def _set(cls: type, name: str, value) -> None:
    _undo.append((cls, name, vars(cls).get(name)))
    setattr(cls, name, value)


def _install() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    from kvcanary.integrations.vllm import session as S

    for name in ("initialize_kv_cache", "execute_model", "_model_forward", "shutdown"):
        if not callable(getattr(GPUModelRunner, name, None)):
            raise RuntimeError(f"kv-canary: vLLM's GPUModelRunner.{name} must be a method to hook, got none "
                               f"(vLLM {SUPPORTED_RANGE} expected)")
    init_kv, execute, forward, shutdown = (GPUModelRunner.initialize_kv_cache, GPUModelRunner.execute_model,
                                           GPUModelRunner._model_forward, GPUModelRunner.shutdown)

    @functools.wraps(init_kv)
    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        out = init_kv(self, kv_cache_config, is_profiling, *args, **kwargs)
        if not is_profiling:
            S.open_session(self)
        return out

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        session = S.session_of(self)
        if session is None:
            return execute(self, scheduler_output, *args, **kwargs)
        try:
            session.begin_step(scheduler_output)
            out = execute(self, scheduler_output, *args, **kwargs)
            session.end_step()
        except BaseException as e:
            session.abandon_step(e)  # (the canary's error on a TP rank other than 0 ends this worker: session.py)
            raise
        return out

    @functools.wraps(forward)
    def _model_forward(self, *args, **kwargs):
        session = S.session_of(self)
        if session is None or not session.in_step:
            return forward(self, *args, **kwargs)  # (profiling and warm-up runs: no request's KV)
        return session.guard_forward(forward, self, args, kwargs)

    @functools.wraps(shutdown)
    def runner_shutdown(self, *args, **kwargs):
        session = S.session_of(self)
        if session is not None:
            session.close()
        return shutdown(self, *args, **kwargs)

    def kvcanary_report(self, finish_tp: bool = True) -> dict:
        """This worker's canary report (``LLM.collective_rpc("kvcanary_report")``); ``finish_tp``: run the
        tensor-parallel ranks' last consistency exchange first (collective: every rank gets the call)."""
        runner = getattr(self, "model_runner", None)
        session = S.session_of(runner) if runner is not None else None
        return S.no_session_report() if session is None else session.report(finish_tp=finish_tp)

    _set(GPUModelRunner, "initialize_kv_cache", initialize_kv_cache)
    _set(GPUModelRunner, "execute_model", execute_model)
    _set(GPUModelRunner, "_model_forward", _model_forward)
    _set(GPUModelRunner, "shutdown", runner_shutdown)
    _set(WorkerBase, "kvcanary_report", kvcanary_report)
    _hook_scheduler(S)
    _refuse_runner_v2()


def _hook_scheduler(S) -> None:
    """Mode abort: the requests a session named (``session.PENDING_ABORTS``) fail through the scheduler's own error
    path for one request, the set its ``update_from_output`` finishes with ``FINISHED_ERROR`` (and reports to the
    client with finish reason "error") after the step's outputs: the step's forward has run, so no KV is freed
    under it; a request that already ended is not in the scheduler any more and is left alone."""
    from vllm.v1.core.sched.scheduler import Scheduler

    update = getattr(Scheduler, "update_from_output", None)
    if not callable(update):
        raise RuntimeError(f"kv-canary: vLLM's Scheduler.update_from_output must be a method to hook, got none "
                           f"(vLLM {SUPPORTED_RANGE} expected)")

    @functools.wraps(update)
    def update_from_output(self, *args, **kwargs):
        if S.PENDING_ABORTS:
            errors = getattr(self, "encoder_cache_mismatch_reqs", None)
            if not isinstance(errors, set):
                raise RuntimeError("kv-canary: vLLM's scheduler must keep its per-request error set "
                                   "(encoder_cache_mismatch_reqs) for mode abort, got none")
            errors.update(rid for rid in S.PENDING_ABORTS if rid in self.requests)
            S.PENDING_ABORTS.clear()
        return update(self, *args, **kwargs)

    _set(Scheduler, "update_from_output", update_from_output)
    init = Scheduler.__init__

    @functools.wraps(init)
    def scheduler_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        from kvcanary.integrations.vllm.allocator import note_scheduler

        note_scheduler(self)

    _set(Scheduler, "__init__", scheduler_init)


def _refuse_runner_v2() -> None:
    """vLLM's model runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``, or its default where Triton runs) is another class
    with other internals: the canary is not in it, so a run on it must not start as if guarded."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:  # (no V2 runner in this build: nothing to refuse)
        return
    init_kv = RunnerV2.initialize_kv_cache

    @functools.wraps(init_kv)
    def initialize_kv_cache(self, *args, **kwargs):
        raise RuntimeError(f"kv-canary: {ENABLE_VARIABLE}=1 needs vLLM's V1 model runner, got model runner V2 "
                           "(set VLLM_USE_V2_MODEL_RUNNER=0, or unset KV_CANARY_VLLM to run unguarded)")

    _set(RunnerV2, "initialize_kv_cache", initialize_kv_cache)
