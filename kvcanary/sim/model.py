"""The mock model: real KV tensors filled with deterministic bytes, and the token oracle as sampler.

Each full-attention layer has a K and a V cache of ``[num_pages, page_size * WORDS]``
int64 (one token = ``WORDS`` words = 32 bytes, page-major like a paged KV cache); the
optional sliding-window layer has its own K/V cache indexed by SWA slots. A forward
writes, for every token, words that depend only on (token, position, layer), so any
slot whose bytes changed behind the engine's back is visible to the canary's real-KV
fingerprint. These tensors are the canary's ``RealKvSource``s, seen as float64 (the words keep
bit 62 clear, so every value is finite: the canary's non-finite KV check reads them as a model's
KV; a NaN is a planted bug, ``nan_write``). Sampling is the
token oracle of SPEC 5: the token at position p of request r is
``oracle_token(r, p, vocab)``.
"""

from __future__ import annotations

import torch

from kvcanary.format import MAX_REAL_KV_SOURCES, oracle_token
from kvcanary.ops.types import RealKvSource

WORDS = 4  # int64 words per token and layer: 32 bytes
_M1, _M2, _M3, _M4 = -7046029254386353131, -4658895280553007687, -7723592293110705685, 0x2545F4914F6CDD1D
_MULTS = torch.tensor([_M1, _M2, _M3, _M4], dtype=torch.int64)  # int64 arithmetic wraps like uint64
SWA_LAYER_TAG = 100
SHARD_TAG = 1000  # a tensor-parallel rank's shard of the heads: its own bytes for the same token


def kv_words(tokens: torch.Tensor, positions: torch.Tensor, tag: int) -> torch.Tensor:
    """int64 [n, WORDS] bytes of the KV of (token, position) in the layer/kind named by ``tag``."""
    m = _MULTS
    base = tokens.to(torch.int64) * m[0] + positions.to(torch.int64) * m[1] + (tag + 1) * m[2]
    w = base[:, None] + torch.arange(WORDS, dtype=torch.int64) * m[3]
    w = w ^ (w >> 29)
    return (w * m[0]) & ~(1 << 62)  # (an exponent below all ones: finite as float64)


