"""A varlen (per-request, causal) paged attention for transformers continuous batching.

transformers' ``paged|sdpa`` attends densely over every request's KV in the batch with an additive
mask of (batch tokens x all cached tokens): a batch of 64 requests at 8K context makes each prefill
chunk attend over half a million keys, hours of work for one run. Real engines use varlen kernels;
without flash-attn installed, this registers a varlen attention: the engine's own cache update
(``cache.update`` with its read/write indices, so kv-canary sees exactly the engine's KV writes),
then PyTorch's built-in flash kernel over packed sequences on CUDA, and a per-request SDPA loop on
the CPU (the reference the CUDA path is checked against).

Its name depends on the transformers version (``register`` returns it). 5.17 takes any ``paged|``
name and passes the cache to the attention, which updates it. From 5.18 the layer updates the cache
itself before the attention and continuous batching accepts only ``sdpa``, ``paged|eager`` or a name
containing "flash": the function is registered as ``kvc_flash_varlen`` (no version digit, so
transformers builds no dense mask and keeps its flash-only decode fast path, which would hand the
KV write to the attention, off). ``set_attn_implementation`` would look for a flash kernel of that
name to download, so ``use`` sets the model's config field instead.

    from kvcanary.bench.varlen_attention import use
    use(model)  # registers it and switches the model to it
"""

from __future__ import annotations

import torch

NAME = "paged|kvc_varlen"  # transformers 5.17
NAME_SECTORS = "kvc_flash_varlen"  # transformers 5.18 and later


def _per_request(q, k, v, cu_q, cu_k, scale):
    """Causal attention per request, aligned bottom-right (the new tokens are the last keys)."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ki = k[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        vi = v[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
        lq, lk = qi.shape[1], ki.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        out = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """q (Tq, H, D), k/v (Tk, Hkv, D) packed; bottom-right causal per request; (Tq, H, D)."""
    if q.is_cuda:
        # Flash supports grouped KV heads natively and aligns the causal mask bottom-right.
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]
    return _per_request(q, k, v, cu_q, cu_k, scale)


def paged_varlen_forward(module, query, key, value, attention_mask, cache=None, cu_seq_lens_q=None,
                         cu_seq_lens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kwargs):
    if "max_length_q" in kwargs:
        # transformers 5.18+: the layer already wrote and read back its KV (cache.update(kwargs=)), which also
        # picked this layer type's key lengths
        max_seqlen_q, max_seqlen_k = kwargs["max_length_q"], kwargs["max_length_k"]
        if kwargs.get("block_table") is not None:
            raise ValueError(f"{NAME_SECTORS} reads the KV the cache update returns, got a decode fast-path batch "
                             "(block_table); pass ContinuousBatchingConfig(max_blocks_per_request=0)")
        key, value = (x.squeeze(0).transpose(0, 1) for x in (key, value))  # (the layer's [1, heads, tokens, dim])
    elif cache is None:
        raise ValueError(f"{NAME} needs the paged cache that continuous batching passes")
    else:
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                  read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    if isinstance(cu_seq_lens_k, dict):
        layer_type = "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
    q = query.transpose(1, 2).squeeze(0).contiguous()
    out = varlen(q, key.contiguous(), value.contiguous(), cu_seq_lens_q.to(torch.int32),
                 cu_seq_lens_k.to(torch.int32), int(max_seqlen_q), int(max_seqlen_k), module.scaling)
    return out, None


def register() -> str:
    """Register the attention for the installed transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import cache as cb_cache

    name = NAME_SECTORS if hasattr(cb_cache.PagedAttentionCache, "perform_cache_copy") else NAME
    AttentionInterface.register(name, paged_varlen_forward)
    return name


def use(model) -> str:
    """Register the varlen attention for the installed transformers and switch ``model`` to it; returns its name."""
    name = register()
    if name == NAME:
        model.set_attn_implementation(name)
    else:
        # (a valid switch first prepares the model as for any attention; the name is then set on the config,
        # which the layers read per forward and continuous batching checks when it starts)
        model.set_attn_implementation("sdpa")
        model.config._attn_implementation = name
    return name


def self_check(device: torch.device) -> float:
    """Largest difference between the CUDA kernel and the per-request loop on a small random batch."""
    g = torch.Generator(device="cpu").manual_seed(0)
    lq, lk = [3, 1, 17], [40, 9, 17]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(sum(lq), 8, 64, generator=g).to(device, torch.bfloat16)
    k = torch.randn(sum(lk), 2, 64, generator=g).to(device, torch.bfloat16)
    v = torch.randn(sum(lk), 2, 64, generator=g).to(device, torch.bfloat16)
    fast = varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), 0.125).float()
    ref = _per_request(q.float(), k.float(), v.float(), cu_q, cu_k, 0.125)
    return float((fast - ref).abs().max())
