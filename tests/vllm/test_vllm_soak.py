"""``kvcanary soak --engine vllm``'s CI slice: a few workloads on one engine set-up (docs/soak.md), a campaign with a
planted vLLM bug that must fail, and the workload generator's determinism."""

import json
import os
import subprocess
import sys

from kvcanary.soak import describe, run_campaign
from kvcanary.soak.vllm_workload import ENGINES, make_vllm_workload

# seeds 5-7 draw the tight set-up with prefix caching: chunked prefill, identical prompts, an exact cached prefix,
# preemption (one engine pair for the three)
SEEDS = (5, 3)


def test_a_few_clean_vllm_workloads_report_nothing_and_generate_the_same_tokens():
    s = run_campaign("vllm", SEEDS[1], SEEDS[0])
    assert s["ok"], s["findings"]
    assert s["violations"] == 0 and s["token_mismatches"] == 0 and s["greedy_workloads_compared"] == 3
    for feature in ("chunked-prefill", "exact-cached-prefix", "identical-prompts", "tight-pool", "prefix-caching"):
        assert s["features"].get(feature), (feature, s["features"])
    assert s["events"]["guarded_forwards"]["workloads"] == 3
    assert s["events"]["prefix_hits"]["total"] > 0 and s["events"]["chunked_steps"]["total"] > 0


def test_a_vllm_campaign_with_a_planted_bug_fails():
    s = run_campaign("vllm", 1, 5, bug="chunk-skips-a-token")
    assert not s["ok"] and s["violations"] > 0 and s["planted_bug"] == "chunk-skips-a-token"
    assert "--bug chunk-skips-a-token" in s["findings"][0]["replay"]


def test_vllm_workloads_are_deterministic_and_cover_every_set_up():
    ws = [make_vllm_workload(s) for s in range(300)]
    assert {w.engine for w in ws} == set(ENGINES)
    features = {f for w in ws for f in w.features}
    assert {"tp-1", "tp-2", "no-prefix-caching", "staggered-arrivals", "tight-pool", "exact-cached-prefix"} <= features
    code = "from kvcanary.soak.vllm_workload import make_vllm_workload as m; print(m(11).to_dict())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.strip()
    assert other == str(make_vllm_workload(11).to_dict())
    assert json.dumps(describe("vllm", 11), default=str)
