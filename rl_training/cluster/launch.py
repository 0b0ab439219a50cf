"""Per-node launcher under SLURM: started once per node by scripts/slurm/rl_train.sbatch, runs torchrun in-process.

    srun --ntasks-per-node=1 .venv/bin/python -m rl_training.cluster.launch -- --cfg cfg/x.yaml key=value ...

What it does on each node, in this order:
1. Blocks SIGUSR1/SIGUSR2. SLURM delivers the time-limit signal to every process of the job step, and
   torchrun's agent would die on it (default action) and orphan its workers. The workers inherit the
   blocked mask: a signal that reaches a worker before its handler exists stays pending until
   rl_training/runtime/stopping.py installs the handler and unblocks it (ignoring it would lose it). A signal that
   reaches the node before torchrun has started the workers would reach no worker at all: a launcher thread
   (`watch_stop_signal`) takes it and writes the file RL_STOP_FILE, which the workers poll every step.
2. Builds the workers' environment from an allow-list (ALLOW_EXACT, ALLOW_PREFIXES, plus RL_WORKER_ENV) instead
   of passing on the whole SLURM environment; only the names are printed, never the values. The runner's
   arguments are printed with credential-like values redacted (see `redact`): the log is slurm-%j.out.
3. Points TMPDIR and the compiler caches at a node-local directory (RL_NODE_LOCAL_ROOT, default /tmp), never
   NFS, and removes it at exit (RL_KEEP_NODE_LOCAL=1 keeps it); see `node_local_env`. The Hugging Face caches
   stay where the user has them (HF_HOME, HF_HUB_CACHE, HF_DATASETS_CACHE): offline, a hub id loads only from
   a cache populated beforehand. Sets HF offline mode (RL_HF_OFFLINE=0 turns that off).
4. Runs torchrun with --nnodes=$SLURM_NNODES, one worker per GPU (RL_NPROC_PER_NODE overrides), c10d
   rendezvous at RL_RDZV_ENDPOINT (host:port, resolved by the batch script on the head node), with node 0
   hosting the store (is_host: no guessing from hostnames on multi-NIC hosts).
5. With RL_RETRIEVER_ARGS or RL_RETRIEVER_URL (search tasks), starts this node's retrieval server on 127.0.0.1
   or uses the given one, waits for its /health (RL_RETRIEVER_DEADLINE_S), puts its exact host in NO_PROXY
   and points the runner at it (search.retriever=http search.url=...); stops it at exit. See
   `start_retriever`.
6. Exits 75 when the workers stopped on the signal after a checkpoint (see exit_status), else 1 for a
   failure, 0 for success.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rl_training.base.exit_codes import DRIFT_EXIT_CODE, STOPPED_EXIT_CODE, WEIGHT_STATE_EXIT_CODE

ALLOW_EXACT = {
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ",
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURMD_NODENAME",  # provenance only; nothing else of SLURM's
    "XDG_CACHE_HOME",
}  # fmt: skip
ALLOW_PREFIXES = (
    "LC_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_",
    "PYTORCH_",  # PYTORCH_CUDA_ALLOC_CONF (expandable segments), PYTORCH_NVML_BASED_CUDA_CHECK, ...
    "TORCHINDUCTOR_", "TRITON_", "VLLM_", "GLOO_", "TP_", "FI_", "UCX_", "RCLONE_", "AWS_", "RL_",
)  # fmt: skip
NODE_LOCAL = {  # variable -> subdirectory of the node-local directory: scratch and compiler caches
    "TMPDIR": "tmp",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "VLLM_CACHE_ROOT": "vllm",
    "CUDA_CACHE_PATH": "nv_compute_cache",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
}
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Names whose values are not echoed. `token` but not `tokens`/`tokenizer`: max_new_tokens=256 stays readable.
SECRET_NAME = re.compile(r"secret|passw(?:or)?d|credential|token(?!s|izer)|key", re.IGNORECASE)
# A parameter of an rclone connection string (`:s3,secret_access_key=...:` or `remote,name=value:`); its
# value may be quoted to hold `,` or `:`.
RCLONE_PARAM = re.compile(r"""(,\s*)([\w-]+)=("[^"]*"|'[^']*'|[^,:]*)""")
REDACTED = "<redacted>"


