"""The memory-bandwidth references the op benchmark compares against.

``torch.Tensor.copy_`` is not the fastest way to stream a buffer on every GPU (on the H200 it
reached 2.7 TB/s where an elementwise Triton copy and a read-only reduction go further), so the
benchmark measures several references in the same run and divides by the strongest:

- ``torch_copy``: ``dst.copy_(src)``, bytes read + written;
- ``triton_copy``: an elementwise copy kernel, 16-byte words, bytes read + written;
- ``triton_read``: a read-only reduction (each program folds its block to one word), bytes read.

On CPU (or without Triton) the Triton references are skipped and ``torch_read`` (a sum) stands in.
"""

from __future__ import annotations

import torch

COPY_BLOCK = 8192  # int32 words per program: 32 KiB in, 32 KiB out
READ_BLOCK = 16384


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(p_src, p_dst, n, BLOCK: tl.constexpr):
        i_b = tl.program_id(0).to(tl.int64)
        o_x = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        m_x = o_x < n
        tl.store(p_dst + o_x, tl.load(p_src + o_x, mask=m_x), mask=m_x)

    @triton.jit
    def read_kernel(p_src, p_out, n, BLOCK: tl.constexpr):
        i_b = tl.program_id(0).to(tl.int64)
        o_x = i_b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        b_x = tl.load(p_src + o_x, mask=o_x < n, other=0)
        tl.store(p_out + i_b, tl.sum(b_x, axis=0))

    return copy_kernel, read_kernel


def references(device: torch.device, bench, nbytes: int | None = None) -> dict[str, float]:
    """GB/s of each reference on ``device``; ``bench(fn, device)`` returns (p20, p50, p80) milliseconds."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (1 << 27))
    src = torch.ones(nbytes // 4, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    out = {"torch_copy": 2 * nbytes / (bench(lambda: dst.copy_(src), device)[1] * 1e-3) / 1e9}
    if device.type != "cuda":
        out["torch_read"] = nbytes / (bench(lambda: src.sum(), device)[1] * 1e-3) / 1e9
        return out
    try:
        copy_kernel, read_kernel = _kernels()
    except ImportError:
        return out
    n = src.numel()
    grid_c = (-(-n // COPY_BLOCK),)
    grid_r = (-(-n // READ_BLOCK),)
    partial = torch.empty(grid_r[0], dtype=torch.int32, device=device)
    out["triton_copy"] = 2 * nbytes / (bench(lambda: copy_kernel[grid_c](src, dst, n, BLOCK=COPY_BLOCK, num_warps=8),
                                             device)[1] * 1e-3) / 1e9
    if not torch.equal(dst, src):
        raise RuntimeError("kv-canary: the bandwidth reference copy kernel copied wrongly")
    out["triton_read"] = nbytes / (bench(lambda: read_kernel[grid_r](src, partial, n, BLOCK=READ_BLOCK, num_warps=8),
                                         device)[1] * 1e-3) / 1e9
    if int(partial.sum()) != n:
        raise RuntimeError("kv-canary: the bandwidth reference reduction summed wrongly")
    return out
