"""kv-canary on Hugging Face transformers continuous batching (``generate_batch``, ``init_continuous_batching``).

Nothing is patched at import time. ``attach(model)`` rebinds a few methods on that model instance
(and, as they are created, on its batching managers and processors); ``detach()`` removes exactly
those instance attributes again. Supported: transformers ``SUPPORTED_RANGE``, the engine's CUDA graphs
and (5.24+, CUDA) async batching, full-attention and MLA models and hybrid full + sliding-window models
(the latter with ``allow_block_sharing=False``). See docs/transformers.md.

Example:
    >>> handle = attach(model, mode="raise", token_oracle=True)
    >>> out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc)
    >>> handle.stats()["violations"]
    0
    >>> handle.detach()
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator

from kvcanary.integrations.transformers.layout import SUPPORTED_RANGE, check_engine, check_version, patcher
from kvcanary.integrations.transformers.session import EVENTS, Session
from kvcanary.runtime import CanaryConfig, Violation
from kvcanary.runtime.engine import StepOptions

__all__ = ["SUPPORTED_RANGE", "TransformersHandle", "attach", "check_version"]


# The adapter's step-path toggles: private (``tuned``), for benchmarks and tests that compare paths; the
# defaults are what users run, and each path gives the same results.
TUNING_OPTIONS = ("timing", "step_graphs", "late_hooks", "fused_steps", "in_graph_waits", "bucket_batches",
                  "steady_steps")
_TUNING: contextvars.ContextVar[dict] = contextvars.ContextVar("kvcanary_tuning", default={})


@contextlib.contextmanager
def tuned(**toggles: bool) -> Iterator[None]:
    """Private: ``attach`` calls inside the block take these step-path toggles (``TUNING_OPTIONS``).

    timing: per-step host times and profiler ranges for benchmarks; step_graphs: replay each batch shape's
    canary launches from CUDA graphs; late_hooks: run a step's canary work once the engine has enqueued the
    forward; fused_steps: a steady decode step's canary work as one graph replayed after the forward;
    in_graph_waits: that graph waits for the engine's events itself; bucket_batches: pad decode batches to
    size buckets; steady_steps: the CPU's bound steady steps. All default True except timing (docs/transformers.md).
    """
    unknown = sorted(set(toggles) - set(TUNING_OPTIONS))
    if unknown:
        raise TypeError(f"kv-canary: tuned got unknown toggles {unknown}; expected {list(TUNING_OPTIONS)}")
    _check_options(toggles)
    token = _TUNING.set({**_TUNING.get(), **toggles})
    try:
        yield
    finally:
        _TUNING.reset(token)


def attach(model_or_manager, config: CanaryConfig | None = None, *, mode: str | None = None,
           check_v: bool | None = None, real_kv: str | None = None, sweep_interval: int | None = None,
           token_history: bool = True, token_oracle: bool = False, max_context: int | None = None,
           allow_unsupported_version: bool = False) -> TransformersHandle:
    """Guard a transformers model (or a not-yet-started ``ContinuousBatchingManager``) with kv-canary.

    Args:
        model_or_manager: a ``PreTrainedModel`` with continuous batching (``generate_batch``), or a
            manager from ``model.init_continuous_batching(...)`` whose cache holds no KV yet.
        config: the canary's ``CanaryConfig`` (default ``CanaryConfig.from_env()``: the ``KV_CANARY_*``
            variables); every other knob is a field there (docs/configuration.md).
        mode, check_v, real_kv, sweep_interval: override those ``config`` fields ("log" / "raise" / "abort" / "none";
            also V; real-KV bytes hashed; sweep every N steps).
        token_history: check stored tokens against each request's prompt + generated tokens (default True).
        token_oracle: force every sampled token to ``oracle_token(request_id, position, vocab)``, so the
            write-input assert checks each input id and position (changes the generated text: for tests).
        max_context: columns of the canary's tables (default: the cache's pages, the longest a request can be).
        allow_unsupported_version: skip the transformers version gate.

    Returns:
        a ``TransformersHandle``; ``handle.detach()`` restores the engine.
    """
    if config is not None and not isinstance(config, CanaryConfig):
        raise TypeError(f"kv-canary: attach config must be a CanaryConfig or None, got {type(config).__name__} "
                        f"{config!r} (options such as mode='raise' are keyword arguments of attach)")
    options = {**_TUNING.get(), "token_history": token_history, "token_oracle": token_oracle,
               "max_context": max_context, "allow_unsupported_version": allow_unsupported_version}
    _check_options(options)
    try:
        import transformers  # noqa: F401  (the extra; layout.py imports it lazily)
    except ImportError as e:
        raise ImportError(f"kv-canary: attach needs the transformers package, got an ImportError ({e}); install "
                          "it with pip install 'kv-canary[transformers]'") from e
    live = live_handle(model_or_manager)
    if live is not None:
        # Two handles on one engine would stack their hooks; detaching them out of order reinstalls the
        # other's hooks, so a second canary is refused instead of composed.
        raise RuntimeError(f"kv-canary: attach model_or_manager must not be guarded already, got a "
                           f"{type(model_or_manager).__name__} with a live handle {live!r}; call its detach() "
                           "first")
    overrides = {k: v for k, v in (("mode", mode), ("check_v", check_v), ("real_kv", real_kv),
                                   ("sweep_interval", sweep_interval)) if v is not None}
    config = CanaryConfig.from_env(**overrides) if config is None else config.replace(**overrides)
    check_version(allow_unsupported=allow_unsupported_version, config=config)  # (before any hook)
    _warn_unused(options, config)
    handle = TransformersHandle(config, options)
    try:
        if hasattr(model_or_manager, "_create_batch_processor"):
            handle._hook_manager(model_or_manager)
        elif hasattr(model_or_manager, "init_continuous_batching"):
            handle._hook_model(model_or_manager)
        else:
            raise TypeError("kv-canary: attach expects a transformers model with continuous batching or a "
                            f"ContinuousBatchingManager, got {type(model_or_manager).__name__}")
    except BaseException:
        handle._patcher.restore()
        raise
    return handle


def _zero_stats() -> dict:
    """Every key a session's stats() has (the canary's monitor's, then the session's own) at its value before any
    step: ``stats()`` starts from it, so its keys do not change after the first session."""
    return {
        **dict.fromkeys(("step", "forwards", "tokens_protected", "entries_checked"), 0), "launches": {},
        **dict.fromkeys(("sweeps", "violations", "idempotent_rewrites", "aborted_requests"), 0), "aborts_by_reason": {},
        **dict.fromkeys(("abort_unattributed", "abort_handler_errors", "poisoned_slots", "write_check_notes",
                         "attention_checks", "allocator_checks", "allocator_violations"), 0),
        **dict.fromkeys(EVENTS, 0), "requests": 0}


_FLAG_OPTIONS = (*TUNING_OPTIONS, "token_history", "token_oracle", "allow_unsupported_version")
# The instance attributes a live handle installs: attach reads them to find an engine already guarded.
_HOOKED = {"model": ("init_continuous_batching", "generate_batch"), "manager": ("_create_batch_processor", "stop")}


def _check_options(options: dict) -> None:
    """TypeError/ValueError for an integration option of the wrong type or range (before anything is hooked)."""
    for name in _FLAG_OPTIONS:
        if name in options and not isinstance(options[name], bool):
            raise TypeError(f"kv-canary: attach {name} must be a bool (True/False), got {options[name]!r}")
    ctx = options.get("max_context")
    if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool)):
        raise TypeError(f"kv-canary: attach max_context must be an int >= 1 or None, got {ctx!r}")
    if ctx is not None and ctx < 1:
        raise ValueError(f"kv-canary: attach max_context must be an int >= 1 or None (None: the cache's "
                         f"pages), got {ctx!r}")


def _warn_unused(options: dict, config: CanaryConfig) -> None:
    """One warning per option set explicitly where the rest of the set-up gives it no effect."""
    early = ("token_oracle=True" if options.get("token_oracle") else
             "check_before_forward=True" if config.check_before_forward else
             "fault injection" if config.injecting else None)
    for name, text in StepOptions.ineffective(options, early).items():
        warnings.warn(f"kv-canary: attach option {name}=True has no effect {text}", UserWarning, stacklevel=3)


def live_handle(model_or_manager) -> TransformersHandle | None:
    """The attached handle whose hooks are on this model or manager (or on the model's cached manager)."""
    own = vars(model_or_manager) if hasattr(model_or_manager, "__dict__") else {}
    for obj in (model_or_manager, own.get("_cached_continuous_batching_manager")):
        attrs = vars(obj) if hasattr(obj, "__dict__") else {}
        for name in (n for names in _HOOKED.values() for n in names):
            handle = getattr(attrs.get(name), "kvcanary_handle", None)
            if handle is not None and handle._attached:
                return handle
    return None


class TransformersHandle:
    """What ``attach`` returns: the canaries of each batching session, their reports, and ``detach``.

    Attributes:
        forwards: engine forwards the hooks guarded (proof that they ran).
        sessions: one per batch processor (per paged cache) created while attached.
        errors: exceptions raised inside hooks (the engine runs them on its background thread).
    """

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (f"<TransformersHandle at {id(self):#x}: {state}, {len(self.sessions)} session(s), "
                f"{self.forwards} forwards>")

    def __init__(self, config: CanaryConfig, options: dict):
        self.config, self.options = config, options
        self.lock = threading.RLock()
        self.forwards = 0
        self.sessions: list[Session] = []
        self.errors: list[BaseException] = []
        self._raised: set[int] = set()
        self._patcher = patcher()
        self._attached = True

    # -- hooks -----------------------------------------------------------------------------------
    def _hook_model(self, model) -> None:
        self.model = model
        orig_init, orig_generate = model.init_continuous_batching, model.generate_batch
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if cached is not None:
            self._hook_manager(cached)

        def init_continuous_batching(*args, **kwargs):
            manager = orig_init(*args, **kwargs)
            try:
                self._hook_manager(manager)
            except BaseException:
                # The manager switched the model to paged attention; nothing will stop it, so switch back.
                if manager._original_attn_impl is not None and not manager.is_running():
                    manager.model.set_attn_implementation(manager._original_attn_impl)
                    manager._original_attn_impl = None
                raise
            return manager

        def generate_batch(*args, **kwargs):
            out = orig_generate(*args, **kwargs)
            self.check()
            return out

        for fn in (init_continuous_batching, generate_batch):
            fn.kvcanary_handle = self  # (live_handle finds it)
        self._patcher.set(model, "init_continuous_batching", init_continuous_batching)
        self._patcher.set(model, "generate_batch", generate_batch)

    def _hook_manager(self, manager) -> None:
        if self._patcher.patched(manager, "_create_batch_processor"):
            return
        check_engine(manager.model.config.get_text_config(), manager.continuous_batching_config, canary=self.config,
                     token_oracle=bool(self.options.get("token_oracle")), device=manager.model.device)
        if manager.distributed_helper.tp_size > 1:
            raise ValueError(f"kv-canary: tensor parallelism is not supported, got tp_size="
                             f"{manager.distributed_helper.tp_size}")
        if manager.is_running():
            raise RuntimeError("kv-canary: attach before the manager starts, got a running manager")
        orig_create, orig_stop = manager._create_batch_processor, manager.stop

        def create_batch_processor():
            bp = orig_create()
            if self._session_of(bp) is None:
                self._guarded(self._open_session, bp, manager)
            return bp

        def stop(*args, **kwargs):
            out = orig_stop(*args, **kwargs)
            # Not kept for a next session: the processor (and its cache) is gone.
            if manager.batch_processor is None:
                for s in self.sessions:
                    if not s.closed and s.manager is manager:
                        s.close()
            return out

        for fn in (create_batch_processor, stop):
            fn.kvcanary_handle = self  # (live_handle finds it)
        self._patcher.set(manager, "_create_batch_processor", create_batch_processor)
        self._patcher.set(manager, "stop", stop)
        if manager.batch_processor is not None and self._session_of(manager.batch_processor) is None:
            self._open_session(manager.batch_processor, manager)

    def _open_session(self, bp, manager) -> Session:
        session = Session(self, bp)
        session.manager = manager
        self.sessions.append(session)
        return session

    def _session_of(self, bp) -> Session | None:
        return next((s for s in self.sessions if not s.closed and s.bp is bp), None)

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except BaseException as e:
            self._record_error(e)
            raise

    def _record_error(self, error: BaseException) -> None:
        with self.lock:
            if not any(e is error for e in self.errors):
                self.errors.append(error)

    # -- results ---------------------------------------------------------------------------------
    @property
    def canary(self):
        """The ``Canary`` of the newest open session (None before the first run or after it closed)."""
        open_ = [s for s in self.sessions if not s.closed]
        return open_[-1].canary if open_ else None

    @property
    def violations(self) -> list[Violation]:
        """Every violation drained so far, all sessions (call ``flush`` first while a run is in flight)."""
        return [v for s in self.sessions for v in s.violations]

    def flush(self) -> list[Violation]:
        """Drain pending observations of open sessions; returns all violations."""
        with self.lock:
            for s in self.sessions:
                if not s.closed:
                    s.canary.flush()
        return self.violations

    def stats(self) -> dict:
        """Totals over sessions: forwards, tokens_protected, entries_checked, sweeps, violations, KV movements.

        The keys are the same from attach on (zero before the first session), whatever the sessions met."""
        total: dict = {"sessions": len(self.sessions), "hooked_forwards": self.forwards, **_zero_stats()}
        for s in self.sessions:
            for k, v in s.stats().items():
                if isinstance(v, int):
                    total[k] = total.get(k, 0) + v
                elif isinstance(v, dict):
                    merged = total.setdefault(k, {})
                    for name, n in v.items():
                        merged[name] = merged.get(name, 0) + n
        return total

    def request_name(self, request_id: int | None, session: int = -1) -> str | None:
        """The engine's string id of a canary request id (of ``sessions[session]``)."""
        if request_id is None or not self.sessions:
            return None
        names = {v: k for k, v in self.sessions[session].ids.items()}
        return names.get(request_id)

    def describe(self, violation: Violation, session: int = -1) -> str:
        """The readable violation block, with engine request ids next to the canary's ints."""
        return violation.block(lambda rid: self.request_name(rid, session))

    def check(self) -> None:
        """Raise the first exception a hook raised on the engine thread and that was not raised yet."""
        for e in self.errors:
            if id(e) not in self._raised:
                self._raised.add(id(e))
                raise e

    def detach(self) -> None:
        """Close every session (final drain), restore every rebound method and the reserved block,
        then raise any hook exception not raised yet. A second call does nothing; only this handle's
        hooks are removed (``attach`` refuses a second handle on a guarded engine)."""
        if not self._attached:
            return
        running = [s for s in self.sessions if not s.closed and s.manager is not None and s.manager.is_running()]
        if running:
            raise RuntimeError("kv-canary: detach after the continuous-batching manager stopped, got a running one")
        for s in self.sessions:
            s.close()
        self._patcher.restore()
        self._attached = False
        self.check()
