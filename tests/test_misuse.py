"""Misuse of the public API found by fuzzing: each is a clear ``kv-canary:`` error raised before any state
changes (or, for an option without effect, a one-line warning), never false violations, a canary stuck
with a forward open, stacked hooks, or a crashed interpreter.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch

from kvcanary import CanaryConfig, KvCanaryViolationError, SharedRowError, cli, ops
from kvcanary.format import RealKvMode
from kvcanary.ops import validate
from kvcanary.runtime import config as config_mod
from ops_harness import use_backend
from test_lifecycle import assert_same, batch_of, engine, state
from test_validation import CALL, good, src, t

BACKENDS = ["reference", "torch", "numba", "triton"]


def full_state(e) -> dict:
    """test_lifecycle's snapshot plus whether a forward is open."""
    out = state(e.canary)
    out["open"] = e.canary._open is None
    return out


# -- 1. the same request row twice in one forward ---------------------------------------------------
def test_duplicate_request_row_is_rejected_before_anything_changes():
    e = engine()
    e.add(2, [21, 22])
    before = full_state(e)
    # row 1 twice: the second request would plan from the first one's row and read what it never wrote
    batch = batch_of(e, rows=[1, 2, 1], prefix=[4, 0, 4], extend=[1, 2, 1], locs=[40, 41, 42, 43])
    with pytest.raises(ValueError, match=r"^kv-canary: forward batch req_pool_indices must be distinct rows for "
                                         r"real requests .*got row 1 at batch indices 0 and 2$") as info:
        e.canary.before_forward(batch)
    assert isinstance(info.value, SharedRowError) and (info.value.row, info.value.indices) == (1, (0, 2))
    assert_same(before, full_state(e))
    e.forward([(1, 1), (2, 2)])  # the canary still works: a correct forward is clean
    assert e.canary.flush() == []


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_repeated_padding_rows_are_accepted(backend):
    use_backend(backend)
    e = engine(backend=backend)
    e.add(2, [21, 22])
    # a forward padded to a bucket: two padding requests in row 0 after the real ones
    batch = batch_of(e, rows=[1, 0, 0], prefix=[4, 0, 0], extend=[1, 1, 1], locs=[40, 0, 0])
    e.rtt[1, 4] = 40
    e.canary.before_forward(batch)
    e.canary.after_forward(batch)
    assert e.canary.step == 2
    with pytest.raises(ValueError, match="distinct rows"):
        e.canary.before_forward(batch_of(e, rows=[2, 2, 0], prefix=[0, 0, 0], extend=[1, 1, 1], locs=[41, 42, 0]))
    assert e.canary._open is None


# -- 3. check_before_forward raising leaves no forward open -----------------------------------------
def test_check_before_forward_raise_leaves_the_canary_usable():
    e = engine(mode="raise", check_before_forward=True)
    e.canary.mark_ready()
    e.rtt[1, 1] = e.rtt[1, 2]  # a stale table entry: the next read of request 1 is wrong
    with pytest.raises(KvCanaryViolationError):
        e.forward([(1, 1)])
    assert e.canary._open is None and e.canary.step == 1  # the forward was abandoned, not left open
    e.add(2, [31, 32, 33])
    e.forward([(2, 3)])  # before_forward works again (no "second before_forward" error)
    e.forward([(2, 1)])
    assert e.canary.step == 3


# -- 2. and 5. attach: one live handle per engine, arguments named ----------------------------------
@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("transformers")
    from kvcanary.demo import build_tiny_model

    return build_tiny_model("cpu")


def hooks(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if callable(v)}


