"""``kvcanary`` commands that measure or run campaigns: bench (ops and engine), soak and fuzz."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from kvcanary.cli.base import check_device, check_output, command, emit, need_extra, warn_unused


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
    p.add_argument("--engine", default="transformers", choices=("transformers", "sim", "vllm"),
                   help="transformers continuous batching (tiny models, each workload without and with the "
                        "canary), the simulated engine's clean configurations, or vLLM (run from vLLM's own "
                        "environment; docs/vllm.md) (default transformers)")
    p.add_argument("--workloads", type=int, default=20, help="how many seeded workloads (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first workload; workload i has seed + i "
                                                        "(default 0)")
    p.add_argument("--replay", type=int, default=None, metavar="SEED",
                   help="run the one workload of this seed and print what it is and what it found")
    p.add_argument("--bug", default=None, metavar="NAME",
                   help="plant this engine bug into every canary run (sim.hf_bugs, sim.bugs or sim.vllm_bugs "
                        "names): a campaign that must fail")
    _campaign_output_args(p)


def _check_campaign_args(command: str, args: argparse.Namespace) -> None:
    """The engine's extra, --device and --json of a campaign command, before any work."""
    if args.engine == "transformers":
        need_extra(f"{command} --engine transformers", "transformers", "transformers")
    if args.engine == "vllm":
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:  # (a folder named vllm, e.g. tests/vllm, is no vLLM)
            raise ValueError(f"kv-canary: {command} --engine vllm needs vLLM, which is not installed in this "
                             "environment; run it from vLLM's own environment (.venv-vllm, docs/vllm.md)")
        if args.device != "cpu":
            raise ValueError(f"kv-canary: {command} --engine vllm runs vLLM's CPU build, --device must be cpu, "
                             f"got {args.device!r}")
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