def worker_env(env: dict[str, str], extra: str = "") -> dict[str, str]:
    """The allow-listed part of `env`. `extra`: comma-separated names, `NAME_*` for a prefix (RL_WORKER_ENV)."""
    names = {x.strip() for x in extra.split(",") if x.strip()}
    exact = ALLOW_EXACT | {n for n in names if not n.endswith("*")}
    prefixes = ALLOW_PREFIXES + tuple(n[:-1] for n in names if n.endswith("*"))
    return {k: v for k, v in env.items() if k in exact or k.startswith(prefixes)}


def node_local_env(env: dict[str, str], local: Path) -> dict[str, str]:
    """The variables that point into the node-local directory `local` (created here).

    XDG_CACHE_HOME (other libraries' JIT caches) goes there too unless the user set it; the Hugging Face
    home, which defaults to $XDG_CACHE_HOME/huggingface, is then pinned to where it was
    ($HOME/.cache/huggingface) unless HF_HOME is set: offline, an empty per-node cache could not load a
    hub id, and HF_DATASETS_CACHE / HF_HUB_CACHE default to it."""
    dirs = {var: local / sub for var, sub in NODE_LOCAL.items()}
    if not env.get("XDG_CACHE_HOME"):
        dirs["XDG_CACHE_HOME"] = local / "cache"
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    out = {var: str(d) for var, d in dirs.items()}
    if "XDG_CACHE_HOME" in out and not env.get("HF_HOME"):
        out["HF_HOME"] = str(Path(env.get("HOME") or Path.home()) / ".cache" / "huggingface")
    return out


def add_no_proxy(env: dict[str, str], hosts: list[str]) -> None:
    """With a proxy configured, rendezvous and NCCL bootstrap traffic to the job's own nodes must bypass it."""
    if not any(env.get(k) for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")):
        return
    have = [h for h in (env.get("no_proxy") or env.get("NO_PROXY") or "").split(",") if h]
    merged = ",".join(dict.fromkeys([*have, "localhost", "127.0.0.1", *hosts]))
    env["no_proxy"] = env["NO_PROXY"] = merged


def redact(arg: str) -> str:
    """`arg` as the launcher prints it: the value of a `name=value` whose name looks like a credential, and of
    such a parameter inside an rclone connection string, replaced by <redacted>."""
    name, eq, _ = arg.partition("=")
    if eq and SECRET_NAME.search(name):
        return f"{name}={REDACTED}"
    return RCLONE_PARAM.sub(lambda m: f"{m[1]}{m[2]}={REDACTED}" if SECRET_NAME.search(m[2]) else m[0], arg)


def trainer_gpus(env: dict[str, str]) -> dict[str, str]:
    """RL_TRAINER_GPUS (rl_train.sbatch with vLLM servers beside the trainers): the trainers' GPUs. srun sets every
    task's CUDA_VISIBLE_DEVICES to the step's GPUs, whatever the batch script exported, so it is set here, inside
    the task, as vllm_server.sh does for the servers; nproc_per_node then counts that list."""
    gpus = env.get("RL_TRAINER_GPUS", "")
    return {**env, "CUDA_VISIBLE_DEVICES": gpus} if gpus else env


def worker_threads(env: dict[str, str], nproc: int) -> dict[str, str]:
    """OMP_NUM_THREADS for every worker: its share of the task's CPUs, SLURM_CPUS_PER_TASK // nproc (at least 1),
    whatever value the task inherited: job scripts and site profiles commonly export
    OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK (288 on a GH200 node), and an exported value reaches every worker of every
    node alike, which says nothing of what one of nproc workers may use. A value meant for the workers is named in
    RL_WORKER_ENV (`RL_WORKER_ENV=OMP_NUM_THREADS`) and then passes as it is."""
    named = {x.strip() for x in env.get("RL_WORKER_ENV", "").split(",")}
    if "OMP_NUM_THREADS" in named and env.get("OMP_NUM_THREADS"):
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int(env.get("SLURM_CPUS_PER_TASK") or 1) // nproc))}


def nproc_per_node(env: dict[str, str]) -> int:
    if env.get("RL_NPROC_PER_NODE", "").isdigit() and int(env["RL_NPROC_PER_NODE"]) > 0:
        return int(env["RL_NPROC_PER_NODE"])
    if env.get("RL_TRAINER_GPUS"):
        return len([d for d in env["RL_TRAINER_GPUS"].split(",") if d.strip()])
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit() and int(env["SLURM_GPUS_ON_NODE"]) > 0:
        return int(env["SLURM_GPUS_ON_NODE"])
    cvd = env.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in cvd.split(",") if d.strip()]) or 1


