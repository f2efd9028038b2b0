"""Reports that name vLLM's requests and reach the user from every process.

The canary numbers requests with ints; vLLM names them with strings (``LLM`` appends a random suffix to the
user's id: request ``"7"`` runs as ``"7-1a2b3c4d"``). ``RequestNames`` keeps the map, and every row the
integration emits carries the vLLM ids next to the canary's numbers.

A worker process is out of the user's reach, so each session appends its rows to a JSON-lines file in
``KV_CANARY_VLLM_REPORT_DIR`` as they are drained (``kvcanary-rank<R>-pid<P>.jsonl``) and rewrites its stats
beside it (``.stats.json``); ``read_reports(directory)`` gathers every process's rows. ``collect(llm)`` asks the
live workers of an ``LLM`` instead, through vLLM's ``collective_rpc``.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field


class RequestNames:
    """vLLM request id (str) <-> canary request number (int, from 1 in order of first sight)."""

    def __init__(self):
        self._numbers: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def number(self, name: str) -> int:
        n = self._numbers.get(name)
        if n is None:
            n = self._numbers[name] = len(self._numbers) + 1
            self._names[n] = name
        return n

    def name(self, number: int | None) -> str | None:
        return None if number is None else self._names.get(number)

    def __len__(self) -> int:
        return len(self._numbers)


def violation_row(v, names: RequestNames, *, rank: int, block_size: int, text: str) -> dict:
    """One violation as a JSON-safe row: the canary's fields, the vLLM request ids, the rank, the readable block."""
    row = v.to_dict()
    row.update(kind="violation", rank=rank, pid=os.getpid(), block=v.slot // block_size if v.slot >= 0 else None,
               reader=names.name(v.reader_request), writer=names.name(v.writer_request),
               reader_names=[names.name(r) for r in v.readers],
               holder_names=[names.name(h) for h in getattr(v, "holders", ())], log_line=v.log_line(),
               text=text)
    return row


def describe(v, names: RequestNames) -> str:
    """The readable violation block with the vLLM request id after each canary request number."""
    return v.block(name_of=names.name)


class ReportFiles:
    """This process's files in the report directory (None: no directory; every call is then a no-op)."""

    def __init__(self, directory: str | None, rank: int):
        self.directory = directory
        stem = None if directory is None else os.path.join(directory, f"kvcanary-rank{rank}-pid{os.getpid()}")
        self.rows_path = None if stem is None else stem + ".jsonl"
        self.stats_path = None if stem is None else stem + ".stats.json"

    def append(self, rows: list[dict]) -> None:
        if self.rows_path is None or not rows:
            return
        with open(self.rows_path, "a") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")

    def write_stats(self, stats: dict) -> None:
        if self.stats_path is None:
            return
        tmp = self.stats_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f, default=str)
        os.replace(tmp, self.stats_path)  # (a reader never sees half a file)


@dataclass
class VllmReport:
    """Every process's findings: violation and divergence rows (dicts, ``kind`` tells which) and stats per process.

    ``violations``: rows with ``reader`` / ``writer`` (vLLM request ids), ``rank``, ``text`` (the readable block),
    ``log_line`` and the canary's fields (``reasons``, ``slot``, ``block``, ``position``, ...).
    ``divergences``: tensor-parallel ranks whose canary state differed (``rank``, ``fields``, ``step``).
    ``stats``: one dict per process (``rank``, ``pid``, ``forwards``, ``violations``, ``prefix_hits``, ...).
    """

    violations: list[dict] = field(default_factory=list)
    divergences: list[dict] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)

    @property
    def total_violations(self) -> int:
        return sum(s.get("violations", 0) for s in self.stats)

    @property
    def forwards(self) -> int:
        return sum(s.get("forwards", 0) for s in self.stats)

    @property
    def clean(self) -> bool:
        return not self.violations and not self.divergences and self.total_violations == 0

    def requests(self) -> set[str]:
        """The vLLM request ids the violations name as readers (every reader of a row) or, for write-time rows,
        writers."""
        out = {r.get("reader") or r.get("writer") for r in self.violations}
        out.update(name for r in self.violations for name in r.get("reader_names", ()))
        return out - {None}

    def to_dict(self) -> dict:
        return {"violations": self.violations, "divergences": self.divergences, "stats": self.stats}


def merge(parts: list[dict]) -> VllmReport:
    """One report from per-process parts (``{"rows": [...], "stats": {...}}``)."""
    out = VllmReport()
    seen = set()
    for part in parts:
        for row in part.get("rows", ()):
            if row.get("kind") != "divergence":
                out.violations.append(row)
                continue
            # every rank of an exchange finds the same divergences: one row each
            key = (row.get("step"), row.get("rank"), tuple(row.get("fields", ())))
            if key not in seen:
                seen.add(key)
                out.divergences.append(row)
        if part.get("stats"):
            out.stats.append(part["stats"])
    out.stats.sort(key=lambda s: (s.get("rank", 0), s.get("pid", 0)))
    return out


def read_reports(directory: str) -> VllmReport:
    """Everything every process wrote to ``directory`` (``KV_CANARY_VLLM_REPORT_DIR``) so far."""
    if not os.path.isdir(directory):
        raise ValueError(f"kv-canary: read_reports directory must be an existing directory, got {directory!r}")
    parts = []
    for rows_path in sorted(glob.glob(os.path.join(directory, "kvcanary-rank*-pid*.jsonl"))):
        with open(rows_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        parts.append({"rows": rows})
    for stats_path in sorted(glob.glob(os.path.join(directory, "kvcanary-rank*-pid*.stats.json"))):
        with open(stats_path) as f:
            parts.append({"stats": json.load(f)})
    return merge(parts)


def collect(llm) -> VllmReport:
    """Every worker's report from a live ``vllm.LLM`` (drained now): ``llm.collective_rpc("kvcanary_report")``.

    With tensor parallelism the ranks also run their last consistency exchange (each rank gets the call)."""
    try:
        parts = llm.collective_rpc("kvcanary_report")
    except NotImplementedError as e:
        raise RuntimeError("kv-canary: collect needs the canary in vLLM's workers (KV_CANARY_VLLM=1 before the "
                           f"engine starts), got workers without it ({e})") from None
    return merge(list(parts))
