"""The inference servers' side of scripts/slurm/rl_train.sbatch (rollout.backend=server, docs/server.md).

    python -m rl_training.cluster.servers urls [-- RUNNER ARGS]  # this job's server layout, one fact per line
    python -m rl_training.cluster.servers wait --pid SRUN_PID URL ...   # block until every /health answers
    python -m rl_training.cluster.servers cpus --gpu N   # in a server task: the CPUs of GPU N's NUMA node it may use

The batch script starts the servers as a job step of their own (scripts/slurm/vllm_server.sh, one server per
task) and the trainers as another; this module computes where the servers are and waits for them. Layouts
(environment at submission):
- RL_SERVER_NODES=N > 0: the last N nodes of the allocation run only servers, the trainers run on the rest.
- RL_SERVER_NODES=0 (default): servers beside the trainers on every node (the GH200 layout: 1 learner GPU
  + 3 engine GPUs per node: RL_SERVERS_PER_NODE=3 RL_SERVER_GPUS=1,2,3 RL_TRAINER_GPUS=0).
Server task p (Slurm's task id of the server step, block distribution: node i holds tasks i*per ..
i*per + per - 1) listens on RL_SERVER_PORT + p: ports stay distinct even where fake nodes share a host.
Each server task gets RL_SERVER_CPUS CPUs, by default the job's --cpus-per-task divided among the servers of a
node (3 x 288 on a 288-CPU GH200 node could not be granted: issue 29, N3). The step runs with --cpu-bind=none and
each server binds itself to its own GPU's NUMA node, on GH200 the Grace CPU beside it (`numa_cpus`; vllm_server.sh
execs vLLM under `taskset`): Slurm would otherwise bind each task to CPUs of its own choosing, which need not be
beside the task's GPU (issue 50). RL_NUMA_BIND=0 leaves them unbound, as for the trainers. The servers run with
VLLM_SERVER_DEV_MODE=1 only when the run's server.weight_sync needs vLLM's dev routes (full: /collective_rpc,
/reset_prefix_cache; nccl: the weight-transfer routes, issue 29 N2), read from the runner's own arguments.
No torch import for `urls` and `wait`: they run on the batch host before anything else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rl_training.base.errors import UserError


def server_layout(nodes: list[str], server_nodes: int, per_node: int) -> tuple[list[str], list[str]]:
    """(server hosts, one entry per server task in task order; trainer nodes)."""
    if server_nodes < 0 or per_node < 1:
        raise ValueError(f"RL_SERVER_NODES={server_nodes} must be >= 0 and RL_SERVERS_PER_NODE={per_node} >= 1")
    if server_nodes >= len(nodes):
        raise ValueError(f"RL_SERVER_NODES={server_nodes} leaves none of the job's {len(nodes)} nodes for the trainers")
    hosts = nodes[len(nodes) - server_nodes :] if server_nodes else nodes
    trainers = nodes[: len(nodes) - server_nodes]
    return [h for h in hosts for _ in range(per_node)], trainers


def server_urls(hosts: list[str], port0: int) -> list[str]:
    return [f"http://{h}:{port0 + p}" for p, h in enumerate(hosts)]


def server_cpus(job_cpus_per_task: int, per_node: int, override: str = "") -> int:
    """CPUs per server task: RL_SERVER_CPUS when set, else the job's --cpus-per-task shared by a node's servers."""
    if override:
        return int(override)
    return max(1, job_cpus_per_task // per_node)


def numa_cpus(pci_bus_id: str, allowed: set[int], sysfs: Path = Path("/sys")) -> set[int]:
    """The CPUs of the NUMA node the GPU at `pci_bus_id` (nvidia-smi's 00000009:01:00.0 or sysfs' 0009:01:00.0)
    hangs off that this task may use (`allowed`, its affinity); empty when the platform does not say (one node)."""
    from rl_training.base.dist import numa_node_cpus  # the trainers' binding reads the same sysfs files

    domain, _, rest = pci_bus_id.strip().lower().partition(":")
    return numa_node_cpus(f"{int(domain, 16):04x}:{rest}", sysfs) & allowed


def cpu_list(cpus: set[int]) -> str:
    """`taskset -c`'s form: 72-143 or 0-3,8."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def gpu_pci_bus_id(gpu: str) -> str:
    """nvidia-smi's PCI bus id of GPU `gpu` (an index or UUID as in CUDA_VISIBLE_DEVICES); no CUDA context."""
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", gpu],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"nvidia-smi names no PCI bus id for GPU {gpu}: {(r.stderr or r.stdout).strip()[:200]}")
    return r.stdout.split()[0]


