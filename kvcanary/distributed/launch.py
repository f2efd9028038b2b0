"""Process groups for the multi-process runs: a free port, spawn with a deadline, per-rank devices.

``spawn(fn, world_size, backend=...)`` starts ``world_size`` processes with
``torch.multiprocessing`` (fork for gloo, spawn for NCCL), each of which joins one process group
(gloo on CPU, NCCL with one GPU per rank) before calling ``fn(ctx, *args)``. Rank 0's
return value comes back to the caller. A run that outlives ``timeout_s`` is killed and
raises ``TimeoutError``, so a hung collective fails a test instead of blocking CI.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

BACKENDS = ("gloo", "nccl")
# The collectives' own timeout sits past the run's deadline, so a hang ends as one TimeoutError.
PG_TIMEOUT_MARGIN_S = 30


@dataclass(frozen=True)
class RankContext:
    """What a spawned function knows about its process.

    Attributes:
        rank, world_size: its place in the default process group.
        backend: "gloo" or "nccl".
        device: where tensors that travel must live (cpu for gloo, the rank's GPU for NCCL).
    """

    rank: int
    world_size: int
    backend: str
    device: torch.device


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_backend(backend: str, world_size: int) -> None:
    """Refuse a backend this machine cannot run, before any process starts."""
    if backend not in BACKENDS:
        raise ValueError(f"kv-canary: backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"kv-canary: world_size must be an int >= 2, got {world_size!r}")
    if backend == "nccl":
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise ValueError("kv-canary: backend 'nccl' needs CUDA and a torch build with NCCL, got neither")
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"kv-canary: backend 'nccl' needs one GPU per rank ({world_size}), got "
                             f"{torch.cuda.device_count()}")
    elif not dist.is_gloo_available():
        raise ValueError("kv-canary: backend 'gloo' needs a torch build with gloo, got one without")


def start_method(backend: str) -> str:
    """fork for gloo where the platform has it (children inherit the imported torch: seconds saved per
    process); spawn for NCCL, since a process that initialised CUDA cannot fork."""
    if backend == "gloo" and "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def _entry(rank: int, fn: Callable, world_size: int, backend: str, port: int, timeout_s: float, out_path: str,
           args: tuple) -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s + PG_TIMEOUT_MARGIN_S))
    try:
        result = fn(RankContext(rank, world_size, backend, device), *args)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0):
    """Run ``fn(ctx, *args)`` in ``world_size`` processes of one process group; rank 0's result.

    Args:
        fn: a module-level function (spawned processes import it by name) taking a ``RankContext`` first.
        world_size: processes (>= 2); with NCCL one GPU each.
        backend: "gloo" (CPU) or "nccl".
        timeout_s: deadline for the whole run (collectives time out a little later).

    Raises:
        TimeoutError: the run did not finish in time (every process is killed).
        RuntimeError: a process failed (its traceback is in the message).
    """
    check_backend(backend, world_size)
    if timeout_s <= 0:
        raise ValueError(f"kv-canary: timeout_s must be > 0, got {timeout_s}")
    fd, out_path = tempfile.mkstemp(prefix="kvcanary-dist-", suffix=".pkl")
    os.close(fd)
    try:
        ctx = mp.start_processes(_entry, args=(fn, world_size, backend, free_port(), timeout_s, out_path, args),
                                 nprocs=world_size, join=False, start_method=start_method(backend))
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kv-canary: distributed run must finish within {timeout_s} s, got a run "
                                       "still going (a hung collective?)")
        except ProcessException as e:
            raise RuntimeError(f"kv-canary: a rank failed:\n{e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        with open(out_path, "rb") as f:
            return pickle.load(f)
    finally:
        os.unlink(out_path)
