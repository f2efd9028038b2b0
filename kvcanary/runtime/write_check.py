"""The write check: the KV bytes a written slot holds after the forward against the KV its layer computed.

The record ops certify whatever bytes a slot holds after the forward (TAIL hashes them into the record), so a
cache write that stored the wrong bytes is never seen: a write-only path that writes K and not V, a branch that
copies V into the K cache, a write that lands short. Every later read then "matches" the wrong bytes.

``WriteCheck`` closes that hole for every real-KV source of the pool (the fingerprinted layers, K and V, both
groups), and with ``CanaryConfig.write_check_layers="all"`` for every attention layer the engine names, through
sources of its own over the other layers' cache rows (the records do not change; docs/write_check.md):

- inside the forward, where the engine hands a layer's computed K and V to its cache update, the engine (or
  its adapter) calls ``canary.write_check.note_layer(layer, k, v)`` (after naming each layer's cache rows
  once, ``name_layers``), or ``note(source, rows)`` per real-KV source: one digest per token of the rows' bytes
  (the write digest over every word of the token, ``ops.write_ops``) into a static ``expected[source, token]`` buffer,
  and a flag that the source was noted this forward (device ops only: capturable in the engine's CUDA graph, no sync);
- at TAIL, one pass per group over the forward's live written tokens digests each noted source's bytes of the
  token's slot and compares: a token whose bytes differ pushes one ``write_kv`` row for its first such source,
  naming the slot, position, token, writer and layer, and marks the slot's TAIL record (bit 0 of its real-KV hash
  flipped), so that every later read of the slot fails verify under its reader's name (the writer's next steps, a
  request sharing the block, a fork) until the slot is written again; then the flags are cleared.

Sources the engine never noted in a forward are not compared (nothing to compare with). Rows go into the
canary's ring on the stream TAIL appends to, so they are drained, logged, raised and aborted with the rest.
"""

from __future__ import annotations

import logging

import torch

from kvcanary.format import FailReason
from kvcanary.ops.api import resolve_backend
from kvcanary.ops.types import RealKvSource
from kvcanary.ops.write_ops import as_words, write_impl
from kvcanary.runtime.attention_check import AttentionCheck

__all__ = ["AttentionCheck", "WriteCheck", "check_attribution"]

log = logging.getLogger("kvcanary")
WRITE_KV = int(FailReason.WRITE_KV)
KINDS = ("k", "v")


