"""``kvcanary`` command line: a thin parser over importable functions.

Each subcommand registers itself with ``@command(name, help)`` as a function taking the
argparse namespace and returning an exit code; it adds its own options through
``add_arguments``. Heavy imports live inside the commands so ``--help`` is instant.
Library functions raise; only ``main`` turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

COMMANDS: dict[str, tuple[str, Callable, Callable]] = {}


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """Register ``fn(args) -> int`` as subcommand ``name``."""

    def wrap(fn: Callable[[argparse.Namespace], int]):
        COMMANDS[name] = (help, add_arguments, fn)
        return fn

    return wrap


def emit(args: argparse.Namespace, payload: dict, text: str) -> None:
    """Print JSON with --json, else the human-readable text."""
    print(json.dumps(payload, indent=2, default=str) if getattr(args, "json", False) else text)


def _selfcheck_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


@command("selfcheck", "run every op on an example and compare every backend with the reference", _selfcheck_args)
def _selfcheck(args: argparse.Namespace) -> int:
    from kvcanary.selfcheck import format_selfcheck, run_selfcheck

    result = run_selfcheck(args.device)
    emit(args, result, format_selfcheck(result))
    return 0 if result["ok"] else 1


def _recall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prob", type=float, default=0.2, help="probability of each perturbation per step (default 0.2)")
    p.add_argument("--kinds", default="table,kv,cached,after,swap", help="comma-separated perturbation kinds")
    p.add_argument("--configs", default="", help="comma-separated sim configurations (default: the whole matrix)")
    p.add_argument("--seed", type=int, default=0, help="injection seed of the first configuration (default 0)")
    p.add_argument("--sim-seed", type=int, default=0, help="workload seed of every configuration (default 0)")


@command("recall", "fault injection on the simulated engine: recall of every perturbation kind", _recall_args)
def _recall(args: argparse.Namespace) -> int:
    import logging

    from kvcanary.sim.recall import measure_sim, recall_table
    from kvcanary.sim import MATRIX

    names = [n for n in args.configs.split(",") if n] or list(MATRIX)
    unknown = sorted(set(names) - set(MATRIX))
    if unknown:
        raise ValueError(f"kv-canary: --configs must name sim configurations {sorted(MATRIX)}, got {unknown}")
    logging.getLogger("kvcanary").setLevel(logging.ERROR)  # one line per injection and violation otherwise
    reports = measure_sim([MATRIX[n].replace(seed=args.sim_seed) for n in names], args.prob,
                          [k for k in args.kinds.split(",") if k], args.seed)
    emit(args, {name: rep.to_dict() for name, rep in reports.items()}, recall_table(reports, markdown=False))
    return 0 if all(not r.false_positives and r.recall in (None, 1.0) for r in reports.values()) else 1


def _demo_args(p: argparse.ArgumentParser) -> None:
    from kvcanary.integrations.hf_bugs import BUGS

    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--bug", default="early-free", choices=sorted(BUGS),
                   help="engine bug planted in the second run (default early-free)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local Hugging Face model directory (loaded with local_files_only=True) instead of the "
                        "built-in tiny model")


@command("demo", "a tiny model on transformers continuous batching with the canary: clean, then a planted bug",
         _demo_args)
def _demo(args: argparse.Namespace) -> int:
    from kvcanary.demo import format_demo, run_demo

    result = run_demo(device=args.device, bug=args.bug, model_path=args.model)
    emit(args, result, format_demo(result))
    return 0 if result["clean"]["violations"] == 0 and result["bug"]["violations"] > 0 else 1


def _zoo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bug", action="append", metavar="NAME",
                   help="run only this planted bug (repeatable; default: every bug, see docs/zoo.md)")
    p.add_argument("--seeds", type=int, default=1, help="workload seeds per configuration (default 1)")
    p.add_argument("--config", action="append", metavar="NAME",
                   help="run only this matrix configuration (repeatable; default: the whole matrix)")
    p.add_argument("--distributed", action="store_true",
                   help="the distributed zoo instead: tensor-parallel and prefill/decode runs in N processes "
                        "(docs/distributed.md); --bug then names distributed bugs (--seeds, --config unused)")
    p.add_argument("--world-size", type=int, default=2, help="with --distributed: processes (default 2)")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"),
                   help="with --distributed: gloo on CPU (default) or nccl, one GPU per rank")
    p.add_argument("--interval", type=int, default=None,
                   help="with --distributed: forwards between consistency exchanges (default 16)")
    p.add_argument("--bench-slots", type=int, default=0, metavar="N",
                   help="with --distributed: also time the consistency exchange over an N-slot canary and the "
                        "arrival check of a 4096-token request on each rank's device (default 0: off)")


@command("zoo", "planted-bug zoo on the simulated engine: every bug where it applies, plus clean baselines",
         _zoo_args)
def _zoo(args: argparse.Namespace) -> int:
    if args.distributed:
        from kvcanary.distributed import DEFAULT_INTERVAL
        from kvcanary.sim.distributed import format_report, run_distributed

        report = run_distributed(args.world_size, args.backend, args.bug, args.interval or DEFAULT_INTERVAL,
                                 args.bench_slots)
        emit(args, report.to_dict(), format_report(report))
        return 0 if report.ok else 1
    from kvcanary.sim.zoo import format_table, run_verdict, run_zoo

    def progress(i: int, total: int, r) -> None:
        where = f"{r.bug or 'clean'} @ {r.config} seed {r.seed}"
        print(f"[{i}/{total}] {where}: {run_verdict(r)} (planted {r.planted_step}, first violation "
              f"{r.first_detected_step}, {r.violations} violations, {r.wall_s:.1f} s)", file=sys.stderr, flush=True)

    report = run_zoo(args.bug, args.seeds, args.config, progress=progress)
    emit(args, report.to_dict(), format_table(report))
    return 0 if report.ok else 1


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--providers", nargs="+", default=None, help="default: triton torch on cuda, torch on cpu")
    p.add_argument("--small", action="store_true", help="the CPU-sized workloads")
    p.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help="op workloads to run (default: all of the size chosen; kvcanary.bench.ops)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--engine", nargs="*", default=None, metavar="WORKLOAD",
                   help="canary cost inside transformers continuous batching instead of op throughput: the "
                        "named workloads (default: every one for the device; kvcanary.bench.suite)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per engine workload (default 900)")
    p.add_argument("--canary-option", action="append", default=[], metavar="KEY=VALUE",
                   help="with --engine: canary configuration of the runs, a CanaryConfig field each "
                        "(e.g. real_kv=all, check_v=true); repeatable")


@command("bench", "op throughput, or with --engine the canary's cost inside transformers CB; JSON and PNG",
         _bench_args)
def _bench(args: argparse.Namespace) -> int:
    if args.engine is not None:
        return _bench_engine(args)
    from kvcanary.bench.ops import bench_main

    out = bench_main(args)
    emit(args, out, json.dumps(out["meta"]))
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    import torch

    from kvcanary.bench import suite as bench_suite

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"kv-canary: bench device must be available, got {device} without a CUDA GPU")
    from kvcanary.bench.engine import canary_config

    canary_config(args.canary_option)  # a bad option fails here, not once per workload process
    out = bench_suite.run_engine(device, args.engine, args.timeout, canary_options=args.canary_option)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        bench_suite.plot(out["results"], args.plot)
    emit(args, out, bench_suite.table(out["results"]))
    ok = all(not d.get("error") and d["correctness"]["tokens_identical"] and not d["correctness"]["violations"]
             for d in out["results"])
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache integrity sanitizer for LLM engines")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command][2](args)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        print(f"kvcanary {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