def test_second_attach_is_refused_and_detach_is_idempotent(tiny):
    from kvcanary.integrations.transformers import attach

    bare = hooks(tiny)
    first = attach(tiny)
    installed = hooks(tiny)
    with pytest.raises(RuntimeError, match=r"^kv-canary: attach model_or_manager must not be guarded already, got "
                                           r"a LlamaForCausalLM with a live handle <TransformersHandle at 0x[0-9a-f]+:"
                                           r" attached.*call its detach\(\) first$"):
        attach(tiny, mode="raise")
    assert hooks(tiny) == installed  # the refused call changed nothing
    first.detach()
    first.detach()  # a no-op
    assert hooks(tiny) == bare
    second = attach(tiny)
    live = hooks(tiny)
    first.detach()  # a stale handle never touches the live one's hooks
    assert hooks(tiny) == live != bare
    assert all(getattr(v, "kvcanary_handle", None) is second for v in hooks(tiny).values())
    second.detach()
    assert hooks(tiny) == bare


def test_attach_to_a_manager_a_model_handle_guards_is_refused(tiny):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvcanary.integrations.transformers import attach

    handle = attach(tiny)
    try:
        manager = tiny.init_continuous_batching(
            GenerationConfig(max_new_tokens=2, eos_token_id=-1),
            ContinuousBatchingConfig(block_size=4, num_blocks=16, use_async_batching=False, use_cuda_graph=False))
        installed = hooks(manager)
        with pytest.raises(RuntimeError, match="must not be guarded already"):
            attach(manager)
        assert hooks(manager) == installed
    finally:
        handle.detach()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(config="raise"), TypeError, r"^kv-canary: attach config must be a CanaryConfig or None, got str 'raise'"),
    (dict(max_context=-1), ValueError, r"^kv-canary: attach max_context must be an int >= 1 or None .*got -1$"),
    (dict(max_context=2.5), TypeError, r"^kv-canary: attach max_context must be an int >= 1 or None, got 2.5$"),
    (dict(token_oracle="yes"), TypeError, r"^kv-canary: attach token_oracle must be a bool \(True/False\), got 'yes'$"),
])
def test_attach_arguments_are_named(tiny, kwargs, exc, match):
    from kvcanary.integrations.transformers import attach

    bare = hooks(tiny)
    with pytest.raises(exc, match=match):
        attach(tiny, **kwargs)
    assert hooks(tiny) == bare


def test_attach_without_transformers_names_the_extra(monkeypatch):
    from kvcanary.integrations.transformers import attach

    monkeypatch.setitem(sys.modules, "transformers", None)  # the import now fails as if not installed
    with pytest.raises(ImportError, match=r"^kv-canary: attach needs the transformers package.*pip install "
                                          r"'kv-canary\[transformers\]'$"):
        attach(object())


@pytest.mark.parametrize("kwargs, option", [
    (dict(step_graphs=False, fused_steps=True), "fused_steps=True has no effect with step_graphs=False"),
    (dict(fused_steps=False, in_graph_waits=True), "in_graph_waits=True has no effect with fused_steps=False"),
    (dict(token_oracle=True, late_hooks=True), "late_hooks=True has no effect with token_oracle=True"),
    (dict(check_before_forward=True, late_hooks=True), "late_hooks=True has no effect with check_before_forward"),
])
def test_attach_options_without_effect_warn(tiny, kwargs, option):
    from kvcanary.integrations.transformers.reach import attach_with

    with pytest.warns(UserWarning, match=option):
        handle = attach_with(tiny, **kwargs)
    handle.detach()


def test_attach_options_with_effect_do_not_warn(tiny):
    from kvcanary.integrations.transformers.reach import attach_with

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach_with(tiny, step_graphs=True, fused_steps=True, late_hooks=True).detach()


def test_attach_keeps_to_ten_keywords_and_the_toggles_are_private(tiny):
    import inspect

    from kvcanary.integrations.transformers import TUNING_OPTIONS, attach, tuned

    params = inspect.signature(attach).parameters
    assert len(params) <= 10 and not set(params) & set(TUNING_OPTIONS)
    bare = hooks(tiny)
    with pytest.raises(TypeError, match="step_graphs"):
        attach(tiny, step_graphs=False)  # a toggle is not a user's keyword
    with pytest.raises(TypeError, match=r"^kv-canary: tuned got unknown toggles \['graphs'\]"):
        with tuned(graphs=False):
            pass
    with pytest.raises(TypeError, match=r"^kv-canary: attach step_graphs must be a bool"):
        with tuned(step_graphs="no"):
            pass
    assert hooks(tiny) == bare
    with tuned(step_graphs=False, timing=True):
        handle = attach(tiny)
    assert handle.options["step_graphs"] is False and handle.options["timing"] is True
    handle.detach()
    handle = attach(tiny)  # outside the block: the defaults again
    assert "step_graphs" not in handle.options
    handle.detach()


