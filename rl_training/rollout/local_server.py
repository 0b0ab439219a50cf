"""A vLLM OpenAI-compatible server on this machine, on 127.0.0.1 with an ephemeral port: the CPU build's command
line of docs/server.md, for the CPU demo (`scripts/demo.py --server`), the benchmarks and the tests (on GPU
nodes the sbatch wrapper or `vllm serve` starts servers). Started in its own process group, so stop() ends it
and its engine-core child together."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rl_training.rollout.kinds import CPU_BLOCK_SIZE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    def __init__(
        self,
        model: Path,
        log: Path,
        max_lora_rank: int = 8,
        served_name: str = "base",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ):
        """cpus: the cores the server (API process and engine) runs on, its OpenMP threads bound one per core;
        None: vLLM's default (every core of the NUMA node), which shares them with anything else running."""
        self.model, self.log, self.rank, self.served_name = model, log, max_lora_rank, served_name
        self.extra_args, self.env, self.cpus = list(extra_args), env or {}, cpus
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--enable-lora",
            "--max-lora-rank",
            str(self.rank),
            "--max-loras",
            "3",
            "--logprobs-mode",
            "processed_logprobs",
            "--generation-config",
            "vllm",
            "--seed",
            "0",
            "--block-size",
            str(CPU_BLOCK_SIZE),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 300.0) -> VLLMServer:
        import requests

        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            **self.env,
        }
        pin = None
        if self.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(self.cpus)))
            pin = lambda cpus=set(self.cpus): os.sched_setaffinity(0, cpus)  # noqa: E731
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=pin
            )
        session = requests.Session()
        session.trust_env = False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                if session.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass  # still starting
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM server not healthy after {timeout_s} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
