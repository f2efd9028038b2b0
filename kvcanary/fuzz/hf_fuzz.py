"""Perturbed schedules of transformers continuous batching: what a perturbation seed changes, one run under it,
and the near-tie test that tells a batch-variant divergence from a corrupted one.

The workload of seed W is the soak's (``soak.hf_run.installed_workload(W)``), always greedy. A
perturbation changes how the engine schedules it, through ``ContinuousBatchingConfig`` and the order and
time requests reach the scheduler:

  max_batch_tokens          the token budget per forward (chunked prefill when below a prompt)
  max_requests_per_batch    the batch cap (1 = one request per forward)
  num_blocks                the pool: a tight one preempts (soft resets), with a CPU swap pool it offloads
  offload_blocks            the CPU swap pool (llama model, tight pool: offload and restore)
  scheduler                 ``scheduler_type``: fifo or prefill_first
  order, arrival            the order requests reach the scheduler, and the forward step each arrives at

Arrival goes through ``ArrivalSchedule``, a batch-processor shim: ``generate_batch`` queues every request at
once (sorted by prompt when prefix sharing is on), and the engine's thread drains its queue whenever it
runs, so the shim holds the requests back until all are queued and then hands each to the scheduler at its
step: the same schedule on every replay.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass

from kvcanary.fuzz.judge import Run
from kvcanary.soak.hf_run import installed_workload
from kvcanary.soak.hf_workload import HfWorkload, blocks_per_request

# Logits of the same request differ across batch compositions by a few ULPs on the CPU (fp32 reductions of
# another shape; log-probs by <= 5e-7 in docs/fuzz.md's measurement): a greedy divergence whose two tokens'
# logits were closer than this is a near tie that such noise explains, not corruption.
TIE_TOLERANCE = 1e-4
HOLD_TIMEOUT_S = 30.0  # how long the shim waits for generate_batch to queue every request


@dataclass(frozen=True)
class HfPerturbation:
    """One drawn schedule for a transformers workload (see the module docstring); ``seed`` >= 1 names it."""

    seed: int
    max_batch_tokens: int
    max_requests_per_batch: int
    num_blocks: int
    offload_blocks: int
    scheduler: str
    order: tuple[int, ...]  # prompt indices in the order they reach the scheduler
    arrival: tuple[int, ...]  # per prompt index: the forward step it arrives at (0: before the first)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"order": list(self.order), "arrival": list(self.arrival)}


def fuzz_workload(seed: int) -> HfWorkload:
    """The soak's workload of ``seed`` (the MLA model in some, on transformers 5.25+), greedy (the fuzzer compares
    greedy tokens)."""
    return dataclasses.replace(installed_workload(seed), sampling="greedy")


def draw_hf_perturbation(w: HfWorkload, seed: int) -> HfPerturbation:
    """Perturbation ``seed`` (>= 1) of workload ``w`` (every draw comes from the two seeds)."""
    rng = random.Random(f"kvcanary-fuzz-hf-{w.seed}-{seed}")
    longest = max(len(p) for p in w.prompts)
    budget = max(4, rng.choice((w.max_batch_tokens, longest, 2 * longest, rng.randint(4, max(4, longest)),
                                rng.randint(4, 16))))
    cap = rng.choice((w.max_requests_per_batch, 1, 2, 3, 4, 8))
    need = blocks_per_request(w.prompts, w.max_new_tokens, w.num_return_sequences, w.block_size,
                              w.model == "hybrid")
    # the soak's bounds: a tight pool holds the largest request (and block 0, which the canary keeps)
    tight, plenty = max(need) + 2 + rng.randint(0, 2), sum(need) + 4 + rng.randint(0, 8)
    blocks = rng.choice((w.num_blocks, tight, plenty))
    offload = w.offload_blocks
    if blocks < sum(need) and w.model != "hybrid":
        offload = rng.choice((0, sum(need)))
    scheduler = rng.choice(("fifo", "fifo", "prefill_first"))
    order = list(range(len(w.prompts)))
    if rng.random() < 0.5:
        rng.shuffle(order)
    arrival = tuple(0 if rng.random() < 0.6 else rng.randint(1, 6) for _ in w.prompts)
    return HfPerturbation(seed=seed, max_batch_tokens=budget, max_requests_per_batch=cap, num_blocks=blocks,
                          offload_blocks=offload if blocks < sum(need) else 0, scheduler=scheduler,
                          order=tuple(order), arrival=arrival)


class ArrivalSchedule:
    """A batch-processor shim (``soak.hf_engine.wrap_processors``): requests ``req_i`` reach the scheduler in
    ``order``, each once ``arrival[i]`` forwards have run; when nothing is left to run, the next ones arrive
    at once (no idle steps). Forks and re-queued (preempted) requests pass straight through."""

    def __init__(self, order: tuple[int, ...], arrival: tuple[int, ...]):
        self.plan = sorted((arrival[i], pos, f"req_{i}") for pos, i in enumerate(order))
        self.failure: str | None = None  # set when generate_batch did not queue every request in time

    def __call__(self, bp) -> None:
        sched = bp.scheduler
        add, drain, update = sched.add_waiting_request, bp._update_tp_group_state, bp.update_batch
        expected = {rid for _, _, rid in self.plan}
        held: dict[str, object] = {}
        pending = list(self.plan)
        forwards = [0]
        all_held = threading.Event()
        deadline = [None]

        def add_waiting_request(state):
            if state.request_id in expected and state.request_id not in held:
                held[state.request_id] = state
                if len(held) == len(expected):
                    all_held.set()
            else:
                add(state)

        def update_tp_group_state():
            stop = drain()  # (queued requests go through add_waiting_request: held)
            if not all_held.is_set():
                deadline[0] = deadline[0] or time.monotonic() + HOLD_TIMEOUT_S
                if time.monotonic() < deadline[0]:
                    return stop
                self.failure = f"only {len(held)} of {len(expected)} requests were queued"
            due = [x for x in pending if x[0] <= forwards[0]]
            if not due and pending and not sched.has_pending_requests():
                due = [x for x in pending if x[0] == pending[0][0]]
            for x in due:
                pending.remove(x)
                if x[2] in held:
                    add(held[x[2]])
            return stop

        def update_batch():
            update()
            if all_held.is_set():
                forwards[0] += 1

        sched.add_waiting_request = add_waiting_request
        bp._update_tp_group_state = update_tp_group_state
        bp.update_batch = update_batch


def run_hf_schedule(model, w: HfWorkload, perturbation: HfPerturbation | None, device: str = "cpu",
                    bug: str | None = None, canary: bool = True) -> Run:
    """Run greedy workload ``w`` under ``perturbation`` (None: the reference schedule, the soak's) under the
    canary (``canary=False``: without it, as the engine runs alone), with ``bug`` planted."""
    from kvcanary.soak.hf_run import EVENTS, generate

    p, shims, overrides = perturbation, (), None
    if p is not None:
        w = dataclasses.replace(w, max_batch_tokens=p.max_batch_tokens, max_requests_per_batch=p.max_requests_per_batch,
                                num_blocks=p.num_blocks, offload_blocks=p.offload_blocks)
        shims, overrides = (ArrivalSchedule(p.order, p.arrival),), {"scheduler_type": p.scheduler}
    run = Run(perturbation=0 if p is None else p.seed,
              params={"model": w.model, "block_size": w.block_size} | (p.to_dict() if p else {}))
    t0 = time.perf_counter()
    try:
        tokens, errors, handle = generate(model, w, device, canary=canary, bug=bug, shims=shims, overrides=overrides)
    except Exception as e:  # a schedule the engine cannot run is judged against the reference, not a crash
        run.error = f"{type(e).__name__}: {e}"
        run.seconds = round(time.perf_counter() - t0, 3)
        return run
    failed = dict(e.split(": ", 1) for e in errors)
    run.tokens = {k: t for k, t in tokens.items() if k not in failed}
    run.failed = failed
    if handle is None:
        run.seconds = round(time.perf_counter() - t0, 3)
        return run
    stats = handle.stats()
    run.violations = int(stats.get("violations", 0))
    run.first_violations = [v.log_line() for v in handle.violations[:3]]
    run.problems = [f"hook error: {type(e).__name__}: {e}" for e in handle.errors
                    if type(e).__name__ != "KvCanaryViolationError"]
    if shims and shims[0].failure:
        run.problems.append(f"arrival schedule: {shims[0].failure}")
    run.events = {k: int(stats.get(k, 0)) for k in EVENTS}
    run.seconds = round(time.perf_counter() - t0, 3)
    return run


def near_tie(model, w: HfWorkload, reference: Run):
    """``judge``'s near-tie test for workload ``w``: the margin between the two tokens in the logits of a plain
    forward (no cache) over the prompt and the reference's tokens before the divergence, when it is below
    ``TIE_TOLERANCE``."""
    import torch

    def margin(key: str, index: int, want: int, got: int) -> float | None:
        prompt = list(w.prompts[int(key.split("__")[0].removeprefix("req_"))])
        ids = torch.tensor([prompt + reference.tokens[key][:index]], device=model.device)
        logits = plain_logits(model, ids)[0, -1].float()
        m = abs(float(logits[want] - logits[got]))
        return m if m < TIE_TOLERANCE else None

    return margin


def plain_logits(model, ids):
    """The logits of a plain forward (no cache) over ``ids``. The tiny models run transformers 5.17's
    ``paged|sdpa``, which serves continuous batching's forwards only (a plain one raises), so its plain
    ``sdpa`` runs this one; from 5.18 ``sdpa`` is both."""
    import torch

    impl = model.config._attn_implementation
    plain = impl.removeprefix("paged|")
    if plain != impl:
        model.set_attn_implementation(plain)
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        if plain != impl:
            model.set_attn_implementation(impl)


def hf_schedules(seed: int, perturbations: list[int]) -> list[HfPerturbation]:
    """The perturbations of workload ``seed`` named by ``perturbations`` (seeds >= 1)."""
    w = fuzz_workload(seed)
    return [draw_hf_perturbation(w, p) for p in perturbations]
