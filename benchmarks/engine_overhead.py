"""One engine workload from a checkout: the same as ``python -m kvcanary.bench.engine`` (see there)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.bench.engine import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
