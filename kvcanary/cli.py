"""``kvcanary`` command line: a thin parser over importable functions.

Each subcommand registers itself with ``@command(name, help)`` as a function taking the
argparse namespace and returning an exit code; it adds its own options through
``add_arguments``. Heavy imports live inside the commands so ``--help`` is instant.
Library functions raise; only ``main`` turns errors into exit codes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
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


def check_device(option: str, device: str | None) -> str | None:
    """``device`` if it names the CPU or an available CUDA device, else ValueError naming the option."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"kv-canary: {option} must be cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"kv-canary: {option} must be an available device, got {device!r} with {count} CUDA "
                             "device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"kv-canary: {option} must be cpu or cuda[:N], got {device!r}")
    return device


def check_output(option: str, path: str | None) -> None:
    """A file can be written at ``path`` (its folder exists), checked before the work that fills it."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"kv-canary: {option} must be a path in an existing folder, got {path!r} ({folder} does "
                         "not exist)")
    if os.path.isdir(path):
        raise ValueError(f"kv-canary: {option} must be a file path, got the folder {path!r}")


def need_extra(command: str, module: str, extra: str) -> None:
    """ValueError naming the extra to install when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"kv-canary: {command} needs {module}, which is not installed; install the extra: "
                         f"pip install 'kv-canary[{extra}]'")


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

    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--bug", default="early-free", choices=sorted(BUGS),
                   help="engine bug planted in the second run (default early-free)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="local Hugging Face model directory (loaded with local_files_only=True) instead of the "
                        "built-in tiny model")


@command("demo", "a tiny model on transformers continuous batching with the canary: clean, then a planted bug",
         _demo_args)
def _demo(args: argparse.Namespace) -> int:
    need_extra("demo", "transformers", "transformers")
    check_device("--device", args.device)
    if args.model is not None and not os.path.isdir(args.model):
        raise ValueError(f"kv-canary: --model must be a local model directory, got {args.model!r}")
    from kvcanary.demo import format_demo, run_demo

    result = run_demo(device=args.device, bug=args.bug, model_path=args.model)
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


def warn_unused(command: str, option: str, why: str) -> None:
    """One line on stderr for an option that has no effect in the chosen mode (never silently ignored)."""
    print(f"kvcanary {command}: warning: {option} has no effect {why}", file=sys.stderr)


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


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--providers", nargs="+", default=None, help="default: triton torch on cuda, numba (when it imports) torch on cpu")
    p.add_argument("--small", action="store_true", help="the CPU-sized workloads")
    p.add_argument("--workloads", nargs="+", default=None, metavar="NAME",
                   help="op workloads to run (default: all of the size chosen; kvcanary.bench.ops)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--engine", nargs="*", default=None, metavar="WORKLOAD",
                   help="canary cost inside transformers continuous batching instead of op throughput: the "
                        "named workloads (default: every one for the device; kvcanary.bench.suite)")
    p.add_argument("--timeout", type=float, default=None,
                   help="with --engine: seconds per engine workload (default 900)")
    p.add_argument("--canary-option", action="append", default=[], metavar="KEY=VALUE",
                   help="with --engine: canary configuration of the runs, a CanaryConfig field each "
                        "(e.g. real_kv=all, check_v=true); repeatable")
    p.add_argument("--lockstep", action="store_true",
                   help="with --engine: pair steps, not runs (two engines, without and with the canary, step in "
                        "turn on one model: twice the KV memory; docs/benchmarks.md, 'Step pairing')")


@command("bench", "op throughput, or with --engine the canary's cost inside transformers CB; JSON and PNG",
         _bench_args)
