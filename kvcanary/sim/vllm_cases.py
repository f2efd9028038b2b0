"""Each planted vLLM bug with the workload that brings it about, and the run that judges it.

``judge(name)`` starts a small vLLM engine (the tiny Llama, the bug's engine settings), installs the shadow
oracle (``vllm_oracle``) and, when asked, the canary (``kvcanary.integrations.vllm``), plants the bug
(``vllm_bugs.plant``), runs the bug's arrivals and returns the verdict:

- ``harmful``: the oracle saw attention read wrong KV; the canary must then report violations (``detected``);
- ``harmless``: the bug fired, and the oracle saw no wrong read under this workload (not counted as detected);
- ``not fired``: the workload never reached the state the bug needs (a broken case).

Example:
    >>> v = judge("phantom-prefix-hit")
    >>> v["verdict"], v["detected"]
    ('harmful', True)
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

from kvcanary.sim.vllm_bugs import BUGS, PUBLISHED, plant
from kvcanary.sim.vllm_drive import Arrival, drive, make_llm, runner_of, tiny_lora_dir, tiny_model_dir
from kvcanary.sim.vllm_oracle import ShadowOracle


def seq(n: int, a: int, b: int) -> list[int]:
    """``n`` tokens of an affine sequence (distinct prompts from distinct ``a, b``)."""
    return [(a * i + b) % 509 + 1 for i in range(n)]


SYSTEM = seq(64, 37, 11)  # two whole blocks of 32


@dataclass(frozen=True)
class Case:
    """A bug's workload: engine settings and arrivals."""

    engine: dict
    arrivals: tuple
    lora: bool = False
    tp: int = 1
    note: str = ""


def _cases(lora_dir: str | None) -> dict[str, Case]:
    lx = ("x", 1, lora_dir) if lora_dir else None
    tight_decodes = tuple(Arrival(f"r{k}", seq(40, 3 + 2 * k, k), 60) for k in range(4))
    rows = (Arrival("b", seq(40, 5, 1), 30), Arrival("a", seq(40, 7, 2), 4, step=1),
            Arrival("c", seq(50, 11, 3), 10, step=8))
    return {
        "shared-block-double-free": Case(
            dict(num_gpu_blocks_override=12),
            (Arrival("a", SYSTEM + seq(10, 3, 1), 8), Arrival("b", SYSTEM + seq(3, 5, 2), 60, step=2),
             Arrival("c", seq(275, 7, 3), 10, step=14))),
        "early-free": Case(
            dict(num_gpu_blocks_override=16, enable_prefix_caching=False),
            (Arrival("a", seq(80, 3, 1), 40), Arrival("c", seq(100, 5, 2), 10, step=6))),
        "parentless-block-hash": Case(
            {}, (Arrival("a", seq(32, 3, 1) + seq(32, 5, 2) + seq(5, 7, 3), 4),
                 Arrival("b", seq(32, 5, 2) * 2 + seq(7, 9, 4), 6, step=3))),
        "lora-salt-collision": Case(
            dict(enable_lora=True, max_lora_rank=8, max_loras=1),
            (Arrival("a", seq(70, 3, 1), 4, lora=lx), Arrival("b", seq(70, 3, 1), 6, step=3, cache_salt="x")),
            lora=True),
        "phantom-prefix-hit": Case(
            dict(num_gpu_blocks_override=12),
            (Arrival("a", SYSTEM + seq(5, 3, 1), 3), Arrival("c", seq(300, 5, 2), 8, step=4),
             Arrival("d", SYSTEM + seq(9, 7, 3), 6, step=8))),
        "stale-inflight-write": Case(
            dict(num_gpu_blocks_override=16),
            (Arrival("a", seq(40, 3, 1), 10), Arrival("c", seq(60, 5, 2), 10, step=14))),
        "slot-mapping-row-stride": Case(
            {}, (Arrival("a", seq(100, 3, 1), 20), Arrival("b", seq(40, 5, 2), 20))),
        "decode-write-prev-block": Case({}, (Arrival("a", seq(60, 3, 1), 20),)),
        "row-count-not-reset": Case({}, rows),
        "row-keeps-old-ids": Case({}, rows),
        "resumed-keeps-old-blocks": Case(dict(num_gpu_blocks_override=7, max_num_seqs=4), tight_decodes),
        "chunk-skips-a-token": Case(dict(max_num_batched_tokens=64), (Arrival("a", seq(150, 3, 1), 5),)),
        "zero-delivered-block": Case(
            {}, (Arrival("a", SYSTEM + seq(10, 3, 1), 20), Arrival("b", SYSTEM + seq(5, 5, 2), 10, step=3))),
        "v-write-dropped": Case({}, (Arrival("a", seq(40, 3, 1), 8), Arrival("b", seq(50, 5, 2), 8, step=2))),
        "tp-rank-slot-shift": Case(
            dict(tensor_parallel_size=2), (Arrival("a", seq(40, 3, 1), 12), Arrival("b", seq(50, 5, 2), 12)),
            tp=2),
    }


