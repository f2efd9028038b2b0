"""How vLLM V1's paged KV cache maps onto the canary, and what the integration refuses.

A canary slot is ``block_id * block_size + offset``: the index vLLM's slot mapping holds for the token's KV
write, and the address its block table gives a read. Block 0 is vLLM's null block (padding, blocks a sliding
window dropped): no live token may map to its slots, so they are the pool's reserved slots.

The real-KV bytes come from the CPU attention backend's cache (``CPU_ATTN``, layout ``LBHNC``): one tensor per
layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, read as ``[num_blocks, num_kv_heads,
2 * block_size, head_size]``: per block and head, ``block_size`` rows of K, then ``block_size`` rows of V. How a
token's values lie inside those rows depends on the kernel's ISA: with ``vec`` (AVX-512/AVX2) V is one row per
token but K is stored transposed (dimension-major), so one token's K bytes are not contiguous and a
``RealKvSource`` (contiguous bytes per slot) cannot address them. ``probe_rows`` writes one token through vLLM's
own cache-write op into a scratch block at start-up and finds which of K and V keep a token's values in one row;
the canary hashes only those (V, with ``vec``). With ``amx`` (bf16 on a CPU with AMX tiles, a block size that is
a multiple of 32) neither does: K lies in pairs of values across 16 tokens, V in single values across 2 tokens,
and ``probe_token_map`` finds where each of a token's values lands: the canary then hashes token-row copies of
the fingerprinted heads, refreshed from the cache after each forward (``mirror.RowMirror``). With tensor
parallelism each rank's cache holds its own heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcanary.ops.types import RealKvSource

SUPPORTED_BACKENDS = ("CPU_ATTN",)


@dataclass(frozen=True)
class KvLayout:
    """One KV-cache group of full attention: its blocks, its layers' cache tensors, and where its bytes are."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    layer_names: tuple[str, ...]
    caches: tuple[torch.Tensor, ...]  # per layer, [num_blocks, num_kv_heads, block_size, 2 * head_size]
    k_rows: bool = False  # one token's K is one row (probe_rows); False: K is not hashed
    v_rows: bool = False
    isa: str = ""
    # where neither is one row (the amx kernel): per kind (K, V), int64 [block_size * head_size], the place in the
    # head's K (V) span of a block of token t's value d at index t * head_size + d (probe_token_map); the canary
    # then hashes token-row copies of the fingerprinted heads (mirror.RowMirror)
    token_maps: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def mirrored(self) -> bool:
        """The real-KV sources are token-row copies refreshed from the cache (``mirror.RowMirror``)."""
        return self.token_maps is not None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def reserved_slots(self) -> tuple[int, ...]:
        """The null block's slots besides slot 0 (which the canary reserves anyway)."""
        return tuple(range(1, self.block_size))

    def head_source(self, layer: int, head: int, kv: str) -> RealKvSource:
        """The K (``kv="k"``) or V of one head of one layer, one token per slot."""
        t = self.caches[layer]
        rows = t.view(t.shape[0], -1)
        span = self.block_size * self.head_size
        start = head * 2 * span + (span if kv == "v" else 0)
        nbpt = self.head_size * t.element_size()
        return RealKvSource(rows[:, start:], page_size=self.block_size, num_bytes_per_token=nbpt, read_bytes=nbpt)

    def real_kv_picks(self, check_v: bool) -> tuple[tuple[tuple[int, int, str], ...], ...]:
        """(K buffer picks, V buffer picks): each ``(layer, head, kind)`` whose bytes a real-KV source hashes (``kind``
        "k" or "v": which rows of the head), at most four per buffer (the canary's limit), over the rows
        ``probe_rows`` found token-contiguous (``head_source`` makes each one's source).

        Without V buffers the K record hashes the first and the last layer, each of its first and last KV head
        (K where K rows are contiguous, else V), so a write or copy that misses a layer or a head changes it. With
        V buffers (only where K rows are contiguous), K records hash those layers' K and V records their V."""
        last_layer, last_head = len(self.caches) - 1, self.num_kv_heads - 1
        heads = sorted({0, last_head})
        layers = sorted({0, last_layer})
        pairs = [(layer, h) for layer in layers for h in heads][:4]
        if check_v:
            return tuple((layer, h, "k") for layer, h in pairs), tuple((layer, h, "v") for layer, h in pairs)
        k_rows, v_rows = (True, True) if self.mirrored else (self.k_rows, self.v_rows)
        if not (k_rows or v_rows):
            return (), ()
        first, last = ("k" if k_rows else "v"), ("v" if v_rows else "k")
        picks = [(0, h, first) for h in heads] + [(last_layer, h, last) for h in heads]
        return tuple(list(dict.fromkeys(picks))[:4]), ()


