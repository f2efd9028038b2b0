"""A shadow of what vLLM's attention really reads: the judge of the planted vLLM bugs, independent of the canary.

The canary checks KV through its own records, hashes and kernels; a planted bug's verdict must not rest on
them. This oracle keeps its own plain-Python shadow of vLLM's paged KV, one entry per slot, and judges each
forward of vLLM's model runner from the metadata attention is really given (the CPU backend's
``slot_mapping``, ``block_table``, ``seq_lens`` and ``query_start_loc``):

- a write (slot mapping entry ``s`` of token ``j``) makes ``s`` hold the content key of the writing request's
  true token sequence up to that position: ``key(tokens[0..p])``, chained over the request's prompt and the
  tokens it generated (and its LoRA adapter, which changes the KV), with the KV bytes the token's layers
  computed: in the first and the last layer, the K and V each hands its cache write, stored by the backend's
  own cache-write method as it was when the oracle was installed into a scratch block (a store that leaves
  other bytes in the slot is then a wrong read of that slot, whatever the records say);
- a read (every position ``p < seq_len`` of every request, through its block table row, as the attention
  kernel gathers them) is right when the slot holds the reader's own ``key(tokens[0..p])`` and the bytes
  written with it. Anything else is a *wrong read*: never written, another content, bytes that changed
  since their write (a zeroing, a stale write, a flip), or content computed from wrong reads (taint).

The truth comes from the request, not from the engine's bookkeeping: each request's prompt as submitted and
the tokens it generated. A bug whose oracle count is zero under its workload made attention read nothing
wrong there: it is reported as harmless, not counted as a detection.

Example (in the process that runs the model, e.g. vLLM's in-process engine):
    >>> oracle = ShadowOracle(runner); oracle.install(); ...; oracle.uninstall(); oracle.summary()
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ANCHOR = 0x5EED  # (the seed of every request's key chain, with its LoRA adapter)


@dataclass
class WrongRead:
    """One slot attention read that did not hold what the reading request expects."""

    forward: int
    request_id: str
    position: int
    slot: int
    why: str

    def line(self) -> str:
        return (f"forward {self.forward}: request {self.request_id} position {self.position} read slot {self.slot}: "
                f"{self.why}")


@dataclass
class _Record:
    key: int
    position: int
    writer: str
    forward: int


@dataclass
class ShadowOracle:
    """The shadow of one vLLM model runner's KV (its rank's shard under tensor parallelism)."""

    runner: object
    forwards: int = 0
    reads: int = 0
    writes: int = 0
    wrong: list[WrongRead] = field(default_factory=list)
    _records: dict = field(default_factory=dict)
    _bytes: dict = field(default_factory=dict)
    _keys: dict = field(default_factory=dict)
    _orig: object = None
    error: str = ""
    _stores: list = field(default_factory=list)  # this forward's cache writes of the first and last layer
    _impls: list = field(default_factory=list)  # (backend instance, its own attribute before the oracle's)

    # --- installation -------------------------------------------------------------------------------------
    def install(self) -> "ShadowOracle":
        """Wrap this runner instance's ``_model_forward`` (an instance attribute; ``uninstall`` removes it)."""
        if self._orig is not None:
            raise RuntimeError("kv-canary: the shadow oracle is already installed on this runner")
        runner = self.runner
        self._orig = orig = runner._model_forward

        def _model_forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            try:
                self.after_forward(kwargs.get("input_ids", args[0] if args else None),
                                   kwargs.get("positions", args[1] if len(args) > 1 else None))
            except Exception as e:  # the oracle's own failure must not pass for the engine's
                self.error = f"{type(e).__name__}: {e}"
                raise
            return out

        runner._model_forward = _model_forward
        self._watch_stores()
        return self

    def _watch_stores(self) -> None:
        """Keep what the first and the last layer hand their cache write (``do_kv_cache_update``) each forward,
        and that method as it is now (``_expected_bytes`` stores with it: a bug planted later is not in it)."""
        caches = [c.data_ptr() for c in self._caches()]
        for layer in attention_layers(self.runner):
            if not hasattr(layer.kv_cache, "data_ptr") or layer.kv_cache.data_ptr() not in caches:
                continue
            impl, which = layer.impl, caches.index(layer.kv_cache.data_ptr())
            own = vars(impl).get("do_kv_cache_update")  # (another wrapper of this instance: it runs, as before)
            self._impls.append((impl, own))
            # the backend's own method, no wrapper of this instance (the canary's notes nothing here)
            pristine = getattr(type(impl), "do_kv_cache_update").__get__(impl)
            impl.do_kv_cache_update = self._store_hook(impl, own, pristine, which)

    def _store_hook(self, impl, own, pristine, which: int):
        def do_kv_cache_update(attn, key, value, kv_cache, slot_mapping):
            self._stores.append((which, pristine, attn, key.clone(), value.clone(), slot_mapping.clone()))
            run = own if own is not None else getattr(type(impl), "do_kv_cache_update").__get__(impl)
            return run(attn, key, value, kv_cache, slot_mapping)

        return do_kv_cache_update

    def uninstall(self) -> None:
        if self._orig is not None:
            vars(self.runner).pop("_model_forward", None)
            self._orig = None
        while self._impls:
            impl, own = self._impls.pop()
            if own is None:
                vars(impl).pop("do_kv_cache_update", None)
            else:
                impl.do_kv_cache_update = own

    def summary(self) -> dict:
        return {"forwards": self.forwards, "reads": self.reads, "writes": self.writes,
                "wrong_reads": len(self.wrong), "first": [w.line() for w in self.wrong[:3]]}

    # --- the truth ----------------------------------------------------------------------------------------
    def _tokens(self, rid: str) -> list[int]:
        st = self.runner.requests[rid]
        return list(st.prompt_token_ids or []) + [t for t in st.output_token_ids if t >= 0]

    def _chain(self, rid: str, toks: list[int]) -> list[int]:
        """key(tokens[0..p]) for every known position p of request ``rid``, extended as it generates."""
        keys, seen = self._keys.setdefault(rid, ([], []))
        if seen and (len(seen) > len(toks) or seen[-1] != toks[len(seen) - 1]):
            keys.clear()  # (another request under a reused id)
            seen.clear()
        if not keys:
            st = self.runner.requests[rid]
            lora = getattr(getattr(st, "lora_request", None), "lora_int_id", 0) or 0
            keys.append(hash((_ANCHOR, lora)))
        for t in toks[len(seen):]:
            keys.append(hash((keys[-1], t)))
            seen.append(t)
        return keys[1:]

    # --- one forward ---------------------------------------------------------------------------------------
    def _metadata(self):
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if isinstance(meta, list):  # micro-batches: not used on the CPU
            meta = meta[0]
        name = next(iter(meta))
        return name, meta[name]

    def _slot_bytes(self, slots):
        """The K and V bytes of ``slots`` in the first and last layer: ``[2 layers, n, bytes of a token]``.

        The CPU backend lays a block out per ISA (tiled for AMX): which elements of a block one token's
        K and V occupy is learned once, by writing each offset of a scratch block through the layer's own
        cache update (``_token_elements``)."""
        import torch

        idx = self._token_elements()
        s = torch.as_tensor(slots, dtype=torch.long)
        B = idx.shape[0]
        out = [c.reshape(c.shape[0], -1)[(s // B)[:, None], idx[s % B]] for c in self._caches()]
        return torch.stack(out)

    def _token_elements(self):
        return token_elements(self.runner)

    def _caches(self):
        kv = [c for c in self.runner.kv_caches if c is not None]
        return [kv[0], kv[-1]] if len(kv) > 1 else kv[:1]

    def after_forward(self, input_ids, positions) -> None:
        """Judge the forward that just ran (its writes, then every slot its attention read)."""
        if not self.runner.kv_caches:
            return
        _, m = self._metadata()
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        rids = list(batch.req_ids[:num_reqs])
        if num_reqs == 0 or getattr(m, "block_table", None) is None:
            return
        self.forwards += 1
        f = self.forwards
        B = self._caches()[0].shape[2]
        n = int(m.num_actual_tokens)
        qsl = m.query_start_loc[: num_reqs + 1].tolist()
        seq_lens = m.seq_lens[:num_reqs].tolist()
        table = m.block_table[:num_reqs].tolist()
        slots = m.slot_mapping[:n].tolist()
        ids = input_ids[:n].tolist()
        pos = positions[:n].tolist()
        # writes: what each written slot now holds
        written: dict[int, list[int]] = {}
        for i, rid in enumerate(rids):
            start = seq_lens[i] - (qsl[i + 1] - qsl[i])
            toks = self._tokens(rid)
            chain = self._chain(rid, toks)
            for k, j in enumerate(range(qsl[i], qsl[i + 1])):
                s = slots[j]
                if s < 0:
                    continue
                p, right = pos[j], pos[j] == start + k
                right = right and p < len(toks) and toks[p] == ids[j]
                key = chain[p] if right else hash(("wrong-input", rid, p, ids[j]))
                self._records[s] = _Record(key, p, rid, f)
                written.setdefault(i, []).append(s)
                self.writes += 1
        if written:
            every = sorted({s for ss in written.values() for s in ss})
            want = self._expected_bytes(every)
            for k, s in enumerate(every):
                self._bytes[s] = want[:, k].clone()
        self._stores.clear()
        # reads: every position < seq_len of every request, through its block table row
        bad_requests = set()
        for i, rid in enumerate(rids):
            L, chain = seq_lens[i], self._chain(rid, self._tokens(rid))
            read = [table[i][p // B] * B + p % B for p in range(L)]
            self.reads += L
            if not read:
                continue
            now = self._slot_bytes(read)
            for p, s in enumerate(read):
                why = self._judge(chain, p, s, now[:, p])
                if why:
                    self.wrong.append(WrongRead(f, rid, p, s, why))
                    bad_requests.add(i)
        # content computed from wrong reads is wrong content (later layers mix the whole context)
        for i in bad_requests:
            for s in written.get(i, ()):
                r = self._records[s]
                self._records[s] = _Record(hash(("tainted", r.key)), r.position, r.writer, f)

    def _expected_bytes(self, slots: list[int]):
        """``[2 layers, n, bytes of a token]`` as ``_slot_bytes`` of ``slots`` (sorted, distinct): the bytes each
        written slot must hold, what this forward's cache writes of the first and last layer handed over, stored by
        the pristine write method into a scratch block at the slot's offset. A layer whose write did not reach the oracle (none this forward):
        the slot's bytes as they are (the truth of the records alone)."""
        import torch

        got = self._slot_bytes(slots)
        idx = self._token_elements()
        B = idx.shape[0]
        want = torch.as_tensor(slots, dtype=torch.long)
        for which, pristine, attn, key, value, slot_mapping in self._stores:
            cache = self._caches()[which]
            sm = slot_mapping.to(torch.long)
            rows = torch.nonzero(torch.isin(sm, want)).flatten()  # (the tokens that wrote one of ``slots``)
            if not rows.numel():
                continue
            s, n = sm[rows], rows.numel()
            scratch = torch.zeros((n,) + tuple(cache.shape[1:]), dtype=cache.dtype)
            pristine(attn, key[rows], value[rows], scratch, torch.arange(n) * B + s % B)
            at, order = torch.searchsorted(want, s), torch.arange(n)
            # (a slot two tokens wrote holds the later one's bytes)
            last = torch.full((want.numel(),), -1, dtype=torch.long).scatter_reduce(0, at, order, reduce="amax")
            keep = last[at] == order
            got[which, at[keep]] = scratch.reshape(n, -1)[order[keep][:, None], idx[s[keep] % B]]
        return got

    def _judge(self, chain: list[int], p: int, s: int, now) -> str:
        import torch

        rec = self._records.get(s)
        if rec is None:
            return "never written"
        if p >= len(chain):
            return "a position the request has no token for yet"
        if rec.key != chain[p]:
            return (f"holds position {rec.position} of request {rec.writer} (forward {rec.forward}), other content"
                    if rec.position != p else "holds other content at this position")
        if not torch.equal(now, self._bytes[s]):
            return (f"its KV bytes are not what request {rec.writer}'s layers computed at its write (forward "
                    f"{rec.forward}): stored wrong or changed since")
        return ""


_ELEMENTS: dict = {}


def attention_layers(runner) -> list:
    """The runner's attention layers that hold a KV cache, in vLLM's forward-context order."""
    ctx = runner.compilation_config.static_forward_context
    return [m for m in ctx.values() if getattr(m, "kv_cache", None) is not None and hasattr(m, "impl")]


def token_elements(runner):
    """``[block_size, elements]``: the flat element indices of a KV block that hold the token at each offset.

    The CPU backend lays a block out per ISA (K transposed on ``vec``, tiled on AMX): learned once per runner
    by writing each offset of a scratch block through the attention layer's own cache update."""
    import torch

    key = id(runner)
    if key in _ELEMENTS:
        return _ELEMENTS[key]
    layer = attention_layers(runner)[0]
    cache = next(c for c in runner.kv_caches if c is not None)
    _, heads, B, width = cache.shape
    scratch = torch.zeros((1, heads, B, width), dtype=cache.dtype)
    ones = torch.ones((1, heads, width // 2), dtype=cache.dtype)
    rows = []
    for o in range(B):
        scratch.zero_()
        # (the backend class's method: no wrapper of the instance sees the scratch block)
        type(layer.impl).do_kv_cache_update(layer.impl, layer, ones, ones, scratch, torch.tensor([o], dtype=torch.long))
        rows.append(torch.nonzero(scratch.reshape(-1)).reshape(-1))
    if len({len(r) for r in rows}) != 1 or len(rows[0]) != heads * width:
        raise RuntimeError(f"kv-canary: could not learn the CPU backend's KV block layout (elements per token "
                           f"{[len(r) for r in rows]}, expected {heads * width})")
    _ELEMENTS[key] = torch.stack(rows)
    return _ELEMENTS[key]
