"""The in-loop probes of one optimizer step: GNS small gradients at three levels, and the ESS family.

The trainer calls, per RL step (every rank, same order; the collectives are marked):
    probes.begin_step(group_size, advantages, completion_lengths, step, rewards)   # this rank's groups, all
    for each micro-batch, epoch 0:  with probes.micro(mb): forward + backward     (hooks armed only here)
                                    probes.observe_rollout(mb, old_logp, tis_weights)
    probes.before_allreduce(params)     # rank level: this rank's accumulated gradient
    [gradient all-reduce]
    probes.after_allreduce(params)      # Q = |G_B|^2 before clipping; GNS update        (collective)
    last inner epoch > 0:           probes.observe_ppo(mb, logp, old_logp)
    probes.metrics(work)                 # timed as the step's `probe` phase                 (collective)
With a RolloutBudget (probe.advisor, budget.py) the unit level's capture also reads per-sequence norms, and the
nested ANOVA and the advice ride in the same two collectives.

Unit accounting (docs/probes.md 1.5, 2): U = prompt groups in the step over all ranks, all counted (groups
whose forward was skipped for a zero advantage are units with a zero gradient). With h the gradient a piece of
work added to this rank's `.grad` under the step's loss scaling and W ranks, the step gradient is
G_B = (1/W) sum_r grad_r = (1/U) sum_j gamma_j with per-unit gradients gamma_j = (U/W) h_j. Hence:
    unit  level: g = (U/W) h_j,               b = 1,   c = 1/U
    micro level: g = (U/W) h_mb / n_mb,       b = n_mb, c = n_mb/U
    rank  level: g = (U/W) grad_r / N_r,      b = N_r, c = N_r/U
The GNS is updated from epoch 0 only (on-policy, one update per rollout batch, so EMA samples are distinct).

Everything a step accumulates stays on the training device as 0-d float64 tensors; after_allreduce() and
metrics() each move their values to the host once. Every entry point runs under a ProbeGuard (guard.py): an
exception is counted and the step goes on; the collectives always run, with fixed-size payloads.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager, nullcontext

import torch

from rl_training.algs.common import zero_adv_groups
from rl_training.base import dist
from rl_training.base.groups import Groups
from rl_training.probes import ess as ess_math
from rl_training.probes.budget import RolloutBudget, StepWork
from rl_training.probes.capture import LoraUnitCapture, MicroGradCapture
from rl_training.probes.dashboard import alerts, mismatch_ess
from rl_training.probes.gns import GNSTracker, Hysteresis, SmallBatchSums, b_star, level_report, recommend_batch
from rl_training.probes.guard import ProbeGuard
from rl_training.probes.lora_health import lora_health

LEVELS = ("unit", "micro", "rank")
ESS_KINDS = ("tok_raw", "tok_used", "seq", "adv_seq", "adv_tok", "ppo")
ESS_FIELDS = ("s1", "s2", "n", "bad")
STEP_SUMS = ("k1", "k3", "rho2", "tok", "lr.sum", "lr.sq", "groups.n", "groups.zero", "len.sum")


def _grad_sq_norm(params) -> torch.Tensor:
    """|grad|^2 over the trainable parameters, a 0-d float64 tensor on their device (no host sync)."""
    return torch.stack([p.grad.detach().double().pow(2).sum() for p in params if p.grad is not None]).sum()


def _to_host(t: torch.Tensor) -> list[float]:
    """The probes' only device-to-host transfers: one in after_allreduce(), one in metrics() (a test swaps it
    to run the tensor code on the meta device, where nothing can be read)."""
    return t.tolist()


def _vector(values, device: torch.device) -> torch.Tensor:
    """One float64 vector on `device` from floats and 0-d tensors (no host round trip for the tensors)."""
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])


class NullProbes:
    """probe.enabled=false: every hook of StepProbes, doing nothing, so the update has no `probes is None` branch."""

    enabled = False

    def begin_step(
        self, group_size: int, advantages, completion_lengths: list[int], step: int = 0, rewards=()
    ) -> None: ...

    def micro(self, mb):
        return nullcontext()

    def per_sequence(self, step: int) -> bool:
        return False

    def before_allreduce(self) -> None: ...

    def after_allreduce(self) -> None: ...

    def observe_rollout(self, mb, old_logp, used_weights) -> None: ...

    def observe_ppo(self, mb, logp, old_logp) -> None: ...

    def metrics(self, work: StepWork | None = None) -> dict[str, float]:
        return {}

    def regroup(self, units_per_step: int, group_size: int, restart: bool) -> None: ...

    def state_dict(self) -> None:
        return None


class StepProbes:
    enabled = True
    _ess_format = staticmethod(ess_math.step_metrics)  # an attribute: a test replaces it on one instance

    def __init__(
        self,
        model,
        params,
        *,
        levels: list[str],
        ema_beta: float,
        units_per_step: int,
        world_size: int,
        micro_batch_groups: int,
        device: torch.device,
        step_time: tuple[float, float] = (0.0, 0.0),
        unit_every: int = 1,
        budget: RolloutBudget | None = None,
    ):
        self.levels = [lv for lv in LEVELS if lv in levels]
        # The unit level's exact per-group norms cost about one more LoRA weight-gradient pass (13% of a tiny
        # model's step): it measures on steps step % unit_every == 0 only; its EMA skips the others (not
        # counted as skipped steps). The micro and rank levels are nearly free and measure every step.
        self.unit_every = unit_every
        self.unit_on = "unit" in self.levels
        self.model, self.params, self.device = model, params, torch.device(device)
        self.units, self.world, self.multiple = units_per_step, world_size, world_size * micro_batch_groups
        self.tracker = GNSTracker(beta=ema_beta)
        self.step_time = step_time  # (t_f, t_u) of step time = t_f + t_u * B; zeros = unknown (no B*)
        hold = math.ceil(1 / (1 - ema_beta)) if ema_beta < 1 else 1
        self.rec_simple, self.rec_star = Hysteresis(hold), Hysteresis(hold)
        self.budget = budget if self.unit_on else None  # the ANOVA reads the unit level's capture
        self.micro_cap = self.unit_cap = None
        self.install_hooks()
        self.hook_errors = self.invalid_streak = 0
        self.ess_history: deque[float] = deque(maxlen=50)  # recent mismatch ESS values for the drop alert
        self.guard = ProbeGuard()
        self.failures_total = 0.0  # probe/failures of the last step: all ranks, since the start of the run
        self.q = math.nan
        self._reset(0, [])

    def install_hooks(self) -> None:
        """Attach the capture hooks; idempotent (an existing set is removed first, never doubled)."""
        self.remove_hooks()
        self.micro_cap = MicroGradCapture(self.params) if "micro" in self.levels else None
        self.unit_cap = LoraUnitCapture(self.model) if "unit" in self.levels else None

    def remove_hooks(self) -> None:
        """Detach every hook (for a probes-off comparison); install_hooks() puts them back."""
        for cap in (self.micro_cap, self.unit_cap):
            if cap is not None:
                cap.remove()
        self.micro_cap = self.unit_cap = None

    def regroup(self, units_per_step: int, group_size: int, restart: bool) -> None:
        """rollout.group_size_auto: later steps have `units_per_step` groups of `group_size` (all ranks). `restart` (a
        switch, not a resume): the GNS restarts (a new unit); the advisor's estimates go on (docs/probes.md 10.9)."""
        self.units = units_per_step
        if self.budget:
            self.budget.set_split(units_per_step, group_size)
        if restart:
            self.tracker.restart()
            self.rec_simple, self.rec_star = Hysteresis(self.rec_simple.hold), Hysteresis(self.rec_star.hold)

    # -------------------------------------------------------------------------------------- step
    def _reset(self, groups: Groups | int, completion_lengths: list[int]) -> None:
        if isinstance(groups, int):  # the size of every group (0: none yet)
            groups = Groups.of_rows(len(completion_lengths), groups) if groups else Groups(())
        self.groups = groups
        self.G = groups.sizes[0] if len(set(groups.sizes)) == 1 else 0  # the common size (0: none, or unequal)
        self.kept_sizes: list[int] = []  # the sizes of the groups seq_log_w holds, in its order
        self.n_local = len(self.groups)
        self.lengths = completion_lengths
        zero = _vector([0.0], self.device)[0]
        self.sums = {k: zero for k in STEP_SUMS}  # device scalars, reduced over ranks in metrics()
        self.seen_groups: set[int] = set()
        # per level: sum of |g_k|^2 (device scalar), K, sum 1/b_k, sum c_k^2/b_k (host floats from counts)
        self.small = {lv: {"s": zero, "k": 0.0, "ib": 0.0, "c2b": 0.0} for lv in self.levels}
        self.kept_groups = self.block_groups = 0
        self.broken: set[str] = set()
        self.kish = {k: ess_math.LogKish.empty(self.device) for k in ESS_KINDS if k != "seq"}
        self.log_rho_all: list[torch.Tensor] = []
        self.seq_log_w: list[torch.Tensor] = []

    def per_sequence(self, step: int) -> bool:
        """Whether step `step`'s capture reads each sequence's own gradient (the advisor's ANOVA, on unit_every
        steps): a shared-prompt row cannot give it (train/shared_prompt.py), so such a step runs padded."""
        return self.budget is not None and "unit" in self.levels and step % self.unit_every == 0

    def begin_step(
        self, groups: Groups | int, advantages: torch.Tensor, completion_lengths: list[int], step: int = 0, rewards=()
    ) -> None:
        """`advantages`, `completion_lengths` and `rewards` [n_seq]: all of this rank's sequences, group by group
        (`groups`, or the size of every group), including the groups that zero-advantage dropping will skip.
        `step`: the RL step (unit_every's cadence)."""
        self.guard.step_failed = False
        self.unit_on = "unit" in self.levels and step % self.unit_every == 0
        with self.guard("begin_step"):
            self._reset(groups, completion_lengths)
            zero = zero_adv_groups(advantages.detach().to(self.device), self.groups.sizes)
            self.sums["groups.n"] = float(self.n_local)
            self.sums["groups.zero"] = zero.double().sum()
            self.sums["len.sum"] = float(sum(completion_lengths))
            if self.budget:
                self.budget.begin_step(advantages.to(self.device), list(rewards), self.groups.sizes)

    def _add_small(self, level: str, s, k: float, inv_b: float, c2_over_b: float) -> None:
        acc = self.small[level]
        acc["s"], acc["k"] = acc["s"] + s, acc["k"] + k
        acc["ib"], acc["c2b"] = acc["ib"] + inv_b, acc["c2b"] + c2_over_b

    @contextmanager
    def micro(self, mb):
        """Arm the hooks around one micro-batch's forward + backward. Only the probes' own bookkeeping is
        guarded: an exception from the training code inside the block propagates as it would without probes."""
        armed = []
        with self.guard("micro"):
            if self.micro_cap:
                self.micro_cap.arm()
                armed.append(self.micro_cap)
            if self.unit_cap and self.unit_on:
                shared = getattr(mb, "shared", None) is not None  # one row per group (train/shared_prompt.py)
                if self.budget and shared:  # Learner.learn never builds this
                    raise RuntimeError("per-sequence capture of shared-prompt rows: a prompt's gradient is summed")
                tokens = None if (packed := getattr(mb, "packed", None)) is None else packed.group_tokens  # PackedRows
                k = self.mb_sizes = () if shared else self.groups.select(mb.group_ids).sizes  # per_prompt's differ
                per_seq = {"per_sequence": True, "seq_tokens": getattr(packed, "seq_tokens", None)}
                self.unit_cap.arm(len(mb.group_ids), tokens, group_sizes=k, **(per_seq if self.budget else {}))
                armed.append(self.unit_cap)
        try:
            yield
        finally:
            for cap in armed:
                cap.disarm()  # never raises; a hook's exception is kept in cap.error
        with self.guard("micro"):
            for cap in armed:
                if cap.error is not None:
                    self.broken.add("micro" if cap is self.micro_cap else "unit")
                    raise cap.error
            self._after_micro(mb)

    def _after_micro(self, mb) -> None:
        n, n_block = len(mb.group_ids), mb.n_units  # kept groups; the block's groups incl. dropped ones
        self.kept_groups += n
        self.seen_groups.update(mb.group_ids)
        self.block_groups += n_block
        scale = self.units / self.world
        # Pitfall P6: a hook count other than one per parameter (or LoRA module) means the captured norms are
        # not this micro-batch's gradient; that level's step is then skipped (counted in skipped_steps).
        if self.micro_cap and self.micro_cap.calls != len(self.params):
            self.hook_errors += 1
            self.broken.add("micro")
        if self.unit_cap and self.unit_on and not self.unit_cap.hooks_ok:
            self.hook_errors += 1
            self.broken.add("unit")
        if self.micro_cap:
            # dropped groups of the block are units with a zero gradient: they count in the block's mean
            g2 = (scale / n_block) ** 2 * self.micro_cap.sq_norm
            self._add_small("micro", g2, 1.0, 1.0 / n_block, (n_block / self.units) ** 2 / n_block)
        if self.unit_cap and self.unit_on:
            s = scale**2 * self.unit_cap.unit_sq_norms.sum()
            self._add_small("unit", s, float(n), float(n), n / self.units**2)
            if self.budget:
                self.budget.add(self.unit_cap.seq_sq_norms, self.unit_cap.unit_sq_norms, self.mb_sizes)

    def before_allreduce(self) -> None:
        with self.guard("before_allreduce"):
            self._before_allreduce()

    def _before_allreduce(self) -> None:
        # Groups skipped for a zero advantage are units with a zero gradient: at the unit level one zero small
        # batch each; at the micro level a block left empty is one zero small batch of the block's size (blocks
        # are fixed before dropping, see make_micro_batches). Their sequences and tokens count in the advantage
        # ESS with weight 0 (E6), so dropping leaves ess/adv_seq and ess/adv_token unchanged.
        skipped = self.n_local - self.kept_groups
        gone = [g for g in range(self.n_local) if g not in self.seen_groups]
        skipped_seqs = sum(self.groups.sizes[g] for g in gone)
        skipped_tokens = sum(self.lengths[r] for r in self.groups.rows_of(gone))
        empty = ess_math.LogKish.empty(self.device)
        self.kish["adv_seq"] += ess_math.LogKish(empty.shift, empty.s1, empty.s2, empty.n + skipped_seqs, empty.bad)
        self.kish["adv_tok"] += ess_math.LogKish(empty.shift, empty.s1, empty.s2, empty.n + skipped_tokens, empty.bad)
        if "unit" in self.small and self.unit_on:
            self._add_small("unit", 0.0, float(skipped), float(skipped), skipped / self.units**2)
        if "micro" in self.small:
            block = self.multiple // self.world
            left = self.n_local - self.block_groups
            while left > 0:
                b = min(block, left)
                self._add_small("micro", 0.0, 1.0, 1.0 / b, (b / self.units) ** 2 / b)
                left -= b
        if "rank" in self.levels:
            g = (self.units / self.world) / self.n_local
            c = self.n_local / self.units
            self._add_small("rank", g * g * _grad_sq_norm(self.params), 1.0, 1.0 / self.n_local, c * c / self.n_local)

    def after_allreduce(self) -> float:
        """Collective. Updates every level's GNS state from this step; returns Q = |G_B|^2 (pre-clip)."""
        keys = [(lv, f) for lv in self.levels for f in ("s", "k", "ib", "c2b", "broken")]
        n_budget = RolloutBudget.N_LOCAL if self.budget else 0
        local, q, budget = [math.nan] * len(keys), math.nan, [math.nan] * n_budget
        with self.guard("after_allreduce"):
            q = _grad_sq_norm(self.params)
            acc = {(lv, f): v for lv in self.levels for f, v in self.small[lv].items()}
            local = [float(lv in self.broken) if f == "broken" else acc[lv, f] for lv, f in keys]
            budget = self.budget.local_sums() if self.budget else []
        failed = float(self.guard.step_failed)
        tot = dist.all_reduce_(_vector([*local, *budget, failed], self.device))  # fixed size on every rank
        host = _to_host(torch.cat([tot, _vector([q], self.device)]))
        t, self.q = dict(zip(keys, host, strict=False)), host[-1]
        budget_tot, any_failed = host[len(keys) : len(keys) + n_budget], host[len(keys) + n_budget] > 0
        with self.guard("after_allreduce"):
            for lv in self.levels:
                if lv == "unit" and not self.unit_on:
                    self.tracker.last[lv] = None  # this step's raw values are NaN, not the last measured ones
                    continue
                # A non-finite norm (e.g. an inf gradient), a hook miscount or a probe failure on any rank
                # yields no estimate: the step is skipped (and counted) on every rank alike.
                bad = t[lv, "broken"] != 0 or any_failed
                s_sum = math.nan if bad else t[lv, "s"]
                self.tracker.update(lv, SmallBatchSums(s_sum, t[lv, "k"], t[lv, "ib"], t[lv, "c2b"]), self.q)
            if self.budget and self.unit_on:
                self.budget.update(budget_tot, self.q, valid=not (t["unit", "broken"] or any_failed))
        return self.q

    # -------------------------------------------------------------------------------------- ESS
    def observe_rollout(self, mb, old_logp: torch.Tensor, used_weights: torch.Tensor | None) -> None:
        with self.guard("observe_rollout"):
            self._observe_rollout(mb, old_logp, used_weights)

    def _observe_rollout(self, mb, old_logp: torch.Tensor, used_weights: torch.Tensor | None) -> None:
        m = mb.mask.bool()
        log_rho = old_logp.detach().double() - mb.rollout_logp.double()
        self.kish["tok_raw"] += ess_math.log_kish(log_rho, m)
        used = ess_math.weight_log(used_weights) if used_weights is not None else torch.zeros_like(log_rho)
        self.kish["tok_used"] += ess_math.log_kish(used, m)
        # Valid tokens are selected with `where` (boolean indexing would sync the host on CUDA); pads are
        # NaN for the quantile (ess.nan_quantile skips them) and 0 in the sums.
        self.log_rho_all.append(torch.where(m, log_rho, math.nan).reshape(-1))
        lr = torch.where(m, log_rho, 0.0)
        # KL(rollout || train) estimates from samples of the rollout policy; a non-finite ratio gives a
        # non-finite reading here (torch arithmetic never raises), while the ESS counts it as bad.
        self.sums["k1"] = self.sums["k1"] + (-lr).sum()
        self.sums["k3"] = self.sums["k3"] + (torch.exp(lr) - 1 - lr).sum()
        self.sums["rho2"] = self.sums["rho2"] + torch.where(m, torch.exp(2 * lr), 0.0).sum()
        self.sums["tok"] = self.sums["tok"] + m.double().sum()
        self.sums["lr.sum"] = self.sums["lr.sum"] + lr.sum()
        self.sums["lr.sq"] = self.sums["lr.sq"] + (lr * lr).sum()
        self.seq_log_w.append(ess_math.sequence_log_weights(log_rho, mb.mask))
        if not self.G:  # unequal groups: the sizes of the groups just appended
            self.kept_sizes += [self.groups.sizes[g] for g in mb.group_ids]
        log_abs_adv = ess_math.weight_log(mb.advantages.abs())
        self.kish["adv_seq"] += ess_math.log_kish(log_abs_adv)
        self.kish["adv_tok"] += ess_math.log_kish(log_abs_adv, counts=mb.mask.sum(-1))

    def observe_ppo(self, mb, logp: torch.Tensor, old_logp: torch.Tensor) -> None:
        with self.guard("observe_ppo"):
            self.kish["ppo"] += ess_math.log_kish(logp.detach().double() - old_logp.double(), mb.mask)

    def lora_health(self, model) -> dict[str, float]:
        """LoRA health (lora_health.py) under the guard: a failure counts in probe/failures; no lora/* that step."""
        with self.guard("lora_health"):
            return lora_health(model)
        return {}

    # -------------------------------------------------------------------------------------- output
    def metrics(self, work: StepWork | None = None) -> dict[str, float]:
        """Collective: reduce the ESS sums and format every probe value for logging. `work`: what this rank's
        step spent (the advisor's costs; None: unknown)."""
        # payload sizes fixed by the configuration, so every rank sends the same whatever failed
        n_work = self.budget.n_work_sums if self.budget else 0
        n_max, n_sum = len(ESS_KINDS) + 1, len(ESS_KINDS) * len(ESS_FIELDS) + len(STEP_SUMS) + n_work + 2
        n_gather = self.units // self.world  # groups per rank
        local_max, local_sums, gness, kish = [math.nan] * n_max, [math.nan] * n_sum, [math.nan] * n_gather, None
        with self.guard("metrics"):
            local_max, kish = self._local_maxima()
        mx = dist.all_reduce_(_vector(local_max, self.device), "max")
        if kish is not None:
            with self.guard("metrics"):
                local_sums = self._local_sums(kish, mx[: len(ESS_KINDS)], work)
        local_sums[-2:] = [float(self.guard.step_failed), float(self.guard.failures)]
        tot = dist.all_reduce_(_vector(local_sums, self.device))
        with self.guard("metrics"):
            gness = self._local_group_ness(n_gather)
        gathered = dist.all_gather_cat(_vector(gness, self.device) if isinstance(gness, list) else gness)
        host = _to_host(torch.cat([mx, tot, gathered]))
        out: dict[str, float] = {}
        with self.guard("metrics"):
            out = self._format(host[:n_max], host[n_max : n_max + n_sum], host[n_max + n_sum :])
        out["probe/failures"] = self.failures_total = host[n_max + n_sum - 1]  # all ranks, whole run
        out["probe/step_failed"] = float(host[n_max + n_sum - 2] > 0 or self.guard.step_failed)
        self.guard.step_failed = False
        return out

    def _local_maxima(self) -> tuple[list, dict[str, ess_math.LogKish]]:
        kish = dict(self.kish)
        seq_lw = torch.cat(self.seq_log_w) if self.seq_log_w else torch.zeros(0, dtype=torch.float64)
        kish["seq"] = ess_math.log_kish(seq_lw.to(self.device))
        all_lr = torch.cat(self.log_rho_all) if self.log_rho_all else torch.zeros(0, dtype=torch.float64)
        p999 = ess_math.nan_quantile(all_lr.exp(), 0.999) if all_lr.numel() else 0.0
        return [*(kish[k].shift for k in ESS_KINDS), p999], kish

    def _local_sums(self, kish: dict[str, ess_math.LogKish], shifts: torch.Tensor, work: StepWork | None) -> list:
        """Each ESS's sums rescaled to the global max shift, then the step's plain sums, the rollout budget's
        work sums; 2 slots for flags."""
        out = []
        for i, k in enumerate(ESS_KINDS):
            r = kish[k].rescaled(shifts[i])
            out += [r.s1, r.s2, r.n, r.bad]
        budget = self.budget.work_sums(work) if self.budget else []
        return [*out, *(self.sums[k] for k in STEP_SUMS), *budget, 0.0, 0.0]

    def _local_group_ness(self, n: int) -> torch.Tensor:
        """Within-group ness of this rank's kept groups, padded with NaN to the fixed per-rank group count
        (ranks keep different numbers of groups after zero-advantage dropping)."""
        seq_lw = torch.cat(self.seq_log_w).to(self.device) if self.seq_log_w else None
        g = (
            ess_math.group_ness(seq_lw, self.G or self.kept_sizes)
            if seq_lw is not None
            else torch.zeros(0, dtype=torch.float64)
        )
        g = g.to(self.device)
        pad = torch.full((n - g.numel(),), math.nan, dtype=torch.float64, device=self.device)
        return torch.cat([g, pad])

    def _format(self, mx: list[float], tot: list[float], gathered: list[float]) -> dict[str, float]:
        names = [f"{k}.{f}" for k in ESS_KINDS for f in ESS_FIELDS] + list(STEP_SUMS)
        t = dict(zip(names, tot, strict=False))
        ess = {k: ess_math.kish(mx[i], *(t[f"{k}.{f}"] for f in ESS_FIELDS)) for i, k in enumerate(ESS_KINDS)}
        groups = sorted(x for x in gathered if not math.isnan(x))
        bad_tokens = t["tok_raw.bad"] + t["tok_used.bad"]
        out = self._ess_format(ess, t, mx[-1], groups, bad_tokens)
        zero_adv_group_frac = t["groups.zero"] / max(t["groups.n"], 1.0)
        mean_group_tokens = t["len.sum"] / max(t["groups.n"], 1.0)
        out.update(self._gns_metrics(zero_adv_group_frac, mean_group_tokens))
        if self.budget:
            n_work = self.budget.n_work_sums
            out.update(self.budget.metrics(tot[len(names) : len(names) + n_work], measured=self.unit_on))
        self.invalid_streak = 0 if out.get("probe/gns/valid", 0.0) else self.invalid_streak + 1
        out.update(alerts(out, self.invalid_streak, list(self.ess_history)))
        # a step with every group dropped has no token ESS, and a non-finite weight is a flag, not a
        # measurement: neither enters the drop rule's history
        if out["probe/ess/defined"] and not bad_tokens:
            self.ess_history.append(mismatch_ess(out))
        return out

    def _gns_metrics(self, p0: float, mean_group_tokens: float) -> dict[str, float]:
        out: dict[str, float] = {"probe/gns/degenerate_group_frac": p0, "probe/gns/hook_errors": self.hook_errors}
        B = float(self.units)
        primary = next((lv for lv in LEVELS if lv in self.tracker.levels), None)
        for lv, st in self.tracker.levels.items():
            out[f"probe/gns/trace_sigma_est@{lv}"] = st.trace_sigma
            out[f"probe/gns/grad_sq_norm_est@{lv}"] = st.grad_sq_norm
            out[f"probe/gns/b_simple@{lv}"] = st.b_simple
        if primary is None:
            return out
        st, raw = self.tracker.levels[primary], self.tracker.last.get(primary)
        bs, (lo, hi) = st.b_simple, st.band
        bounds = (self.units, self.multiple, self.multiple, 16 * self.units)
        bstar = b_star(bs, *self.step_time) if st.valid else float("nan")
        star_band = (b_star(lo, *self.step_time), b_star(hi, *self.step_time))  # B* is monotone in B_simple
        rec = self.rec_simple(recommend_batch(st, *bounds).batch)
        rec_star = self.rec_star(recommend_batch(st, *bounds, target_band=star_band).batch)
        mean_size = self.groups.n_rows / max(len(self.groups), 1)  # G, or per_prompt allocation's mean
        out.update(level_report(st, raw, B, mean_size, mean_group_tokens, self.q))
        out["probe/gns/recommended_batch"] = rec  # kappa * B_simple (kappa = 1)
        out["probe/gns/b_star"] = bstar  # goodput-optimal batch; NaN unless probe.step_time_* are set
        out["probe/gns/recommended_batch_star"] = rec_star
        return out

    # -------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """Everything later steps' outputs depend on (JSON-safe): the GNS EMAs, the recommendations'
        hysteresis, the ESS drop-rule history, the invalid-step streak and the failure count."""
        return {
            "gns": self.tracker.state_dict(),
            "rec_simple": {"value": self.rec_simple.value, "since": self.rec_simple.since},
            "rec_star": {"value": self.rec_star.value, "since": self.rec_star.since},
            "ess_history": list(self.ess_history),
            "invalid_streak": self.invalid_streak,
            "hook_errors": self.hook_errors,
            "failures": self.failures_total,  # over all ranks: restored on rank 0 only
            "budget": self.budget.state_dict() if self.budget else None,
        }

    def load_state_dict(self, d: dict) -> None:
        """Continue from `state_dict()`. A checkpoint saved with another gns_ema_beta: the configured beta wins
        and the GNS EMAs restart (mixed betas would break the bias correction and N_eff), with a warning."""
        if not self.tracker.load_state_dict(d["gns"]):
            dist.print0(
                f"probe: checkpoint has probe.gns_ema_beta={d['gns']['beta']}, config has {self.tracker.beta}; "
                "keeping the configured beta and restarting the GNS EMAs (B_simple warms up again)"
            )
        self.rec_simple, self.rec_star = (Hysteresis(self.rec_simple.hold, **d[k]) for k in ("rec_simple", "rec_star"))
        self.ess_history = deque(d["ess_history"], maxlen=self.ess_history.maxlen)
        self.invalid_streak, self.hook_errors = d["invalid_streak"], d["hook_errors"]
        if self.budget and d.get("budget"):  # a checkpoint from before the advisor (or without it) starts it fresh
            self.budget.load_state_dict(d["budget"])
        rank0 = dist.rank() == 0
        self.guard.failures = int(d.get("failures", 0)) if rank0 else 0