class WriteCheck:
    """The write check of one ``Canary`` (``canary.write_check``); idle with ``CanaryConfig.write_check`` off."""

    def __init__(self, canary):
        self.c = canary
        self.on = bool(canary.config.write_check) and canary.enabled
        # "all": every layer ``name_layers`` names gets sources of its own besides the fingerprinted ones
        self.all_layers = canary.config.write_check_layers == "all"
        self.ops = write_impl(resolve_backend(canary.config.backend, canary.device))
        self.pending = False  # host: a note since the last TAIL pass (the CPU skips a pass with nothing noted)
        self.notes = 0  # stats: sources noted so far
        self.by_layer: dict[int, list] = {}  # engine layer -> [(source, kind, K and V share one row)]
        self.skipped = False  # a layer's rows did not fit its source once (warned)
        self._build([[] for _ in canary.groups])

    def _build(self, extra: list[list[tuple[RealKvSource, int, str]]]) -> None:
        """The sources, group by group (each group's contiguous: one TAIL pass per group): the real-KV sources of
        the pool (the fingerprinted layers), then ``extra[group]`` ((source, layer, kind): the other layers' K and
        V with ``write_check_layers="all"``), and the buffers sized by them."""
        canary = self.c
        self.sources: list[RealKvSource] = []
        self.spans: list[tuple[int, int]] = []  # per group: its sources' [lo, hi)
        self.where: list[tuple[str, str]] = []  # per source: (group, the record buffer whose hash covers it)
        layer_of, kind_of, tags = [], [], []
        for g, more in zip(canary.groups, extra):
            lo = len(self.sources)
            for kv in KINDS:
                for src in g.sources[kv]:
                    self.sources.append(src)
                    self.where.append((g.name, kv))
                    tags.append(g.tag("tail", kv))
                    layer_of.append(-1)
                    kind_of.append(None)
            for src, layer, kind in more:  # (no record covers these: the row's KIND is the cache's kind)
                self.sources.append(src)
                self.where.append((g.name, kind))
                tags.append(g.tag("tail", kind))
                layer_of.append(layer)
                kind_of.append(kind)
            self.spans.append((lo, len(self.sources)))
        # per source: the TAIL record buffer a wrong write of it marks (``check_writes`` records): its kind's, else K's
        # (without V buffers the K record covers V too; a record whose kind has no source stores 0, marked all the same)
        # (int64 word views of the uint8 buffers, one per buffer)
        self.records = []
        for g, (lo, hi) in zip(canary.groups, self.spans):
            words = {kv: g.bufs["tail", kv].view(torch.int64) for kv in g.kvs}
            self.records.append([words[kind if kind in words else "k"] for _, kind in self.where[lo:hi]])
        self.index = {id(src): s for s, src in enumerate(self.sources)}
        self.group_of_tag = {g.tag("tail", kv): i for i, g in enumerate(canary.groups) for kv in KINDS}
        n, dev = max(1, len(self.sources)), canary.device
        self.expected = torch.zeros(n, canary.max_tokens if self.on else 1, dtype=torch.int64, device=dev)
        self.noted = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tags = torch.tensor(tags or [0], dtype=torch.int64, device=dev)
        self.layers = torch.tensor(layer_of or [-1], dtype=torch.int64, device=dev)
        self.layer_of = layer_of or [-1]  # host copies of ``layers`` and of each source's kind ("k" / "v" / None)
        self.kind_of: list[str | None] = kind_of or [None]

    # -- naming layers ------------------------------------------------------------------------------
    def name_layers(self, groups) -> dict[int, list]:
        """Which sources hold each engine layer's K and V: ``groups`` is ``[(group, layers, keys, values)]`` with
        ``keys[i]`` / ``values[i]`` the tensors of layer ``layers[i]``'s cache rows (every attention layer of the
        group), as the pool's sources were built over them (matched by their first byte, within the group: one
        tensor may serve several groups, their slots telling them apart). A layer whose K and V are one tensor
        (an MLA latent row) is noted as its K then V bytes side by side. With ``write_check_layers="all"`` each
        layer no pool source covers gets a source of its own, laid out like the group's fingerprinted layers
        (``_layer_source``). Call it once, before the first forward (the buffers are sized here). Returns
        ``{layer: [(source, kind, joined)]}``."""
        self.by_layer = {}
        if not self.on:
            return self.by_layer
        extra: list[list] = [[] for _ in self.c.groups]
        for name, layers, keys, values in groups:
            if len(layers) != len(keys) or len(layers) != len(values):
                raise ValueError(f"kv-canary: name_kv_layers wants one K and one V tensor per layer, got "
                                 f"{len(layers)} layers, {len(keys)} K and {len(values)} V tensors in group {name!r}")
            g = self.c._group(name)
            at: dict[int, tuple[int, str, bool]] = {}
            for layer, k, v in zip(layers, keys, values):
                joined = k.data_ptr() == v.data_ptr()
                at.setdefault(k.data_ptr(), (int(layer), "k", joined))  # (joined: the first name wins)
                at.setdefault(v.data_ptr(), (int(layer), "v", joined))
            named = {}  # first byte -> (the named tensor, the pool source over it)
            for src in (*g.sources["k"], *g.sources["v"]):
                hit = at.get(src.tensor.data_ptr())
                if hit is not None:
                    self.by_layer.setdefault(hit[0], []).append((src, hit[1], hit[2]))
                    named[src.tensor.data_ptr()] = src
            if not self.all_layers:
                continue
            rows = {t.data_ptr(): t for pair in zip(keys, values) for t in pair}
            template = next(((rows[p], src) for p, src in named.items()), None)
            for layer, k, v in zip(layers, keys, values):
                joined = k.data_ptr() == v.data_ptr()
                for kind, t in ((("k", k),) if joined else (("k", k), ("v", v))):
                    if t.data_ptr() in named:
                        continue
                    if template is None:
                        raise ValueError(f"kv-canary: write_check_layers='all' lays each layer's source out like a "
                                         f"real-KV source of its group, got group {name!r} with none of its layers "
                                         f"a pool source (PoolSpec / SwaSpec k_sources, v_sources)")
                    src = _layer_source(t, *template, f"layer {layer}'s {kind.upper()} rows in group {name!r}")
                    named[t.data_ptr()] = src
                    extra[self.c.groups.index(g)].append((src, int(layer), kind))
                    self.by_layer.setdefault(int(layer), []).append((src, kind, joined))
        if any(extra):
            self._build(extra)
        return self.by_layer

    def note_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """``note`` for each source of ``layer`` (``name_layers``): ``k``, ``v`` [tokens, ...] as computed. Rows that
        do not fit the source (another shape than its cache rows) are skipped, with one warning."""
        todo = self.by_layer.get(layer)
        if not todo or not self.on:
            return
        n = k.shape[0]
        for src, kind, joined in todo:
            rows = torch.cat([k.reshape(n, -1), v.reshape(n, -1)], 1) if joined else (k if kind == "k" else v)
            if rows.shape[0] > self.expected.shape[1] or (
                    n and rows.numel() // n * src.tensor.element_size() != src.num_bytes_per_token):
                if not self.skipped:
                    self.skipped = True
                    log.warning("kv-canary: layer %d's computed %s (shape %s) does not fit its cache rows (%d bytes "
                                "per token): the write check skips it", layer, kind.upper(), tuple(rows.shape),
                                src.num_bytes_per_token)
                continue
            self.note(src, rows, layer=layer, kind=kind)

    # -- inside the forward ------------------------------------------------------------------------
    def note(self, source: RealKvSource, rows: torch.Tensor, *, layer: int | None = None,
             kind: str | None = None) -> None:
        """Hash ``rows`` (the K or V the layer computed, one row per token of the forward in ``out_cache_loc``
        order, each row the token's ``source.num_bytes_per_token`` bytes once in the source's dtype) as what the
        forward's writes into ``source`` must leave in each token's slot. Rows past the live tokens (padding)
        are hashed and never compared. Device ops only, validated from metadata."""
        if not self.on:
            return
        s = self.index.get(id(source))
        if s is None:
            raise ValueError("kv-canary: note_written_kv source must be one of the canary's real-KV sources "
                             "(PoolSpec k_sources / v_sources, SwaSpec's), got a RealKvSource that is not; "
                             f"the pool has {len(self.sources)}")
        if not isinstance(rows, torch.Tensor) or rows.dim() < 1:
            raise TypeError(f"kv-canary: note_written_kv rows must be a tensor [tokens, ...], got "
                            f"{type(rows).__name__} {getattr(rows, 'shape', '')}")
        if rows.device != source.tensor.device:
            raise ValueError(f"kv-canary: note_written_kv rows must be on the source's device "
                             f"{source.tensor.device}, got {rows.device}")
        n = rows.shape[0]
        per_row = (rows.numel() // n if n else 0) * source.tensor.element_size()
        if n and per_row != source.num_bytes_per_token:
            raise ValueError(f"kv-canary: note_written_kv rows must hold one token's {source.num_bytes_per_token} "
                             f"bytes per row in the source's dtype {source.tensor.dtype}, got shape "
                             f"{tuple(rows.shape)} ({per_row} bytes per row)")
        if n > self.expected.shape[1]:
            raise ValueError(f"kv-canary: note_written_kv rows must be at most max_tokens = "
                             f"{self.expected.shape[1]} rows, got {n}")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kv-canary: note_written_kv kind must be 'k', 'v' or None, got {kind!r}")
        if layer is not None and layer != self.layer_of[s]:
            self.layer_of[s] = int(layer)
            self.layers[s] = int(layer)
        self.kind_of[s] = kind if kind is not None else self.kind_of[s]
        if rows.dtype != source.tensor.dtype:
            rows = rows.to(source.tensor.dtype)  # (what the cache's copy stores: a cast)
        # (the noted flag set by the hash's own launch: one launch fewer per source inside the engine's forward)
        self.ops.hash_rows(words=as_words(rows), out=self.expected[s], flag=self.noted[s:s + 1])
        self.pending = True
        self.notes += 1

    def forget(self) -> None:
        """Drop this forward's notes (an abandoned forward: ``runtime/abandon.py``); nothing is compared for it."""
        if self.on:
            self.noted.zero_()
            self.pending = False

    def save(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This forward's notes (expected hashes and flags; None: nothing noted), for ``restore``: an engine that
        checks one model forward as several canary forwards (vLLM's waves) hands each the notes of its tokens."""
        if not self.on or not self.pending:
            return None
        return self.expected.clone(), self.noted.clone()

    def restore(self, saved: tuple[torch.Tensor, torch.Tensor] | None, tokens: torch.Tensor) -> None:
        """Make the notes ``saved`` took of the model forward's tokens ``tokens`` (int64 indices into its rows, in the
        coming canary forward's token order) this canary forward's notes; ``saved`` None: nothing."""
        if saved is None:
            return
        expected, noted = saved
        n = int(tokens.numel())
        if n > self.expected.shape[1]:
            raise ValueError(f"kv-canary: write_check.restore takes at most max_tokens = {self.expected.shape[1]} "
                             f"tokens, got {n}")
        self.expected[:, :n] = expected[:, tokens.to(expected.device)]
        self.noted.copy_(noted)
        self.pending = True

    # -- TAIL ---------------------------------------------------------------------------------------
    def after(self) -> None:
        """Compare the forward's written slots with what was noted (after the launcher's TAIL, on its stream)."""
        if not self.on or not self.sources:
            return
        launcher = self.c.launcher
        if self._host() and not self.pending:
            return  # (the CPU, nothing noted this forward: nothing to compare)
        with launcher.side():
            if launcher.staged_now:
                # static buffers only (staged inputs, plan, KV, the expected hashes): captured with TAIL
                if not launcher.extend_tail("write_check", self._after_device):
                    launcher.graphs.run(("write_check",) + launcher.key, lambda call: call(self._after_device))
            else:
                self._after_device()
        self.pending = False

    def _after_device(self) -> None:
        """The device pass (no host read off the CPU: capturable), on the current stream."""
        c = self.c
        c.launcher.streams.note("write_check", reads=("plan", "staged", "kv"), writes=("write_check", "tail_bufs"),
                                atomic=("ring",))
        x = c.launcher.inputs
        for (lo, hi), g, loc, records in zip(self.spans, c.groups, x.loc, self.records):
            if hi > lo:
                self.ops.check_writes(out_cache_loc=loc, write_offsets=g.plan.write_offsets,
                                      num_requests=c.launcher.key[0], positions=x.positions, input_ids=x.input_ids,
                                      writer_ids=x.writer_ids, num_slots=g.num_slots, sources=self.sources[lo:hi],
                                      expected=self.expected[lo:hi], noted=self.noted[lo:hi], tags=self.tags[lo:hi],
                                      layers=self.layers[lo:hi], ring=c.ring, records=records,
                                      host_reads=self._host())
        self.noted.zero_()

    def _host(self) -> bool:
        """Whether values may be read on the host (the CPU outside a recorded step; ``SlotChecks._host``)."""
        return self.c.device.type == "cpu" and self.c.launcher.host_ops

    # -- reports ------------------------------------------------------------------------------------
    def describe(self, s: int) -> str:
        """'V of layer 3 (full group)' for source ``s`` (as the adapter named it, else by its buffer)."""
        if not 0 <= s < len(self.sources):
            return f"real-KV source {s}"
        group, buf = self.where[s]
        kind = (self.kind_of[s] or buf).upper()
        layer = self.layer_of[s]
        return f"{kind} of layer {layer} ({group} group)" if layer >= 0 else \
            f"{kind} real-KV source {s} ({group} group)"

    def attribution(self, row: list[int], step: int) -> dict:
        """What a report adds to a ``write_kv`` row: the writer (who reads this KV next: also the reader mode
        "abort" fails), the layer."""
        writer = row[5] if row[5] >= 0 else None
        # (the row holds the source's index among its group's: the tag names the group)
        s = self.spans[self.group_of_tag.get(row[0], 0)][0] + row[4]
        layer = self.layer_of[s] if 0 <= s < len(self.layer_of) and self.layer_of[s] >= 0 else row[6]
        return {"writer_request": writer, "writer_step": step, "reader_request": writer, "reader_position": row[2],
                "layer": layer, "source": self.describe(s)}

    def stats(self) -> dict:
        return {"write_check_notes": self.notes}


def _layer_source(rows: torch.Tensor, named: torch.Tensor, template: RealKvSource, what: str) -> RealKvSource:
    """A source over ``rows`` (another layer's cache rows) laid out as ``template`` lies over ``named`` (the rows of
    a fingerprinted layer of the same group): same dtype, row layout and strides; any number of rows (a layer's
    rows may be a view running to the end of one shared tensor). View ops only: a recorded step sees the source."""
    t = template.tensor
    if (rows.dtype != named.dtype or rows.shape[1:] != named.shape[1:] or rows.stride() != named.stride()
            or t.shape[0] != named.shape[0] or rows.device != named.device):
        raise ValueError(f"kv-canary: write_check_layers='all' wants {what} laid out like the group's fingerprinted "
                         f"layer's rows ({named.dtype}, rows {tuple(named.shape[1:])}, strides {named.stride()}, "
                         f"{named.device}), got {rows.dtype}, rows {tuple(rows.shape[1:])}, strides {rows.stride()}, "
                         f"{rows.device}")
    offset = rows.storage_offset() * rows.element_size()
    size, stride = (rows.shape[0], *t.shape[1:]), t.stride()
    if rows.element_size() == t.element_size():
        view = torch.as_strided(rows.view(t.dtype), size, stride, offset // t.element_size())
    else:  # (a view of another element size: re-pointed at the storage)
        view = torch.empty(0, dtype=t.dtype, device=rows.device).set_(rows.untyped_storage(),
                                                                      offset // t.element_size(), size, stride)
    return RealKvSource(view, page_size=template.page_size, num_bytes_per_token=template.num_bytes_per_token,
                        read_bytes=template.read_bytes)


def check_attribution(canary, row: list[int], step: int) -> dict:
    """What a report adds to a write-check or attention-metadata row (``Monitor._decode``)."""
    if row[7] & WRITE_KV:
        return canary.write_check.attribution(row, step)
    return canary.attention_check.attribution(row, step)