def server_binding(gpu: str, sysfs: Path = Path("/sys")) -> str:
    """What vllm_server.sh binds the server of GPU `gpu` to (a taskset list), or '' (unbound) with the reason on
    stderr: no NUMA information, or none of the node's CPUs allowed to this task."""
    if shutil.which("nvidia-smi") is None:
        print(f"vllm_server.sh: no nvidia-smi: the server of GPU {gpu} is not bound to its NUMA node", file=sys.stderr)
        return ""
    bus = gpu_pci_bus_id(gpu)
    allowed = os.sched_getaffinity(0)
    cpus = numa_cpus(bus, allowed, sysfs)
    if not cpus:
        print(
            f"vllm_server.sh: GPU {gpu} ({bus}): its NUMA node is unknown or shares no CPU with this task's "
            f"{len(allowed)}; not bound",
            file=sys.stderr,
        )
    return cpu_list(cpus)


# The server.weight_sync modes that publish through vLLM's dev routes (VLLM_SERVER_DEV_MODE=1): full calls
# /collective_rpc and /reset_prefix_cache; nccl the weight-transfer routes of launchers/api_server/routers.py.
DEV_MODE_SYNCS = ("full", "nccl")


def needs_dev_mode(runner_args: list[str]) -> bool:
    """Whether the run the runner's arguments (--cfg FILE key=value ...) describe publishes weights through dev
    routes; ConfigError (one line) when they do not load."""
    from rl_training.config.load import load_config

    cfg_file = runner_args[runner_args.index("--cfg") + 1] if "--cfg" in runner_args else None
    overrides = [a for a in runner_args if "=" in a and not a.startswith("-")]
    # what the batch script adds for the trainers (the URLs are placeholders: only the sync mode is read)
    overrides += ["rollout.backend=server", "server.urls=[http://127.0.0.1:1]"]
    return load_config(cfg_file, overrides, training=False).server.weight_sync in DEV_MODE_SYNCS


def wait_healthy(urls: list[str], deadline_s: float, pid: int | None = None) -> None:
    """Every url's /health answers 200 before the deadline, else SystemExit with a one-line reason. `pid`:
    the server step's srun; its exit ends the wait at once."""
    import requests

    session = requests.Session()
    session.trust_env = False  # the servers are reached directly, never through a proxy
    deadline = time.monotonic() + deadline_s
    for url in urls:
        while True:
            try:
                if session.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass  # still loading the model
            if pid is not None and not _alive(pid):
                raise SystemExit(f"the server job step exited before {url} was healthy (see its log)")
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}/health did not answer within RL_SERVER_DEADLINE_S={deadline_s:g} s")
            time.sleep(1.0)
        print(f"slurm_servers: {url} healthy", flush=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("urls")
    u.add_argument("runner_args", nargs=argparse.REMAINDER, help="-- the runner's --cfg FILE key=value ...")
    w = sub.add_parser("wait")
    w.add_argument("--pid", type=int, default=None)
    w.add_argument("urls", nargs="+")
    c = sub.add_parser("cpus")
    c.add_argument("--gpu", required=True, help="the server's GPU, as in its CUDA_VISIBLE_DEVICES")
    c.add_argument("--sysfs", default="/sys")
    a = ap.parse_args(argv)
    env = os.environ
    if a.cmd == "cpus":
        try:
            print(server_binding(a.gpu, Path(a.sysfs)))
        except RuntimeError as e:  # the server still starts, unbound: the reason is in its log
            print(f"vllm_server.sh: {e}; not bound", file=sys.stderr)
            print("")
        return 0
    if a.cmd == "wait":
        wait_healthy(a.urls, float(env.get("RL_SERVER_DEADLINE_S", "900")), a.pid)
        return 0
    out = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True, text=True)
    try:
        hosts, trainers = server_layout(
            out.stdout.split(), int(env.get("RL_SERVER_NODES", "0")), int(env.get("RL_SERVERS_PER_NODE", "1"))
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    port0 = int(env.get("RL_SERVER_PORT") or 30000 + int(env["SLURM_JOB_ID"]) % 20000)
    per = int(env.get("RL_SERVERS_PER_NODE", "1"))
    runner_args = [x for x in a.runner_args if x != "--"]
    try:
        dev = needs_dev_mode(runner_args)
    except UserError as e:  # a config that does not load: the one line the batch script prints
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(",".join(dict.fromkeys(hosts)))  # line 1: server nodes
    print(",".join(trainers))  # line 2: trainer nodes
    print(",".join(server_urls(hosts, port0)))  # line 3: urls
    print(port0)  # line 4: the first port
    print(server_cpus(int(env.get("SLURM_CPUS_PER_TASK", "1")), per, env.get("RL_SERVER_CPUS", "")))  # line 5
    print(int(dev))  # line 6: 1 = start the servers with VLLM_SERVER_DEV_MODE=1
    return 0


if __name__ == "__main__":
    sys.exit(main())
