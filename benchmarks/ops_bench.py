"""Op throughput from a checkout: the same as ``kvcanary bench`` (see kvcanary/bench.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench.ops import main  # noqa: E402

if __name__ == "__main__":
    main()
