"""The step meter (rl_training/base/meter.py): what each call logs, on one rank and reduced over two (gloo)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.base.meter import Meter
from tests.helpers import free_port

CPU = torch.device("cpu")


def test_each_call_logs_its_global_value():
    m = Meter()
    m.add("a/count", 2)
    m.add("a/count", torch.tensor(3.0))  # numbers and tensors mix
    m.mean("a/mean", 1.0, per=2)
    m.mean("a/mean", torch.tensor(5.0), per=torch.tensor(2))  # (1 + 5) / (2 + 2) = 1.5: a global sum over a global
    m.mean("a/mean", 0.0, per=0)  # denominator, not a mean of means ((0.5 + 2.5) / 2 = 1.5 here by chance: next)
    m.mean("b/mean", 3.0, per=1)
    m.mean("b/mean", 1.0, per=3)  # (3 + 1) / (1 + 3) = 1.0, where the mean of the means 3 and 1/3 is 5/3
    m.max("a/max", 1.0)
    m.max("a/max", torch.tensor(4.0))
    m.max("a/max", 2.0)
    m.std("a/std", torch.tensor([1.0, 2.0, 3.0, 6.0]))  # mean 3, squares 4+1+0+9 = 14, / (n - 1) = 14/3
    m.ready("a/ready", 7.0)
    out = m.reduce(CPU)
    assert out == {
        "a/count": 5.0,
        "a/mean": 1.5,
        "b/mean": 1.0,
        "a/max": 4.0,
        "a/std": pytest.approx(math.sqrt(14 / 3)),
        "a/ready": 7.0,
    }
    assert m.totals["a/mean"] == 6.0 and m.pers["a/mean"] == 4.0


def test_a_mean_or_max_over_nothing_is_absent_and_hidden_names_reach_then():
    m = Meter()
    m.mean("x/rate", 0.0, per=0)  # nothing measured: no value, never a 0
    m.max("x/max", torch.tensor(-math.inf))  # a max over an empty mask
    m.add("x/n", 3, log=False)
    m.max("x/slowest", 2.5, log=False)
    m.then(lambda logged, totals: {"x/derived": totals["x/n"] * totals["x/slowest"] + len(logged)})
    assert m.reduce(CPU) == {"x/derived": 7.5}


def test_then_sees_what_came_before_in_order():
    m = Meter()
    m.mean("y/canary", 0.2, per=1)
    m.then(lambda logged, totals: {"y/first": logged["y/canary"] * 10})
    m.then(lambda logged, totals: {"y/second": logged["y/first"] + 1})
    assert m.reduce(CPU) == {"y/canary": 0.2, "y/first": 2.0, "y/second": 3.0}


def test_kept_values_come_back_in_order_and_a_name_has_one_kind():
    m = Meter()
    m.keep("gap", torch.tensor([0.1, 0.2]))
    m.keep("gap", torch.tensor([[0.3]]))
    m.add("z/n", 1)
    m.reduce(CPU)
    assert m.kept["gap"] == pytest.approx([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="z/n"):  # summed here, maxed there: a bug, not a metric
        m.max("z/n", 1)
    m.ready("z/lr", 1.0)
    with pytest.raises(ValueError, match="z/lr"):  # two producers of one name: which one is logged?
        m.ready({"z/lr": 2.0})


def _two_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m = Meter()
    # rank 0: rewards [1, 0], 3 tokens of gap 0.6 in all; rank 1: rewards [1, 1, 1], 1 token of gap 0.2.
    rewards = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])][rank]
    m.mean("r/mean", rewards.sum(), per=len(rewards))  # 4 / 5 = 0.8
    m.std("r/std", rewards)  # mean 0.8, squares 0.04*4 + 0.64 = 0.8, / 4 = 0.2
    gap = torch.tensor([0.6, 0.2][rank], dtype=torch.float64)
    m.mean("r/gap", gap, per=[3, 1][rank])  # 0.8 / 4 = 0.2
    m.max("r/slowest", [1.5, 0.5][rank])
    m.add("r/count", rank + 1)  # 3
    m.mean("r/empty", 0.0, per=0)
    m.ready("r/lr", 1e-4)
    m.keep("rows", torch.full((rank + 1,), float(rank)))
    logged = m.reduce(CPU)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"logged": logged, "kept": m.kept["rows"]}, fh)
    torch.distributed.destroy_process_group()


def test_two_ranks_reduce_to_global_sums_maxes_and_keep_their_own(tmp_path):
    out = str(tmp_path / "m")
    mp.spawn(_two_rank_worker, args=(2, free_port(), out), nprocs=2)
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    expected = {"r/mean": 0.8, "r/std": math.sqrt(0.2), "r/gap": 0.2, "r/slowest": 1.5, "r/count": 3.0, "r/lr": 1e-4}
    for g in got:
        assert g["logged"] == pytest.approx(expected, rel=1e-12)  # every rank logs the same global values
    assert got[0]["kept"] == [0.0] and got[1]["kept"] == [1.0, 1.0]  # each rank keeps its own
