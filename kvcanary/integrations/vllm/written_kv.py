"""The vLLM side of the write check (docs/write_check.md): the K and V each fingerprinted layer hands its cache write.

vLLM's attention layer hands the K and V it computed (``[tokens, kv_heads, head_size]``, in the forward's token
order: the slot mapping's) to its backend's ``do_kv_cache_update`` (through the ``unified_kv_cache_update`` op),
which stores them through the slot mapping (the CPU backend: ``cpu_attn_reshape_and_cache``). ``WrittenKv`` wraps
that method on the backend instance of each layer a real-KV source covers and, before the store runs, notes the
rows of each covered head (``canary.write_check.note``). After the forward the canary compares each written
slot's bytes with what was noted, so a store that leaves wrong bytes, writes into the wrong cache or not at all is
a ``write_kv`` row at the forward that made it, naming the layer, the slot and the writer.

The wrapper looks the backend's method up at each call (a later patch of the class is what runs), and notes only
inside a guarded forward (vLLM's warm-up and profiling runs are not the canary's). A forward the session checks
as several canary forwards (``batch.waves``) hands each wave the notes of its own tokens (``WriteCheck.save`` /
``restore``). Not installed (one log line) where the store changes what the layer computed: a quantized cache
(``kv_cache_dtype`` other than "auto").
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvcanary")

METHOD = "do_kv_cache_update"


class WrittenKv:
    """The write check's hooks in one vLLM model runner (``install``; ``uninstall`` restores the backends)."""

    def __init__(self, runner, layout, canary, picks):
        """``picks``: ``(layer, head, kind)`` per real-KV source, with the sources (``KvLayout.real_kv_picks``
        paired with the pool's sources, K buffers then V buffers)."""
        self.canary = canary
        self.live = False  # inside a guarded forward (Session.guard_forward)
        self.max_tokens = canary.write_check.expected.shape[1]
        by_layer: dict[int, list] = {}
        for (layer, head, kind), src in picks:
            by_layer.setdefault(layer, []).append((src, head, kind))
        ctx = runner.compilation_config.static_forward_context
        self._undo: list[tuple[object, object]] = []  # (backend instance, its own attribute before: None if none)
        for layer, todo in by_layer.items():
            impl = ctx[layout.layer_names[layer]].impl
            if not hasattr(impl, METHOD):
                raise ValueError(f"kv-canary: the vLLM write check needs the attention backend's {METHOD}, got "
                                 f"{type(impl).__name__} without one for layer {layout.layer_names[layer]}")
            own = impl.__dict__.get(METHOD)  # (an instance attribute set before ours: it runs, not the class's)
            self._undo.append((impl, own))
            setattr(impl, METHOD, self._wrap(impl, own, layer, todo))

    def _wrap(self, impl, own, layer: int, todo: list):
        def do_kv_cache_update(attn_layer, key, value, kv_cache, slot_mapping):
            if self.live and key is not None and value is not None:
                n = min(int(key.shape[0]), self.max_tokens)  # (rows past the live tokens are never compared)
                for src, head, kind in todo:
                    rows = (key if kind == "k" else value)[:n, head]
                    self.canary.write_check.note(src, rows, layer=layer, kind=kind)
            store = own if own is not None else getattr(type(impl), METHOD).__get__(impl)
            return store(attn_layer, key, value, kv_cache, slot_mapping)

        return do_kv_cache_update

    def uninstall(self) -> None:
        while self._undo:
            impl, own = self._undo.pop()
            if own is None:
                impl.__dict__.pop(METHOD, None)
            else:
                setattr(impl, METHOD, own)


def install(runner, layout, canary, picks) -> WrittenKv | None:
    """The write check's hooks for this runner, or None where it is off (``KV_CANARY_WRITE_CHECK=0``, the canary
    off, no real-KV source) or cannot compare (a quantized cache: logged)."""
    if not canary.write_check.on or not picks:
        return None
    cache_dtype = getattr(runner.cache_config, "cache_dtype", "auto")
    if cache_dtype != "auto":
        log.info("kv_canary: the write check is off on vLLM's %r KV cache (the store converts what the layer "
                 "computed)", cache_dtype)
        return None
    return WrittenKv(runner, layout, canary, picks)
