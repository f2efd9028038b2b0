"""kv-canary inside vLLM V1: every forward of vLLM's own model runner, in every process (docs/vllm.md).

Turned on by the environment, not by code, because vLLM runs its model in processes user code never reaches:
``KV_CANARY_VLLM=1`` (and the ``KV_CANARY_*`` configuration) before vLLM starts; the package's
``vllm.general_plugins`` entry point (``plugin.register``) then hooks the model runner class in each process.

The modules, each one part of the canary around one vLLM forward:

- ``plugin``: the entry point, the version gate and the class hooks (``register`` / ``unregister``);
- ``settings``: what the environment asks for (mode, report directory, TP exchange interval), checked at start-up;
- ``layout``: the engine checks and the KV cache's slots and real-KV bytes (the CPU attention backend's layout);
- ``batch``: one forward from vLLM's attention metadata, slot mapping and input batch, each canary forward of it
  a ``runtime.engine.HostStep`` (the runtime's ``StepTables`` builds the ``ForwardBatch``);
- ``session``: one canary per model runner (per process and TP rank), the per-step hooks, the TP exchange;
- ``report``: rows naming vLLM's request ids, the report directory, ``collect(llm)`` and ``read_reports(dir)``;
- ``written_kv``: the write check's hooks at each fingerprinted layer's cache write (the K / V it computed);
- ``allocator``: vLLM's block pool as the allocator check reads it (one worker, ``KV_CANARY_VLLM_ALLOCATOR_INTERVAL``);
- ``engine``: a tiny engine for tests, the demo and benchmarks (random-weight model, ``LLM`` arguments, hooks on/off).

Example (in-process or multiprocess alike):
    >>> os.environ["KV_CANARY_VLLM"] = "1"                 # before vllm starts its engine
    >>> llm = LLM(model=path, ...); llm.generate(prompts, params)
    >>> report = collect(llm)                              # every worker's rows and stats
    >>> report.clean, [row["reader"] for row in report.violations]
"""

import importlib

# Loaded on first use: importing the package imports neither torch nor vllm (the plugin entry point is cheap).
_NAMES = {"register": "plugin", "unregister": "plugin", "enabled": "plugin", "check_version": "plugin",
          "SUPPORTED_RANGE": "plugin", "ENABLE_VARIABLE": "plugin", "REPORT_DIR_VARIABLE": "plugin",
          "TP_INTERVAL_VARIABLE": "plugin", "ALLOCATOR_INTERVAL_VARIABLE": "plugin", "collect": "report", "read_reports": "report", "VllmReport": "report",
          "SESSIONS": "session", "Settings": "settings"}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"kvcanary.integrations.vllm.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'kvcanary.integrations.vllm' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_NAMES))
