"""Run one transformers soak workload twice, without and with the canary, and compare.

The run without the canary is the reference: the canary must report nothing, and a greedy workload must
generate the same tokens. Both runs have the same capacity (the run without the canary gives up the block
the canary keeps for its padding slot), so they schedule alike. A planted engine bug (``hf_bugs``) goes
into the canary's run only: that is how the campaign shows it can fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvcanary.soak.hf_engine import engine_config, processor_shims, wrap_processors
from kvcanary.soak.hf_workload import SLIDING_WINDOW, HfWorkload, make_hf_workload

# Engine events (canary stats) that show a drawn feature really happened in the run.
EVENTS = ("prefix_hits", "dedup_remaps", "fork_block_copies", "soft_resets", "offloaded_requests",
          "restored_requests", "sweeps", "allocator_checks")
_MODELS: dict[tuple[str, str], object] = {}


def tiny_model(kind: str, device: str):
    """The tiny seeded model of ``kind`` ('llama', 'hybrid' or 'mla'), built once per process and device."""
    key = (kind, device)
    if key not in _MODELS:
        from kvcanary.demo import build_tiny_model

        _MODELS[key] = build_tiny_model(device, sliding_window=SLIDING_WINDOW if kind == "hybrid" else None,
                                        mla=kind == "mla")
    return _MODELS[key]


def installed_workload(seed: int) -> HfWorkload:
    """Workload ``seed`` as the installed transformers runs it: MLA models in some where it pages MLA latents."""
    from kvcanary.integrations.transformers.reach import has_mla_paging

    return make_hf_workload(seed, mla=has_mla_paging())


@dataclass
class Outcome:
    """One workload's verdict; ``findings`` is empty for a clean pass."""

    seed: int
    features: list[str]
    violations: int = 0
    tokens_compared: bool = False
    tokens_match: bool | None = None
    events: dict[str, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    engine_failures: list[str] = field(default_factory=list)  # the same failed requests without the canary
    first_violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""


def generate(model, w: HfWorkload, device: str, canary: bool, bug: str | None, *, shims: tuple = (),
             overrides: dict | None = None):
    """Run ``w`` on ``model`` once; returns (tokens by request id, failed requests' errors, the handle or None).

    ``shims``: more functions to run on each batch processor (kvcanary.fuzz's arrival schedule);
    ``overrides``: ``ContinuousBatchingConfig`` keywords that replace the workload's (e.g. scheduler_type)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.integrations.transformers.layout import POOL_OPTIONS
    from kvcanary.sim.hf_bugs import plant
    from kvcanary.integrations.transformers.reach import attach_with, has_block_pool

    if w.greedy:
        # forks need sampling in transformers' batching; top_k=1 keeps it greedy and deterministic
        sampling = dict(do_sample=True, top_k=1) if w.num_return_sequences > 1 else dict(do_sample=False)
    else:
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    gen = GenerationConfig(max_new_tokens=w.max_new_tokens, eos_token_id=-1,
                           num_return_sequences=w.num_return_sequences, **sampling)
    cbc = ContinuousBatchingConfig(**{**engine_config(w, device), **(overrides or {})})
    undo_shims = wrap_processors(model, processor_shims(w, device, reserve_padding=not canary) + list(shims))
    undo_bug = plant(model, bug) if bug else None
    # (5.17's cache has no block pool: attach refuses the allocator check and poison on free there, so a workload
    # runs without them)
    options = {k: v for k, v in w.canary_options if has_block_pool() or k not in POOL_OPTIONS}
    handle = attach_with(model, mode="log", **options) if canary else None
    try:
        out = model.generate_batch([list(p) for p in w.prompts], generation_config=gen,
                                   continuous_batching_config=cbc)
    finally:
        if handle is not None:
            handle.detach()
        if undo_bug is not None:
            undo_bug()
        undo_shims()
    tokens = {rid: list(o.generated_tokens) for rid, o in sorted(out.items())}
    errors = sorted(f"{rid}: {o.error}" for rid, o in out.items() if getattr(o, "error", None))
    return tokens, errors, handle


def run_hf_workload(w: HfWorkload, device: str = "cpu", bug: str | None = None) -> Outcome:
    """Run ``w`` without and with the canary (``bug`` planted in the latter) and compare."""
    t0 = time.perf_counter()
    result = Outcome(seed=w.seed, features=list(w.features))
    model = tiny_model(w.model, device)
    try:
        base, base_errors, _ = generate(model, w, device, canary=False, bug=None)
        tokens, errors, handle = generate(model, w, device, canary=True, bug=bug)
    except Exception as e:  # a workload the engine or the adapter cannot run is a finding, not a crash
        result.findings.append(f"error: {type(e).__name__}: {e}")
        result.seconds = round(time.perf_counter() - t0, 3)
        return result
    stats = handle.stats()
    result.violations = int(stats.get("violations", 0))
    result.events = {k: int(stats.get(k, 0)) for k in EVENTS}
    vs = handle.violations
    result.first_violations = [v.log_line() for v in vs[:3]]
    if result.violations:
        result.findings.append(f"violations: {result.violations}")
    if base_errors and errors == base_errors:
        # the engine fails these requests on its own, alike with and without the canary: not the canary's
        # doing, but listed, since it is what the workload ran into
        result.engine_failures = errors
    elif base_errors or errors:
        result.findings.append(f"failed requests: {len(base_errors)} without the canary, {len(errors)} with "
                               f"({(errors or base_errors)[0]})")
    if w.greedy:
        result.tokens_compared = True
        result.tokens_match = tokens == base
        if not result.tokens_match:
            diff = sum(tokens.get(r) != t for r, t in base.items()) + len(set(tokens) - set(base))
            result.findings.append(f"tokens: {diff} of {len(base)} sequences differ from the run without the "
                                   "canary")
    result.note = "same capacity: the run without the canary keeps block 0 out of its pool too"
    result.seconds = round(time.perf_counter() - t0, 3)
    return result
