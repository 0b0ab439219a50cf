"""The rollout-budget probe: the nested ANOVA fed from the unit level's capture, and the advisor's advice.

Per step (docs/probes.md 9.4, 10.2), on the steps the unit level measures:
    begin_step(advantages, rewards)        # which groups are fed in; this rank's waste curve
    add(seq_sq, group_sq, sizes)           # after each captured micro-batch: sum |h_ij|^2, sum |h_i|^2 / k_i
    local_sums() / update(totals, q)       # in StepProbes.after_allreduce's one collective
    work_sums(work) / metrics(totals)      # in StepProbes.metrics' sum all-reduce: waste and costs, then the tags

Which groups are fed in: with `exact_zero` (no KL term, the condition under which train.drop_zero_adv_groups is
exact) a zero-advantage group has a zero gradient, so the ANOVA reads the informative groups only (B = their
number over all ranks, Q = |G_B|^2 (U / B)^2, the squared norm of their mean) and the advisor's waste is the
measured one. With a KL term every group has a gradient: all U groups are fed in and the advisor ignores waste
(a zero-advantage group still carries the KL term's gradient, so it is not wasted).

Costs (docs/probes.md 10.2): the phase timer's generate, score and train seconds, split by tokens. A backend that
prefills a prompt once for its K completions (vLLM's prefix cache) charges the prompt tokens' share of generation
to the prompt; everything else (decode, scoring, the training forward/backward, which runs every sequence with its
prompt) to the completion. A prefill token is charged like a decode token: on a GPU prefill is cheaper per token,
so c_p is overstated there and K* (which grows as sqrt(c_p)) is an upper estimate.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from rl_training.algs.common import zero_adv_groups
from rl_training.probes.advisor import SplitCosts, advise, best_k, group_waste
from rl_training.probes.anova import QUANTITIES, AnovaState, group_sums_from_contributions, nested_anova

K_MAX = 64  # the largest K the advisor considers (the waste curve's length)


@dataclass(frozen=True)
class StepWork:
    """What this rank's step spent, for the advisor's per-prompt and per-completion costs."""

    seconds: dict[str, float]  # the phase timer's (generate, score and train are read)
    prompts: int
    completions: int
    prompt_tokens: int  # summed over the prompts, each once
    completion_tokens: int
    prompt_once: bool  # the backend prefills each prompt once for its K completions


def split_seconds(work: StepWork) -> tuple[float, float]:
    """(seconds charged to the prompts, seconds charged to the completions) of one rank's step."""
    gen = work.seconds.get("generate", 0.0)
    rest = work.seconds.get("score", 0.0) + work.seconds.get("train", 0.0)
    tokens = work.prompt_tokens + work.completion_tokens
    share = work.prompt_tokens / tokens if work.prompt_once and tokens else 0.0
    return gen * share, gen * (1 - share) + rest


class _Ema:
    """Bias-corrected EMA of a fixed-length vector."""

    def __init__(self, beta: float, n: int):
        self.beta, self.t, self.m = beta, 0, [0.0] * n

    def update(self, x: list[float]) -> None:
        self.t += 1
        self.m = [self.beta * a + (1 - self.beta) * b for a, b in zip(self.m, x, strict=True)]

    @property
    def value(self) -> list[float]:
        c = 1 - self.beta**self.t
        return [v / c for v in self.m] if self.t else [math.nan] * len(self.m)


