"""Every Triton kernel the canary launches compiles for the H200 (sm_90), on the CPU.

The interpreter runs a kernel's Python: it accepts what the compiler refuses (a global that is not a constexpr,
say), so a kernel can pass every CPU test and fail at its first launch on a GPU. Here a small transformers
workload runs under the interpreter with every launch recorded, and each kernel is then compiled ahead of time
for sm_90 with the argument types and constexpr values it was launched with (Triton's own compiler and the
ptxas its wheel ships; no GPU is needed)."""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("transformers")
def _has_cuda_compiler() -> bool:
    """Triton's NVIDIA backend and the ptxas its wheel ships (a build without them compiles for no GPU)."""
    try:
        from triton.backends import backends
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return "nvidia" in backends and os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"))


pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                       reason="the workload's launches are recorded under the interpreter"),
    pytest.mark.skipif(not _has_cuda_compiler(), reason="this Triton has no CUDA compiler"),
]

_TYPES = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.float64: "fp64"}


def _type(value):
    """A launch argument's type in Triton's signature notation."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
    if isinstance(value, tuple):
        return tuple(_type(v) for v in value)
    raise TypeError(f"an argument of type {type(value).__name__}")


def _recorded_launches(monkeypatch) -> dict:
    """(kernel, constexpr values) -> what an AOT compile needs, of every launch of a small workload."""
    from kvcanary.demo import build_tiny_model, run_workload
    from kvcanary.ops import triton_ops

    seen: dict = {}
    orig = triton_ops._launch

    def launch(fn, grid, **kw):
        py = getattr(fn, "fn", fn)  # (the interpreter's wrapper of the kernel's Python function)
        params = inspect.signature(py).parameters.values()
        const = {p.name for p in params if "constexpr" in str(p.annotation)}
        constexprs = {n: kw[n] for n in const if n in kw}
        signature = {p.name: "constexpr" if p.name in const else _type(kw[p.name]) for p in params if p.name in kw}
        key = (py.__module__, py.__name__, tuple(sorted((k, repr(v)) for k, v in constexprs.items())))
        seen.setdefault(key, {"module": py.__module__, "name": py.__name__, "signature": signature,
                              "constexprs": constexprs, "num_warps": kw.get("num_warps", 4)})
        orig(fn, grid, **kw)

    monkeypatch.setattr(triton_ops, "_launch", launch)
    monkeypatch.setattr(triton_ops, "WRITE_LANES_MAX_RATIO", 1)  # (the default, whatever KVCANARY_TEST_WRITE_LANES)
    # the adapter's step graphs on the CPU stand-in: captured steps run the slot checks' kernels (eager CPU steps
    # answer them on the host)
    from kvcanary.integrations.transformers import session as hf_session
    from kvcanary.runtime.graphs import DispatchGraph

    orig_runner = hf_session.Session._step_runner
    monkeypatch.setattr(hf_session.Session, "_step_runner", lambda self, graph_type=None: orig_runner(
        self, DispatchGraph))
    model = build_tiny_model("cpu")
    # the common kernels and a violation row pushed: a planted bug's run launches every kernel of a clean run with
    # the same constexprs (measured: a clean run beside it added no kernel and no constexpr value), and more
    run_workload(model, backend="triton", max_new_tokens=4, bug="flip-kv")
    # the seed op and the fingerprint op, which the workload does not launch
    from kvcanary import ops
    from ops_harness import kv_source

    pool = torch.zeros(4, 8, dtype=torch.int32)
    ops.scatter_req_token_ids(torch.arange(1, 8), torch.tensor([0, 4, 7]), torch.tensor([1, 3]), pool, backend="triton")
    ops.fingerprint(torch.arange(4), [kv_source(8, torch.bfloat16, 2)], backend="triton")
    # the step snapshot's pass, which only CUDA's observer launches (the CPU reads the ring in place)
    from kvcanary.ops.snapshot_ops import snapshot_impl

    rows, recs = torch.zeros(64, 8, dtype=torch.int64), torch.zeros(5, 8, dtype=torch.int64)
    snapshot_impl("triton").snapshot_rows(rows=rows, write_index=torch.tensor([3]), out_rows=torch.zeros_like(rows),
                                          records=[recs[:, :6]], out_records=torch.zeros(1, 16, 6, dtype=torch.int64))
    return seen


_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

failed = []
for k in json.load(sys.stdin):
    fn = getattr(importlib.import_module(k["module"]), k["name"])
    sig = {n: tuple(t) if isinstance(t, list) else t for n, t in k["signature"].items()}
    try:
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=k["constexprs"]),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": k["num_warps"]})
    except Exception as exc:
        failed.append(f"{k['name']} {k['constexprs']}: {type(exc).__name__}: {str(exc)[:300]}")
print(json.dumps(failed))
"""


def test_every_launched_kernel_compiles_for_sm90(monkeypatch, tmp_path):
    launches = _recorded_launches(monkeypatch)
    names = {name for _, name, _ in launches}
    assert {"_plan_kernel", "_write_kernel", "_write_lanes_kernel", "_verify_kernel", "_accept_kernel",
            "_nonfinite_kernel", "_reserved_writes_kernel", "_scatter_kernel", "_fingerprint_kernel",
            "_attention_layout_kernel", "_attention_mask_kernel", "_attention_push_kernel", "_hash_rows_kernel",
            "_check_writes_kernel", "_snapshot_kernel"} <= names, names
    # compiled in a process without the interpreter: there every kernel (and every helper it calls) is Triton's
    # JIT function, as on the GPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(list(launches.values())), env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
