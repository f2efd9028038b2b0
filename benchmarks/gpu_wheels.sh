#!/usr/bin/env bash
# transformers 5.25 for the GPU image (python3.12, torch 2.11, triton 3.6, transformers 5.17, no internet):
#   bash benchmarks/gpu_wheels.sh download      # here, with the package index: wheels/ (git-ignored, < 40 MB)
#   bash benchmarks/gpu_wheels.sh install DIR   # there: the wheels into DIR; prints the PYTHONPATH to use
# download resolves transformers $VERSION and the image's transformers $IMAGE_VERSION for cp312 manylinux
# x86_64 and keeps the wheels only the first needs (transformers itself, huggingface-hub 2 and what it
# brings): everything else both need is in the image already. install puts them in DIR with --no-deps, so
# nothing in the image changes; DIR first on PYTHONPATH shadows the image's transformers and hub.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${VERSION:-5.25.0}
IMAGE_VERSION=${IMAGE_VERSION:-5.17.0}
WHEELS=${WHEELS:-wheels}
PY=${PY:-python3}
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64)

case "${1:-}" in
  download)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # (no torch: transformers does not require it, and the image has its own)
    $PY -m pip download -q "${target[@]}" -d "$tmp/new" "transformers==$VERSION"
    $PY -m pip download -q "${target[@]}" -d "$tmp/old" "transformers==$IMAGE_VERSION"
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    for w in "$tmp"/new/*.whl; do
      # a wheel of the same name and version in the image's resolution: the image has what it needs
      [ -e "$tmp/old/$(basename "$w")" ] || cp "$w" "$WHEELS/"
    done
    ls -1 "$WHEELS"
    du -sh "$WHEELS"
    ;;
  install)
    dir=${2:?usage: gpu_wheels.sh install DIR}
    ls "$WHEELS"/transformers-"$VERSION"-*.whl > /dev/null  # (run download first, and carry wheels/ over)
    $PY -m pip install -q --no-deps --no-index --find-links "$WHEELS" --target "$dir" "$WHEELS"/*.whl
    dir=$(cd "$dir" && pwd)
    # the import check: transformers $VERSION from DIR, its requirements met by DIR plus the image
    PYTHONPATH="$dir" $PY - "$VERSION" <<'PYEOF'
import sys
from importlib.metadata import requires, version

import transformers
from packaging.requirements import Requirement

assert transformers.__version__ == sys.argv[1], transformers.__version__
bad = []
for line in requires("transformers") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        got = version(req.name)
    except Exception:
        got = None
    if got is None or not req.specifier.contains(got, prereleases=True):
        bad.append(f"{req} (got {got})")
print(f"transformers {transformers.__version__} from {transformers.__file__}; requirements "
      f"{'unmet: ' + ', '.join(bad) if bad else 'met'}", file=sys.stderr)
sys.exit(1 if bad else 0)
PYEOF
    echo "PYTHONPATH=$dir:$PWD"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_wheels.sh download | install DIR" >&2
    exit 2
    ;;
esac