# -- 4. out structures of every op: checked from metadata before any kernel runs --------------------
def _shorter(x: torch.Tensor) -> torch.Tensor:
    return x[:-1].clone() if x.dim() == 1 else x[:, :-1].clone()


def _retyped(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32 if x.dtype == torch.int64 else torch.int64)


def _mutants(name: str, obj):
    """(label, a copy of ``obj`` with one tensor part broken) for every tensor part of a structure."""
    for f in dataclasses.fields(obj):
        part = getattr(obj, f.name)
        if dataclasses.is_dataclass(part):
            for label, sub in _mutants(f"{name}.{f.name}", part):
                yield label, dataclasses.replace(obj, **{f.name: sub})
            continue
        for how, fn in (("short", _shorter), ("dtype", _retyped)):
            yield f"{name}.{f.name}-{how}", dataclasses.replace(obj, **{f.name: fn(part)})


def _accept_args() -> dict:
    plan = ops.Plan.allocate(8, 2)
    plan.write_offsets[:2] = t([0, 1])
    return dict(head_buf=ops.allocate_canary_buffer(8, 48), tail_buf=ops.allocate_canary_buffer(8, 48), plan=plan,
                num_requests=1, out_cache_loc=t([3]), sources=[src(tensor=torch.zeros(8, 32, dtype=torch.uint8))],
                real_kv_mode=RealKvMode.ALL, rewrites=torch.zeros(1, dtype=torch.int64))


def _args(op: str) -> dict:
    return _accept_args() if op == "accept_rewrites" else good(op)


def _call(op: str, kw: dict, backend: str) -> None:
    if op == "accept_rewrites":
        ops.accept_rewrites(**kw, backend=backend)
    elif op == "fill_entries":
        CALL[op](kw)
    else:
        CALL[op](dict(kw, backend=backend))


OUT_ARGS = {"plan": ("out",), "write": ("plan", "ring"), "verify": ("entries", "ring"),
            "fill_entries": ("entries",), "accept_rewrites": ("plan",)}
STRUCT_CASES = [(op, label, arg) for op, args in OUT_ARGS.items() for arg in args
                for label, _ in _mutants(arg, _args(op)[arg])]
TENSOR_CASES = [  # out arguments that are plain tensors: (op, argument, broken value)
    ("scatter", "pool_out", torch.zeros(4, 8, dtype=torch.int64)),
    ("scatter", "pool_out", torch.zeros(8, dtype=torch.int32)),
    ("write", "counters", torch.zeros(20, dtype=torch.int64)),
    ("write", "counters", torch.zeros(20, 2, dtype=torch.int32)),
    ("write", "buf", torch.zeros(16, 36, dtype=torch.uint8)),
    ("write", "buf", torch.zeros(16, 96, dtype=torch.uint8)[:, ::2]),
    ("write", "step", torch.zeros(2, dtype=torch.int64)),
    ("write", "writer_ids", torch.zeros(0, dtype=torch.int64)),
    ("verify", "counters", torch.zeros(20, 3, dtype=torch.int64)),
    ("verify", "buf", torch.zeros(16, 48, dtype=torch.int32)),
    ("accept_rewrites", "tail_buf", torch.zeros(8, 40, dtype=torch.uint8)[:, :36]),
    ("accept_rewrites", "rewrites", torch.zeros(2, dtype=torch.int64)),
    ("accept_rewrites", "rewrites", torch.zeros(1, dtype=torch.int32)),
]