class RolloutBudget:
    def __init__(
        self,
        *,
        group_size: int,
        units_per_step: int,
        world_size: int,
        ema_beta: float,
        exact_zero: bool,
        b_multiple: int,
        device: torch.device,
        measured_every: int = 1,
    ):
        self.K, self.units, self.world = group_size, units_per_step, world_size
        self.n = group_size * units_per_step  # the step's completion budget, which set_split keeps
        self.exact_zero, self.b_multiple, self.device = exact_zero, b_multiple, device
        self.k_max = max(K_MAX, group_size)
        # The ANOVA updates only on the steps the unit level measures (every `measured_every`-th, probe.unit_every).
        # Its EMA factor is per update, so beta^measured_every keeps its window, warm-up and trust lag the same
        # number of *steps* as the per-step EMAs': with beta itself, the 60-update warm-up of beta 0.95 took 240
        # steps at unit_every 4, and the trust flag could not rise in a 100-step run (docs/probes.md 9.5).
        self.state = AnovaState(beta=ema_beta**measured_every)
        self.waste = _Ema(ema_beta, self.k_max)  # w(k), k = 1..k_max: mean over the step's prompts
        self.costs = _Ema(ema_beta, 2)  # (c_p, c_r) seconds
        self.last = None  # this step's AnovaEstimate (None: not measured or not identifiable)
        self.begin_step(torch.zeros(0), [])

    def set_split(self, units_per_step: int, group_size: int) -> None:
        """rollout.group_size_auto: later steps have `units_per_step` groups of `group_size` (all ranks); the advice
        stays for the budget (B* completions_per_step // K*)."""
        self.units, self.K = units_per_step, group_size

    # ----------------------------------------------------------------------------------- the step
    def begin_step(self, advantages: torch.Tensor, rewards, sizes: tuple[int, ...] | None = None) -> None:
        """`advantages` [n_seq] and `rewards` [n_seq] of this rank's groups (every group, dropped ones too), whose
        sizes are `sizes` (None: groups of the split's K; rollout.allocation: per_prompt's differ)."""
        if sizes is None:
            sizes = (self.K,) * (len(rewards) // self.K) if self.K else ()
        n = len(sizes)
        zero = zero_adv_groups(advantages.detach(), sizes) if n else torch.zeros(0, dtype=torch.bool)
        fed = ~zero if self.exact_zero else torch.ones_like(zero)
        k = torch.tensor(sizes, dtype=torch.float64, device=zero.device)
        # this rank's groups fed in, their completions and sum k_i^2, and all its completions (the step's N)
        self.counts = [fed.double().sum(), (fed * k).sum(), (fed * k * k).sum(), k.sum()]
        self.h = torch.zeros(2, dtype=torch.float64, device=self.device)  # sum |h_ij|^2, sum |h_i|^2 / k_i
        starts = [0, *itertools.accumulate(sizes)]
        curves = [group_waste(list(rewards[a:b]), self.k_max) for a, b in itertools.pairwise(starts)]
        self.waste_sum = [sum(c[k] for c in curves) for k in range(self.k_max)]
        self.groups_local = n
        self.last = None

    def add(self, seq_sq: torch.Tensor, group_sq: torch.Tensor, sizes) -> None:
        """One captured micro-batch: `seq_sq` [n_seq], `group_sq` [n] squared norms of each sequence's and each
        group's contribution to this rank's gradient (LoraUnitCapture), `sizes` the n groups' sizes."""
        # A group left out (zero advantage, exact_zero) has h = 0 here: summing it in changes nothing.
        k = torch.tensor(sizes, dtype=group_sq.dtype, device=group_sq.device)
        self.h = self.h + torch.stack([seq_sq.sum(), (group_sq / k).sum()])

    def local_sums(self) -> list:
        """This rank's [sum |h_ij|^2, sum |h_i|^2 / k_i, groups fed in, their completions, their sum k_i^2, all its
        completions] (device scalars: no host sync)."""
        return [self.h[0], self.h[1], *(c.to(self.device) for c in self.counts)]

    N_LOCAL = 6

    def update(self, totals: list[float], q: float, valid: bool) -> None:
        """After the all-reduce of local_sums (`totals`) and Q = |G_B|^2, on a step the unit level measured:
        one ANOVA update, or a skipped one (counted) when the capture broke or failed on any rank (`valid`).
        Q of the groups fed in: G_B is the mean of all N completions' g_ij, the fed ones' mean is N / N_fed
        times it (the others' g_ij are 0)."""
        seq, grp, fed, n_fed, k_sq, n_all = totals
        q_fed = q * (n_all / n_fed) ** 2 if self.exact_zero and n_fed > 0 else q
        sums = group_sums_from_contributions(seq, grp, fed, n_fed, k_sq, n_all / self.world)
        self.last = nested_anova(sums, q_fed) if valid else None
        self.state.update(self.last)

    def work_sums(self, work: StepWork | None) -> list[float]:
        """This rank's [w(k) summed over its prompts for k = 1..k_max, prompts, c_p seconds, c_r seconds,
        prompts timed, completions timed]: fixed length, summed over ranks."""
        prompt_s, rollout_s = split_seconds(work) if work else (0.0, 0.0)
        timed = (work.prompts, work.completions) if work else (0, 0)
        return [*self.waste_sum, float(self.groups_local), prompt_s, rollout_s, *map(float, timed)]

    @property
    def n_work_sums(self) -> int:
        return self.k_max + 5

    # ----------------------------------------------------------------------------------- output
    def metrics(self, totals: list[float], measured: bool) -> dict[str, float]:
        """The probe/anova/* and probe/advisor/* tags from the all-reduced work_sums; {} on a step the unit
        level did not measure (`measured`: the advice is logged at the unit level's cadence, probe.unit_every)."""
        k = self.k_max
        prompts, prompt_s, rollout_s, n_p, n_c = totals[k : k + 5]
        if prompts > 0:
            self.waste.update([w / prompts for w in totals[:k]])
        if n_p > 0 and n_c > 0:
            self.costs.update([prompt_s / n_p, rollout_s / n_c])
        if not measured:
            return {}
        return {**self._anova_metrics(), **self._advice_metrics()}

    def _anova_metrics(self) -> dict[str, float]:
        st, raw = self.state, self.last
        est, se = st.estimate, st.se
        lo, hi = st.ratio_band
        out = {f"probe/anova/{q}": est[q] for q in QUANTITIES}
        out |= {f"probe/anova/{q}_raw": getattr(raw, q) if raw else math.nan for q in QUANTITIES}
        out |= {f"probe/anova/{q}_se": se[q] for q in QUANTITIES}
        return out | {
            "probe/anova/within_between_ratio": st.ratio,  # tr S_w / tr S_b
            "probe/anova/ratio_lo": lo,
            "probe/anova/ratio_hi": hi,
            "probe/anova/groups": raw.groups if raw else math.nan,  # B fed in this step (all ranks)
            "probe/anova/n_eff": st.n_eff,
            "probe/anova/trusted": float(st.trusted),
            "probe/anova/skipped_steps": float(st.skipped),
        }

    def _advice_metrics(self) -> dict[str, float]:
        c_p, c_r = self.costs.value
        waste = tuple(self.waste.value) if self.exact_zero else ()
        costs = SplitCosts(c_p, c_r, k_max=self.k_max, waste_by_k=waste if waste and math.isfinite(waste[0]) else ())
        st = self.state
        a = advise(
            st.estimate,
            st.ratio_band,
            st.trusted,
            costs,
            current_k=self.K,
            completions_per_step=self.n,
            b_multiple=self.b_multiple,
        )
        e = st.estimate
        ok = e["trace_between"] > 0 and c_r > 0
        no_waste = SplitCosts(c_p, c_r, k_max=min(self.k_max, self.n))
        return {
            "probe/advisor/k_star": a.k_star,
            "probe/advisor/b_star": a.b_star,
            "probe/advisor/k_lo": a.k_lo,
            "probe/advisor/k_hi": a.k_hi,
            "probe/advisor/k_current": float(self.K),
            "probe/advisor/k_star_no_waste": float(best_k(e["trace_between"], e["trace_within"], no_waste))
            if ok
            else math.nan,
            "probe/advisor/efficiency": a.efficiency,  # f(K*) / f(K): 1 = the current split is the best
            "probe/advisor/critical_rollouts": a.critical_rollouts,
            "probe/advisor/waste_at_k": costs.waste(self.K) if costs.has_waste else 0.0,  # the model's w(K)
            "probe/advisor/cost_prompt_s": c_p,
            "probe/advisor/cost_rollout_s": c_r,
            "probe/advisor/trusted": float(a.trusted),
            "probe/alert/rollout_split": float(a.far),
        }

    # ----------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        return {
            "anova": self.state.state_dict(),
            "waste": {"t": self.waste.t, "m": list(self.waste.m)},
            "costs": {"t": self.costs.t, "m": list(self.costs.m)},
        }

    def load_state_dict(self, d: dict) -> None:
        """Continue from state_dict(); a changed beta restarts the EMAs (AnovaState's rule), a changed K_MAX the
        waste curve."""
        same = self.state.load_state_dict(d["anova"])
        for name in ("waste", "costs"):
            ema, saved = getattr(self, name), d[name]
            if same and len(saved["m"]) == len(ema.m):
                ema.t, ema.m = saved["t"], list(saved["m"])
