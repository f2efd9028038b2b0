#!/usr/bin/env bash
# SGLang 0.5.23's kv-canary kernels for the GPU image (python3.12, torch 2.11, triton 3.6, nvcc 13.0, ninja;
# no internet), the comparison target of benchmarks/sglang_kernels.py:
#   bash benchmarks/sglang_wheels.sh download      # here, with the package index: wheels_sglang/ (git-ignored, < 60 MB)
#   bash benchmarks/sglang_wheels.sh install DIR   # there: the wheels into DIR, then an import check of the kernels
# Only sglang itself and what its kernel path imports and the image lacks are carried (EXTRA below), each
# with --no-deps: the rest of sglang's requirements (flashinfer, torch 2.14, transformers, ...) serve its
# server, never these kernels. sglang_kernels.py imports the kernel package without running sglang's
# top-level __init__ (the frontend language API: aiohttp, IPython, ...); what remains is
# sglang.srt.utils.common (orjson, pybase64, starlette, pyzmq, and pydantic_core through msgspec_utils;
# pillow, requests, anyio, numpy, psutil, typing_extensions are in the image), sglang.kernels.fused_op and
# the JIT cache (msgspec), and the JIT build and load itself (tvm_ffi: its headers, libtvm_ffi.so and
# load_module; sglang pins apache-tvm-ffi 0.1.11). Checked against the image's `pip list` (no pydantic there).
# SGLANG_WHEEL=path/to/sglang-0.5.23-cp312-*.whl skips downloading sglang (39 MB) when a copy is at hand.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${VERSION:-0.5.23}
WHEELS=${WHEELS:-wheels_sglang}
PY=${PY:-python3}
LIMIT_MB=60
EXTRA=(orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 starlette==1.10.0 pyzmq==27.3.0 pydantic-core==2.50.5
       apache-tvm-ffi==0.1.11)
# (the image's glibc is >= 2.34: sglang's own wheel is manylinux_2_34; pyzmq 27 has no manylinux2014 wheel)
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

case "${1:-}" in
  download)
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    if [ -n "${SGLANG_WHEEL:-}" ]; then
      case "$(basename "$SGLANG_WHEEL")" in
        sglang-"$VERSION"-cp312-*.whl) cp "$SGLANG_WHEEL" "$WHEELS/" ;;
        *) echo "SGLANG_WHEEL must be an sglang-$VERSION-cp312-*.whl, got $SGLANG_WHEEL" >&2; exit 2 ;;
      esac
    else
      $PY -m pip download -q --no-deps "${target[@]}" -d "$WHEELS" "sglang==$VERSION"
    fi
    $PY -m pip download -q --no-deps "${target[@]}" -d "$WHEELS" "${EXTRA[@]}"
    ls -1 "$WHEELS"
    kb=$(du -sk "$WHEELS" | cut -f1)
    echo "total: $((kb / 1024)) MB in $WHEELS/ (carry it: [\"$WHEELS\"])"
    if [ "$kb" -ge $((LIMIT_MB * 1024)) ]; then
      echo "the wheels must stay under $LIMIT_MB MB, got $((kb / 1024)) MB" >&2
      exit 1
    fi
    ;;
  install)
    dir=${2:?usage: sglang_wheels.sh install DIR}
    # (run download first, and carry wheels_sglang/ over)
    ls "$WHEELS"/sglang-"$VERSION"-*.whl > /dev/null
    $PY -m pip install -q --upgrade --no-deps --no-index --target "$dir" "$WHEELS"/*.whl
    dir=$(cd "$dir" && pwd)
    # The import check: the kernel modules as sglang_kernels.py imports them (sglang's top-level __init__
    # skipped), and tvm_ffi's build inputs. Compiling needs a GPU; the benchmark does it.
    PYTHONPATH="$dir:$PWD" $PY - "$VERSION" <<'PYEOF'
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from sglang_kernels import import_sglang  # noqa: E402

sgl = import_sglang()
assert sgl.version == sys.argv[1], sgl.version
from tvm_ffi.libinfo import find_include_path, find_libtvm_ffi  # noqa: E402

print(f"sglang {sgl.version} kernels from {sgl.root}; tvm_ffi {sgl.tvm_ffi_version}: "
      f"{find_libtvm_ffi()}, headers {find_include_path()}", file=sys.stderr)
PYEOF
    echo "PYTHONPATH=$dir:$PWD"
    ;;
  *)
    echo "usage: bash benchmarks/sglang_wheels.sh download | install DIR" >&2
    exit 2
    ;;
esac
