"""The plug-in's compiled-mode switch, on a stand-in for vLLM's CPU platform.

`plugin._compile_with_lora` wraps the platform's config step so that a LoRA
model gets the compilation mode it would get without LoRA, except where it
must stay eager (an untested vLLM, a pooling model), which is logged. The
stand-in does what vLLM 0.32/0.33's `CpuPlatform.check_and_update_config`
does with the mode: the default becomes DYNAMO_TRACE_ONCE, and any LoRA
config makes it NONE. Runs without vLLM.
"""

import enum
import logging
import types

import pytest

from vllm_cpu_lora import plugin


class Mode(enum.Enum):
    NONE = 0
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


def _platform():
    class Platform:
        seen_lora = []

        @classmethod
        def check_and_update_config(cls, vllm_config):
            cls.seen_lora.append(vllm_config.lora_config)
            config = vllm_config.compilation_config
            if config.mode == Mode.VLLM_COMPILE:
                config.mode = Mode.DYNAMO_TRACE_ONCE
            if vllm_config.lora_config is not None:
                config.mode = Mode.NONE
            if vllm_config.fail:
                raise ValueError("bad config")

    return Platform


def _config(lora=True, mode=Mode.VLLM_COMPILE, runner="generate", fail=False):
    return types.SimpleNamespace(
        lora_config=object() if lora else None,
        compilation_config=types.SimpleNamespace(mode=mode),
        model_config=types.SimpleNamespace(runner_type=runner),
        fail=fail,
    )


@pytest.fixture
def logs(caplog, monkeypatch):
    """The plug-in's log records (see tests/test_plugin_version.py)."""
    monkeypatch.setattr(plugin.logger, "propagate", False)
    plugin.logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger=plugin.logger.name):
        yield caplog
    plugin.logger.removeHandler(caplog.handler)


def _check(config, version="0.33.0"):
    platform = _platform()
    plugin._compile_with_lora(platform, version)
    platform.check_and_update_config(config)
    return platform


def test_lora_gets_the_mode_it_would_get_without_lora(logs):
    config = _config()
    lora = config.lora_config
    platform = _check(config)
    assert config.compilation_config.mode == Mode.DYNAMO_TRACE_ONCE
    assert platform.seen_lora == [None] and config.lora_config is lora
    assert "LoRA with compilation mode DYNAMO_TRACE_ONCE" in logs.text


def test_eager_when_the_user_asks_for_it():
    # vLLM sets mode NONE for enforce_eager before the platform's step.
    config = _config(mode=Mode.NONE)
    _check(config)
    assert config.compilation_config.mode == Mode.NONE


def test_without_lora_nothing_changes(logs):
    config = _config(lora=False)
    _check(config)
    assert config.compilation_config.mode == Mode.DYNAMO_TRACE_ONCE
    assert logs.records == []


@pytest.mark.parametrize(
    ("version", "runner", "reason"),
    [
        ("0.34.0", "generate", "vLLM 0.34.0 is not a release"),
        ("0.33.0", "pooling", "a pooling model"),
    ],
)
def test_stays_eager_with_a_logged_reason(logs, version, runner, reason):
    config = _config(runner=runner)
    lora = config.lora_config
    platform = _check(config, version)
    assert config.compilation_config.mode == Mode.NONE
    assert platform.seen_lora == [lora]
    (record,) = logs.records
    assert record.levelno == logging.WARNING and reason in record.getMessage()


def test_lora_config_is_restored_when_the_step_fails():
    config = _config(fail=True)
    lora = config.lora_config
    with pytest.raises(ValueError, match="bad config"):
        _check(config)
    assert config.lora_config is lora
