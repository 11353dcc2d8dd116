"""The main job, `vllm serve` with LoRA, as the demo runs it, checked.

One fp32 server session of `vllm_cpu_lora.demo.serve_and_query`: concurrent
completions for the base model and two adapters given as --lora-modules,
then a third adapter loaded at run time, used and unloaded. Checked:

* every completion's tokens are Hugging Face transformers + peft's greedy
  tokens for its model (each the argmax of HF's logits before it), and the
  adapters change the output;
* the server log shows our plug-in and its ISA path;
* the runtime-loaded adapter serves its own tokens, and once unloaded a
  request for it gets vLLM's 404;
* no process of the server is left after it stopped, also when the demo
  gets Ctrl-C (SIGINT) or SIGTERM mid-burst, or when the server fails to
  start (an adapter path that does not exist).

Needs CPU vLLM, the openai client, transformers and peft (scripts/test_vllm.sh);
skipped without them.
"""

import os
import signal
import subprocess
import sys

import pytest
from tiny_vllm import skip_module_without

skip_module_without("vllm", "openai", "transformers", "peft")

from vllm_cpu_lora import demo, server, tiny_model  # noqa: E402

PROMPTS = tiny_model.PROMPTS[:3]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_serve")
    base, adapters = demo.build_models(work)
    result = demo.serve_and_query(
        base,
        adapters,
        work=work,
        dtype="float32",
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
    )
    return base, adapters, result


def _check_against_hf(base, adapters, results):
    names = sorted({r["model"] for r in results} - {demo.BASE_MODEL})
    sequences = [
        (
            r["prompt_token_ids"],
            r["token_ids"],
            None if r["model"] == demo.BASE_MODEL else r["model"],
        )
        for r in results
    ]
    hf = tiny_model.hf_next_token_logits(
        base, {name: adapters[name] for name in names}, sequences
    )
    for r, logits in zip(results, hf, strict=True):
        assert len(r["token_ids"]) == MAX_TOKENS
        assert r["token_ids"] == logits.argmax(-1).tolist(), r


def test_concurrent_requests_match_hf(session):
    base, adapters, result = session
    burst = result["burst"]
    assert len(burst) == 3 * len(PROMPTS)
    _check_against_hf(base, adapters, burst)
    first = {
        r["model"]: r["token_ids"] for r in burst if r["prompt"] == PROMPTS[0]
    }
    assert len({tuple(t) for t in first.values()}) == 3, first


def test_server_log_names_our_wrapper_and_isa(session):
    lines = session[2]["log_lines"]
    assert lines, "the server did not log the vllm_cpu_lora plug-in"
    assert all("PunicaWrapperCPULoRA" in line for line in lines)
    assert all("ISA path" in line for line in lines)


def test_runtime_adapter_serves_and_unloads(session):
    base, adapters, result = session
    _check_against_hf(base, adapters, result["runtime"])
    status, text = result["after_unload"]
    assert status == 404, (status, text)
    assert "adapter-3" in text


def test_no_server_process_is_left(session):
    assert server.live_group_members(session[2]["pgid"]) == []


def _served_groups() -> set[int]:
    pids = subprocess.run(
        ["pgrep", "-f", "vllm serve"], capture_output=True, text=True
    ).stdout.split()
    return {os.getpgid(int(pid)) for pid in pids}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_demo_stops_the_server(tmp_path, sig):
    before = _served_groups()
    demo_proc = subprocess.Popen(
        [sys.executable, "-m", "vllm_cpu_lora.demo", "--workdir", tmp_path]
        + ["--max-tokens", "200"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As from a terminal: SIGINT not ignored (background shells do).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    output = []
    for line in demo_proc.stdout:
        output.append(line)
        if "concurrent completions" in line:
            break
    groups = _served_groups() - before
    assert len(groups) == 1, "".join(output)
    demo_proc.send_signal(sig)
    output.append(demo_proc.stdout.read())
    assert demo_proc.wait(timeout=120) == 128 + sig, "".join(output)
    assert server.live_group_members(groups.pop()) == []


def test_a_server_that_fails_to_start_leaves_nothing(tmp_path):
    base, _ = demo.build_models(tmp_path)
    failing = server.VllmServer(
        base,
        adapters={"adapter-1": str(tmp_path / "no-such-adapter")},
        log_path=tmp_path / "serve.log",
        dtype="float32",
    )
    with pytest.raises(server.ServerError, match="exited with"):
        failing.start()
    assert server.live_group_members(failing.pgid) == []
