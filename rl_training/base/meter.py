"""A step's metrics, written where each is measured under the name it is logged as, reduced over ranks once.

    meter.add("rollout/reward_fn_errors", n)                    summed over calls and ranks
    meter.max("perf/generate_s", seconds)                       the largest over calls and ranks
    meter.mean("train/entropy", entropy_sum, per=tokens)        a global sum over a global denominator
    meter.std("rollout/reward_std", rewards)                    the sample std of every rank's values
    meter.ready("train/lr", lr)                                 already agreed over ranks, or one engine's own: rank
                                                                0's value, as it is
    meter.keep("logp_gap", gaps)                                this rank's own values, not reduced nor logged
    meter.then(fn)                                              fn(logged, totals) -> more metrics, after reducing

A value is a Python number or a tensor (a 0-d tensor for add/max/mean; any shape for keep); a device tensor is
accumulated on its device, without a host sync. `reduce` (collective) stacks every sum and every max, runs one sum
all-reduce and one max all-reduce, and copies the result to the host once, with the kept values in the same copy.

What is logged: every add and max, every mean whose global denominator is > 0 (a mean over nothing is absent,
never a 0), every std over at least one value, the ready values, then each `then` function's metrics in the
order they were registered; `log=False` keeps a sum or a max out of the log but in `totals` (fn's second argument:
the global sum, or the numerator of a mean, of every metered name). A max nothing raised above -inf is absent
too: `max` of a tensor masked with -inf measures nothing where the mask is empty.

Every rank must meter the same names for add, max, mean and std (in any order, any number of calls), or the
collectives would not line up: a producer meters its names on every rank, with 0 where a rank has nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rl_training.base import dist

Then = Callable[[dict[str, float], dict[str, float]], dict[str, float]]
Value = float | int | bool | torch.Tensor


def _plus(a: Value | None, b: Value) -> Value:
    if isinstance(b, torch.Tensor):
        b = b.detach().double()
    return b if a is None else a + b


def _larger(a: Value | None, b: Value) -> Value:
    if isinstance(b, torch.Tensor):
        b = b.detach().double()
        return b if a is None else torch.maximum(torch.as_tensor(a, dtype=torch.float64, device=b.device), b)
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, torch.as_tensor(float(b), dtype=torch.float64, device=a.device))
    return b if a is None else max(a, b)


@dataclass
class Meter:
    sums: dict[tuple[str, str], Value] = field(default_factory=dict)  # (name, role) -> this rank's sum
    maxes: dict[str, Value] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # name -> 'add' | 'mean' | 'std' | 'max'
    hidden: set[str] = field(default_factory=set)  # metered with log=False
    readies: dict[str, float] = field(default_factory=dict)
    kept: dict[str, list] = field(default_factory=dict)  # name -> tensors; after reduce, one list of floats
    thens: list[Then] = field(default_factory=list)
    # after reduce: the global numerator of every add, mean and std (and every max), and each mean's denominator
    totals: dict[str, float] = field(default_factory=dict)
    pers: dict[str, float] = field(default_factory=dict)

    def _kind(self, name: str, kind: str, log: bool) -> None:
        if self.kinds.setdefault(name, kind) != kind:
            raise ValueError(f"metric {name!r} metered as {self.kinds[name]} and as {kind}")
        if not log:
            self.hidden.add(name)

    def add(self, name: str, value: Value, *, log: bool = True) -> None:
        self._kind(name, "add", log)
        self.sums[name, "sum"] = _plus(self.sums.get((name, "sum")), value)

    def mean(self, name: str, value: Value, *, per: Value, log: bool = True) -> None:
        """`value` added to the numerator and `per` to the denominator, each over calls and ranks."""
        self._kind(name, "mean", log)
        self.sums[name, "sum"] = _plus(self.sums.get((name, "sum")), value)
        self.sums[name, "per"] = _plus(self.sums.get((name, "per")), per)

    def std(self, name: str, values: torch.Tensor) -> None:
        """The sample standard deviation (n - 1 in the denominator) of every rank's `values`, from global sums."""
        self._kind(name, "std", True)
        v = values.detach().double()
        for role, x in (("n", float(v.numel())), ("sum", v.sum()), ("sq", (v * v).sum())):
            self.sums[name, role] = _plus(self.sums.get((name, role)), x)

    def max(self, name: str, value: Value, *, log: bool = True) -> None:
        self._kind(name, "max", log)
        self.maxes[name] = _larger(self.maxes.get(name), value)

    def ready(self, name: str | dict[str, float], value: float | None = None) -> None:
        """A value that needs no reduction (or a dict of them). A name has one producer: a second is an error."""
        values = name if isinstance(name, dict) else {name: value}
        if twice := sorted(set(values) & set(self.readies)):
            raise ValueError(f"metric {twice[0]!r} made ready twice in one step (two producers of one name)")
        self.readies.update(values)

    def keep(self, name: str, values: torch.Tensor) -> None:
        """This rank's own values (e.g. per sequence), appended to those kept under `name` before; `reduce` copies
        them to the host with the reduced ones: `kept[name]`, a list."""
        self.kept.setdefault(name, []).append(values.detach().double().flatten())

    def then(self, fn: Then) -> None:
        self.thens.append(fn)

    def reduce(self, device: torch.device) -> dict[str, float]:
        """Collective (every rank, the same names): the step's logged metrics. `kept` then holds host lists, and
        `totals` and `pers` the global numerators and denominators."""
        skeys, mkeys = sorted(self.sums), sorted(self.maxes)
        kkeys = list(self.kept)
        sums = _stack([self.sums[k] for k in skeys], device)
        maxes = _stack([self.maxes[k] for k in mkeys], device)
        if len(sums):
            dist.all_reduce_(sums)
        if len(maxes):
            dist.all_reduce_(maxes, op="max")
        kept = [torch.cat([v.to(device) for v in self.kept[k]]) for k in kkeys]
        host = torch.cat([sums, maxes, *kept]).tolist()  # the one host copy
        total = dict(zip(skeys, host[: len(skeys)], strict=True))
        largest = dict(zip(mkeys, host[len(skeys) : len(skeys) + len(mkeys)], strict=True))
        at = len(skeys) + len(mkeys)
        for k, v in zip(kkeys, kept, strict=True):
            self.kept[k], at = host[at : at + v.numel()], at + v.numel()
        totals = {name: total[name, "sum"] for name, role in skeys if role == "sum"}
        totals.update(largest)
        self.totals, self.pers = totals, {name: total[name, "per"] for name, role in skeys if role == "per"}
        out: dict[str, float] = {}
        for name, kind in self.kinds.items():
            if name in self.hidden:
                continue
            if kind == "add":
                out[name] = total[name, "sum"]
            elif kind == "max":
                if largest[name] > -math.inf:
                    out[name] = largest[name]
            elif kind == "mean":
                if total[name, "per"] > 0:
                    out[name] = total[name, "sum"] / total[name, "per"]
            elif total[name, "n"] > 0:  # std
                n, s, sq = total[name, "n"], total[name, "sum"], total[name, "sq"]
                out[name] = math.sqrt(max(sq / n - (s / n) ** 2, 0.0) * n / max(n - 1, 1))
        out.update(self.readies)
        for fn in self.thens:
            out.update(fn(out, totals))
        return out


def _stack(values: list[Value], device: torch.device) -> torch.Tensor:
    """[len(values)] float64 on `device`: the Python numbers in one host-to-device copy, the tensors stacked where
    they are (a name may be a tensor on one rank and a number on another: the positions stay the keys')."""
    out = torch.zeros(len(values), dtype=torch.float64, device=device)
    nums = [i for i, v in enumerate(values) if not isinstance(v, torch.Tensor)]
    if nums:
        out[nums] = torch.tensor([float(values[i]) for i in nums], dtype=torch.float64, device=device)
    tens = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if tens:
        out[tens] = torch.stack([values[i].to(device, torch.float64) for i in tens])
    return out
