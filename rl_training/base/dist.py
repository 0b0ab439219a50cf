"""Distributed hygiene in one place: init from the torchrun environment, rank helpers, reductions.

Works with or without torchrun: a plain `python` launch is a world of one and never creates a process
group. gloo on CPU, NCCL on CUDA. Nothing here is called only on rank 0 if it is a collective.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rl_training.base.errors import UserError

_OWN_GROUP = False


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float | None = None) -> DistInfo:
    """Read RANK/WORLD_SIZE/LOCAL_RANK set by torchrun; bind this worker to its GPU's NUMA node; create the
    process group when world > 1, with collectives timing out after `timeout_s` (run.dist_timeout_s; None:
    torch's default, 10 min for NCCL, 30 for gloo)."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda(local_rank):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if os.environ.get("RL_NUMA_BIND", "1") != "0":
            cpus = bind_to_numa_node(gpu_pci_address(local_rank))
            if cpus and rank == 0:
                print(f"numa: rank 0 bound to the {len(cpus)} CPUs of GPU {local_rank}'s NUMA node", flush=True)
    else:
        device = torch.device("cpu")
    global _OWN_GROUP
    if world > 1 and not dist.is_initialized():
        # Before the group exists: torch.distributed.nn.functional takes `group=group.WORLD` as default arguments,
        # evaluated at import (transformers imports it while loading a tokenizer). Imported after this call it
        # would hold the group for the life of the interpreter, past destroy_process_group (see cleanup()).
        importlib.import_module("torch.distributed.nn.functional")

        timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **timeout)
        _OWN_GROUP = True
        # A path that exits without reaching cleanup() (a worker body that returns, sys.exit deep inside) still
        # destroys the group before the interpreter finalizes: atexit runs while threads may still take the GIL.
        atexit.unregister(cleanup)  # once per process, however many groups it makes in turn
        atexit.register(cleanup)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world, device=device)


DEVICE_ENV = "RL_DEVICE"  # "cpu": a run (or a multi-rank CPU test) on the CPU even where CUDA is available


def use_cuda(local_rank: int) -> bool:
    """CUDA when available unless RL_DEVICE=cpu; a local rank without a GPU of its own is an error naming the fix
    (a 2-rank run on a 1-GPU machine would otherwise fail with "invalid device ordinal" in rank 1)."""
    if os.environ.get(DEVICE_ENV, "") == "cpu" or not torch.cuda.is_available():
        return False
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise UserError(
            f"LOCAL_RANK={local_rank} but this process sees {n} GPU(s): start at most {n} ranks per node, or set "
            f"{DEVICE_ENV}=cpu for a run on the CPU"
        )
    return True


def gpu_pci_address(index: int) -> str:
    """The sysfs PCI address ('0009:01:00.0') of CUDA device `index`."""
    p = torch.cuda.get_device_properties(index)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def numa_node_cpus(pci_address: str, sysfs: Path = Path("/sys")) -> set[int]:
    """CPUs of the NUMA node a PCI device hangs off (its numa_node file, then the node's cpulist); empty
    when the platform does not say (numa_node -1: a single node, or no such file)."""
    node_file = sysfs / "bus" / "pci" / "devices" / pci_address / "numa_node"
    node = int(node_file.read_text()) if node_file.exists() else -1
    cpulist = sysfs / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    if node < 0 or not cpulist.exists():
        return set()
    cpus: set[int] = set()
    for part in cpulist.read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        if lo:
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def bind_to_numa_node(pci_address: str, sysfs: Path = Path("/sys")) -> set[int]:
    """Pin every thread of this process to the CPUs of the device's NUMA node that it may use (on GH200 the
    Grace CPU next to the GPU: host-side work and first-touch host memory stay local). Returns the CPUs
    bound to; empty (nothing changed) when the node is unknown or shares no CPU with the allowed set
    (SLURM's cpuset)."""
    cpus = numa_node_cpus(pci_address, sysfs) & os.sched_getaffinity(0)
    if not cpus:
        return set()
    for tid in os.listdir("/proc/self/task"):  # sched_setaffinity is per thread on Linux
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return cpus


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def barrier() -> None:
    if is_dist():
        dist.barrier()


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum/max/min); identity in a world of one."""
    if is_dist():
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op])
    return t


def average_gradients_(params: list[torch.nn.Parameter]) -> None:
    """Average .grad over ranks with one flat all-reduce (what DDP does, for the few LoRA tensors).

    A manual reduction instead of the DDP wrapper: ranks may run different numbers of micro-batches
    (zero-advantage groups skipped), and the probes need each rank's local gradient before the reduction.
    """
    if not is_dist():
        return
    grads = [p.grad for p in params if p.grad is not None]
    if len(grads) != len(params):
        raise RuntimeError("every trainable parameter must have a .grad before the all-reduce")
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def reduce_sums(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Sum each scalar over ranks (one collective for the whole dict, keys in sorted order)."""
    if not is_dist():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


def reduce_max(values: dict[str, float], device: torch.device) -> dict[str, float]:
    if not is_dist():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist(), strict=True))


def broadcast_object(obj, src: int = 0):
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] in a world of one."""
    if not is_dist():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-length 1-D tensors from every rank, on x's device."""
    if not is_dist():
        return x
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    return torch.cat(out)


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def cleanup() -> None:
    """Destroy the process group if this module created it (vLLM creates and tears down its own in a world
    of one; destroying that one here would break vLLM's exit handler).

    The group must really go here, not at interpreter exit: its destructor joins gloo's worker threads. A worker
    thread that is still alive drops its last finished collective a moment after the rank's wait returned, and
    that releases a tensor's Python object, which takes the GIL. If the interpreter is finalizing by then, Python
    (3.11) ends the thread with pthread_exit, whose unwinding through that noexcept C++ destructor aborts the
    process: "terminate called without an active exception", SIGABRT, on a rank whose work was done."""
    global _OWN_GROUP
    if _OWN_GROUP and dist.is_initialized():
        group = dist.group.WORLD
        dist.destroy_process_group()
        held = sys.getrefcount(group) - 2  # less this name and getrefcount's own argument
        if held > 0:
            print(
                f"warning: the process group outlived destroy_process_group ({held} reference(s) left, e.g. a module "
                "imported after init_process_group that took group.WORLD as a default argument); its worker "
                "threads may abort this process at exit",
                file=sys.stderr,
                flush=True,
            )
    _OWN_GROUP = False
