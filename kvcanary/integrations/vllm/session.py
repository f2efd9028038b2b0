"""One canary per vLLM model runner (one per process and tensor-parallel rank), and what the hooks do with it.

``open_session`` runs when the runner has allocated its KV cache: it checks the engine (``layout.check_engine``),
builds the ``Canary`` over the cache's slots and, with tensor parallelism, a ``ConsistencyCheck`` over vLLM's
tensor-parallel process group. Per scheduler step (``execute_model``):

  begin_step   the step's cache events: prefix-cache hits of new requests, resumptions after preemption, frees;
               vLLM's KV block copies (copy-on-write) carry the canary records along (``copy_records``)
  guard_forward  the forward from the attention metadata (``batch.BatchBuilder``), each of its waves a host step
               (``runtime.engine.HostStep``) whose batch the runtime's ``StepTables`` builds; before_forward, the
               model, after_forward (drain: each violation becomes a row naming vLLM's request ids), the TP exchange
  end_step     a step that scheduled tokens must have run a guarded forward, else the hooks were bypassed: error

The session drives the ``Canary`` itself rather than through the runtime's ``StepRunner``: a model forward here
may be several canary forwards (waves, ``batch.waves``), each after the one before has closed, while the runner
takes one canary step per model forward; and the runner's eager step adds the new tokens' read check, which vLLM's
canary does not run (docs/vllm.md, "One forward as a host step").

Rows go to the report directory as they are drained and stay in memory for ``report()`` (``collect(llm)``).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import numpy as np
import torch

from kvcanary.runtime import Canary, PoolSpec
from kvcanary.runtime.step.tables import StepTables

from kvcanary.integrations.vllm import written_kv
from kvcanary.integrations.vllm.allocator import BlockPoolView
from kvcanary.integrations.vllm.batch import BatchBuilder, waves
from kvcanary.integrations.vllm.layout import KvLayout, check_engine
from kvcanary.integrations.vllm.mirror import RowMirror
from kvcanary.integrations.vllm.report import ReportFiles, RequestNames, describe, violation_row
from kvcanary.integrations.vllm.settings import Settings

log = logging.getLogger("kvcanary")

SESSIONS: list = []  # this process's sessions, newest last (live handles for in-process engines)
# mode "abort": vLLM request ids to fail, taken by the scheduler of this process after the step (plugin.py)
PENDING_ABORTS: set[str] = set()
MAX_ROWS = 10_000  # rows kept in memory per session (every row still goes to the report directory)
STATS_EVERY_S = 1.0  # the stats file is rewritten at most this often while serving (and at every report)


def session_of(runner) -> Session | None:
    return getattr(runner, "_kvcanary_session", None) if runner is not None else None


def open_session(runner) -> Session | None:
    settings = Settings.from_env()
    if settings.config.mode == "none":
        return None
    session = Session(runner, settings)
    runner._kvcanary_session = session
    SESSIONS.append(session)
    return session


def no_session_report() -> dict:
    """A worker without a session (KV_CANARY_MODE=none, or no KV cache yet): no rows, and stats that say so."""
    return {"rows": [], "stats": {"pid": os.getpid(), "guarded": False, "forwards": 0, "violations": 0}}


def _canary_work(method):
    """A session method whose exceptions are the canary's own (``Session.failure``), not the engine's: all but the
    model forward's, which ``guard_forward`` names ``engine_error``."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException as e:
            if e is not self.engine_error:
                self.failure = e
            raise

    return run


