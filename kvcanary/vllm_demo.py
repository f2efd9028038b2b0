"""``kvcanary demo --engine vllm``: the tiny model on vLLM's own engine (V1, CPU), clean and then with a planted bug.

Three runs of one workload on in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): without the canary (the
reference tokens), with it (no violation, the same tokens), and with a bug planted in vLLM's code at run time
(violations naming vLLM's request ids). Run it with the Python of the environment that has vLLM (``.venv-vllm``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time

DEFAULT_BUG = "slot-off-by-one"
# name -> (class in shared/BUGS.md terms, what goes wrong)
BUGS = {
    "slot-off-by-one": ("E", "the slot mapping of each step's last request writes its last token one slot past its "
                              "position's slot (the block table still gives the right one)"),
    "stale-block": ("C", "a request's second block-table entry keeps the id of a block freed and reused by another "
                         "request (a stale block table row)"),
    "v-write-dropped": ("G", "the CPU backend's cache write stores each token's K and leaves its V as it was (a "
                             "write path that never writes V): every later read of that V reads stale bytes"),
}


def demo_prompts(vocab: int = 512) -> list[list[int]]:
    """A 40-token system prompt shared by most requests (prefix-cache hits once its block is cached), varied lengths
    (chunked prefill at 64 tokens a step) and unrelated short prompts."""
    system = [(37 * i + 11) % vocab for i in range(40)]
    questions = [[(13 * k + 5 * i + 7) % vocab for i in range(3 + 9 * k)] for k in range(5)]
    short = [[(300 + 3 * i) % vocab for i in range(5)], [(400 + i) % vocab for i in range(70)]]
    return [system + q for q in questions] + short


@contextlib.contextmanager
def plant(bug: str):
    """Patch vLLM's code for the duration of the block (undone after it)."""
    undo = apply_bug(bug)
    try:
        yield
    finally:
        undo()


def apply_bug(bug: str):
    """Patch vLLM's code in this process; returns the function that undoes it."""
    from vllm.v1.worker import block_table as bt

    if bug == "slot-off-by-one":
        orig = bt.BlockTable.compute_slot_mapping

        def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
            orig(self, num_reqs, query_start_loc, positions)
            if num_reqs >= 2:
                last = int(query_start_loc[num_reqs]) - 1
                self.slot_mapping.gpu[last] += 1  # (the CPU runner's "gpu" buffer is its CPU tensor)

        bt.BlockTable.compute_slot_mapping = compute_slot_mapping
        return lambda: setattr(bt.BlockTable, "compute_slot_mapping", orig)
    if bug == "stale-block":
        orig = bt.BlockTable.commit_block_table

        def commit_block_table(self, num_reqs):
            # the last request's second block is replaced by the first request's (freed then shared) block
            if num_reqs >= 2 and self.num_blocks_per_row[num_reqs - 1] >= 2 and self.num_blocks_per_row[0] >= 2:
                self.block_table.np[num_reqs - 1, 1] = self.block_table.np[0, 1]
            orig(self, num_reqs)

        bt.BlockTable.commit_block_table = commit_block_table
        return lambda: setattr(bt.BlockTable, "commit_block_table", orig)
    if bug == "v-write-dropped":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as impl

        from kvcanary.sim.vllm_planters import without_v

        store = impl.do_kv_cache_update
        impl.do_kv_cache_update = without_v(store)
        return lambda: setattr(impl, "do_kv_cache_update", store)
    raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS)}, got {bug!r}")


