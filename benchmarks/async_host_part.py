"""Host time of the transformers adapter's host part under async batching: a decode step of the same requests
on the general path (per-request Python) against the steady path (a kept array; ``_Steady.lag``), for a few
batch sizes. No engine and no device: the builder reads fake request states, as tests/test_hf_rows.py does, and
stages to the CPU. A development tool (docs/benchmarks.md quotes its dev-CPU figures).

    python benchmarks/async_host_part.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcanary.integrations.transformers.batch import BatchBuilder  # noqa: E402
from kvcanary.runtime.step.staging import Staging  # noqa: E402


def builder(steady: bool, rows: int) -> BatchBuilder:
    b = BatchBuilder.__new__(BatchBuilder)  # the host half alone, as tests/test_hf_rows.py builds it
    b.init_rows(rows)
    b.want_history, b.stage, b.iota_np = True, Staging(torch.device("cpu")), np.arange(4, dtype=np.int64)
    b.carries, b.pad_cap = True, 0
    ids = {}
    pairs = [SimpleNamespace(host_io=SimpleNamespace(req_id_to_new_token_position={})) for _ in range(2)]
    b.s = SimpleNamespace(ids=ids, request_id=lambda n: ids.setdefault(n, len(ids) + 1),
                          bp=SimpleNamespace(inputs_and_outputs=SimpleNamespace(io_pairs=pairs, current_pair=0)))
    if not steady:
        b._steady = lambda *args, **kwargs: None
    return b


def per_step_us(steady: bool, bs: int, steps: int) -> float:
    b = builder(steady, 2 * bs + 2)
    aio = b.s.bp.inputs_and_outputs
    states = [SimpleNamespace(request_id=f"r{i}", initial_tokens=list(range(64)), generated_tokens=[],
                              position_offset=64) for i in range(bs)]
    reqs = [SimpleNamespace(state=st, query_length=1) for st in states]
    names = {st.request_id: i for i, st in enumerate(states)}
    aio.requests_in_batch = [SimpleNamespace(state=st, query_length=64) for st in states]
    aio.io_pairs[1].host_io.req_id_to_new_token_position = {}
    b.host_part()  # the prompts
    aio.requests_in_batch = reqs
    times = []
    for step in range(steps):
        aio.current_pair = 1 - aio.current_pair
        aio.io_pairs[1 - aio.current_pair].host_io.req_id_to_new_token_position = names
        for st in states:
            if step:
                st.generated_tokens.append(step)  # (the host learns the token of the forward before the last)
            st.position_offset += 1
        t0 = time.perf_counter()
        b.host_part()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[steps // 10:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    a = p.parse_args()
    print(f"{'batch':>6} {'general us':>11} {'steady us':>10}")
    for bs in (1, 8, 32, 64):
        print(f"{bs:>6} {per_step_us(False, bs, a.steps):>11.1f} {per_step_us(True, bs, a.steps):>10.1f}")


if __name__ == "__main__":
    main()
