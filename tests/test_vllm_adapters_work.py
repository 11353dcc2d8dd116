"""The demo's trained adapters do their jobs through vLLM with our plug-in.

One offline vLLM engine (fp32, the plug-in on) answers every held-out
question of `vllm_cpu_lora.toy_tasks` with the base model and with each
adapter of `vllm_cpu_lora.train` (trained, or taken from the cache), all in
one mixed batch, and Hugging Face transformers + peft answers the same
requests. Checked:

* vLLM used our wrapper, and each of its answers is HF's greedy answer;
* each adapter's held-out accuracy on its own task is HF's and at least
  `THRESHOLD`, and so is the base model's on answering in English;
* negative controls: on each task, the base model and every other adapter
  score below `THRESHOLD` (a missing or wrong adapter fails the check).

Needs CPU vLLM, transformers and peft (scripts/test_vllm.sh); skipped
without them. About a minute once the models are cached (training them
takes about another).
"""

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "transformers", "peft", "tokenizers")

from vllm_cpu_lora import offline, plugin, toy_tasks, train  # noqa: E402

# Held-out accuracy a model must reach on its task: the trained models
# score 80% (upper) to 100% (base, sql) through HF, the base model and the
# wrong adapter 0% on an adapter's task.
THRESHOLD = 0.6
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def session():
    """(vLLM's result, requests, model -> vLLM's answers, model -> HF's)."""
    models = train.ensure_models()
    _, held_out = toy_tasks.split(toy_tasks.facts())
    names = [None, *models.adapters]
    # Interleaved, so that each step's batch mixes every adapter and none.
    requests = [
        (toy_tasks.question(fact), name) for fact in held_out for name in names
    ]
    spec = {
        "model": str(models.base),
        "adapters": models.adapters,
        "batches": [requests],
        "max_tokens": MAX_TOKENS,
        "dtype": "float32",
        "max_lora_rank": 16,
        "max_loras": len(models.adapters),
        "ignore_eos": False,
    }
    result = offline.run_vllm_child(spec)
    assert result["error"] is None, (
        f"vLLM failed: {result['error']}\n{result['log'][-6000:]}"
    )
    served = [o["text"] for o in result["batches"][0]["outputs"]]
    hf = train.hf_answers(models.base, models.adapters, requests, MAX_TOKENS)

    def by_model(texts):
        return {
            name or "base": [
                text
                for text, (_, adapter) in zip(texts, requests, strict=True)
                if adapter == name
            ]
            for name in names
        }

    return result, requests, by_model(served), by_model(hf)


def test_mixed_batch_runs_through_our_wrapper(session):
    report = session[0]["report"]
    assert report["wrappers"] == [plugin.WRAPPER]
    assert report["calls"].get("lora_shrink", 0) > 0, report["calls"]


def test_answers_are_hf_peft_greedy_answers(session):
    _, requests, served, hf = session
    for model in served:
        for prompt, ours, theirs in zip(
            (p for p, a in requests if (a or "base") == model),
            served[model],
            hf[model],
            strict=True,
        ):
            assert ours.strip() == theirs.strip(), (model, prompt)


def test_each_model_does_its_task(session):
    _, _, served, hf = session
    ours = train.held_out_accuracies(served)
    theirs = train.held_out_accuracies(hf)
    for model in served:
        task = train.task_of(model)
        assert ours[model][task] == theirs[model][task], (model, ours, theirs)
        assert ours[model][task] >= THRESHOLD, (model, ours[model])


def test_base_and_wrong_adapters_fail_each_task(session):
    accuracy = train.held_out_accuracies(session[2])
    for task in toy_tasks.TASKS:
        for model, row in accuracy.items():
            if train.task_of(model) != task:
                assert row[task] < THRESHOLD, (model, task, row)