def node_hosts(nodelist: str) -> list[str]:
    if not nodelist or not shutil.which("scontrol"):
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    return out.stdout.split()


def torchrun_args(nnodes: int, nproc: int, endpoint: str, job_id: str, is_host: bool, entry: str) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf=is_host={int(is_host)}",
        "--max-restarts=0",  # a failed worker ends the job; the chain resumes from the last checkpoint
        entry,
    ]


def main(argv=None) -> int:
    # First, before any thread exists (threads inherit the mask) and before anything slow: see the docstring.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGUSR2})
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entrypoint", default=None, help="training script (default: the RL runner)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the runner's arguments")
    a = ap.parse_args(argv)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args

    env = trainer_gpus(dict(os.environ))
    missing = [k for k in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "RL_RDZV_ENDPOINT") if not env.get(k)]
    if missing:
        print(
            f"slurm_launch: missing {', '.join(missing)}; run it through scripts/slurm/rl_train.sbatch", file=sys.stderr
        )
        return 2
    job, node_id, nnodes = env["SLURM_JOB_ID"], int(env["SLURM_NODEID"]), int(env["SLURM_NNODES"])
    node = env.get("SLURMD_NODENAME", f"node{node_id}")
    nproc = nproc_per_node(env)
    entry = a.entrypoint or str(Path(__file__).resolve().parents[1] / "runners" / "rl_runner.py")

    wenv = worker_env(env, env.get("RL_WORKER_ENV", ""))
    add_no_proxy(wenv, [*node_hosts(env.get("SLURM_JOB_NODELIST", "")), env["RL_RDZV_ENDPOINT"].rsplit(":", 1)[0]])
    if env.get("RL_HF_OFFLINE", "1") != "0":
        wenv.update(HF_OFFLINE)
    wenv.update(worker_threads(env, nproc))
    local = Path(env.get("RL_NODE_LOCAL_ROOT", "/tmp")) / f"rl-{job}-{node}"  # per node: fake nodes share /tmp
    wenv.update(node_local_env(env, local))
    stop_file = local / "stop_requested"
    wenv["RL_STOP_FILE"] = str(stop_file)

    try:
        retriever = start_retriever(env, wenv, local, Path(f"retriever-{job}-{node}.log").resolve())
    except RetrieverError as e:
        print(f"slurm_launch[{node}]: {e}", file=sys.stderr, flush=True)
        shutil.rmtree(local, ignore_errors=True)
        return 1
    args = [*args, *retriever.overrides]
    targs = torchrun_args(nnodes, nproc, env["RL_RDZV_ENDPOINT"], job, node_id == 0, entry)
    print(
        f"slurm_launch[{node} {node_id}/{nnodes}]: torchrun {' '.join(targs)} {' '.join(map(redact, args))}\n"
        f"slurm_launch[{node}]: node-local dir {local}; worker environment ({len(wenv)} variables, values not "
        f"shown): {' '.join(sorted(wenv))}",
        flush=True,
    )
    # torchrun copies this process's environment into every worker: replace it with the filtered one.
    os.environ.clear()
    os.environ.update(wenv)
    done = threading.Event()
    watcher = threading.Thread(target=watch_stop_signal, args=(stop_file, done), daemon=True)
    watcher.start()
    try:
        return run_torchrun([*targs, *args])
    finally:
        retriever.stop()
        done.set()
        watcher.join()
        if env.get("RL_KEEP_NODE_LOCAL") != "1":
            shutil.rmtree(local, ignore_errors=True)


# ---------------------------------------------------------------------------- retrieval server (search tasks)
class RetrieverError(RuntimeError):
    pass