class MockModel:
    """KV caches of ``num_layers`` full layers (+ one SWA layer) and an oracle sampler.

    Args:
        num_slots: full-pool slots (a multiple of page_size).
        page_size: tokens per page row of the KV tensors.
        num_layers: full-attention layers.
        swa_slots: slots of the SWA pool (0 = no SWA layer).
        vocab: vocabulary of the token oracle.
    """

    def __init__(self, num_slots: int, page_size: int, num_layers: int, swa_slots: int, vocab: int):
        self.page_size = page_size
        self.vocab = vocab
        pages = num_slots // page_size
        self.k = [torch.zeros(pages, page_size * WORDS, dtype=torch.int64) for _ in range(num_layers)]
        self.v = [torch.zeros(pages, page_size * WORDS, dtype=torch.int64) for _ in range(num_layers)]
        self.swa_k = torch.zeros(swa_slots, WORDS, dtype=torch.int64) if swa_slots else None
        self.swa_v = torch.zeros(swa_slots, WORDS, dtype=torch.int64) if swa_slots else None
        self.shard = 0  # tensor-parallel rank whose heads these caches hold (kvcanary.sim.distributed_tp)

    @property
    def num_kv_tensors(self) -> int:
        """Full-layer K and V tensors (what ``read`` returns per slot list)."""
        return 2 * len(self.k)

    # -- real-KV sources for the canary --------------------------------------------------------
    def _source(self, t: torch.Tensor, page_size: int) -> RealKvSource:
        # (float64 views of the int64 words: the canary checks float KV for NaN/Inf)
        return RealKvSource(t.view(torch.float64), page_size=page_size, num_bytes_per_token=WORDS * 8,
                            read_bytes=WORDS * 8)

    def fingerprinted(self) -> list[int]:
        """The layers whose K and V are the pool's real-KV sources: every layer up to four (the format's most
        sources per buffer), past that the first, the last and two evenly spaced between (the write check covers
        the others with ``write_check_layers="all"``)."""
        n = len(self.k)
        return list(range(n)) if n <= MAX_REAL_KV_SOURCES else sorted({round(i * (n - 1) / 3) for i in range(4)})

    def k_sources(self) -> tuple[RealKvSource, ...]:
        return tuple(self._source(self.k[j], self.page_size) for j in self.fingerprinted())

    def v_sources(self) -> tuple[RealKvSource, ...]:
        return tuple(self._source(self.v[j], self.page_size) for j in self.fingerprinted())

    def swa_sources(self) -> tuple[tuple[RealKvSource, ...], tuple[RealKvSource, ...]]:
        if self.swa_k is None:
            return (), ()
        return (self._source(self.swa_k, 1),), (self._source(self.swa_v, 1),)

    # -- forward -------------------------------------------------------------------------------
    def _full_views(self):
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            yield 2 * layer, k.view(-1, WORDS)
            yield 2 * layer + 1, v.view(-1, WORDS)

    def forward(self, out_cache_loc: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                swa_loc: torch.Tensor | None = None, note=None) -> None:
        """Write the KV of every token (padding included) into its slot, in every layer.

        Args: out_cache_loc, input_ids, positions: int64 [n]; swa_loc: int64 [n] SWA slots
        the SWA layer writes (None without SWA). Out-of-range slots are dropped like masked stores.
        ``note(layer, k, v)``: each layer's computed K and V, every token's row (float64 views of the words, as
        the real-KV sources see them), before they are stored (the canary's write check); the SWA layer is
        layer ``len(self.k)``.
        """
        loc = out_cache_loc.to(torch.int64)
        for layer, (k, v) in enumerate(zip(self.k, self.v)):
            rows = [kv_words(input_ids, positions, 2 * layer + kind + SHARD_TAG * self.shard) for kind in (0, 1)]
            if note is not None:
                note(layer, rows[0].view(torch.float64), rows[1].view(torch.float64))
            for t, words in zip((k, v), rows):
                view = t.view(-1, WORDS)
                ok = (loc >= 0) & (loc < view.shape[0])
                view[loc[ok]] = words[ok]
        if swa_loc is not None and self.swa_k is not None:
            rows = [kv_words(input_ids, positions, SWA_LAYER_TAG + kind + SHARD_TAG * self.shard) for kind in (0, 1)]
            if note is not None:
                note(len(self.k), rows[0].view(torch.float64), rows[1].view(torch.float64))
            ok = (swa_loc >= 0) & (swa_loc < self.swa_k.shape[0])
            self.swa_k[swa_loc[ok]] = rows[0][ok]
            self.swa_v[swa_loc[ok]] = rows[1][ok]

    def sample(self, request_id: int, position: int) -> int:
        """The next token: the token oracle's token for ``position``."""
        return oracle_token(request_id, position, self.vocab)

    # -- copies (offload, load-back, moves) ----------------------------------------------------
    def read(self, slots: list[int]) -> list[torch.Tensor]:
        """KV bytes of ``slots`` in every full layer (K and V), as copies."""
        idx = torch.tensor(slots, dtype=torch.int64)
        return [view[idx].clone() for _, view in self._full_views()]

    def write(self, slots: list[int], data: list[torch.Tensor]) -> None:
        """Store bytes from ``read`` into ``slots`` (same order)."""
        idx = torch.tensor(slots, dtype=torch.int64)
        for (_, view), d in zip(self._full_views(), data):
            view[idx] = d

    def move(self, src: list[int], dst: list[int], swa_src: list[int] | None = None,
             swa_dst: list[int] | None = None) -> None:
        """Copy KV from src to dst slots (full layers, and the SWA layer when SWA slots are given)."""
        self.write(dst, self.read(src))
        if swa_src is not None and self.swa_k is not None:
            s, d = torch.tensor(swa_src, dtype=torch.int64), torch.tensor(swa_dst, dtype=torch.int64)
            self.swa_k[d] = self.swa_k[s].clone()
            self.swa_v[d] = self.swa_v[s].clone()
