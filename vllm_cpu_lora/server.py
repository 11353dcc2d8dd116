"""`vllm serve` on localhost, started and stopped with everything it spawns.

`VllmServer` runs vLLM's OpenAI-compatible server (the `vllm` command of the
running Python's environment) in a process group of its own, with LoRA
enabled and the adapters given as ``--lora-modules``. Leaving the ``with``
block, normally, on an error or on Ctrl-C, stops the whole group: SIGINT
(vLLM's own clean shutdown), then SIGTERM, then SIGKILL, and checks that no
process of it is left.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_cpu_lora.offline import child_env

__all__ = ["ServerError", "VllmServer", "live_group_members"]

# How long each stop signal gets before the next one.
_STOP_GRACE_S = (30.0, 10.0, 5.0)


class ServerError(RuntimeError):
    """The server did not start, or died; the message ends with its log."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_group_members(pgid: int) -> list[int]:
    """The processes of group `pgid` that still run (zombies excluded)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


class VllmServer:
    """A `vllm serve` process group on 127.0.0.1 (see module doc)."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        adapters: dict[str, str | os.PathLike],
        log_path: str | os.PathLike,
        dtype: str = "bfloat16",
        max_lora_rank: int = 16,
        max_loras: int = 2,
        max_model_len: int = 256,
        extra_args: Sequence[str] = (),
        disable_plugin: bool = False,
        runtime_lora_updates: bool = True,
        startup_timeout_s: float = 600.0,
        extra_env: dict[str, str] | None = None,
    ):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._startup_timeout_s = startup_timeout_s
        vllm = Path(sys.executable).parent / "vllm"
        self._cmd = [
            str(vllm),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--seed",
            "0",
            "--enable-lora",
            "--max-lora-rank",
            str(max_lora_rank),
            "--max-loras",
            str(max_loras),
        ]
        if adapters:
            self._cmd += ["--lora-modules"]
            self._cmd += [f"{name}={path}" for name, path in adapters.items()]
        self._cmd += list(extra_args)
        self._env = child_env(disable_plugin)
        if runtime_lora_updates:
            self._env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        self._env.update(extra_env or {})
        self._proc: subprocess.Popen | None = None
        # The server's process group (its pid): set once started.
        self.pgid: int | None = None

    def __enter__(self) -> "VllmServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Starts the server and waits until it answers /health."""
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(
                self._cmd,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pgid = self._proc.pid
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                # The processes it started may still be exiting.
                self.stop()
                raise ServerError(
                    f"vllm serve exited with {code} while "
                    f"starting; its log ends with:\n{self.log_tail()}"
                )
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerError(
            f"vllm serve did not answer within {self._startup_timeout_s} s; "
            f"its log ends with:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stops the whole process group; raises if any of it survives."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        for sig, grace in zip(
            (signal.SIGINT, signal.SIGTERM, signal.SIGKILL),
            _STOP_GRACE_S,
            strict=True,
        ):
            if not live_group_members(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while live_group_members(pgid) and time.monotonic() < deadline:
                self._proc.poll()
                time.sleep(0.2)
        self._proc.wait()
        self._proc = None
        left = live_group_members(pgid)
        if left:
            raise ServerError(f"vllm serve left processes {left} running")

    def wait_for_exit(self, timeout_s: float) -> int | None:
        """The server's exit code once it has exited by itself, or None if
        it still runs after `timeout_s`."""
        assert self._proc is not None, "not started"
        try:
            return self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        return urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> tuple[int, str]:
        """(HTTP status, response text) of a request to the server."""
        req = self._request(method, path, body)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[Any]:
        """The JSON events of a streamed POST (``"stream": true`` added), as
        they arrive; an HTTP error status raises urllib's HTTPError."""
        req = self._request("POST", path, {**body, "stream": True})
        with urllib.request.urlopen(req, timeout=120) as r:
            # Server-sent events: "data: <JSON>" lines, "data: [DONE]" last.
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)
