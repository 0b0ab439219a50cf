"""The in-loop probes of one optimizer step: GNS small gradients at three levels, and the ESS family.

The trainer calls, per RL step (every rank, same order; the collectives are marked):
    probes.begin_step(group_size, advantages, completion_lengths)   # this rank's groups, before any dropping
    for each micro-batch, epoch 0:  with probes.micro(mb): forward + backward     (hooks armed only here)
                                    probes.observe_rollout(mb, old_logp, tis_weights)
    probes.before_allreduce(params)     # rank level: this rank's accumulated gradient
    [gradient all-reduce]
    probes.after_allreduce(params)      # Q = |G_B|^2 before clipping; GNS update        (collective)
    last inner epoch > 0:           probes.observe_ppo(mb, logp, old_logp)
    probes.metrics()                     # timed as the step's `probe` phase                 (collective)

Unit accounting (GNS_ESS.md 1.5, 2): U = prompt groups in the step over all ranks, all counted (groups whose
forward was skipped for a zero advantage are units with a zero gradient). With h the gradient a piece of work
added to this rank's `.grad` under the step's loss scaling and W ranks, the step gradient is
G_B = (1/W) sum_r grad_r = (1/U) sum_j gamma_j with per-unit gradients gamma_j = (U/W) h_j. Hence:
    unit  level: g = (U/W) h_j,               b = 1,   c = 1/U
    micro level: g = (U/W) h_mb / n_mb,       b = n_mb, c = n_mb/U
    rank  level: g = (U/W) grad_r / N_r,      b = N_r, c = N_r/U
The GNS is updated from epoch 0 only (on-policy, one update per rollout batch, so EMA samples are distinct).
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as tdist

from rl_training import dist
from rl_training.algs.dr_grpo import zero_adv_groups
from rl_training.probes import ess as E
from rl_training.probes.capture import LoraUnitCapture, MicroGradCapture
from rl_training.probes.dashboard import ESS_CRITICAL, ESS_WARN, alerts, mismatch_ess
from rl_training.probes.gns import GNSTracker, Hysteresis, SmallBatchSums, b_star, recommend_batch

LEVELS = ("unit", "micro", "rank")


def _grad_sq_norm(params) -> float:
    return sum(p.grad.detach().double().pow(2).sum().item() for p in params if p.grad is not None)


class StepProbes:
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
    ):
        self.levels = [lv for lv in LEVELS if lv in levels]
        self.params, self.device = params, device
        self.units, self.world = units_per_step, world_size
        self.multiple = world_size * micro_batch_groups
        self.tracker = GNSTracker(beta=ema_beta)
        self.step_time = step_time  # (t_f, t_u) of step time = t_f + t_u * B; zeros = unknown (no B*)
        hold = math.ceil(1 / (1 - ema_beta)) if ema_beta < 1 else 1
        self.rec_simple, self.rec_star = Hysteresis(hold), Hysteresis(hold)
        self.model = model
        self.micro_cap = self.unit_cap = None
        self.install_hooks()
        self.hook_errors = 0
        self.invalid_streak = 0
        self.ess_history: deque[float] = deque(maxlen=50)  # recent mismatch ESS values for the drop alert

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

    # -------------------------------------------------------------------------------------- step
    def begin_step(self, group_size: int, advantages: torch.Tensor, completion_lengths: list[int]) -> None:
        """`advantages` [n_seq] and `completion_lengths` [n_seq]: all of this rank's sequences, group by group,
        including the groups that zero-advantage dropping will skip."""
        self.G = group_size
        self.n_local = len(completion_lengths) // group_size
        self.lengths = completion_lengths
        zero = zero_adv_groups(advantages.detach().cpu(), group_size)
        self.group_stats = {"groups.n": float(self.n_local), "groups.zero": float(zero.sum().item())}
        self.group_stats["len.sum"] = float(sum(completion_lengths))
        self.seen_groups: set[int] = set()
        self.small: dict[str, list[tuple[float, float, float]]] = {lv: [] for lv in self.levels}  # (|g|^2,b,c)
        self.kept_groups = self.block_groups = 0
        self.broken: set[str] = set()
        self.ess_tok_raw, self.ess_tok_used = E.KishSums(0, 0, 0), E.KishSums(0, 0, 0)
        self.log_rho_all: list[torch.Tensor] = []
        self.seq_log_w: list[torch.Tensor] = []
        self.adv_seq, self.adv_tok = E.KishSums(0, 0, 0), (0.0, 0.0, 0.0)
        self.ppo = E.KishSums(0, 0, 0)
        self.mismatch = {"k1": 0.0, "k3": 0.0, "rho2": 0.0, "tok": 0.0}

    @contextmanager
    def micro(self, mb):
        n, n_block = len(mb.group_ids), mb.n_units  # kept groups; the block's groups incl. dropped ones
        self.kept_groups += n
        self.seen_groups.update(mb.group_ids)
        self.block_groups += n_block
        with (
            self.micro_cap.capture() if self.micro_cap else nullcontext(),
            self.unit_cap.capture(n) if self.unit_cap else nullcontext(),
        ):
            yield
        scale = self.units / self.world
        # Pitfall P6: a hook count other than one per parameter (or LoRA module) means the captured norms are
        # not this micro-batch's gradient; that level's step is then skipped (counted in skipped_steps).
        if self.micro_cap and self.micro_cap.calls != len(self.params):
            self.hook_errors += 1
            self.broken.add("micro")
        if self.unit_cap and not self.unit_cap.hooks_ok:
            self.hook_errors += 1
            self.broken.add("unit")
        if self.micro_cap:
            # dropped groups of the block are units with a zero gradient: they count in the block's mean
            g2 = (scale / n_block) ** 2 * self.micro_cap.sq_norm.item()
            self.small["micro"].append((g2, n_block, n_block / self.units))
        if self.unit_cap:
            for v in self.unit_cap.unit_sq_norms.tolist():
                self.small["unit"].append((scale**2 * v, 1.0, 1.0 / self.units))

    def before_allreduce(self) -> None:
        # Groups skipped for a zero advantage are units with a zero gradient: at the unit level one zero small
        # batch each; at the micro level a block left empty is one zero small batch of the block's size (blocks
        # are fixed before dropping, see make_micro_batches). Their sequences and tokens count in the advantage
        # ESS with weight 0 (E6), so dropping leaves ess/adv_seq and ess/adv_token unchanged.
        skipped = self.n_local - self.kept_groups
        skipped_tokens = sum(
            sum(self.lengths[g * self.G : (g + 1) * self.G]) for g in range(self.n_local) if g not in self.seen_groups
        )
        self.adv_seq = self.adv_seq + E.KishSums(0.0, 0.0, float(skipped * self.G))
        self.adv_tok = (self.adv_tok[0], self.adv_tok[1], self.adv_tok[2] + float(skipped_tokens))
        if "unit" in self.small:
            self.small["unit"] += [(0.0, 1.0, 1.0 / self.units)] * skipped
        if "micro" in self.small:
            block = self.multiple // self.world
            left = self.n_local - self.block_groups
            while left > 0:
                b = min(block, left)
                self.small["micro"].append((0.0, float(b), b / self.units))
                left -= b
        if "rank" in self.levels:
            g = (self.units / self.world) / self.n_local
            self.small["rank"].append((g * g * _grad_sq_norm(self.params), self.n_local, self.n_local / self.units))

    def after_allreduce(self) -> float:
        """Collective. Updates every level's GNS state from this step; returns Q = |G_B|^2 (pre-clip)."""
        q = _grad_sq_norm(self.params)
        flat = {}
        for lv, rows in self.small.items():
            flat[f"{lv}.s"] = sum(r[0] for r in rows)
            flat[f"{lv}.k"] = float(len(rows))
            flat[f"{lv}.ib"] = sum(1.0 / r[1] for r in rows)
            flat[f"{lv}.c2b"] = sum(r[2] ** 2 / r[1] for r in rows)
            flat[f"{lv}.broken"] = float(lv in self.broken)
        tot = dist.reduce_sums(flat, self.device)
        for lv in self.small:
            # A non-finite norm (e.g. an inf gradient) or a hook miscount on any rank yields no estimate: the
            # step is skipped and counted.
            s_sum = tot[f"{lv}.s"] if tot[f"{lv}.broken"] == 0 else math.nan
            self.tracker.update(lv, SmallBatchSums(s_sum, tot[f"{lv}.k"], tot[f"{lv}.ib"], tot[f"{lv}.c2b"]), q)
        self.q = q
        return q

    # -------------------------------------------------------------------------------------- ESS
    def observe_rollout(self, mb, old_logp: torch.Tensor, used_weights: torch.Tensor | None) -> None:
        m = mb.mask.bool()
        log_rho = old_logp.double() - mb.rollout_logp.double()
        rho = torch.exp(log_rho)
        self.ess_tok_raw = self.ess_tok_raw + E.kish_sums(rho, m)
        used = used_weights if used_weights is not None else torch.ones_like(rho)
        self.ess_tok_used = self.ess_tok_used + E.kish_sums(used, m)
        lr = log_rho[m]
        self.log_rho_all.append(lr)
        self.mismatch["k1"] += (-lr).sum().item()  # KL(rollout || train) estimates, samples from the rollout
        self.mismatch["k3"] += (torch.exp(lr) - 1 - lr).sum().item()
        self.mismatch["rho2"] += torch.exp(2 * lr).sum().item()
        self.mismatch["tok"] += float(lr.numel())
        self.seq_log_w.append(E.sequence_log_weights(log_rho, mb.mask))
        lengths = mb.mask.sum(-1)
        self.adv_seq = self.adv_seq + E.kish_sums(mb.advantages.abs())
        s1, s2, t = E.advantage_token_sums(mb.advantages, lengths)
        self.adv_tok = (self.adv_tok[0] + s1, self.adv_tok[1] + s2, self.adv_tok[2] + t)

    def observe_ppo(self, mb, logp: torch.Tensor, old_logp: torch.Tensor) -> None:
        self.ppo = self.ppo + E.kish_sums(torch.exp(logp.detach().double() - old_logp.double()), mb.mask)

    # -------------------------------------------------------------------------------------- output
    def metrics(self) -> dict[str, float]:
        """Collective: reduce the ESS sums and format every probe value for logging."""
        out, t = self._ess_metrics()
        zero_adv_group_frac = t["groups.zero"] / max(t["groups.n"], 1.0)
        mean_group_tokens = t["len.sum"] / max(t["groups.n"], 1.0)
        out.update(self._gns_metrics(zero_adv_group_frac, mean_group_tokens))
        self.invalid_streak = 0 if out.get("probe/gns/valid", 0.0) else self.invalid_streak + 1
        out.update(alerts(out, self.invalid_streak, list(self.ess_history)))
        if out["probe/ess/defined"]:  # a step with every group dropped has no token ESS: not a zero in the history
            self.ess_history.append(mismatch_ess(out))
        return out

    # -------------------------------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """Everything later steps' outputs depend on (JSON-safe): the GNS EMAs, the recommendations'
        hysteresis, the ESS drop-rule history and the invalid-step streak."""
        return {
            "gns": self.tracker.state_dict(),
            "rec_simple": {"value": self.rec_simple.value, "since": self.rec_simple.since},
            "rec_star": {"value": self.rec_star.value, "since": self.rec_star.since},
            "ess_history": list(self.ess_history),
            "invalid_streak": self.invalid_streak,
            "hook_errors": self.hook_errors,
        }

    def load_state_dict(self, d: dict) -> None:
        """Continue from `state_dict()`. A checkpoint saved with another gns_ema_beta: the configured beta wins
        and the GNS EMAs restart (mixed betas would break the bias correction and N_eff), with a warning.
        Checkpoints from before the probe state held more than the GNS EMAs ({"gns": ...} only) restore those."""
        saved_beta = d["gns"]["beta"]
        if not self.tracker.load_state_dict(d["gns"]):
            dist.print0(
                f"probe: checkpoint has probe.gns_ema_beta={saved_beta}, config has {self.tracker.beta}; "
                "keeping the configured beta and restarting the GNS EMAs (B_simple warms up again)"
            )
        if "rec_simple" not in d:
            return
        for name in ("rec_simple", "rec_star"):
            h = getattr(self, name)
            h.value, h.since = d[name]["value"], d[name]["since"]
        self.ess_history.clear()
        self.ess_history.extend(d["ess_history"])
        self.invalid_streak, self.hook_errors = d["invalid_streak"], d["hook_errors"]

    def _ess_metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        seq_lw = torch.cat(self.seq_log_w) if self.seq_log_w else torch.zeros(0, dtype=torch.float64)
        all_lr = torch.cat(self.log_rho_all) if self.log_rho_all else torch.zeros(0, dtype=torch.float64)
        local_max = seq_lw.max().item() if seq_lw.numel() else -math.inf
        p999 = torch.quantile(all_lr.exp(), 0.999).item() if all_lr.numel() else 0.0
        mx = dist.reduce_max({"lw": local_max, "p999": p999}, self.device)
        seq = E.log_domain_sums(seq_lw, mx["lw"]) if seq_lw.numel() else E.KishSums(0, 0, 0)
        gness = E.group_ness(seq_lw, self.G) if seq_lw.numel() else torch.zeros(0, dtype=torch.float64)
        sums = {}
        for name, s in (
            ("tok_raw", self.ess_tok_raw),
            ("tok_used", self.ess_tok_used),
            ("seq", seq),
            ("adv_seq", self.adv_seq),
            ("ppo", self.ppo),
        ):
            sums.update({f"{name}.w": s.sum_w, f"{name}.w2": s.sum_w2, f"{name}.n": s.n})
        sums.update(
            {
                "adv_tok.1": self.adv_tok[0],
                "adv_tok.2": self.adv_tok[1],
                "adv_tok.t": self.adv_tok[2],
                "lr.sum": all_lr.sum().item(),
                "lr.sq": (all_lr**2).sum().item(),
                **self.mismatch,
                **self.group_stats,
            }
        )
        t = dist.reduce_sums(sums, self.device)
        # Ranks can keep different numbers of groups (zero-advantage dropping): pad to the same length with NaN.
        pad = torch.full((self.n_local - gness.numel(),), math.nan, dtype=torch.float64)
        gather = _all_gather_cat(torch.cat([gness.double(), pad]), self.device)
        gather = gather[~torch.isnan(gather)]

        def k(name):
            return E.kish(E.KishSums(t[f"{name}.w"], t[f"{name}.w2"], t[f"{name}.n"]))

        tok, tok_raw, sq, adv, ppo = k("tok_used"), k("tok_raw"), k("seq"), k("adv_seq"), k("ppo")
        n_tok = max(t["tok"], 1.0)
        lr_mean = t["lr.sum"] / n_tok
        out = {
            "probe/ess/token": tok.ness,
            "probe/ess/token_raw": tok_raw.ness,
            "probe/ess/seq": sq.ness,
            "probe/ess/seq_abs": sq.ess,
            "probe/ess/group_min": gather.min().item() if gather.numel() else float("nan"),
            "probe/ess/group_median": gather.median().item() if gather.numel() else float("nan"),
            "probe/ess/ppo_token": ppo.ness if ppo.defined else 1.0,  # one epoch: the PPO ratio is exactly 1
            "probe/ess/adv_seq": adv.ness,
            "probe/ess/adv_token": E.adv_token_ness(t["adv_tok.1"], t["adv_tok.2"], t["adv_tok.t"]),
            "probe/ess/defined": float(tok.defined and tok_raw.defined),
            "probe/ess/ref_warn": ESS_WARN,  # constant reference lines for the off-policy chart
            "probe/ess/ref_critical": ESS_CRITICAL,
            # is/ratio_mean, is/ratio_max and is/trunc_frac come with the trainer's rollout canary.
            "is/log_ratio_mean": lr_mean,
            "is/log_ratio_std": math.sqrt(max(t["lr.sq"] / n_tok - lr_mean**2, 0.0)),
            "is/ratio_p99_9": mx["p999"],  # max over ranks of each rank's 99.9th percentile
            "is/kl_k1": t["k1"] / n_tok,
            "is/kl_k3": t["k3"] / n_tok,
            "is/chi2_token": t["rho2"] / n_tok - 1.0,
            "is/chi2_seq": (1.0 / sq.ness - 1.0) if sq.defined and sq.ness > 0 else float("nan"),
        }
        return out, t

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
        out.update(
            {
                "probe/gns/b_simple": bs,
                "probe/gns/b_simple_seq": bs * self.G,
                "probe/gns/b_simple_tokens": bs * mean_group_tokens,
                # Fieller band at +-2 SE (docs/probes.md 1.6): NaN in the warm-up, hi = inf while |G|^2 is
                # not significantly above 0
                "probe/gns/b_simple_lo": lo,
                "probe/gns/b_simple_hi": hi,
                "probe/gns/trusted": float(st.trusted),  # the recommendation's gate
                "probe/gns/zone_lo": bs / 2,  # efficient zone B in [B_s/2, 2 B_s]
                "probe/gns/zone_hi": bs * 2,
                "probe/gns/grad_sq_norm_est": st.grad_sq_norm,
                "probe/gns/trace_sigma_est": st.trace_sigma,
                "probe/gns/grad_sq_norm_raw": raw.grad_sq_norm if raw else float("nan"),
                "probe/gns/trace_sigma_raw": raw.trace_sigma if raw else float("nan"),
                "probe/gns/small_sq_norm_mean": raw.s_bar if raw else float("nan"),
                "probe/gns/big_sq_norm": self.q,
                "probe/gns/n_small": raw.k if raw else 0.0,
                "probe/gns/a": raw.a if raw else float("nan"),
                "probe/gns/beta": raw.beta if raw else float("nan"),
                "probe/gns/batch_units": B,
                "probe/gns/b_simple_rel_se": st.b_simple_rel_se,
                "probe/gns/n_eff": st.n_eff,
                "probe/gns/valid": float(st.valid),
                "probe/gns/skipped_steps": float(st.skipped),
                "probe/gns/batch_ratio": B / bs if st.valid and bs > 0 else float("nan"),
                "probe/gns/step_efficiency": B / (B + bs) if st.valid else float("nan"),
                "probe/gns/sample_efficiency": bs / (B + bs) if st.valid else float("nan"),
                "probe/gns/recommended_batch": rec,  # kappa * B_simple (kappa = 1)
                "probe/gns/b_star": bstar,  # goodput-optimal batch; NaN unless probe.step_time_* are set
                "probe/gns/recommended_batch_star": rec_star,
            }
        )
        return out


def _all_gather_cat(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Concatenate equal-length 1-D tensors from every rank (each rank has the same number of groups)."""
    if not dist.is_dist():
        return x
    x = x.to(device)
    out = [torch.empty_like(x) for _ in range(tdist.get_world_size())]
    tdist.all_gather(out, x)
    return torch.cat(out).cpu()
