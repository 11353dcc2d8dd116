"""A short soak of `vllm serve` with our plug-in (scripts/soak.py).

8 adapters of different ranks and target modules behind 2 slots and a CPU
cache of 4, concurrent greedy completions over them and the base model,
two adapters unloaded and reloaded through the API meanwhile. Checked:
every request answered (404 only for an adapter while it is unloaded),
every response's tokens those of transformers + peft for its own model
(the 9 models' tokens differing on every prompt), every unload and load
accepted, the server's RSS flat after warm-up, no process left. The full
run (400 requests, and vLLM's own ops for contrast) is the script's
default; its figures are in docs/reliability.md.

Needs CPU vLLM, transformers and peft (scripts/test_vllm.sh); skipped
without them.
"""

import sys
from pathlib import Path

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "transformers", "peft")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import soak  # noqa: E402

from vllm_cpu_lora import tiny_model  # noqa: E402

# Fewer than the script's 400: the suite runs twice in CI (vLLM 0.32 and
# 0.33), and most of this test's time is the server's start anyway.
REQUESTS = 200


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_soak")
    base, adapters = soak.build_models(work)
    return soak.run_soak(
        base, adapters, work=work, requests=REQUESTS, time_limit_s=600
    )


def test_every_request_is_answered(result):
    assert result.failed == []
    assert result.served + result.refused_unloaded == (
        REQUESTS + (1 + len(soak.ADAPTERS)) * len(tiny_model.PROMPTS)
    )


def test_every_response_is_its_own_models(result):
    assert result.indistinct == []
    assert result.wrong == []


def test_adapters_churn_at_run_time(result):
    assert result.churn_failed == []
    # At least one adapter was unloaded and loaded again (the churn's pace
    # is fixed, the run's length depends on the machine).
    assert result.churn_calls >= 2


def test_rss_is_flat_after_warm_up(result):
    assert result.rss_drift_kib <= soak.RSS_TOLERANCE_KIB, result.rss_kib


def test_no_server_process_is_left(result):
    assert result.left == []
    assert result.problems() == []
