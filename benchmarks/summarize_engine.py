"""Table (and, with matplotlib, a PNG plot) of engine results: bench_engine JSON files, or the JSON of
``kvcanary bench --engine``.

    python benchmarks/summarize_engine.py docs/results/engine_*.json [--plot overhead.png]
    python benchmarks/summarize_engine.py --retrace docs/results/engine_*.json   # GPU split from traces

``--retrace`` recomputes each result's GPU time split from the chrome trace saved beside it
(``NAME.trace.json.gz``, written by ``bench_engine --trace``) and rewrites the result file;
``--slim`` first cuts those traces down to the events the split reads.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench import suite as bench_suite  # noqa: E402


def load(paths: list[str]) -> list[dict]:
    results = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        results += d["results"] if "results" in d else [d]
    return results


def retrace(path: str, slim: bool = False) -> None:
    trace = Path(path).with_suffix("").with_suffix(".trace.json.gz")
    if not trace.exists():
        print(f"{path}: no trace at {trace}, left as it is", file=sys.stderr)
        return
    if slim:
        bench_suite.slim_trace(str(trace))
    with open(path) as f:
        d = json.load(f)
    d["gpu_time"] = bench_suite.gpu_time(bench_suite.trace_ranges(str(trace)))
    with open(path, "w") as f:
        f.write(json.dumps(d, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    ap.add_argument("--retrace", action="store_true", help="recompute gpu_time from the traces beside the results")
    ap.add_argument("--slim", action="store_true", help="with --retrace: first cut the traces to the events it reads")
    args = ap.parse_args()
    if args.retrace:
        for p in args.paths:
            retrace(p, args.slim)
    results = load(args.paths)
    print(bench_suite.table(results))
    if args.plot:
        bench_suite.plot(results, args.plot)


if __name__ == "__main__":
    main()
