"""The plug-in's vLLM version check: one warning outside TESTED_VLLM.

Runs without vLLM (the check reads only the version string it is given).
"""

import logging

import pytest

from vllm_cpu_lora import plugin


@pytest.fixture
def warnings_(caplog, monkeypatch):
    """The plug-in's warnings, caught on its own logger: vLLM's logging
    configuration may stop them from reaching the root logger."""
    monkeypatch.setattr(plugin.logger, "propagate", False)
    plugin.logger.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING, logger=plugin.logger.name):
        yield caplog
    plugin.logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0+cpu", "0.33.2"])
def test_tested_versions_do_not_warn(warnings_, version):
    plugin._warn_if_untested(version)
    assert warnings_.records == []


@pytest.mark.parametrize("version", ["0.31.1", "0.34.0", "1.0.0", "dev"])
def test_other_versions_warn_once_naming_the_tested_range(warnings_, version):
    plugin._warn_if_untested(version)
    (record,) = warnings_.records
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert f"this is vLLM {version}" in message
    assert "tested with vLLM 0.32, 0.33" in message