def cases(model_dir: str | None = None) -> dict[str, Case]:
    """Every bug's case (the LoRA case's adapter is built on first use)."""
    model_dir = model_dir or tiny_model_dir()
    return _cases(tiny_lora_dir(model_dir))


def canary_on(**config: str):
    """The canary's vLLM plugin on in this process (``KV_CANARY_VLLM=1``, log mode) for the engines started in the
    block (``kvcanary.integrations.vllm.engine.guarded``)."""
    from kvcanary.integrations.vllm import engine

    return engine.guarded(True, KV_CANARY_MODE="log", **{f"KV_CANARY_{k.upper()}": v for k, v in config.items()})


@dataclass
class Verdict:
    name: str
    verdict: str
    fired: int
    wrong_reads: int
    violations: int | None
    detected: bool | None
    published: str
    notes: list[str] = field(default_factory=list)
    oracle_first: list[str] = field(default_factory=list)
    canary_first: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""


def judge(name: str, canary: bool = True, model_dir: str | None = None, engine: dict | None = None) -> dict:
    """Run bug ``name``'s case under the shadow oracle (and the canary): the verdict as a dict. ``engine``: more
    ``make_llm`` arguments (e.g. another ``dtype``) over the case's."""
    if name not in BUGS:
        raise ValueError(f"kv-canary: vLLM bug must be one of {sorted(BUGS)}, got {name!r}")
    model_dir = model_dir or tiny_model_dir()
    case = _cases(tiny_lora_dir(model_dir) if name == "lora-salt-collision" else None)[name]
    if case.tp != 1:
        from kvcanary.sim.vllm_tp import judge_tp

        return judge_tp(name, case, canary, model_dir)
    t0 = time.perf_counter()
    with canary_on() if canary else contextlib.nullcontext():
        llm = make_llm(model_dir, **{**case.engine, **(engine or {})})
        oracle = ShadowOracle(runner_of(llm)).install()
        error = ""
        with plant(name, llm) as state:
            try:
                drive(llm, list(case.arrivals))
            except Exception as e:  # a bug may break the engine after it did its damage: judged all the same
                error = f"{type(e).__name__}: {e}"
        oracle.uninstall()
        if oracle.error:
            raise RuntimeError(f"kv-canary: the shadow oracle failed on bug {name}: {oracle.error}")
        report = _canary_report(llm) if canary else None
        del llm
        gc.collect()
    summary = oracle.summary()
    violations = None if report is None else len(report.violations)
    verdict = "not fired" if not state.fired else "harmful" if summary["wrong_reads"] else "harmless"
    return vars(Verdict(
        name, verdict, state.fired, summary["wrong_reads"], violations,
        None if violations is None or verdict != "harmful" else violations > 0, PUBLISHED.get(name, ""),
        state.notes[:3], summary["first"], [] if report is None else [_line(r) for r in report.violations[:3]],
        round(time.perf_counter() - t0, 1), error))


def _canary_report(llm):
    from kvcanary.integrations.vllm import collect

    return collect(llm)


def _line(row) -> str:
    return row.get("log_line", str(row)) if isinstance(row, dict) else str(row)


def table(verdicts: list[dict]) -> str:
    """The verdicts as a markdown table (docs/vllm.md, "Planted vLLM bugs")."""
    rows = ["| bug | class | component | replays | oracle: wrong reads | canary: violations | verdict |",
            "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        cls, component, _ = BUGS[v["name"]]
        found = {True: "detected", False: "**missed**", None: "-"}[v["detected"]]
        rows.append(f"| `{v['name']}` | {cls} | {component} | {v['published'] or '-'} | {v['wrong_reads']} | "
                    f"{v['violations']} | {v['verdict']}{', ' + found if v['verdict'] == 'harmful' else ''} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcanary.sim.vllm_cases [BUG ...]``: judge the bugs (default: all) and print the table."""
    import json
    import sys

    names = (argv if argv is not None else sys.argv[1:]) or list(BUGS)
    verdicts = []
    for name in names:
        verdicts.append(judge(name))
        print(json.dumps(verdicts[-1]), flush=True)
    print(table(verdicts))


if __name__ == "__main__":
    main()
