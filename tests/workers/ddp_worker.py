"""Worker bodies for the 2-rank gloo tests (tests/integration/test_ddp.py), started with torch.multiprocessing.spawn."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def _init(rank: int, world: int, port: int, timeout_s: float | None = None):
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "RL_DEVICE": "cpu",  # gloo on the CPU even on a CUDA machine (rank 1 has no second GPU there)
        }
    )
    from rl_training.base import dist

    return dist.init_distributed(timeout_s)


def probes_worker(rank: int, world: int, port: int, out: str, model_dir: str, drop: bool = False) -> None:
    """T3: this rank's half of 8 prompt groups (2 micro-batches of 2 groups) with all three GNS levels;
    `drop` skips the zero-advantage group (rank 1 only, so the ranks keep different numbers of groups)."""
    from rl_training.algs.objectives import StepNorm
    from rl_training.base import dist
    from rl_training.policy.models import trainable_parameters
    from rl_training.probes.probe import StepProbes
    from rl_training.train.batches import make_micro_batches
    from rl_training.train.learner import UpdateHParams, train_on_rollouts
    from tests.helpers import G, lora_policy, subset

    info = _init(rank, world, port)
    model = lora_policy(model_dir, seed=1)
    params = trainable_parameters(model)
    ro, adv = ddp_batch()
    mine = list(range(4 * rank, 4 * rank + 4))
    rows = [g * G + i for g in mine for i in range(G)]
    mbs = make_micro_batches(subset(ro, mine), adv[rows], G, 2, 0, torch.device("cpu"), drop_zero_adv_groups=drop)
    probes = StepProbes(
        model,
        params,
        levels=["unit", "micro", "rank"],
        ema_beta=0.9,
        units_per_step=8,
        world_size=world,
        micro_batch_groups=2,
        device=info.device,
    )
    opt = torch.optim.SGD(params, lr=0.0)
    probes.begin_step(G, adv[rows], [len(ro.completion_ids[r]) for r in rows])
    train_on_rollouts(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        params,
        mbs,
        UpdateHParams(max_grad_norm=0.0),
        StepNorm(seqs=4 * G, tokens=1.0, max_new_tokens=8),
        probes,
    )
    res = {lv: vars(est) for lv, est in probes.tracker.last.items()}
    res["metrics"] = probes.metrics()  # collective (ESS gather)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.cleanup()


def ddp_batch():
    from tests.helpers import fake_rollouts

    ro = fake_rollouts(8, seed=11)
    adv = torch.tensor(
        [0.6, -0.6, 0.1, -0.1, 0.9, -0.9, -0.3, 0.3, 0.5, -0.5, 0.0, 0.0, 0.8, -0.8, -0.2, 0.2], dtype=torch.float64
    )
    return ro, adv


def train_worker(rank: int, world: int, port: int, out: str, overrides: list[str]) -> None:
    """The real runner on 2 ranks: three RL steps, then report prompts, adapter and metrics."""
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.runners import rl_runner
    from tests.helpers import TESTCFG

    info = _init(rank, world, port)
    cfg = load_config(TESTCFG, overrides)
    run = rl_runner.setup(cfg, info)
    steps = []
    for step in range(3):
        metrics = rl_runner.rl_step(run, step)
        steps.append({"indices": run.sampler.indices(step, rank), "metrics": metrics})
    flat = torch.cat([p.detach().reshape(-1) for p in run.params])
    torch.save(flat, Path(out, f"params{rank}.pt"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(steps))
    run.logger.close()
    run.backend.close()
    dist.cleanup()


def publish_failure_worker(rank: int, world: int, port: int, out: str) -> None:
    """Issue 29 N6: rank 0's publisher raises something that is neither ServerError nor OSError (an NCCL
    failure); every rank must stop with it at once instead of waiting in the next collective."""
    import time
    from types import SimpleNamespace

    from rl_training.base import dist
    from rl_training.rollout.server import ServerBackend

    _init(rank, world, port, timeout_s=20)  # without the fix rank 1 would wait in the broadcast until then

    def publish(publisher):
        raise RuntimeError("NCCL error: unhandled system error\n(second line)")

    me = SimpleNamespace(publisher=object() if rank == 0 else None)
    t0 = time.perf_counter()
    try:
        ServerBackend._on_rank0(me, publish)
        result = "no error"
    except Exception as e:  # noqa: BLE001 -- what each rank saw is the test's result
        result = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"error": result, "s": time.perf_counter() - t0}))
    dist.cleanup()
