"""Misuse is a clear error at start-up, never an unguarded run: bad settings where vLLM loads its plugins, an engine
the canary cannot guard exactly where vLLM allocates its KV cache."""

import pytest

from kvcanary.integrations.vllm import engine, plugin
from kvcanary.integrations.vllm.layout import probe_rows
from kvcanary.integrations.vllm.settings import Settings


@pytest.mark.parametrize("env, message", [
    ({"KV_CANARY_MODE": "loud"}, "KV_CANARY_MODE must be one of"),
    ({"KV_CANARY_INJECT": "kv=0.1"}, "KV_CANARY_INJECT must be unset on vLLM"),
    ({"KV_CANARY_VLLM_TP_INTERVAL": "-2"}, "KV_CANARY_VLLM_TP_INTERVAL must be an integer >= 0, got '-2'"),
    ({"KV_CANARY_VLLM_TP_INTERVAL": "often"}, "KV_CANARY_VLLM_TP_INTERVAL must be an integer >= 0, got 'often'"),
    ({"KV_CANARY_WRITE_CHECK_LAYERS": "all"}, "KV_CANARY_WRITE_CHECK_LAYERS must be 'fingerprinted' on vLLM, got 'all'"),
])
def test_bad_settings_are_refused(env, message):
    with pytest.raises(ValueError, match="^kv-canary: " + message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_an_unwritable_report_directory_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="KV_CANARY_VLLM_REPORT_DIR must be a directory this process can create"):
        Settings.from_env({"KV_CANARY_VLLM_REPORT_DIR": str(blocker / "reports")})


def test_register_refuses_bad_settings_and_a_bad_switch(monkeypatch):
    with engine.guarded(False):
        monkeypatch.setenv("KV_CANARY_VLLM", "1")
        monkeypatch.setenv("KV_CANARY_MODE", "loud")
        with pytest.raises(ValueError, match="got 'loud'"):
            plugin.register()
        assert not plugin.installed()  # (nothing half-installed)
        monkeypatch.setenv("KV_CANARY_VLLM", "maybe")
        with pytest.raises(ValueError, match="KV_CANARY_VLLM must be a boolean"):
            plugin.register()
        monkeypatch.setenv("KV_CANARY_VLLM", "0")
        plugin.register()
        assert not plugin.installed()  # off: vLLM runs exactly as without the package


@pytest.mark.parametrize("version, ok", [("0.32.0", True), ("0.32.3+cpu", True), ("0.31.2", False), ("0.33.0", False)])
def test_the_version_gate(version, ok):
    if ok:
        assert plugin.check_version(version) == version
    else:
        with pytest.raises(RuntimeError, match=f"vLLM must be >=0.32,<0.33 .* got {version}"):
            plugin.check_version(version)


def test_an_engine_the_canary_cannot_guard_does_not_start(model_dir):
    with engine.guarded(True), pytest.raises(Exception, match="kv-canary: the vLLM engine must have token-id prompts"):
        engine.start(model_dir, num_blocks=32, enable_prompt_embeds=True)


def test_separate_v_records_need_token_rows_of_k(model_dir):
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = getattr(torch, engine.DTYPE)
    isa = _get_attn_isa(dtype, 32, 32)
    k_rows, _ = probe_rows(isa, dtype, 32, 32, "auto")
    with engine.guarded(True, KV_CANARY_CHECK_V="1"):
        if k_rows:  # (a kernel that keeps K in rows: V records are fine)
            engine.stop(engine.start(model_dir, num_blocks=32))
            return
        with pytest.raises(Exception, match=f"KV_CANARY_CHECK_V=1 .* got K stored transposed by ISA '{isa}'"):
            engine.start(model_dir, num_blocks=32)


@pytest.mark.parametrize("world, backend", [(2, "mp"), (1, "mp")])
def test_mode_abort_needs_the_scheduler_in_the_worker_process(world, backend):
    from types import SimpleNamespace

    from kvcanary.integrations.vllm.session import _check_abort

    runner = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world, distributed_executor_backend=backend))
    with pytest.raises(ValueError, match=f"KV_CANARY_MODE=abort on vLLM needs the worker in the scheduler's process .* "
                                         f"world size {world} with backend '{backend}'"):
        _check_abort(runner)
    with pytest.raises(ValueError, match="KV_CANARY_VLLM_ALLOCATOR_INTERVAL on vLLM needs the worker"):
        _check_abort(runner, "KV_CANARY_VLLM_ALLOCATOR_INTERVAL")
    _check_abort(SimpleNamespace(parallel_config=SimpleNamespace(world_size=1, distributed_executor_backend="uni")))


def test_a_forward_that_raises_is_abandoned_and_its_unwritten_kv_is_reported(model_dir, prompts):
    """vLLM's model raises inside a guarded forward: the error reaches the caller unchanged and the canary's
    forward is abandoned (nothing stays open). vLLM's scheduler still counts the failed forward's tokens as
    computed, so the engine's next forward reads KV that was never written: the canary (not stuck on a forward
    left open, which would raise "a second before_forward") reports those reads, naming their readers."""
    from kvcanary import KvCanaryViolationError
    from kvcanary.integrations.vllm.session import session_of

    with engine.guarded(True, KV_CANARY_MODE="raise"):
        llm = engine.start(model_dir, num_blocks=32)
        try:
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            session = session_of(runner)
            model = runner.model
            calls = []

            def failing(*args, **kwargs):
                calls.append(1)
                raise RuntimeError("planted engine failure")

            model.forward = failing
            try:
                with pytest.raises(RuntimeError, match="planted engine failure"):
                    engine.generate(llm, prompts[:2], max_tokens=3)
            finally:
                del model.forward
            assert len(calls) == 1 and session.events["abandoned_forwards"] == 1
            assert session.canary._open is None and not session.in_step and not session.rows
            failed = {session.names.name(n) for n in range(1, len(session.names) + 1)}
            assert len(failed) == 2
            forwards = session.canary.step
            with pytest.raises(KvCanaryViolationError):
                engine.generate(llm, prompts[2:4], max_tokens=3)
            assert session.canary.step > forwards and session.rows
            # the failed requests' own unwritten KV, and the blocks of the 40-token system prompt the new ones share
            # with them (vLLM cached those blocks when it scheduled the failed forward): whichever forward reads
            # first raises, naming its readers
            readers = {r["reader"] for r in session.rows} - {None}
            assert readers and readers <= failed | set(session.names._numbers)
            # each row a read of a never-written slot (an empty record), or the chain-position assert of a write
            # that follows the unwritten tokens
            assert all(("verify_token" in r["reasons"] and r["stored_token"] == 0) or r["reasons"] == ["write_position"]
                       for r in session.rows)
            assert any("verify_token" in r["reasons"] for r in session.rows)
        finally:
            engine.stop(llm)