class Session:
    """The canary of one vLLM model runner."""

    def __init__(self, runner, settings: Settings):
        self.runner, self.settings = runner, settings
        self.layout: KvLayout = check_engine(runner, settings.config)
        self.rank, self.tp_size, group = _tp_rank(runner)
        self.names = RequestNames()
        self.files = ReportFiles(settings.report_dir, self.rank)
        self.rows: list[dict] = []
        self.dropped_rows = 0
        self.events = {"prefix_hits": 0, "prefix_hit_tokens": 0, "resumed_after_preemption": 0, "preempted": 0,
                       "finished": 0, "block_copies": 0, "chunked_prefill_chunks": 0, "steps": 0,
                       "split_forwards": 0, "aborted": 0, "abandoned_forwards": 0}
        self.in_step = False
        self.closed = False
        # this step's exception raised by the canary's work (mode raise, a divergence, a failure of its own), and
        # the engine's own from the model forward: abandon_step tells them apart
        self.failure: BaseException | None = None
        self.engine_error: BaseException | None = None
        self._step_forwards = 0
        self._running_only = False  # this step schedules running requests only (begin_step)
        self._stats_at = 0.0
        self.canary = self._build_canary()
        lay = self.layout
        c = self.canary
        self.builder = BatchBuilder(max_batch=c.max_batch, max_tokens=c.max_tokens, max_context=c.max_context,
                                    block_size=lay.block_size, num_slots=lay.num_slots,
                                    layer_name=lay.layer_names[0], names=self.names,
                                    history=c.config.token_check, lora=runner.lora_config is not None)
        self.tables = StepTables(c, self.builder)  # each wave's ForwardBatch from its host step
        self.consistency = None
        if self.tp_size > 1:
            from kvcanary.distributed import ConsistencyCheck

            self.consistency = ConsistencyCheck(self.canary, interval=settings.tp_interval, group=group)
        self._write_stats(force=True)
        log.info("kv_canary: guarding vLLM's model runner (rank %d of %d, %d slots of %d blocks, mode %s)",
                 self.rank, self.tp_size, lay.num_slots, lay.num_blocks, settings.config.mode)

    def _build_canary(self) -> Canary:
        r, lay, config = self.runner, self.layout, self.settings.config
        max_batch = int(r.scheduler_config.max_num_seqs)
        max_tokens = int(r.scheduler_config.max_num_batched_tokens)
        max_context = -(-int(r.model_config.max_model_len) // lay.block_size) * lay.block_size
        if not config.plan_capacity:
            # every request of a forward re-verifies its whole context; shared prefixes make that more than the
            # pool's slots, but rarely twice as many (an overflow skips one verify, and warns with the count)
            config = config.replace(plan_capacity=min(max_batch * max_context, 2 * lay.num_slots + max_tokens))
        k_picks, v_picks = lay.real_kv_picks(config.check_v)
        # (a kernel that interleaves tokens: the sources are token-row copies, refreshed after each forward)
        self.mirror = RowMirror(lay, k_picks + v_picks) if lay.mirrored and (k_picks or v_picks) else None
        source = self.mirror.source if self.mirror is not None else (lambda pick: lay.head_source(*pick))
        k_sources, v_sources = (tuple(source(p) for p in picks) for picks in (k_picks, v_picks))
        pool = PoolSpec(lay.num_slots, k_sources, v_sources, reserved_slots=lay.reserved_slots())
        if config.mode == "abort":
            _check_abort(r, "KV_CANARY_MODE=abort")
        if self.settings.allocator_interval:
            _check_abort(r, "KV_CANARY_VLLM_ALLOCATOR_INTERVAL")
            config = config.replace(allocator_check_interval=self.settings.allocator_interval)
        canary = Canary(pool, config, max_batch=max_batch, max_tokens=max_tokens, max_context=max_context,
                        num_rows=max_batch + 1, device="cpu", on_violation=self._on_violation,
                        on_abort=self._on_abort)
        if self.settings.allocator_interval:
            canary.watch_allocator(BlockPoolView(self.names, lay.num_blocks), num_blocks=lay.num_blocks,
                                   slots_per_block=lay.block_size)
        # No forward before this one wrote request KV through the guarded path (warm-up runs are unguarded and
        # write no request's blocks): arm the chain-position assert now.
        canary.mark_ready()
        # the write check: each fingerprinted head's computed K / V, noted at its layer's cache write
        self.written = written_kv.install(r, lay, canary, list(zip(k_picks + v_picks, k_sources + v_sources)))
        return canary

    # -- hooks -----------------------------------------------------------------------------------
    @_canary_work
    def begin_step(self, so) -> None:
        """Before vLLM's ``execute_model`` applies the scheduler's step: its events and block copies."""
        self.failure = self.engine_error = None
        if self.in_step:
            raise RuntimeError("kv-canary: vLLM's execute_model must not be re-entered, got a second call inside one")
        self.events["steps"] += 1
        for req in so.scheduled_new_reqs:
            self.names.number(req.req_id)
            if req.num_computed_tokens > 0:
                self.events["prefix_hits"] += 1
                self.events["prefix_hit_tokens"] += int(req.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        self.events["resumed_after_preemption"] += len(getattr(cached, "resumed_req_ids", ()) or ())
        self.events["preempted"] += len(so.preempted_req_ids or ())
        self.events["finished"] += len(so.finished_req_ids)
        copies = so.kv_cache_block_copies
        if copies:
            # vLLM copies each pair's blocks in _update_states, before the forward: the records go first
            bs = self.layout.block_size
            src = np.repeat(np.array([c[0] for c in copies], dtype=np.int64) * bs, bs) + np.tile(np.arange(bs), len(copies))
            dst = np.repeat(np.array([c[1] for c in copies], dtype=np.int64) * bs, bs) + np.tile(np.arange(bs), len(copies))
            self.canary.copy_records(torch.from_numpy(src), torch.from_numpy(dst))
            self.events["block_copies"] += len(copies)
        # a step of running requests only (none new, none resumed): in its decode-only forwards no request may read
        # a block another writes (guard_forward)
        self._running_only = not so.scheduled_new_reqs and not getattr(cached, "resumed_req_ids", None)
        self.in_step, self._step_forwards = True, 0
        self._expect_forward = so.total_num_scheduled_tokens > 0

    @_canary_work
    def guard_forward(self, forward, runner, args, kwargs):
        """vLLM's ``_model_forward`` between the canary's before and after work."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if input_ids is None or positions is None or positions.dim() != 1:
            raise RuntimeError("kv-canary: vLLM's forward must get token ids and 1-D positions, got "
                               f"input_ids={type(input_ids).__name__}, positions="
                               f"{None if positions is None else tuple(positions.shape)}")
        fwd = self.builder.read(runner, input_ids, positions)
        self._count_chunks(runner, fwd)
        if self._running_only and fwd.num_tokens == fwd.batch_size:
            # Decode only, every request scheduled before: a block one of them writes now is its own partial tail
            # block, which no other request's table can hold (vLLM shares full blocks only, hit when a request is
            # scheduled first). One wave, without the split's per-forward search; a table that does hold another's
            # tail block (an engine bug) fails the verify either way: the slot's record is the writer's token.
            parts = [list(range(fwd.batch_size))]
        else:
            parts = waves(fwd, self.layout.block_size)
        # (each wave's tokens among the forward's: its share of the write check's notes)
        tokens = [None] if len(parts) == 1 else [torch.from_numpy(fwd.tokens(idx)) for idx in parts]
        first = self._batch(fwd, None if len(parts) == 1 else parts[0])
        self.canary.before_forward(first)
        written = self.written
        try:
            if written is not None:
                written.live = True
            out = forward(runner, *args, **kwargs)
        except BaseException as e:
            self.engine_error = e
            # the engine's failure, not the canary's: the forward is abandoned (its unwritten KV stays unwritten
            # for the canary), so a later forward of this worker starts as any other (runtime/abandon.py)
            self.canary.abandon_forward()
            self.events["abandoned_forwards"] += 1
            raise
        finally:
            if written is not None:
                written.live = False
        if self.mirror is not None:
            # (the after work alone reads KV bytes: the slots the forward read and wrote, as the cache holds them now)
            self.mirror.refresh(self.mirror.blocks_of(fwd))
        # the write check's notes are in the model forward's token order: each wave gets its own tokens' notes
        wc = self.canary.write_check
        notes = wc.save() if len(parts) > 1 else None
        for k, idx in enumerate(parts):
            part = first
            if k:  # reads of blocks an earlier wave wrote in this forward: checked now that their records are written
                part = self._batch(fwd, idx)
                self.canary.before_forward(part)
            wc.restore(notes, tokens[k])
            self.canary.after_forward(part)
        self.events["split_forwards"] += len(parts) > 1
        self._step_forwards += 1
        if self.consistency is not None:
            self._divergences(self.consistency.step())
        return out

    def _batch(self, fwd, idx: list[int] | None):
        """The ``ForwardBatch`` of the requests ``idx`` of ``fwd`` (None: all): their host step, packed by the
        builder, built by the runtime's ``StepTables`` (no key: vLLM's steps send whole histories, seldom twice
        the same shape)."""
        b = self.builder
        b.set_wave(fwd, idx)
        return self.tables.build(b.host_part(), None)

    @_canary_work
    def end_step(self) -> None:
        self.in_step = False
        if self._expect_forward and not self._step_forwards:
            raise RuntimeError("kv-canary: a vLLM step that scheduled tokens must run a guarded forward, got none "
                               "(the model ran outside GPUModelRunner._model_forward: this vLLM build is not "
                               "supported)")
        self._write_stats()

    def abandon_step(self, error: BaseException | None = None) -> None:
        """The step raised ``error``. With tensor parallelism, where it is the canary's (mode raise's violation or
        divergence, or a failure of its own) on a rank other than 0, this worker's process ends (``SystemExit``):
        vLLM's multiprocess executor awaits each step's reply from rank 0 alone and only logs another rank's
        exception, so raised there the error would leave that rank a step behind its peers (their next collective
        never met: the engine hangs); a worker that dies is what vLLM fails the whole engine for. Rank 0's error
        reaches the caller in its reply; the engine's own errors go to vLLM unchanged."""
        self.in_step = False
        # (an Exception: vLLM's own SystemExit at a shutdown signal, or an interrupt, passes unchanged)
        if self.tp_size > 1 and self.rank != 0 and isinstance(error, Exception) and error is self.failure:
            log.error("kv_canary: rank %d of %d stops its worker process: %r", self.rank, self.tp_size, error)
            self.close()
            raise SystemExit(f"kv-canary: rank {self.rank} stopped its vLLM worker: {error}") from error

    # -- reports ---------------------------------------------------------------------------------
    def _on_violation(self, v) -> None:
        row = violation_row(v, self.names, rank=self.rank, block_size=self.layout.block_size,
                            text=describe(v, self.names))
        self._keep([row])

    def _on_abort(self, request_id: int, violations) -> None:
        """Mode abort: the request read wrong KV. Its vLLM id waits for this process's scheduler, which fails it
        through its own error path after the step (the forward that read the KV has run: nothing is freed under
        it)."""
        name = self.names.name(request_id)
        if name is not None:
            PENDING_ABORTS.add(name)
            self.events["aborted"] += 1

    def _divergences(self, fresh) -> None:
        rows = [{"kind": "divergence", "pid": os.getpid(), "reporting_rank": self.rank, **d.to_dict()} for d in fresh]
        self._keep(rows)

    def _keep(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.files.append(rows)
        room = max(0, MAX_ROWS - len(self.rows))
        self.rows.extend(rows[:room])
        self.dropped_rows += len(rows) - min(room, len(rows))
        self._write_stats(force=True)

    def stats(self) -> dict:
        s = self.canary.stats()
        out = {"rank": self.rank, "tp_size": self.tp_size, "pid": os.getpid(), "guarded": True,
               "mode": self.settings.config.mode, "block_size": self.layout.block_size,
               "num_slots": self.layout.num_slots, "requests": len(self.names), "rows_dropped": self.dropped_rows,
               **{k: v for k, v in s.items() if isinstance(v, (int, float, str))}, **self.events}
        if self.consistency is not None:
            out["tp_exchanges"] = self.consistency.exchanges
            out["tp_divergences"] = len(self.consistency.divergences)
        return out

    def _write_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.files.stats_path is None or (not force and now - self._stats_at < STATS_EVERY_S):
            return
        self._stats_at = now
        self.files.write_stats(self.stats())

    def report(self, finish_tp: bool = True) -> dict:
        """Drain everything and return the rows and stats of this canary session (``kvcanary_report``; JSON-safe)."""
        if finish_tp and self.consistency is not None and not self.closed:
            # (the drain, then the exchange every rank enters, also one whose drain raised: ConsistencyCheck.finish)
            self._divergences(self.consistency.finish())
        else:
            self.canary.flush()
        self._write_stats(force=True)
        return {"rows": list(self.rows), "stats": self.stats()}

    def close(self) -> None:
        """The runner shuts down: last drain and stats (no TP exchange: the other ranks may be gone already)."""
        if self.closed:
            return
        try:
            self.canary.flush()
        except Exception as e:  # (mode raise: rows and log lines are out; vLLM's shutdown must go on)
            log.error("kv_canary: the last drain at vLLM's shutdown raised %r", e)
        finally:
            self.closed = True
            if self.written is not None:
                self.written.uninstall()
            self._write_stats(force=True)

    def _count_chunks(self, runner, fwd) -> None:
        """Requests of this forward whose prompt is not complete after it (a chunked prefill's earlier chunks)."""
        n = fwd.batch_size
        done = np.add(fwd.prefix, fwd.extend)
        self.events["chunked_prefill_chunks"] += int((done < runner.input_batch.num_prompt_tokens[:n]).sum())


def _check_abort(runner, what: str = "KV_CANARY_MODE=abort") -> None:
    """Mode abort and the allocator check need the scheduler in this process (vLLM's one-worker executor, ``uni``):
    a worker of the multiprocess executor cannot reach it without a change to vLLM."""
    pc = runner.parallel_config
    if pc.world_size > 1 or pc.distributed_executor_backend not in (None, "uni"):
        raise ValueError(f"kv-canary: {what} on vLLM needs the worker in the scheduler's process (one worker, "
                         f"distributed_executor_backend 'uni'), got world size {pc.world_size} with backend "
                         f"{pc.distributed_executor_backend!r}")


def _tp_rank(runner) -> tuple[int, int, object]:
    """(tensor-parallel rank, TP size, vLLM's TP process group on the CPU: gloo) of this worker."""
    size = int(runner.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1, None
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return int(tp.rank_in_group), size, tp.cpu_group
