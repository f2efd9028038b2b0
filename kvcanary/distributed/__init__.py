"""kv-canary beyond one GPU: tensor-parallel consistency and prefill/decode transfers (docs/distributed.md).

- ``ConsistencyCheck``: one canary per TP rank; every N steps an ``all_gather`` of per-rank
  counters and digests names the rank whose tables or KV diverged.
- ``pack_records`` / ``send_transfer`` / ``recv_transfer`` / ``land_records`` / ``ArrivalCheck``:
  a request's canary records travel with its KV from a prefill to a decode instance and are
  verified through the decode side's table before its first decode forward.
- ``gather_violations``: every rank's violations on one rank, each row with its rank.
- ``spawn``: N processes in one gloo or NCCL process group, with a deadline.
"""

from kvcanary.distributed.consistency import (
    DEFAULT_INTERVAL,
    ConsistencyCheck,
    Divergence,
    KvCanaryDivergenceError,
    record_digest,
)
from kvcanary.distributed.launch import RankContext, free_port, spawn
from kvcanary.distributed.report import RankedViolation, gather_violations
from kvcanary.distributed.transfer import (
    ArrivalCheck,
    RecordPacket,
    TransferViolation,
    land_records,
    pack_records,
    recv_transfer,
    send_transfer,
)

__all__ = ["DEFAULT_INTERVAL", "ArrivalCheck", "ConsistencyCheck", "Divergence", "KvCanaryDivergenceError",
           "RankContext", "RankedViolation", "RecordPacket", "TransferViolation", "free_port", "gather_violations",
           "land_records", "pack_records", "record_digest", "recv_transfer", "send_transfer", "spawn"]
