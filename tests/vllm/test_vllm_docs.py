"""docs/vllm.md's Python example, as a user runs it: a fresh interpreter where the canary arrives through the
vllm.general_plugins entry point alone, the report through collective_rpc. (The engine core stays in that process:
a second one would add half a minute to the suite; the tensor-parallel test runs vLLM's worker processes.)"""

import os
import pathlib
import re
import subprocess
import sys

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
BLOCK = re.compile(r"<!-- vllm: [^>]+-->\s*\n```python\n(.*?)```", re.S)


def test_the_docs_example_runs_in_a_fresh_process():
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) == 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CANARY_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    done = subprocess.run([sys.executable, "-c", blocks[0]], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'guarded': True" in done.stdout and "'violations': 0" in done.stdout
