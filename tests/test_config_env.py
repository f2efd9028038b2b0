"""CanaryConfig from the environment: errors name the variable, choices ignore case, typos warn."""

from __future__ import annotations

import warnings

import pytest

from kvcanary import CanaryConfig


@pytest.mark.parametrize("var, raw, message", [
    ("MODE", "bogus", "KV_CANARY_MODE must be one of ('none', 'log', 'raise', 'abort'), got 'bogus'"),
    ("REAL_KV", "some", "KV_CANARY_REAL_KV must be one of ('none', 'partial', 'all'), got 'some'"),
    ("RING_CAPACITY", "0", "KV_CANARY_RING_CAPACITY must be >= 1, got '0'"),
    ("INJECT", "kv=1.5", "KV_CANARY_INJECT kv must be in [0, 1], got '1.5'"),
    ("INJECT", "warmup=x", "KV_CANARY_INJECT warmup must be an integer, got 'x'"),
    ("INJECT", "kv", "KV_CANARY_INJECT must be comma-separated key=value pairs with keys ['table', 'kv', 'cached', "
                     "'after', 'swap', 'seed', 'warmup', 'group'] (e.g. 'kv=0.05,seed=3'), got 'kv'"),
    ("VALUE_CHECK", "maybe", "KV_CANARY_VALUE_CHECK must be one of ('auto', 'always', 'off'), got 'maybe'"),
    ("WRITE_CHECK_LAYERS", "every", "KV_CANARY_WRITE_CHECK_LAYERS must be one of ('fingerprinted', 'all'), got "
                                    "'every'"),
])
def test_bad_variable_is_named(var, raw, message):
    with pytest.raises(ValueError) as info:
        CanaryConfig.from_env({"KV_CANARY_" + var: raw})
    assert str(info.value) == "kv-canary: " + message


def test_an_override_is_named_as_an_argument_not_a_variable():
    with pytest.raises(ValueError, match=r"^kv-canary: config mode must be one of"):
        CanaryConfig.from_env({"KV_CANARY_MODE": "raise"}, mode="loud")


@pytest.mark.parametrize("raw, mode", [("RAISE", "raise"), (" Log ", "log"), ("None", "none")])
def test_choices_ignore_case(raw, mode):
    assert CanaryConfig.from_env({"KV_CANARY_MODE": raw}).mode == mode


def test_write_check_layers_from_the_environment():
    assert CanaryConfig.from_env({"KV_CANARY_WRITE_CHECK_LAYERS": "All"}).write_check_layers == "all"
    # both checks a cost measurement switches off from the environment (benchmarks/user_cost.py's no-graph arm)
    assert CanaryConfig.from_env({"KV_CANARY_ATTENTION_CHECK": "0"}).attention_check is False
    assert CanaryConfig.from_env({}).write_check_layers == "fingerprinted"


def test_booleans_ignore_case():
    assert CanaryConfig.from_env({"KV_CANARY_CHECK_V": "TRUE"}).check_v is True
    assert CanaryConfig.from_env({"KV_CANARY_CHECK_V": "Off"}).check_v is False


def test_unknown_variables_warn_and_known_others_do_not():
    with pytest.warns(UserWarning, match=r"unknown environment variables \['KV_CANARY_MODEE'\] ignored"):
        cfg = CanaryConfig.from_env({"KV_CANARY_MODEE": "raise"})
    assert cfg.mode == "log"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CanaryConfig.from_env({"KV_CANARY_TRITON_FAST_LAUNCH": "0", "OTHER": "1"})


def test_twenty_one_variables_and_fields_set_only_in_code_warn():
    from kvcanary.runtime.config import VARIABLES, env_table

    assert len(VARIABLES) == 21 and [row[0] for row in env_table()] == list(VARIABLES)
    # a field without a variable (set in code) is not read from the environment: the variable warns
    with pytest.warns(UserWarning, match=r"unknown environment variables \['KV_CANARY_RECORD_STRIDE'\]"):
        cfg = CanaryConfig.from_env({"KV_CANARY_RECORD_STRIDE": "64"})
    assert cfg.record_stride == CanaryConfig().record_stride


def test_sources():
    src = CanaryConfig.sources({"KV_CANARY_MODE": "raise"}, check_v=True)
    assert (src["mode"], src["check_v"], src["real_kv"]) == ("environment", "argument", "default")
