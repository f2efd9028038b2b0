"""Table (and, with matplotlib, a PNG plot) of engine results: bench_engine JSON files, or the JSON of
``kvcanary bench --engine``.

    python benchmarks/summarize_engine.py docs/results/engine_*.json [--plot overhead.png]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary import bench_suite  # noqa: E402


def load(paths: list[str]) -> list[dict]:
    results = []
    for p in paths:
        with open(p) as f:
            d = json.load(f)
        results += d["results"] if "results" in d else [d]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args()
    results = load(args.paths)
    print(bench_suite.table(results))
    if args.plot:
        bench_suite.plot(results, args.plot)


if __name__ == "__main__":
    main()
