"""Tensor parallel on CPU: TP=2 with our plug-in serves LoRA as TP=1 does.

vLLM's CPU platform runs tensor parallelism with its multiprocessing
executor: one worker process per rank, collectives over shared memory and
gloo. On the tiny float32 model of `tiny_vllm` (4 heads, 2 KV heads, MLP
512, vocabulary 511 padded to 512: all split in two) and its mixed batch of
two adapters and none, each configuration runs in one child process, and
checked are, with fully_sharded_loras off and on:

* TP=2's tokens are TP=1's (eager), which are HF transformers + peft's
  greedy tokens exactly, in eager and in vLLM's compiled mode;
* every rank (`collective_rpc` returns one report per rank) used
  `PunicaWrapperCPULoRA`, and all ranks ran the same nonzero op calls;
  compiled, every rank ran DYNAMO_TRACE_ONCE with one captured graph;
  eager, torch.compile compiled nothing but vLLM's own masking helper.

Each child starts its engine in 30-60 s on 2 shared vCPUs (a compiled one
about a minute more).

vLLM's automatic thread binding puts rank N on NUMA node N and refuses TP=2
on a machine with fewer NUMA nodes; the test binds each rank's OpenMP
threads to one CPU of its own instead (VLLM_CPU_OMP_THREADS_BIND), which
works on any host with 2 CPUs. Skipped with fewer, or without CPU vLLM.
"""

import os

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "transformers", "peft", "tokenizers")
CPUS = sorted(os.sched_getaffinity(0))
if len(CPUS) < 2:
    pytest.skip(
        f"TP=2 needs a CPU per rank; this process may use {len(CPUS)}",
        allow_module_level=True,
    )

from tiny_vllm import (  # noqa: E402
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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return build_models(tmp_path_factory.mktemp("vllm_tp"))


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "compiled"])
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
                    llm_args={
                        "tensor_parallel_size": tp,
                        "fully_sharded_loras": fully_sharded,
                        "enforce_eager": enforce_eager,
                    },
                    env=BIND_ENV if tp > 1 else {},
                ),
                log_path=logs / "tp{}-fs{:d}-eager{:d}".format(*key),
            )
        return cache[key]

    return _run


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["fs0", "fs1"])
def test_tp2_tokens_are_tp1_and_hf_tokens(
    models, run, enforce_eager, fully_sharded
):
    tp1 = outputs(run(1, False, True))
    assert_hf_greedy(models, tp1)
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
    mode = "NONE" if enforce_eager else "DYNAMO_TRACE_ONCE"
    for report in reports:
        assert report["compilation_mode"] == mode, reports
        if enforce_eager:
            # Only vLLM's masking helper of its vocab-parallel embedding,
            # which vLLM compiles by itself at TP > 1 in any mode. Its graphs
            # are vLLM's business: it has dynamic shapes, but a one-token
            # input gets a graph of its own.
            functions = {name for name, _ in report["dynamo_compiles"]}
            assert functions == {"get_masked_input_and_mask"}, reports
        else:
            # The model, traced once (the helper inlined into its graph).
            assert report["dynamo_graphs"] == 1, reports