def _bench(args: argparse.Namespace) -> int:
    check_device("--device", args.device)
    check_output("--out", args.out)
    check_output("--plot", args.plot)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("kv-canary: --plot needs matplotlib, which is not installed (pip install matplotlib)")
    if args.engine is not None:
        return _bench_engine(args)
    if args.canary_option:
        raise ValueError(f"kv-canary: --canary-option applies to --engine runs only, got {args.canary_option} "
                         "without --engine")
    if args.lockstep:
        raise ValueError("kv-canary: --lockstep applies to --engine runs only, got it without --engine")
    if args.timeout is not None:
        warn_unused("bench", "--timeout", "without --engine (op runs have no per-workload deadline)")
    import torch

    from kvcanary.bench.ops import bench_main
    from kvcanary.ops import api

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for p in args.providers or ():
        if p not in api.BACKENDS or p == "auto":
            raise ValueError(f"kv-canary: --providers must be among {[b for b in api.BACKENDS if b != 'auto']}, "
                             f"got {p!r}")
        api.impl_module(p, device.type)  # an unusable backend (triton without a GPU or interpreter) fails here
    out = bench_main(args)
    emit(args, out, json.dumps(out["meta"]))
    failed = [r["workload"] for r in out["results"] if r.get("error")]
    if failed:
        print(f"kvcanary bench: {len(failed)} workload(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or not out["results"] else 0


def _bench_engine(args: argparse.Namespace) -> int:
    import torch

    from kvcanary.bench import suite as bench_suite

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for option, given in (("--small", args.small), ("--workloads", args.workloads)):
        if given:
            warn_unused("bench", option, "with --engine (name engine workloads after --engine)")
    args.timeout = 900.0 if args.timeout is None else args.timeout
    if args.timeout <= 0:
        raise ValueError(f"kv-canary: --timeout must be > 0 seconds, got {args.timeout}")
    if args.providers:
        raise ValueError(f"kv-canary: --providers applies to op runs only, got {args.providers} with --engine")
    need_extra("bench --engine", "transformers", "transformers")
    from kvcanary.bench.engine import canary_config

    try:
        canary_config(args.canary_option)  # a bad option fails here, not once per workload process
    except ValueError as e:
        # The options travel as KV_CANARY_* variables: name the option the user wrote instead.
        for key in (o.partition("=")[0] for o in args.canary_option):
            var = "KV_CANARY_" + key.upper()
            if f"kv-canary: {var} " in str(e):
                raise ValueError(str(e).replace(var, f"--canary-option {key}", 1)) from None
        raise
    out = bench_suite.run_engine(device, args.engine, args.timeout, canary_options=args.canary_option,
                                 lockstep=args.lockstep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        bench_suite.plot(out["results"], args.plot)
    emit(args, out, bench_suite.table(out["results"]))
    ok = all(not d.get("error") and d["correctness"]["tokens_identical"] and not d["correctness"]["violations"]
             for d in out["results"])
    return 0 if ok else 1


def _soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="transformers", choices=("transformers", "sim"),
                   help="transformers continuous batching (tiny models, each workload without and with the "
                        "canary) or the simulated engine's clean configurations (default transformers)")
    p.add_argument("--workloads", type=int, default=20, help="how many seeded workloads (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first workload; workload i has seed + i "
                                                        "(default 0)")
    p.add_argument("--replay", type=int, default=None, metavar="SEED",
                   help="run the one workload of this seed and print what it is and what it found")
    p.add_argument("--bug", default=None, metavar="NAME",
                   help="plant this engine bug into every canary run (sim.hf_bugs or sim.bugs names): a campaign "
                        "that must fail")
    _campaign_output_args(p)


def _check_campaign_args(command: str, args: argparse.Namespace) -> None:
    """The engine's extra, --device and --json of a campaign command, before any work."""
    if args.engine == "transformers":
        need_extra(f"{command} --engine transformers", "transformers", "transformers")
    check_device("--device", args.device)
    if args.json not in (None, "-"):
        check_output("--json", args.json)


def _campaign_output_args(p: argparse.ArgumentParser) -> None:
    """--device and --json of the campaign commands (soak, fuzz)."""
    p.add_argument("--device", default="cpu", help="transformers: cpu or cuda (default cpu)")
    # (replaces the generic --json flag: a path takes the summary, a bare --json prints it)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the JSON summary to PATH (bare --json: print it instead of the text)")


@command("soak", "seeded clean workloads that must report nothing: violations, greedy tokens against a run "
                 "without the canary", _soak_args)
def _soak(args: argparse.Namespace) -> int:
    _check_campaign_args("soak", args)
    if args.workloads < 1:
        raise ValueError(f"kv-canary: --workloads must be >= 1, got {args.workloads}")
    for option, value in (("--seed", args.seed), ("--replay", args.replay)):
        if value is not None and value < 0:
            raise ValueError(f"kv-canary: {option} must be >= 0, got {value}")
    from kvcanary.soak import campaign

    campaign.check_bug(args.engine, args.bug)
    first, count = (args.replay, 1) if args.replay is not None else (args.seed, args.workloads)
    summary = campaign.run_campaign(args.engine, count, first, device=args.device, bug=args.bug,
                                    progress=sys.stderr)
    text = campaign.format_summary(summary)
    if args.replay is not None:
        summary["workload"] = campaign.describe(args.engine, args.replay)
        text = json.dumps(summary["workload"], default=str) + "\n" + text
    if args.json not in (None, "-"):
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    print(json.dumps(summary, indent=2, default=str) if args.json == "-" else text)
    return 0 if summary["ok"] else 1


def _fuzz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="sim", choices=("sim", "transformers"),
                   help="the simulated engine or transformers continuous batching (tiny models) (default sim)")
    p.add_argument("--workloads", type=int, default=10, help="how many seeded workloads (default 10)")
    p.add_argument("--perturbations", type=int, default=4, help="perturbed schedules per workload (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first workload; workload i has seed + i "
                                                        "(default 0)")
    p.add_argument("--replay", default=None, metavar="W:P",
                   help="run workload W's reference and its perturbation P (0: the reference alone)")
    p.add_argument("--bug", default=None, metavar="NAME",
                   help="plant this engine bug into every run (sim.bugs or transformers.bugs names)")
    _campaign_output_args(p)


@command("fuzz", "a workload under perturbed schedules (token budget, batch cap, preemption, arrival order) "
                 "against its unperturbed run, under the canary", _fuzz_args)
def _fuzz(args: argparse.Namespace) -> int:
    _check_campaign_args("fuzz", args)
    for option, value, least in (("--workloads", args.workloads, 1), ("--perturbations", args.perturbations, 1),
                                 ("--seed", args.seed, 0)):
        if value < least:
            raise ValueError(f"kv-canary: {option} must be >= {least}, got {value}")
    from kvcanary import fuzz

    replay = fuzz.parse_replay(args.replay) if args.replay is not None else None
    summary = fuzz.run_fuzz(args.engine, args.workloads, args.perturbations, args.seed, device=args.device,
                            bug=args.bug, replay=replay, progress=sys.stderr)
    if args.json not in (None, "-"):
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    print(json.dumps(summary, indent=2, default=str) if args.json == "-" else fuzz.format_summary(summary))
    return 0 if summary["ok"] else 1


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


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kv-canary")
    except Exception:  # running from a checkout that was never installed
        import kvcanary

        return kvcanary.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcanary", description="KV-cache integrity sanitizer for LLM engines")
    parser.add_argument("--version", action="version", version=f"kvcanary {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in sorted(COMMANDS.items()):
        p = sub.add_parser(name, help=help_text, description=help_text, conflict_handler="resolve")
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
