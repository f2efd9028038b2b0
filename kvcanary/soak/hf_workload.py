"""Seeded clean workloads for transformers continuous batching: what each soak workload runs.

A seed names a workload exactly: every choice below comes from one ``random.Random`` seeded with a
string made of the seed (string seeds hash the same in every process), and nothing here imports torch
or transformers, so a workload can be drawn, printed and compared without a model.

Features a workload may draw (names as the summary counts them):
  shared-system-prompt   requests that open with the same whole-block system prompt (prefix sharing)
  exact-cached-prefix    a request whose prompt is exactly an earlier request's whole-block system prompt
                         (the engine matches all of it and computes its last token again into the shared
                         block: an idempotent rewrite of a slot another request reads)
  identical-prompts      the same prompt sent two or three times
  parallel-sampling      num_return_sequences 2..4 (the engine forks a request's blocks)
  chunked-prefill        a token budget smaller than the longest prompt
  tight-pool             too few blocks for every request at once: soft resets (preemption)
  cpu-offload            a tight pool with a CPU swap pool: offloads and restores
  sliding-window         the hybrid model (one full and one sliding-window layer; block sharing off)
  greedy / sampled       greedy runs compare tokens with the run without the canary; sampled runs only
                         count violations
  block-size-N           the engine's block size (4 to 64: transformers 5.17 refuses blocks below 4)
  mla                    (``mla=True``: transformers 5.25+, which pages MLA latents) the DeepSeek-V3-shaped model
                         instead of Llama, drawn from a stream of its own: the seed draws everything else as without mla
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

VOCAB = 512  # the tiny models' vocabulary (kvcanary.demo.TINY_CONFIG)
BLOCK_SIZES = (4, 4, 8, 8, 16, 32, 64)
SLIDING_WINDOW = 8
MLA_SHARE = 0.4  # of the full-attention workloads, where mla=True
FEATURES = ("shared-system-prompt", "exact-cached-prefix", "identical-prompts", "parallel-sampling",
            "chunked-prefill", "tight-pool", "cpu-offload", "sliding-window", "greedy", "sampled")


@dataclass(frozen=True)
class HfWorkload:
    """One transformers workload; ``features`` lists what it was drawn to exercise."""

    seed: int
    model: str  # "llama" (full attention), "hybrid" (Qwen2 with a sliding-window layer) or "mla" (DeepSeek-V3)
    block_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int
    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: int
    num_return_sequences: int
    sampling: str  # "greedy" or "sampled"
    offload_blocks: int  # blocks of the CPU swap pool (0: none)
    canary_options: tuple[tuple[str, object], ...]
    features: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.sampling == "greedy"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompts"] = [list(p) for p in self.prompts]
        d["canary_options"] = dict(self.canary_options)
        d["features"] = list(self.features)
        return d


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def blocks_per_request(prompts, max_new: int, n: int, block_size: int, hybrid: bool) -> list[int]:
    """Blocks each prompt needs with its ``n - 1`` forks to generate ``max_new`` tokens (the pool's unit)."""
    bs = block_size
    per_request = [_blocks(len(p) + max_new, bs) + (n - 1) * (1 + _blocks(max_new, bs)) for p in prompts]
    if hybrid:
        # the sliding layer's group takes its blocks from the same pool: up to the window's, per sequence
        per_request = [b + n * min(_blocks(len(p) + max_new, bs), _blocks(SLIDING_WINDOW, bs) + 1)
                       for b, p in zip(per_request, prompts)]
    return per_request


def make_hf_workload(seed: int, mla: bool = False) -> HfWorkload:
    """The transformers workload of ``seed`` (see the module docstring for what it may contain); ``mla``: some
    full-attention workloads run the MLA model."""
    rng = random.Random(f"kvcanary-soak-hf-{seed}")
    tok = lambda: rng.randrange(1, VOCAB)  # noqa: E731
    hybrid = rng.random() < 0.2
    bs = rng.choice(BLOCK_SIZES)
    features: list[str] = ["sliding-window"] if hybrid else []
    # Prompt lengths scale with the block size so that prefixes span whole blocks and block edges,
    # but stay short enough that a workload runs well under a second on a CPU.
    q_len = lambda: rng.randint(1, max(2, min(2 * bs, 24)))  # noqa: E731
    system = [tok() for _ in range(rng.randint(1, 2 if bs <= 16 else 1) * bs)]
    prompts: list[list[int]] = []
    n_requests = rng.randint(2, 6)
    if rng.random() < 0.6:
        features.append("shared-system-prompt")
        prompts += [system + [tok() for _ in range(q_len())] for _ in range(rng.randint(2, 3))]
    exact = not hybrid and rng.random() < 0.4
    if exact:
        # The earlier request holds the system prompt's whole blocks in the prefix cache when the later
        # one, exactly that prompt, arrives; a budget of the earlier prompt's length prefills it alone.
        features.append("exact-cached-prefix")
        prompts.insert(0, system + [tok() for _ in range(rng.randint(1, bs))])
    while len(prompts) < n_requests:
        prompts.append([tok() for _ in range(rng.randint(1, 2 * bs + 3))])
    if exact:
        prompts.insert(rng.randint(1, len(prompts)), list(system))
    if rng.random() < 0.35:
        features.append("identical-prompts")
        twin = rng.choice(prompts)
        for _ in range(rng.randint(1, 2)):
            prompts.insert(rng.randint(1, len(prompts)), list(twin))
    n = rng.randint(2, 4) if rng.random() < 0.35 else 1
    if n > 1:
        features.append("parallel-sampling")
    sampling = "sampled" if rng.random() < 0.3 else "greedy"
    tight = rng.random() < 0.3
    max_new = rng.randint(8, 20) if tight else rng.randint(2, 10)
    longest = max(len(p) for p in prompts)
    budget = rng.choice((longest, 2 * longest, rng.randint(4, max(4, longest)), rng.randint(8, 64)))
    if exact and rng.random() < 0.5:
        budget = len(prompts[0])
    budget = max(4, budget)
    if budget < longest:
        features.append("chunked-prefill")
    # Blocks: every request and its forks at once (plenty), or little more than the largest one needs.
    per_request = blocks_per_request(prompts, max_new, n, bs, hybrid)
    offload = 0
    if tight:
        features.append("tight-pool")
        num_blocks = max(per_request) + 2 + rng.randint(0, 2)
        if not hybrid and rng.random() < 0.5:
            features.append("cpu-offload")
            offload = sum(per_request)
    else:
        num_blocks = sum(per_request) + 4 + rng.randint(0, 8)
    features.append(sampling)
    features.append(f"block-size-{bs}")
    options = (("sweep_interval", rng.choice((1, 2, 4, 8))), ("check_v", rng.random() < 0.3),
               ("real_kv", rng.choice(("partial", "partial", "all"))),
               ("allocator_check_interval", 1))  # (drawn from no rng: the seeds' workloads stay as they were)
    model = "hybrid" if hybrid else "llama"
    if mla and not hybrid and random.Random(f"kvcanary-soak-hf-mla-{seed}").random() < MLA_SHARE:
        model = "mla"
        features.append("mla")
    return HfWorkload(seed=seed, model=model, block_size=bs, num_blocks=num_blocks,
                      max_batch_tokens=budget, max_requests_per_batch=rng.choice((4, 8, 16)),
                      prompts=tuple(tuple(p) for p in prompts), max_new_tokens=max_new, num_return_sequences=n,
                      sampling=sampling, offload_blocks=offload, canary_options=options,
                      features=tuple(features))