@dataclass
class RetrieverServer:
    """This node's retriever: the runner overrides that point at it, and the server process if we started it.
    With neither knob set it is a null object (no overrides, nothing to stop)."""

    url: str = ""
    proc: subprocess.Popen | None = None
    overrides: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # uvicorn shuts down on SIGTERM
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_retriever(env: dict[str, str], wenv: dict[str, str], local: Path, log: Path) -> RetrieverServer:
    """RL_RETRIEVER_ARGS='--corpus C.jsonl [--retriever dense --index I --encoder E ...]': run
    `python -m rl_training.retrieval.server ARGS --host 127.0.0.1 --port 0` on this node (its output in `log`);
    RL_RETRIEVER_URL=http://host:port/retrieve: a server that already runs. Either way /health must answer
    within RL_RETRIEVER_DEADLINE_S (default 900: a FAISS index takes minutes to load), the host goes into
    wenv's NO_PROXY (exact name), and the runner gets search.retriever=http search.url=URL (appended: they win).
    Raises RetrieverError (after stopping what it started) when the server dies or misses the deadline."""
    import shlex

    from rl_training.retrieval.client import no_proxy_hosts

    server_args, url = env.get("RL_RETRIEVER_ARGS", ""), env.get("RL_RETRIEVER_URL", "")
    if not server_args and not url:
        return RetrieverServer()
    if server_args and url:
        raise RetrieverError("set RL_RETRIEVER_ARGS (start a server per node) or RL_RETRIEVER_URL, not both")
    deadline = time.monotonic() + float(env.get("RL_RETRIEVER_DEADLINE_S", "900"))
    server = RetrieverServer(url)
    if server_args:
        port_file = local / "retriever.port"
        cmd = [sys.executable, "-m", "rl_training.retrieval.server", *shlex.split(server_args)]
        cmd += ["--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)]
        with log.open("ab") as out:
            server.proc = subprocess.Popen(cmd, env=wenv, stdout=out, stderr=subprocess.STDOUT)
        print(f"slurm_launch: retriever {' '.join(cmd[1:])} (log {log})", flush=True)
        while not port_file.exists():
            _check_server(server, deadline, log)
            time.sleep(0.2)
        server.url = f"http://127.0.0.1:{port_file.read_text().strip()}/retrieve"
    no_proxy_hosts(wenv, [server.url])
    health = _wait_healthy(server, deadline, log)
    print(f"slurm_launch: retriever {server.url} healthy: {health}", flush=True)
    server.overrides = ["search.retriever=http", f"search.url={server.url}"]
    return server


def _check_server(server: RetrieverServer, deadline: float, log: Path) -> None:
    if server.proc is not None and server.proc.poll() is not None:
        raise RetrieverError(f"the retrieval server exited with status {server.proc.returncode}; see {log}")
    if time.monotonic() > deadline:
        server.stop()
        raise RetrieverError(
            f"the retrieval server {server.url or ''} was not healthy by RL_RETRIEVER_DEADLINE_S; see {log}"
        )


def _wait_healthy(server: RetrieverServer, deadline: float, log: Path) -> dict:
    import requests

    from rl_training.retrieval.client import HttpRetriever

    client = HttpRetriever(server.url, timeout_s=5.0, retries=0)
    try:
        while True:
            try:
                return client.health()
            except requests.RequestException:
                _check_server(server, deadline, log)
                time.sleep(0.5)
    finally:
        client.close()


def watch_stop_signal(path: Path, done: threading.Event) -> None:
    """Launcher thread: the first SIGUSR1/SIGUSR2 that reaches this process (blocked in every thread, so it
    waits here) becomes the file `path`; the workers' StopOnSignal counts it as the signal. Until `done`."""
    while not done.is_set():
        if signal.sigtimedwait({signal.SIGUSR1, signal.SIGUSR2}, 0.5) is not None:
            path.touch()
            return


def run_torchrun(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        status = exit_status(codes)
        if status == STOPPED_EXIT_CODE:
            print(f"slurm_launch: workers stopped on the signal (exit {STOPPED_EXIT_CODE})", flush=True)
        else:
            print(f"slurm_launch: workers failed with exit codes {codes}\n{e}", file=sys.stderr, flush=True)
        return status
    return 0


def exit_status(codes: list[int]) -> int:
    """The node's status from its failed workers' exit codes. Stopped workers exit 75 only after a barrier
    that follows the checkpoint and the final upload, but not at the same instant: torchrun's agent
    SIGTERMs the rest of the node's workers as soon as the first one exits non-zero. A SIGTERM next to a 75
    therefore still means a clean stop. The weight-state and length-drift guards' statuses are kept the same way
    (every rank checkpoints, then stops with it)."""
    for kept in (STOPPED_EXIT_CODE, WEIGHT_STATE_EXIT_CODE, DRIFT_EXIT_CODE):
        if kept in codes and set(codes) <= {kept, -signal.SIGTERM}:
            return kept
    return 1


if __name__ == "__main__":
    sys.exit(main())