def _rejected(op: str, kw: dict, backend: str, name: str) -> None:
    if op != "fill_entries":
        backend = use_backend(backend)
    tensors = [x for x in _tensors(kw)]
    before = [x.clone() for x in tensors]
    with pytest.raises((TypeError, ValueError)) as info:
        _call(op, kw, backend)
    op_name = "scatter_req_token_ids" if op == "scatter" else op
    assert str(info.value).startswith(f"kv-canary: {op_name} {name}"), str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(tensors, before))


def _tensors(obj) -> list:
    from test_validation import _tensors as walk

    return walk(obj, [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, label, arg", STRUCT_CASES, ids=[f"{c[0]}-{c[1]}" for c in STRUCT_CASES])
def test_broken_out_structure_is_rejected_on_every_backend(op, label, arg, backend):
    kw = _args(op)
    kw[arg] = dict(_mutants(arg, kw[arg]))[label]
    _rejected(op, kw, backend, arg)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, arg, value", TENSOR_CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(TENSOR_CASES)])
def test_broken_out_tensor_is_rejected_on_every_backend(op, arg, value, backend):
    kw = _args(op)
    if op == "write" and arg in ("step", "writer_ids"):
        kw["step" if arg == "writer_ids" else "writer_ids"] = None
    kw[arg] = value
    _rejected(op, kw, backend, arg)


@pytest.mark.parametrize("op, arg, value", [("plan", "out", "plan"), ("write", "plan", None),
                                            ("verify", "entries", ops.Plan.allocate(4, 2)),
                                            ("fill_entries", "entries", [0] * 4), ("write", "ring", (1, 2))])
def test_out_structure_of_another_type_is_a_type_error(op, arg, value):
    kw = _args(op)
    kw[arg] = value
    with pytest.raises(TypeError, match=rf"^kv-canary: {op} {arg} must be a"):
        _call(op, kw, "torch")


def test_short_write_offsets_no_longer_reach_the_numba_kernel():
    use_backend("numba")
    kw = good("plan")
    kw["out"] = dataclasses.replace(kw["out"], write_offsets=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^kv-canary: plan out.write_offsets must be of length 3, got length 1$"):
        ops.plan(**kw, backend="numba")


# -- 6. configuration bounds, booleans and the CLI ----------------------------------------------------
@pytest.mark.parametrize("field", sorted(config_mod.UPPER_BOUNDS))
def test_every_size_knob_has_an_upper_bound(field):
    bound = config_mod.UPPER_BOUNDS[field]
    CanaryConfig(**{field: bound})  # the bound itself is allowed
    with pytest.raises(ValueError, match=rf"^kv-canary: config {field} must be <= {bound} "):
        CanaryConfig(**{field: bound + 8})
    if field in config_mod.ENV_FIELDS:
        var = "KV_CANARY_" + field.upper()
        with pytest.raises(ValueError, match=rf"^kv-canary: {var} must be <= {bound} .*got '{bound + 8}'$"):
            CanaryConfig.from_env({var: str(bound + 8)})
    elif field == "inject_warmup":
        with pytest.raises(ValueError, match=rf"^kv-canary: KV_CANARY_INJECT warmup must be <= {bound} "):
            CanaryConfig.from_env({"KV_CANARY_INJECT": f"warmup={bound + 8}"})


@pytest.mark.parametrize("raw, value", [("false", False), ("OFF", False), (" No ", False), ("0", False),
                                        ("true", True), ("Yes", True), ("on", True), ("1", True)])
def test_boolean_variables_parse_words(monkeypatch, raw, value):
    monkeypatch.setenv("KV_CANARY_TRITON_FAST_LAUNCH", raw)
    assert validate.env_flag("KV_CANARY_TRITON_FAST_LAUNCH", not value) is value
    assert CanaryConfig.from_env({"KV_CANARY_CHECK_V": raw}).check_v is value


def test_boolean_variable_that_does_not_parse_is_named(monkeypatch):
    monkeypatch.setenv("KV_CANARY_TRITON_FAST_LAUNCH", "maybe")
    with pytest.raises(ValueError, match=r"^kv-canary: KV_CANARY_TRITON_FAST_LAUNCH must be a boolean "
                                         r"\(1/0/true/false/yes/no/on/off\), got 'maybe'$"):
        validate.env_flag("KV_CANARY_TRITON_FAST_LAUNCH", True)
    monkeypatch.delenv("KV_CANARY_TRITON_FAST_LAUNCH")
    assert validate.env_flag("KV_CANARY_TRITON_FAST_LAUNCH", True) is True


@pytest.fixture
def no_runs(monkeypatch):
    """The zoos' runners replaced by recorders: a test sees what would run, in no time."""
    from kvcanary.sim import distributed, zoo

    runs = []
    report = type("Report", (), {"ok": True, "to_dict": lambda self: {}})()
    monkeypatch.setattr(zoo, "run_zoo", lambda *a, **k: runs.append(("zoo", a)) or report)
    monkeypatch.setattr(zoo, "format_table", lambda r: "table")
    monkeypatch.setattr(distributed, "run_distributed", lambda *a, **k: runs.append(("dist", a)) or report)
    monkeypatch.setattr(distributed, "format_report", lambda r: "table")
    return runs


@pytest.mark.parametrize("argv, message", [
    (["--interval", "0"], "--interval must be >= 1, got 0"),
    (["--interval", "-3"], "--interval must be >= 1, got -3"),
    (["--world-size", "1"], "--world-size must be >= 2, got 1"),
    (["--bench-slots", "-1"], "--bench-slots must be >= 0, got -1"),
])
def test_distributed_zoo_rejects_bad_numbers(no_runs, capsys, argv, message):
    assert cli.main(["zoo", "--distributed", *argv]) == 2
    assert f"kvcanary zoo: error: kv-canary: {message}" in capsys.readouterr().err
    assert no_runs == []


def test_distributed_zoo_interval_is_passed_as_given(no_runs):
    assert cli.main(["zoo", "--distributed", "--interval", "3"]) == 0
    assert no_runs == [("dist", (2, "gloo", None, 3, 0))]


@pytest.mark.parametrize("argv, kind, unused", [
    (["zoo", "--interval", "4"], "zoo", "--interval has no effect without --distributed"),
    (["zoo", "--world-size", "4"], "zoo", "--world-size has no effect without --distributed"),
    (["zoo", "--distributed", "--seeds", "2"], "dist", "--seeds has no effect with --distributed"),
    (["zoo", "--distributed", "--config", "base"], "dist", "--config has no effect with --distributed"),
])
def test_zoo_options_without_effect_warn_on_one_line(no_runs, capsys, argv, kind, unused):
    assert cli.main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(err) == 1 and err[0].startswith(f"kvcanary zoo: warning: {unused}")
    assert [k for k, _ in no_runs] == [kind]


def test_zoo_defaults_run_without_warnings(no_runs, capsys):
    assert cli.main(["zoo"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert no_runs == [("zoo", (None, 1, None))]


def test_bench_timeout_without_engine_warns(monkeypatch, capsys):
    import kvcanary.bench.ops as bench
    from kvcanary.cli import campaigns

    monkeypatch.setattr(bench, "bench_main", lambda args: {"meta": {}, "results": [{"workload": "w"}]})
    monkeypatch.setattr(campaigns, "emit", lambda *a: None)
    assert cli.main(["bench", "--timeout", "5", "--providers", "torch"]) == 0
    assert "kvcanary bench: warning: --timeout has no effect without --engine" in capsys.readouterr().err


def test_kvcanary_config_names_a_variable_past_its_bound(monkeypatch, capsys):
    monkeypatch.setenv("KV_CANARY_RING_CAPACITY", str(config_mod.MAX_RING_CAPACITY + 1))
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert f"kvcanary config: error: kv-canary: KV_CANARY_RING_CAPACITY must be <= {config_mod.MAX_RING_CAPACITY}" in err
