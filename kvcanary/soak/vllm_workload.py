"""Seeded clean workloads for vLLM: what each ``kvcanary soak --engine vllm`` workload runs.

A workload is a batch of requests through one of a few engine set-ups (``ENGINES``): the soak keeps one engine
of each set-up without the canary and one with it for the whole campaign (starting an engine costs seconds,
a tensor-parallel one about a hundred here), so every workload's requests meet the prefix cache as earlier
workloads left it, alike in both engines. A seed names a workload exactly (one ``random.Random`` seeded with a
string made of it); nothing here imports torch or vLLM.

Features a workload may draw (names as the summary counts them):
  prefix-caching / no-prefix-caching   the engine's automatic prefix caching on or off
  shared-system-prompt   requests that open with a system prompt of one or two whole blocks (prefix hits)
  exact-cached-prefix    a request whose prompt is exactly an earlier request's whole-block system prompt
                         (vLLM matches all of it and computes the last token again)
  identical-prompts      one prompt sent two or three times
  chunked-prefill        a prompt longer than the engine's token budget per step
  tight-pool             more KV than the pool holds at once: preemption by recompute
  staggered-arrivals     requests arriving at later engine steps, while others run
  tp-1 / tp-2            tensor parallelism
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

VOCAB = 512
BLOCK = 32
# name: engine settings (vllm_drive.make_llm keywords). Few on purpose: each is started twice per campaign.
ENGINES: dict[str, dict] = {
    "tp1-prefix-roomy": dict(enable_prefix_caching=True, num_gpu_blocks_override=64, max_num_batched_tokens=256),
    "tp1-prefix-tight": dict(enable_prefix_caching=True, num_gpu_blocks_override=12, max_num_batched_tokens=64),
    "tp1-noprefix-tight": dict(enable_prefix_caching=False, num_gpu_blocks_override=12, max_num_batched_tokens=96),
    "tp1-noprefix-roomy": dict(enable_prefix_caching=False, num_gpu_blocks_override=64, max_num_batched_tokens=512),
    "tp2-prefix-tight": dict(enable_prefix_caching=True, num_gpu_blocks_override=14, max_num_batched_tokens=64,
                             tensor_parallel_size=2),
}
ENGINE_WEIGHTS = {"tp1-prefix-roomy": 3, "tp1-prefix-tight": 3, "tp1-noprefix-tight": 2, "tp1-noprefix-roomy": 1,
                  "tp2-prefix-tight": 1}
SYSTEM_PROMPTS = 4  # distinct system prompts across a campaign: later workloads hit earlier ones' blocks


@dataclass(frozen=True)
class VllmWorkload:
    """One vLLM workload: the engine set-up it runs on, its requests and what it was drawn to exercise."""

    seed: int
    engine: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    steps: tuple[int, ...]  # the engine step each request arrives at
    features: tuple[str, ...]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompts"] = [list(p) for p in self.prompts]
        d["engine_settings"] = ENGINES[self.engine]
        return d


def system_prompt(k: int, blocks: int) -> list[int]:
    """System prompt ``k`` of ``blocks`` whole blocks (the same in every workload that draws it)."""
    return [(31 * k + 17 * i + 5) % (VOCAB - 1) + 1 for i in range(blocks * BLOCK)]


def make_vllm_workload(seed: int) -> VllmWorkload:
    """Workload ``seed`` (>= 0)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"kv-canary: workload seed must be an int >= 0, got {seed!r}")
    rng = random.Random(f"kvcanary-vllm-soak-{seed}")
    engine = rng.choices(list(ENGINE_WEIGHTS), weights=list(ENGINE_WEIGHTS.values()))[0]
    settings = ENGINES[engine]
    tight = settings["num_gpu_blocks_override"] < 20
    max_len = (settings["num_gpu_blocks_override"] - 1) * BLOCK
    n = rng.randint(2, 6)
    features = {"prefix-caching" if settings["enable_prefix_caching"] else "no-prefix-caching",
                f"tp-{settings.get('tensor_parallel_size', 1)}"}
    system = None
    if rng.random() < 0.6:
        system = system_prompt(rng.randrange(SYSTEM_PROMPTS), rng.choice((1, 2)))
        features.add("shared-system-prompt")
    prompts: list[list[int]] = []
    for _ in range(n):
        tail = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 120))]
        prompts.append((system + tail) if system is not None and rng.random() < 0.8 else tail)
    if system is not None and rng.random() < 0.4:
        prompts[rng.randrange(n)] = list(system)
        features.add("exact-cached-prefix")
    if rng.random() < 0.25:
        k = rng.randrange(n)
        for _ in range(rng.randint(1, 2)):
            prompts.append(list(prompts[k]))
        features.add("identical-prompts")
    max_tokens = [rng.choice((4, 12, 24, 48)) for _ in prompts]
    # every request fits the engine on its own (vLLM refuses longer ones)
    for i, p in enumerate(prompts):
        if len(p) + max_tokens[i] > max_len:
            prompts[i] = p[: max(1, max_len - max_tokens[i] - 1)]
    steps = [0] * len(prompts)
    if rng.random() < 0.6:
        steps = sorted(rng.randint(0, 12) for _ in prompts)
        features.add("staggered-arrivals")
    if max(map(len, prompts)) > settings["max_num_batched_tokens"]:
        features.add("chunked-prefill")
    need = sum(-(-(len(p) + m) // BLOCK) for p, m in zip(prompts, max_tokens))
    if tight and need > settings["num_gpu_blocks_override"] - 1:
        features.add("tight-pool")
    return VllmWorkload(seed, engine, tuple(map(tuple, prompts)), tuple(max_tokens), tuple(steps),
                        tuple(sorted(features)))