def probe_rows(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> tuple[bool, bool]:
    """(K rows, V rows): whether vLLM's CPU cache-write op (``cpu_attn_reshape_and_cache``, this ``isa``) puts one
    token's K (V) values in one contiguous row of ``head_size`` values at the token's offset in the block.

    Writes two tokens of nonzero values into a zeroed scratch cache of two blocks and two heads and compares the
    elements that changed with the row layout, per token, per head, per K and V."""
    from vllm import _custom_ops as ops

    heads = 2
    kv = torch.zeros(2, heads, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv.view(2, heads, 2 * block_size, head_size).chunk(2, dim=2)
    ok = {"k": True, "v": True}
    span = block_size * head_size
    for offset in (1, block_size - 2):
        kv.zero_()
        ones = torch.ones(1, heads, head_size, dtype=torch.float32 if dtype.itemsize == 4 else dtype)
        ops.cpu_attn_reshape_and_cache(ones.to(dtype), ones.to(dtype), key_cache, value_cache,
                                       torch.tensor([block_size + offset], dtype=torch.int64), isa,
                                       kv_cache_dtype=kv_cache_dtype)
        changed = set((kv.view(2, -1)[1] != 0).nonzero().flatten().tolist())
        if (kv.view(2, -1)[0] != 0).any():
            return False, False
        for h in range(heads):
            for which, base in (("k", h * 2 * span), ("v", h * 2 * span + span)):
                row = set(range(base + offset * head_size, base + (offset + 1) * head_size))
                region = {i for i in changed if base <= i < base + span}
                ok[which] = ok[which] and region == row
    return ok["k"], ok["v"]


def probe_token_map(isa: str, dtype: torch.dtype, block_size: int, head_size: int,
                    kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where vLLM's CPU cache-write op (``isa``) puts each value of each token of a block, for K and for V: per kind,
    int64 ``[block_size * head_size]``, the element of the head's K (V) span of the block holding token ``t``'s value
    ``d`` at index ``t * head_size + d``; None when some layout is not one place per value (a cache that converts
    what it stores, values that the dtype cannot hold exactly).

    Writes one token at each offset of a scratch block, its values ``1 .. head_size`` in K and in V, and reads where
    each value landed; nothing else of the scratch cache may change."""
    from vllm import _custom_ops as ops

    exact = {torch.bfloat16: 256, torch.float16: 2048}.get(dtype, 1 << 24)
    if head_size > exact or kv_cache_dtype != "auto":
        return None
    span = block_size * head_size
    kv = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
    values = torch.arange(1, head_size + 1, dtype=torch.float32).view(1, 1, head_size).to(dtype)
    maps = torch.full((2, span), -1, dtype=torch.int64)
    for t in range(block_size):
        kv.zero_()
        ops.cpu_attn_reshape_and_cache(values, values, key_cache, value_cache,
                                       torch.tensor([block_size + t], dtype=torch.int64), isa,
                                       kv_cache_dtype=kv_cache_dtype)
        if (kv[0] != 0).any():
            return None
        spans = kv[1].view(2, span).float()
        for which in range(2):
            where = spans[which].nonzero().flatten()
            got = spans[which][where].long() - 1  # the value index d each changed element holds
            if where.numel() != head_size or not torch.equal(got.sort().values, torch.arange(head_size)):
                return None
            maps[which, t * head_size + got] = where
    if (maps < 0).any() or any(int(m.unique().numel()) != span for m in maps):
        return None
    return maps[0].clone(), maps[1].clone()


def check_engine(runner, config=None) -> KvLayout:
    """The layout of ``runner`` (vLLM's ``GPUModelRunner`` after ``initialize_kv_cache``), or a clear error for
    an engine set-up the canary cannot guard exactly (raised at start-up, in the worker that loads the model)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    def refuse(what: str, got: object, hint: str = "") -> None:
        raise ValueError(f"kv-canary: the vLLM engine must have {what}, got {got}" + (f" ({hint})" if hint else ""))

    spec_cfg = getattr(runner, "speculative_config", None)
    if spec_cfg is not None:
        refuse("no speculative decoding (draft KV is written outside the guarded forward)",
               f"speculative method {getattr(spec_cfg, 'method', spec_cfg)!r}")
    pc = runner.parallel_config
    if pc.pipeline_parallel_size > 1:
        refuse("pipeline_parallel_size 1 (tensor parallelism is supported)", pc.pipeline_parallel_size)
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) > 1:
            refuse(f"{name} 1 (context-parallel KV shards split a request's positions)", getattr(pc, name))
    if getattr(runner, "uses_mrope", False):
        refuse("1-D positions", "an M-RoPE model (3-D positions)")
    mc = runner.model_config
    if mc.is_encoder_decoder:
        refuse("a decoder-only model", "an encoder-decoder model")
    if getattr(runner, "enable_prompt_embeds", False):
        refuse("token-id prompts", "enable_prompt_embeds=True (inputs without token ids)")
    if getattr(runner, "supports_mm_inputs", False):
        refuse("a text-only model", "a multimodal model (embeddings in place of token ids)")
    try:
        from vllm.distributed.kv_transfer import has_kv_transfer_group

        if has_kv_transfer_group():
            refuse("no KV connector", "a KV transfer connector (KV that arrives without canary records)")
    except ImportError:
        pass
    if getattr(runner, "lora_config", None) is not None and mc.get_vocab_size() >= 1 << 20:
        refuse("a vocabulary below 2**20 tokens with LoRA (records carry the adapter above the token id)",
               mc.get_vocab_size())
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        refuse("one KV-cache group", f"{len(groups)} groups ({[type(g.kv_cache_spec).__name__ for g in groups]})",
               "hybrid and sliding-window models are not supported")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None):
        refuse("full attention in its KV-cache group", f"{type(spec).__name__} (sliding_window="
               f"{getattr(spec, 'sliding_window', None)}, attention_chunk_size={getattr(spec, 'attention_chunk_size', None)})")
    backends = {g.backend.get_name() for g in runner.attn_groups[0]}
    if not backends <= set(SUPPORTED_BACKENDS):
        refuse(f"the attention backend {' or '.join(SUPPORTED_BACKENDS)} (whose KV layout the real-KV hash reads)",
               sorted(backends), "GPU backends are not measured: docs/vllm.md")
    num_blocks, block_size = runner.kv_cache_config.num_blocks, spec.block_size
    caches = []
    for name in groups[0].layer_names:
        t = runner.compilation_config.static_forward_context[name].kv_cache
        if not isinstance(t, torch.Tensor):
            refuse("one KV tensor per layer", f"{type(t).__name__} for layer {name}")
        want = (num_blocks, spec.num_kv_heads, block_size, 2 * spec.head_size)
        if tuple(t.shape) != want or not t.is_contiguous():
            refuse(f"the CPU backend's KV layout {want} (contiguous)",
                   f"{tuple(t.shape)} (contiguous={t.is_contiguous()}) for layer {name}")
        caches.append(t)
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        refuse("K and V of one head size", f"{spec.head_size} and {spec.head_size_v}")
    if spec.head_size * caches[0].element_size() % 16:
        refuse("head_size * KV element bytes a multiple of 16 (the real-KV hash reads 16-byte words)",
               f"{spec.head_size} x {caches[0].element_size()}")
    layer = runner.compilation_config.static_forward_context[groups[0].layer_names[0]]
    isa = getattr(layer, "isa", None)
    if not isinstance(isa, str):
        refuse("attention layers with the CPU kernel's ISA set", f"isa={isa!r}")
    cache_dtype = runner.cache_config.cache_dtype
    k_rows, v_rows = probe_rows(isa, caches[0].dtype, block_size, spec.head_size, cache_dtype)
    token_maps = None
    if config is not None and config.real_kv != "none" and not (k_rows or v_rows):
        # (the amx kernel: tokens interleaved; the canary hashes token-row copies of the fingerprinted heads)
        token_maps = probe_token_map(isa, caches[0].dtype, block_size, spec.head_size, cache_dtype)
        if token_maps is None:
            refuse("a KV layout with one row per token for K or V, or one place per value (what the real-KV hash "
                   "reads)", f"neither for ISA {isa!r} (KV cache dtype {cache_dtype!r})",
                   "set KV_CANARY_REAL_KV=none to guard without real-KV hashes")
        if config.sweep_interval:
            refuse("KV_CANARY_SWEEP_INTERVAL 0 with a layout the canary hashes through token-row copies (a sweep "
                   "reads slots no forward refreshed)", f"{config.sweep_interval} for ISA {isa!r}")
    if config is not None and config.check_v and not k_rows and token_maps is None:
        refuse("token rows of K for KV_CANARY_CHECK_V=1 (separate K and V records)",
               f"K stored transposed by ISA {isa!r}", "unset KV_CANARY_CHECK_V: the K record then hashes V bytes")
    return KvLayout(num_blocks, block_size, spec.num_kv_heads, spec.head_size, tuple(groups[0].layer_names),
                    tuple(caches), k_rows, v_rows, isa, token_maps)
