"""Tensor parallel on CPU: TP=2 with our plug-in serves LoRA as TP=1 does.

vLLM's CPU platform runs tensor parallelism with its multiprocessing
executor: one worker process per rank, collectives over shared memory and
gloo. On the tiny float32 model of `tiny_vllm` (4 heads, 2 KV heads, MLP
512, vocabulary 511 padded to 512: all split in two) and its mixed batch of
two adapters and none, each configuration runs in one child process, and
checked are, with fully_sharded_loras off and on:

* TP=2's tokens are TP=1's, which are HF transformers + peft's greedy
  tokens exactly;
* every rank (`collective_rpc` returns one report per rank) used
  `PunicaWrapperCPULoRA`, and all ranks ran the same nonzero op calls;
* the ops see each rank's shard of the LoRA weights: LoRA B of the
  column-parallel q projection has half its rows, and with
  fully_sharded_loras LoRA A has half the rank (vLLM's S-LoRA layers then
  all-gather the shrunk buffer before the expand).

The configurations are parametrized by `enforce_eager` (the spec key of
`vllm_cpu_lora.offline`): eager mode here; vLLM's compiled mode is one more
value. Each child starts its engine in 30-60 s on 2 shared vCPUs.

vLLM's automatic thread binding puts rank N on NUMA node N and refuses TP=2
on a machine with fewer NUMA nodes; the test binds each rank's OpenMP
threads to one CPU of its own instead (VLLM_CPU_OMP_THREADS_BIND), which
works on any host with 2 CPUs. Skipped with fewer, or without CPU vLLM.
"""

import importlib.util
import json
import os
import re

import pytest

_NEEDED = ("vllm", "transformers", "peft", "tokenizers")
_missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
if _missing:
    pytest.skip(
        f"needs {', '.join(_missing)}: scripts/test_vllm.sh sets them up",
        allow_module_level=True,
    )
CPUS = sorted(os.sched_getaffinity(0))
if len(CPUS) < 2:
    pytest.skip(
        f"TP=2 needs a CPU per rank; this process may use {len(CPUS)}",
        allow_module_level=True,
    )

from tiny_vllm import (  # noqa: E402
    MAX_LORA_RANK,
    ROUTED_OPS,
    assert_hf_greedy,
    build_models,
    outputs,
    spec,
)

from vllm_cpu_lora import offline, plugin  # noqa: E402

TP = 2
# One OpenMP thread per rank, on a CPU of its own.
BIND_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}
# The first call of each op, as the plug-in logs it in each worker process
# (vLLM prefixes a worker's lines with its rank).
FIRST_CALL = re.compile(
    r"\(Worker_TP(\d+) pid=\d+\).*vllm_cpu_lora: first (\w+) call: "
    r"inputs \w+(\[[\d, ]*\]), weights \w+(\[[\d, ]*\])"
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm_tp"))


@pytest.fixture(scope="module", params=[True], ids=["eager"])
def enforce_eager(request):
    return request.param


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """run(tp, fully_sharded, enforce_eager) -> child result, cached."""
    cache = {}
    logs = tmp_path_factory.mktemp("vllm_tp_logs")

    def _run(tp, fully_sharded, enforce_eager):
        key = (tp, fully_sharded, enforce_eager)
        if key not in cache:
            cache[key] = offline.run_vllm_child(
                spec(
                    models,
                    "float32",
                    tensor_parallel_size=tp,
                    fully_sharded_loras=fully_sharded,
                    enforce_eager=enforce_eager,
                    env=BIND_ENV if tp > 1 else {},
                ),
                log_path=logs / "tp{}-fs{:d}-eager{:d}".format(*key),
            )
        return cache[key]

    return _run


def test_tp1_matches_hf(models, run, enforce_eager):
    assert_hf_greedy(models, outputs(run(1, False, enforce_eager)))


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["fs0", "fs1"])
def test_tp2_tokens_are_tp1_tokens(run, enforce_eager, fully_sharded):
    tp1 = outputs(run(1, False, enforce_eager))
    tp2 = outputs(run(TP, fully_sharded, enforce_eager))
    assert [o["token_ids"] for o in tp2] == [o["token_ids"] for o in tp1]


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["fs0", "fs1"])
def test_every_rank_runs_our_ops(run, enforce_eager, fully_sharded):
    result = run(TP, fully_sharded, enforce_eager)
    outputs(result)
    reports = result["reports"]
    assert len(reports) == TP, reports
    for report in reports:
        assert report["wrappers"] == [plugin.WRAPPER], reports
        assert ROUTED_OPS <= set(report["calls"]), reports
        assert all(n > 0 for n in report["calls"].values()), reports
    # The ranks run the same layers on the same batch, step by step.
    assert all(r["calls"] == reports[0]["calls"] for r in reports), reports


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["fs0", "fs1"])
def test_ops_see_each_ranks_shard(models, run, enforce_eager, fully_sharded):
    result = run(TP, fully_sharded, enforce_eager)
    first = {
        (int(rank), op): (json.loads(inputs), json.loads(weights))
        for rank, op, inputs, weights in FIRST_CALL.findall(result["log"])
    }
    with open(os.path.join(models["base"], "config.json")) as f:
        q_width = json.load(f)["hidden_size"]
    rank = MAX_LORA_RANK // TP if fully_sharded else MAX_LORA_RANK
    for tp_rank in range(TP):
        # The first LoRA linear is layer 0's qkv projection, column
        # parallel: its shrink reads A [max_loras, 1, rank, hidden], its
        # first expand the q slice of B [max_loras, 1, q rows, rank], fed
        # the (all-gathered) full rank.
        _, shrink_a = first[tp_rank, "sgmv_shrink"]
        expand_in, expand_b = first[tp_rank, "sgmv_expand_slice"]
        assert shrink_a[2:] == [rank, q_width], first
        assert expand_b[2:] == [q_width // TP, MAX_LORA_RANK], first
        assert expand_in[-1] == MAX_LORA_RANK, first
