"""Hardware selection: tests marked ``gpu`` skip without CUDA; TRITON_INTERPRET=1 runs Triton on CPU."""

import functools
import importlib.util
import os

import pytest
import torch

import triton_interpreter


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


# tests/vllm/ runs in vLLM's own environment (make test: .venv-vllm, a pytest run of its own): the project's
# environment has no vllm, so its run leaves the directory out. (The directory itself, on sys.path's tests/, is a
# namespace package named vllm: only a spec with a file of its own is the real package.)
_VLLM = importlib.util.find_spec("vllm")
collect_ignore_glob = [] if _VLLM is not None and _VLLM.origin not in (None, "namespace") else ["vllm/*"]

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = _triton_usable()
# The device the op tests run on: the GPU when there is one, else the CPU.
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# numba runs CPU tensors only; without the package its cases skip with the reason (ops_harness.use_backend).
FAST_BACKENDS = ["torch"] + (["numba"] if DEVICE.type == "cpu" else []) + (["triton"] if HAS_TRITON else [])


# transformers from this version on zeroes its KV pool when it allocates it (torch.zeros)
ZEROED_POOL_SINCE = (5, 24)


def _zero_new_kv_pools() -> None:
    """Before 5.24, transformers allocates its KV pool uninitialised, and its CUDA-graph warm-up samples from fake
    requests that read that pool. GPU memory left by an earlier test that decodes as NaN then fires the sampler's
    device assert, which ends the process: the flaky worker crashes of the 5.17 GPU suite, in runs without the
    canary too. On CUDA the tests zero each new pool (either cache generation), in runs with and without the
    canary alike."""
    try:
        import transformers
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
    except ImportError:
        return
    from kvcanary.integrations.transformers.layout import parse_version

    if parse_version(transformers.__version__) >= ZEROED_POOL_SINCE:
        return
    init = PagedAttentionCache.__init__

    @functools.wraps(init)
    def zeroed(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # (5.17: per-layer K and V tensors; the sector generation: one byte tensor)
        pool = [*getattr(self, "key_cache", ()), *getattr(self, "value_cache", ())]
        for t in pool or [getattr(self, "cache_tensor", None)]:
            if t is not None:
                t.zero_()

    PagedAttentionCache.__init__ = zeroed


def pytest_configure(config):
    # under TRITON_INTERPRET=1: the interpreter's language patching once per launch, not at every device function
    # call (a third of an interpreted launch's time; tests/triton_interpreter.py says why the kernels run the same)
    triton_interpreter.install()
    if HAS_CUDA:
        _zero_new_kv_pools()
    if os.environ.get("KVCANARY_TEST_WRITE_LANES") == "0" and HAS_TRITON:
        # the whole suite with every write through the block kernel, decode steps' too (by default they take
        # the lane kernel: docs/ops.md "Decode writes")
        from kvcanary.ops import triton_ops

        triton_ops.WRITE_LANES_MAX_RATIO = 0


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture(params=FAST_BACKENDS)
def fast_backend(request) -> str:
    return request.param


def set_device_bounds(monkeypatch) -> None:
    """The torch backend as it runs on an accelerator: work sized by static bounds, counts left on the device (on
    the CPU it reads counts on the host, which no recorded step can hold), until the test ends. The CPU stand-in
    graphs then record the torch ops, and a recorded route's run takes seconds where the Triton interpreter's took
    minutes; the records are the same (tests/test_ops_*)."""
    from kvcanary.ops import attention_ops, slot_ops, torch_ops, write_ops

    for module in (torch_ops, write_ops, slot_ops, attention_ops):
        monkeypatch.setattr(module, "_host_reads", lambda device: False)


@pytest.fixture
def device_bounds(monkeypatch):
    """``set_device_bounds`` for the whole test, eager runs included."""
    set_device_bounds(monkeypatch)


