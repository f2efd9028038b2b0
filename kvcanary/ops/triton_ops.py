"""Triton implementation of the canary ops: host launchers over ``triton_kernels``.

Same keyword signatures as ``kvcanary.ops.reference`` (arguments already
validated by ``kvcanary.ops.api``). Launchers never sync with the device: grids
come from static shapes (batch size, plan and ring capacities), counts are read
in the kernels, so every op can be captured in a CUDA graph. On CPU they run
under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os

import torch

from kvcanary.format import ATTRIBUTION_STRIDE, PARTIAL_READ_BYTES, RealKvMode
from kvcanary.ops import triton_kernels as k
from kvcanary.ops import triton_write_lanes as lanes
from kvcanary.ops import validate as v

SCATTER_BLOCK = 256
FINGERPRINT_BLOCK = 128
PLAN_BLOCK_B = 512
PLAN_BLOCK = 1024
# Programs per request in plan: about this many programs in all, so a few long requests still fill the GPU.
PLAN_PROGRAMS = 512
WRITE_BLOCK = 128
VERIFY_BLOCK = 128
# The one-pass verify's block: its programs each load one block, so a smaller block spreads a small plan
# over more programs (more record gathers in flight in a latency-bound launch): 32 entries of one warp each
# beat 128 of two against SGLang's kernel on the prefill plan (benchmarks/verify_blocks.py, docs/benchmarks.md).
VERIFY_SPECULATE_BLOCK = 32
ACCEPT_BLOCK = 128
PLAN_WARPS = 8
WRITE_WARPS = 4
# Decode-shaped writes (at most this many entries per request on average) take a lane per request
# (triton_write_lanes.py): 1, decode steps; 0, every write takes _write_kernel. The lane kernel gives SGLang's
# records and rows and passed the GPU suite on an H100, where it took the bs-256 decode write from 1.21x to
# 1.34x SGLang's speed (docs/ops.md). Tests raise it to put every launch through that kernel, or set 0 (the
# block kernel); benchmarks/sglang_kernels.py --no-write-lanes sets 0.
WRITE_LANES_MAX_RATIO = 1
WRITE_LANES = 64
WRITE_LANES_WARPS = 2
VERIFY_WARPS = 2
VERIFY_SPECULATE_WARPS = 1
# Persistent verify programs per SM: many small programs keep the most record gathers in flight
# (H200: 72% of copy bandwidth at 1M entries, vs 61% with 4 programs of 256 entries per SM).
VERIFY_PROGRAMS_PER_SM = 32
# Plans of at most this many entries that one block per program covers are verified in one pass whose entry
# loads do not wait for the count (a latency-bound launch); it reads the whole capacity, so only small plans.
VERIFY_SPECULATE_ENTRIES = 1 << 16
# Under the interpreter programs run one after another: a couple exercise the stride loop.
INTERPRETER_PROGRAMS = 2


def _fix_interpreter_index() -> None:
    """Let the Triton interpreter use a loaded scalar as a loop bound under numpy >= 2.4.

    triton <= 3.6 converts the 1-element array behind a scalar with ``int()``, which numpy 2.4
    rejects (triton-lang/triton#9171, fixed upstream by #9172); only the interpreter is affected.
    """
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1))
        return
    except TypeError:
        pass
    patch = interpreter._patch_lang_tensor
    if getattr(patch, "kvcanary_index_fix", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.kvcanary_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if _INTERPRETED:
    _fix_interpreter_index()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _verify_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return VERIFY_PROGRAMS_PER_SM * _sm_count(index)


def _spec(x, _tensor=torch.Tensor):
    """What Triton specialises an argument on: tensor dtype and 16-byte alignment, an int's width,
    value 1 and divisibility by 16, a tuple's members. A superset of Triton's own key is safe: it
    can only cache more kernels, never reuse one compiled for other assumptions."""
    kind = type(x)  # (exact types first: an isinstance chain costs a launch's key a third more)
    if kind is _tensor:
        return (x.dtype, x.data_ptr() % 16 == 0)
    if kind is int:
        return (x == 1, x % 16 == 0, -(1 << 31) <= x < (1 << 31), x >= (1 << 63))
    if kind is tuple:
        return tuple(map(_spec, x))
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() % 16 == 0)
    if isinstance(x, bool) or x is None:
        return x
    if isinstance(x, int):
        return (x == 1, x % 16 == 0, -(1 << 31) <= x < (1 << 31), x >= (1 << 63))
    if isinstance(x, tuple):
        return tuple(_spec(v) for v in x)
    return (type(x), x)


class _Launcher:
    """Launch a Triton kernel through Triton once per specialisation, then call the compiled kernel.

    Triton's own launch path re-binds every argument, specialises it and rebuilds the cache key on
    each call; these kernels take about thirty arguments and the canary launches several per forward.
    (On the H200 the gain was within the machine's noise: docs/benchmarks.md.) Off under the
    interpreter, with a launch hook set (profilers), or with KV_CANARY_TRITON_FAST_LAUNCH=0.
    """

    enabled = v.env_flag("KV_CANARY_TRITON_FAST_LAUNCH", True)  # (1/0/true/false/yes/no/on/off)

    def __init__(self, fn):
        self.fn = fn
        self.names = tuple(fn.arg_names)
        # constexpr arguments are compiled in: their exact values belong in the key
        self.exact = tuple(p.is_constexpr for p in fn.params)
        self.cache: dict = {}

    def __call__(self, grid: tuple, num_warps: int = 4, **kw) -> None:
        if not self.enabled or _launch_hooked():
            self.fn[grid](**kw, num_warps=num_warps)
            return
        args = [kw[n] for n in self.names]
        device = torch.cuda.current_device()
        key = (device, num_warps, tuple([a if exact else _spec(a) for a, exact in zip(args, self.exact)]))
        kernel = self.cache.get(key)
        if kernel is None:
            kernel = self.fn[grid](**kw, num_warps=num_warps)
            self.cache[key] = kernel.result() if hasattr(kernel, "result") else kernel
            return
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        # the raw handle: torch.cuda.current_stream builds a Python Stream object (microseconds per call)
        stream = _raw_stream(device)
        try:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
        except (AttributeError, TypeError):
            # A Triton whose compiled-kernel interface differs: its own launch path from now on.
            _Launcher.enabled = False
            self.fn[grid](**kw, num_warps=num_warps)


def _launch_hooked() -> bool:
    """A launch-enter hook is installed (a profiler): launches must go through Triton, which calls it.

    Triton 3.6 keeps an empty ``HookChain`` there by default, which is truthy: look at its calls."""
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def _raw_stream(device: int) -> int:
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(device) if get is not None else torch.cuda.current_stream(device).cuda_stream


_launchers: dict = {}


def _launch(fn, grid: tuple, **kw) -> None:
    launcher = _launchers.get(fn)
    if launcher is None:
        # The interpreter, or a wrapped kernel (tests record launches): launch as given.
        if not _Launcher.enabled or _INTERPRETED or not hasattr(fn, "params"):
            fn[grid](**kw)
            return
        launcher = _launchers[fn] = _Launcher(fn)
    launcher(grid, **kw)


def _cdiv(a: int, b: int) -> int:
    # plain int arithmetic: triton.cdiv is a jit function, slow to call from the host
    return -(-a // b)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# Source tensors passed as they are (the kernel reads their bytes through a uint8 pointer);
# other dtypes go through a uint8 view of their storage.
_POINTER_DTYPES = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                             torch.bfloat16, torch.float32, torch.float64))


def _source_args(sources, real_kv_mode: int, dummy: torch.Tensor) -> dict:
    """Kernel arguments describing the real-KV sources (tuples of per-source values)."""
    if real_kv_mode == RealKvMode.NONE or not sources:
        return dict(src_ptrs=(dummy,), src_row_stride=(0,), src_page_size=(1,), src_nbpt=(0,), src_nbytes=(0,),
                    src_rows=(0,), NUM_SOURCES=0, ALIGNED=True)
    rows = tuple(s.tensor if s.tensor.dtype in _POINTER_DTYPES else s.byte_rows() for s in sources)
    return dict(
        src_ptrs=rows,
        src_row_stride=tuple(s.row_stride_bytes for s in sources),
        src_page_size=tuple(s.page_size for s in sources),
        src_nbpt=tuple(s.num_bytes_per_token for s in sources),
        src_nbytes=tuple(PARTIAL_READ_BYTES if real_kv_mode == RealKvMode.PARTIAL else s.read_bytes
                         for s in sources),
        src_rows=tuple(s.tensor.shape[0] for s in sources),
        NUM_SOURCES=len(sources),
        # row strides and token widths are multiples of 16: one aligned base makes every word aligned
        ALIGNED=all(r.data_ptr() % 8 == 0 for r in rows),
    )


def scatter_req_token_ids(flat_in, offsets, req_pool_indices, pool_out) -> None:
    bs = req_pool_indices.shape[0]
    if bs == 0 or flat_in.shape[0] == 0:
        return
    _launch(k._scatter_kernel, (bs,),
        p_flat=_flat(flat_in), flat_len=flat_in.shape[0], p_offsets=_flat(offsets), p_rows=_flat(req_pool_indices),
        p_pool=pool_out, pool_rows=pool_out.shape[0], pool_cols=pool_out.shape[1],
        pool_s0=pool_out.stride(0), pool_s1=pool_out.stride(1), BLOCK=SCATTER_BLOCK,
    )


def fingerprint(*, slots, sources, real_kv_mode) -> torch.Tensor:
    n = slots.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=slots.device)
    if n == 0:
        return out
    _launch(k._fingerprint_kernel, (_cdiv(n, FINGERPRINT_BLOCK),),
        p_slots=_flat(slots), n=n, p_out=out, **_source_args(sources, real_kv_mode, out),
        BLOCK=FINGERPRINT_BLOCK,
    )
    return out


def plan(*, req_pool_indices, prefix_lens, extend_lens, req_to_token, out, window=0, full_to_swa=None,
         token_table=None, token_valid_lens=None, token_offset=0) -> None:
    bs = req_pool_indices.shape[0]
    e = out.entries
    rows = _flat(req_pool_indices)
    swa = rows if full_to_swa is None else _flat(full_to_swa)
    tokens = req_to_token if token_table is None else token_table
    valid = rows if token_valid_lens is None else _flat(token_valid_lens)
    split = max(1, min(_cdiv(req_to_token.shape[1], PLAN_BLOCK), PLAN_PROGRAMS // max(bs, 1)))
    _launch(k._plan_kernel, (max(bs, 1), split),
        p_rows=rows, p_prefix=_flat(prefix_lens), p_extend=_flat(extend_lens), bs=bs,
        p_rtt=req_to_token, rtt_s0=req_to_token.stride(0), rtt_s1=req_to_token.stride(1),
        num_rows=req_to_token.shape[0], max_ctx=req_to_token.shape[1], window=window,
        p_swa=swa, swa_len=0 if full_to_swa is None else full_to_swa.shape[0],
        p_tokens=tokens, tok_s0=tokens.stride(0), tok_s1=tokens.stride(1), tok_rows=tokens.shape[0],
        tok_cols=tokens.shape[1], p_valid=valid, token_offset=token_offset,
        p_slot=e.slot, p_position=e.position, p_prev=e.prev, p_expected=e.expected_token, p_count=e.count,
        p_enable=e.enable, p_requested=e.requested, capacity=e.capacity, p_write_offsets=out.write_offsets,
        offsets_len=out.write_offsets.shape[0], p_seed=out.seed_slot,
        HAS_SWA=full_to_swa is not None, HAS_TOKENS=token_table is not None,
        BLOCK_B=PLAN_BLOCK_B, BLOCK=PLAN_BLOCK, num_warps=PLAN_WARPS,
    )


def write(*, buf, write_offsets, seed_slot, num_requests, out_cache_loc, input_ids, positions, ring, counters,
          launch_tag, sources=(), real_kv_mode=0, expected_input_ids=None, expected_positions=None,
          chain_check=None, writer_ids=None, step=None, chain_hint=None) -> None:
    loc = _flat(out_cache_loc)
    # the hint stands in for the serial walk only where the walk pushes no rows (api.write)
    hint = chain_hint is not None and expected_input_ids is None and expected_positions is None and chain_check is None
    args = dict(
        p_buf=buf, stride=buf.shape[1], num_slots=buf.shape[0], p_write_offsets=write_offsets, p_seed=seed_slot,
        num_requests=num_requests, p_loc=loc, p_ids=_flat(input_ids), p_pos=_flat(positions),
        num_tokens=loc.shape[0], p_ring=ring.rows, p_write_index=ring.write_index, ring_capacity=ring.capacity,
        p_counters=counters, launch_tag=launch_tag, **_source_args(sources, real_kv_mode, buf),
        p_exp_ids=loc if expected_input_ids is None else _flat(expected_input_ids),
        p_exp_pos=loc if expected_positions is None else _flat(expected_positions),
        p_chain_check=ring.write_index if chain_check is None else chain_check,
        p_writer_ids=loc if writer_ids is None else _flat(writer_ids),
        p_step=counters if step is None else step,
        HAS_EXP_IDS=expected_input_ids is not None, HAS_EXP_POS=expected_positions is not None,
        HAS_CHAIN_CHECK=chain_check is not None, ATTRIBUTION=buf.shape[1] >= ATTRIBUTION_STRIDE,
        HAS_WRITER_IDS=writer_ids is not None, HAS_STEP=step is not None)
    if WRITE_LANES_MAX_RATIO and loc.shape[0] <= WRITE_LANES_MAX_RATIO * max(num_requests, 1):  # (decode steps)
        _launch(lanes._write_lanes_kernel, (max(_cdiv(num_requests, WRITE_LANES), 1),), **args,
                LANES=WRITE_LANES, num_warps=WRITE_LANES_WARPS)
        return
    _launch(k._write_kernel, (max(num_requests, 1),), **args, p_hint=chain_hint if hint else buf, HAS_HINT=hint,
            BLOCK=WRITE_BLOCK, num_warps=WRITE_WARPS)


def verify_in_one_pass(capacity: int, max_programs: int) -> bool:
    """Whether a verify of a plan of ``capacity`` entries, given at most ``max_programs`` programs, loads
    its entries before the count (one block per program, a small plan)."""
    return capacity <= min(max_programs * VERIFY_SPECULATE_BLOCK, VERIFY_SPECULATE_ENTRIES)


def _verify_shape(capacity: int, device: torch.device) -> tuple[int, int, int, bool]:
    """(programs, block, warps, one pass) of a verify launch over a plan of ``capacity`` entries."""
    max_programs = _verify_programs(device)
    if verify_in_one_pass(capacity, max_programs):
        return max(1, _cdiv(capacity, VERIFY_SPECULATE_BLOCK)), VERIFY_SPECULATE_BLOCK, VERIFY_SPECULATE_WARPS, True
    return max(1, min(_cdiv(capacity, VERIFY_BLOCK), max_programs)), VERIFY_BLOCK, VERIFY_WARPS, False


def verify(*, buf, entries, ring, counters, launch_tag, sources=(), real_kv_mode=0, check_token=True) -> None:
    num_programs, block, warps, one_pass = _verify_shape(entries.capacity, buf.device)
    _launch(k._verify_kernel, (num_programs,),
        p_buf=buf, stride=buf.shape[1], num_slots=buf.shape[0], p_slot=entries.slot, p_position=entries.position,
        p_prev=entries.prev, p_expected=entries.expected_token, p_count=entries.count, p_enable=entries.enable,
        capacity=entries.capacity, p_ring=ring.rows, p_write_index=ring.write_index, ring_capacity=ring.capacity,
        p_counters=counters, launch_tag=launch_tag, **_source_args(sources, real_kv_mode, buf),
        CHECK_TOKEN=bool(check_token), SPECULATE=one_pass, BLOCK=block, num_warps=warps,
    )


def accept_rewrites(*, head_buf, tail_buf, write_offsets, num_requests, out_cache_loc, sources=(), real_kv_mode=0,
                    rewrites=None) -> None:
    loc = _flat(out_cache_loc)
    n = loc.shape[0]
    if n == 0:
        return
    _launch(k._accept_kernel, (_cdiv(n, ACCEPT_BLOCK),),
        p_head=head_buf, p_tail=tail_buf, stride=tail_buf.shape[1], num_slots=tail_buf.shape[0],
        p_write_offsets=write_offsets, num_requests=num_requests, p_loc=loc, num_tokens=n,
        p_rewrites=write_offsets if rewrites is None else rewrites,
        **_source_args(sources, real_kv_mode, tail_buf), HAS_REWRITES=rewrites is not None, BLOCK=ACCEPT_BLOCK,
    )