def plant_on_rank(worker, bug: str, rank: int) -> bool:
    """``LLM.collective_rpc`` target: plant ``bug`` for good in the worker of tensor-parallel rank ``rank`` only (a
    rank whose shard goes wrong); True where it was planted."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return False
    apply_bug(bug)
    return True


def run_demo(bug: str = DEFAULT_BUG, model_path: str | None = None) -> dict:
    """Baseline, clean and buggy runs; returns the summary the CLI prints."""
    if bug not in BUGS:
        raise ValueError(f"kv-canary: bug must be one of {sorted(BUGS)}, got {bug!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: live sessions, one start
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (before vllm's import configures its logger)
    from kvcanary.integrations.vllm import collect, engine

    quiet = logging.getLogger("kvcanary")
    level, quiet.level = quiet.level, logging.ERROR  # the demo prints the report itself
    try:
        with tempfile.TemporaryDirectory() as tmp, _stdout_to_stderr():
            t0 = time.perf_counter()
            path = model_path or engine.tiny_model(os.path.join(tmp, "tiny"))
            prompts = demo_prompts()
            load_s = time.perf_counter() - t0
            with engine.guarded(False):
                baseline = _run(engine, path, prompts, None, None)
            with engine.guarded(True, KV_CANARY_MODE="log"):
                clean = _run(engine, path, prompts, None, collect)
                buggy = _run(engine, path, prompts, bug, collect)
    finally:
        quiet.setLevel(level)
    return {
        "model": model_path or "tiny Llama (2 layers, hidden 128, head_dim 32, seeded random weights)",
        "engine": _engine_line(),
        "device": "cpu",
        "model_load_s": round(load_s, 2),
        "clean": _summary(clean, baseline),
        "bug": {"name": bug, "class": BUGS[bug][0], "what": BUGS[bug][1], **_summary(buggy, None),
                "report": [row["text"] for row in _most_telling(buggy["report"].violations)[:2]],
                "requests_named": sorted(buggy["report"].requests()),
                "log_lines": [row["log_line"] for row in buggy["report"].violations]},
    }


@contextlib.contextmanager
def _stdout_to_stderr():
    """vLLM logs to stdout (its handler holds the stream object, and its C++ prints too): the runs write there to
    stderr, so the demo's stdout is its report alone (``--json`` stays parseable)."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _run(engine, path: str, prompts, bug: str | None, collect) -> dict:
    llm = engine.start(path, num_blocks=64, max_num_batched_tokens=64)
    try:
        t0 = time.perf_counter()
        with plant(bug) if bug else contextlib.nullcontext():
            tokens = engine.generate(llm, prompts, max_tokens=12)
        seconds = time.perf_counter() - t0
        report = collect(llm) if collect else None
    finally:
        engine.stop(llm)
    return {"tokens": tokens, "seconds": seconds, "report": report}


def _engine_line() -> str:
    import vllm

    return f"vLLM {vllm.__version__} (V1 engine, CPU attention backend, in-process engine core)"


def _most_telling(rows: list[dict]) -> list[dict]:
    """One row per slot and position, those naming two requests first, then the earliest."""
    def key(r):
        two = r.get("reader") is not None and r.get("writer") not in (None, r.get("reader"))
        return (not two, r["step"])

    seen, out = set(), []
    for r in sorted(rows, key=key):
        if (r["slot"], r["position"]) not in seen:
            seen.add((r["slot"], r["position"]))
            out.append(r)
    return out


def _summary(run: dict, baseline: dict | None) -> dict:
    stats = run["report"].stats[0] if run["report"] and run["report"].stats else {}
    out = {
        "requests": stats.get("requests", 0),
        "forwards": stats.get("steps", 0),
        "tokens_protected": stats.get("tokens_protected", 0),
        "entries_verified": stats.get("entries_checked", 0),
        "prefix_hits": stats.get("prefix_hits", 0),
        "chunked_prefill_chunks": stats.get("chunked_prefill_chunks", 0),
        "violations": stats.get("violations", 0),
        "seconds": round(run["seconds"], 2),
    }
    if baseline is not None:
        out["tokens_match_without_canary"] = run["tokens"] == baseline["tokens"]
        out["baseline_seconds"] = round(baseline["seconds"], 2)
    return out


def format_demo(result: dict) -> str:
    c, b = result["clean"], result["bug"]
    lines = [
        f"kv-canary demo: {result['model']} on {result['engine']}",
        "",
        "clean run (prefix-cache hits, chunked prefill):",
        f"  requests {c['requests']}, forwards {c['forwards']}, tokens protected {c['tokens_protected']}, "
        f"entries verified {c['entries_verified']}, prefix hits {c['prefix_hits']}, prefill chunks "
        f"{c['chunked_prefill_chunks']}",
        f"  violations: {c['violations']}; tokens identical to a run without the canary: "
        f"{c['tokens_match_without_canary']} ({c['seconds']} s with, {c['baseline_seconds']} s without)",
        "",
        f"same workload with a bug planted in vLLM '{b['name']}' (class {b['class']}): {b['what']}",
        f"  violations: {b['violations']}, vLLM requests named: {', '.join(b['requests_named'])}",
    ]
    for block in b["report"]:
        lines += ["", block]
    if b["log_lines"]:
        lines += ["", f"log lines ({min(5, len(b['log_lines']))} of {len(b['log_lines'])}):"]
        lines += b["log_lines"][:5]
    return "\n".join(lines)
