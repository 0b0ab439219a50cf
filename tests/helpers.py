"""Everything the tests share that is not a fixture (fixtures: the conftest.py of each tier): paths and configs,
the docs page's code blocks, launching torchrun and reading a run back, system packages, a float64 LoRA policy
and fake rollouts, probe and backend stand-ins, the local Slurm cluster's commands, W&B's offline records.
No test module imports another: what two of them need lives here."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.algs.corrections import TruncatedIS
from rl_training.algs.objectives import OBJECTIVES, LossInput, StepNorm, policy_loss
from rl_training.base import dist
from rl_training.base.meter import Meter
from rl_training.config.schema import LoraCfg
from rl_training.policy.models import apply_lora, trainable_parameters
from rl_training.rollout.base import Rollouts
from rl_training.sandbox.worker import descendants
from rl_training.train.batches import forward_logits, make_micro_batches
from rl_training.train.learner import NULL_PROBES, UpdateHParams, train_on_rollouts

# ------------------------------------------------------------------------------------------- paths, configs
REPO = Path(__file__).resolve().parents[1]
TESTCFG = str(REPO / "cfg" / "testconfig.yaml")
# the real-model demo's configs (tests/real_model/: SmolLM2-135M-Instruct, make real-model)
REAL_RL_CFG, REAL_SFT_CFG = REPO / "cfg" / "smollm2_rl.yaml", REPO / "cfg" / "smollm2_sft.yaml"
SFT_CFG = str(REPO / "cfg" / "tiny_sft.yaml")
FIXTURES = REPO / "tests" / "fixtures"
WORKERS = REPO / "tests" / "workers"
RL_RUNNER = str(REPO / "rl_training" / "runners" / "rl_runner.py")
VLLM = ["rollout.backend=vllm", "vllm.kv_cache_gb=0.1"]  # the colocated engine at a CPU-sized KV cache


def data_overrides(reverse_data: Path) -> list[str]:
    return [f"data.train={reverse_data / 'train.jsonl'}", f"data.eval={reverse_data / 'heldout.jsonl'}"]


def server_cpus() -> set[int] | None:
    """The core a test's vLLM server runs on: the last one, where there are two or more (VLLMServer's cpus), so
    the engine's OpenMP threads do not spin on every core the trainer uses."""
    cores = sorted(os.sched_getaffinity(0))
    return {cores[-1]} if len(cores) > 1 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ docs/extending.md
DOC_EXTENDING = REPO / "docs" / "extending.md"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```\n", re.M | re.S)


def doc_blocks(path: Path = DOC_EXTENDING) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a docs page, in order."""
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(path.read_text())]


def doc_file(name: str, path: Path = DOC_EXTENDING) -> str:
    """The body of the page's `# file: NAME` block (a task file the page shows whole)."""
    (body,) = [b for _, b in doc_blocks(path) if b.startswith(f"# file: {name}\n")]
    return body


# --------------------------------- trainer and objective tests: a float64 LoRA policy, fake rollouts, one update
G = 2  # completions per prompt in the fake rollouts


def lora_policy(model_dir, seed: int = 0, attn_implementation: str = "sdpa"):
    """The tiny model in float64 with a LoRA adapter whose B matrices are random (B = 0 would zero every A
    gradient). sdpa, the default: transformers 5's eager path shifts logits by ~1e-7 when every row is padded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation=attn_implementation)
    model = apply_lora(base, LoraCfg(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def unit_sq_norms(model, mb, norm: StepNorm, group_tokens=None) -> torch.Tensor:
    """LoraUnitCapture's per-group squared gradient norms of one micro-batch's Dr-GRPO loss (epoch 0: old = new)."""
    from rl_training.probes.capture import LoraUnitCapture

    for p in trainable_parameters(model):
        p.grad = None
    cap = LoraUnitCapture(model)
    with cap.capture(len(mb.group_ids), group_tokens):
        logp = mb.unpack(token_logprobs(forward_logits(model, mb), mb.row_targets))
        loss = policy_loss(
            LossInput(OBJECTIVES["dr_grpo"], logp, logp.detach(), mb.advantages, mb.mask, norm, 0.2, 0.2)
        )
        loss.loss.backward()
    cap.remove()
    assert cap.hooks_ok and cap.error is None
    return cap.unit_sq_norms.clone()


def fake_rollouts(n_groups: int, seed: int = 0) -> Rollouts:
    """Random prompts (3-8 tokens) and completions (1-6 tokens); sampler log-probs all -1."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps, lps = [], [], []
    for _ in range(n_groups):
        p = torch.randint(2, 200, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(G):
            c = torch.randint(2, 200, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
            prompts.append(p)
            comps.append(c)
            lps.append([-1.0] * len(c))
    return Rollouts(prompts, comps, lps, [False] * len(comps), [""] * len(comps))


def with_observations(ro: Rollouts, obs_logp: float = 5.0, seed: int = 1) -> Rollouts:
    """`ro` made multi-turn: each completion split after its first token by a 2-4 token observation (mask 0,
    turn 0, sampler log-prob `obs_logp`: nonsense that nothing may read); the tokens after it are turn 2."""
    g = torch.Generator().manual_seed(seed)
    comps, lps, masks, turns = [], [], [], []
    for c, lp in zip(ro.completion_ids, ro.logprobs, strict=True):
        obs = torch.randint(2, 200, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        comps.append(c[:1] + obs + c[1:])
        lps.append(lp[:1] + [obs_logp] * len(obs) + lp[1:])
        masks.append([1] + [0] * len(obs) + [1] * (len(c) - 1))
        turns.append([1] + [0] * len(obs) + [2] * (len(c) - 1))
    return Rollouts(ro.prompt_ids, comps, lps, ro.truncated, ro.texts, loss_mask=masks, turn_index=turns)


def grads_after(
    model,
    rollouts,
    adv,
    groups_per_micro,
    *,
    extra_pad=0,
    kl_coef=0.0,
    drop=False,
    epochs=1,
    objective="dr_grpo",
    tis_cap=0.0,
    correction=None,
    pack_row_tokens=None,
    probes=None,
    share_prompt=False,
    group_size=G,
):
    """Run one update with lr 0 and no clipping; return the flat gradient of the last epoch and the update's meter,
    reduced (base/meter.py: .logged, .totals, .pers, .kept)."""
    params = trainable_parameters(model)
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mbs = make_micro_batches(
        rollouts,
        adv,
        group_size,
        groups_per_micro,
        0,
        torch.device("cpu"),
        drop,
        extra_pad,
        pack_row_tokens,
        share_prompt=share_prompt,
    )
    o = OBJECTIVES[objective]
    hp = UpdateHParams(
        objective=o,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        inner_epochs=epochs,
        kl_coef=kl_coef,
        max_grad_norm=0.0,
        correction=TruncatedIS(tis_cap) if tis_cap > 0 else correction,
    )
    norm = StepNorm(
        seqs=len(rollouts), tokens=sum(rollouts.trainable(i) for i in range(len(rollouts))), max_new_tokens=8
    )
    meter = Meter()
    train_on_rollouts(model, opt, sched, params, mbs, hp, norm, NULL_PROBES if probes is None else probes, meter)
    meter.logged = meter.reduce(torch.device("cpu"))
    return torch.cat([p.grad.reshape(-1).clone() for p in params]), meter


# A user task whose grader fails on purpose: records {"q": ..., "mode": "ok" | "raise" | "hang"}; "raise" raises,
# "hang" sleeps 30 s (past any test's reward.timeout_s), "ok" scores 0.5.
MOODY_TASK = """
import time

from rl_training.tasks import Example, Task


class Moody(Task):
    def parse(self, record, where):
        return Example(record["q"], record["mode"])

    def reward(self, completion, example):
        if example.reference == "raise":
            raise RuntimeError("the grader broke")
        if example.reference == "hang":
            time.sleep(30)
        return 0.5
"""


# Rewards scripted on the data and the completion's place in its group, never on what the model writes, so which
# groups tie is the same on any CPU (reverse-task data: prompts of the letters a-j; groups of an even size):
# - TiedOrMixed: a prompt whose string starts with a-e gets 0.5 on every completion (a tied group, zero advantage),
#   any other 0, 1, 0, 1 by place (informative): which groups tie follows from the data order alone;
# - Alternating: every group 0, 1, 0, 1: every group is informative, so every step has a gradient.
SCRIPTED_REWARDS = """
from rl_training.tasks.base import Scores
from rl_training.tasks.reverse import ReverseTask


class TiedOrMixed(ReverseTask):
    def grade(self, completions, examples, timeout_s):
        rewards = [0.5 if ex.question[0] <= "e" else float(i % 2) for i, ex in enumerate(examples)]
        return Scores(rewards, [r >= 0.5 for r in rewards], [True] * len(rewards))


class Alternating(ReverseTask):
    def grade(self, completions, examples, timeout_s):
        rewards = [float(i % 2) for i in range(len(examples))]
        return Scores(rewards, [r > 0 for r in rewards], [True] * len(rewards))
"""


def scripted_reward(tmp_path: Path, name: str) -> str:
    """task.name of the SCRIPTED_REWARDS class `name`, its module written under `tmp_path`."""
    (tmp_path / "scripted_rewards.py").write_text(SCRIPTED_REWARDS)
    return f"task.name={tmp_path / 'scripted_rewards.py'}:{name}"


# ----------------------------------------------------------- launching torchrun, and reading a launched run back


def torchrun_cmd(nproc: int, script: str | Path, *args: str, gpu: bool = False) -> list[str]:
    """torchrun's command line. Its workers stay on the CPU on a GPU machine too (RL_DEVICE=cpu, base/dist.py)
    unless `gpu` (a gpu-marked test): a CPU test's ranks would otherwise take the GPUs, and rank 1 of a 2-rank
    test stop on a 1-GPU box. Through `env`, so the caller's own environment for the launch still applies; with
    `gpu` that environment decides, and tests/conftest.py's RL_DEVICE=cpu must be out of it (test_gpu.py's
    fixture removes it for every test there)."""
    return [
        *([] if gpu else ["env", f"{dist.DEVICE_ENV}=cpu"]),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *args,
    ]


# Reading a launched run back
def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# four steps, checkpoints at 2 and 4 (both kept), no evals: a straight run whose last two steps a resume redoes
FOUR_STEPS = ["train.total_steps=4", "ckpt.every=2", "ckpt.keep_last=5", "eval.every=0"]


def straight_run(runs: Path, argv: list[str]) -> list[dict]:
    """rl_runner (in-process) with `argv` as run `runs`/straight; its metrics, one row per step."""
    from rl_training.runners import rl_runner

    assert rl_runner.main([*argv, "run.name=straight"]) == 0
    rows = read_metrics(runs / "straight")
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and rows
    return rows


def copy_without_last_checkpoint(runs: Path, last: int) -> None:
    """`runs`/straight copied to `runs`/resumed without its step-`last` checkpoint: the run a crash after the
    checkpoint before it leaves."""
    shutil.copytree(runs / "straight", runs / "resumed", symlinks=True)
    shutil.rmtree(runs / "resumed" / "checkpoints" / f"step_{last:06d}")


def resume_last_steps_match(
    runs: Path, argv: list[str], rows: list[dict], from_step: int, timed: tuple[str, ...] = ()
) -> None:
    """Copy the run `runs`/straight (its metrics `rows`) to `runs`/resumed without its last checkpoint, resume it
    with `argv` (the straight run's arguments, in-process rl_runner), and check that every step after `from_step`
    logs the same metrics (perf/, mem/ and the `timed` ones, wall-clock seconds, aside)."""
    import pytest

    from rl_training.runners import rl_runner

    copy_without_last_checkpoint(runs, rows[-1]["step"])
    assert rl_runner.main([*argv, "run.name=resumed", "ckpt.resume=latest"]) == 0
    again = read_metrics(runs / "resumed")
    assert [r["step"] for r in again] == [r["step"] for r in rows]
    for a, b in zip(rows[from_step:], again[from_step:], strict=True):
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/", *timed)):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)


def read_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir)]


def training_started(run_dir: Path) -> bool:
    """A complete first line in metrics.jsonl (polled while the run writes it)."""
    p = run_dir / "metrics.jsonl"
    return p.exists() and "\n" in p.read_text()


def trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


# --------------------------------------------------- system packages some tests need (never installed by a test)
REQUIRE_ENV = "RL_REQUIRE_CLUSTER_TESTS"


def skip_unless_required(reason: str, env: str = REQUIRE_ENV) -> NoReturn:
    """Skip the test, or fail it when `env` (RL_REQUIRE_CLUSTER_TESTS by default) is 1."""
    if os.environ.get(env) == "1":
        pytest.fail(f"{reason} [{env}=1: this test must run, not be skipped]", pytrace=False)
    pytest.skip(reason)


def require_debian_packages(binaries: dict[str, str]) -> None:
    """binaries: command -> Debian package providing it. Skips the test (fails it when required) when one is
    missing, naming the packages to install."""
    missing = sorted({pkg for cmd, pkg in binaries.items() if shutil.which(cmd) is None})
    if missing:
        skip_unless_required(
            f"needs the Debian package(s) {', '.join(missing)}: sudo apt-get install -y {' '.join(missing)} "
            "(or make setup as root; .ci/run installs them)"
        )


# ------------------------------------------------------------------------------- pass@k and maj@k by enumeration
def pass_by_enumeration(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def maj_by_enumeration(classes: list, correct: list[bool], k: int) -> float:
    """The definition, literally: every k-subset votes; ties split evenly; no votes = wrong."""
    total, subsets = 0.0, list(itertools.combinations(range(len(classes)), k))
    for s in subsets:
        votes: dict = {}
        for i in s:
            if classes[i] is not None:
                votes.setdefault(classes[i], []).append(correct[i])
        if votes:
            top = max(map(len, votes.values()))
            winners = [v for v in votes.values() if len(v) == top]
            total += sum(sum(v) / len(v) for v in winners) / len(winners)
    return total / len(subsets)


# ---------------------------------------------------------------------------------------- what W&B wrote offline
WANDB_BLOCK = 32768


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B data file"
    pos, raw, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            raw.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            raw.append(buf + chunk)
    out = []
    for r in raw:
        rec = pb.Record()
        rec.ParseFromString(r)
        out.append(rec)
    return out


def last_wandb_record(path: Path):
    """The file's last record; None while it has none or is still being written (a header or record cut short)."""
    try:
        return (wandb_records(path) or [None])[-1]
    except Exception:  # noqa: BLE001 (a file mid-write fails the header check or the protobuf parse)
        return None


def wandb_closed_files(run_dir: Path, timeout_s: float = 60.0) -> list[Path]:
    """The offline runs' data files of run_dir, once each ends with its 'exit' record: W&B's service process
    writes the file, and under load it was read back before the records were there (history empty, once in a full
    suite beside another tier)."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
        last = {f: last_wandb_record(f) for f in files}
        if files and all(r is not None and r.WhichOneof("record_type") == "exit" for r in last.values()):
            return files
        if time.monotonic() > deadline:
            found = {str(f.relative_to(run_dir)): r and r.WhichOneof("record_type") for f, r in last.items()}
            raise AssertionError(f"no closed W&B run under {run_dir} after {timeout_s} s (last records: {found})")
        time.sleep(0.2)


def wandb_history(run_dir: Path) -> list[dict]:
    """Every logged row ({key: value}, with '_step'), in order, over all offline runs of run_dir."""
    rows = []
    for f in wandb_closed_files(run_dir):
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
    return rows


def wandb_config(run_dir: Path) -> dict:
    for f in wandb_closed_files(run_dir):
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "run" and rec.run.config.update:
                return {i.key: json.loads(i.value_json) for i in rec.run.config.update}
    return {}


# --------------------------------------------------------------------------------- probes: one micro-batch by hand
def subset(ro: Rollouts, groups: list[int]) -> Rollouts:
    rows = [g * G + i for g in groups for i in range(G)]
    return Rollouts(
        *[[getattr(ro, f)[r] for r in rows] for f in ("prompt_ids", "completion_ids", "logprobs", "truncated", "texts")]
    )


def probe_step(model_dir, n_groups: int, model_seed: int, rollout_seed: int, adv: list[float]):
    """(the LoRA policy, fake rollouts of n_groups groups, their advantages, the step's Dr-GRPO normaliser): the
    probes' tests' one step."""
    model = lora_policy(model_dir, seed=model_seed)
    ro = fake_rollouts(n_groups, seed=rollout_seed)
    norm = StepNorm(seqs=n_groups * G, tokens=sum(len(c) for c in ro.completion_ids), max_new_tokens=8)
    return model, ro, torch.tensor(adv, dtype=torch.float64), norm


def one_micro_batch(ro, adv, groups):
    rows = [g * G + i for g in groups for i in range(G)]
    return make_micro_batches(subset(ro, groups), adv[rows], G, len(groups), 0, torch.device("cpu"))[0]


def backward(model, mb, norm):
    logp = mb.unpack(token_logprobs(forward_logits(model, mb), mb.row_targets))
    policy_loss(
        LossInput(OBJECTIVES["dr_grpo"], logp, logp.detach(), mb.advantages, mb.mask, norm, 0.2, 0.2)
    ).loss.backward()


def flat_grad(params):
    return torch.cat([p.grad.reshape(-1) for p in params]).clone()


def perturb_adapter(model, scale: float, seed: int) -> None:
    """Every LoRA B matrix random (seeded): an adapter whose delta moves the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


# ------------------------------------------------------------------------------------ a backend of canned texts
class CannedBackend:
    """Answers each prompt with fixed texts (cycled over n), tokenized like a real completion."""

    name = "canned"

    def __init__(self, tokenizer, texts_by_prompt: dict[tuple, list[str]]):
        self.tok, self.texts = tokenizer, texts_by_prompt
        self.seen: list[list[int]] = []

    def generate(self, prompts, spec, examples=None):
        self.seen += prompts
        texts = [self.texts[tuple(p)][j % len(self.texts[tuple(p)])] for p in prompts for j in range(spec.n)]
        ids = [[*self.tok(t, add_special_tokens=False).input_ids, self.tok.eos_token_id] for t in texts]
        expanded = [p for p in prompts for _ in range(spec.n)]
        return Rollouts(expanded, ids, [[0.0] * len(i) for i in ids], [False] * len(ids), texts)

    def sync_weights(self, model):
        pass

    def sleep(self):
        pass

    def wake(self):
        pass

    def metrics(self):
        return {}

    def close(self):
        pass


# ------------------------------------------------------------------------------------------------ sandbox pool
def sandbox_processes(pool) -> dict[int, int]:
    """Worker bwrap pid -> number of processes below it. An idle strict worker has exactly 1: the template, pid 1
    of the sandbox's namespace (bwrap --as-pid-1)."""
    with pool._cv:
        workers = list(pool._idle)
    return {w.proc.pid: len(descendants(w.proc.pid)) for w in workers}


# ------------------------------------------------------------------------------------- a GPU node, staged on CPU
H100 = "NVIDIA H100 80GB HBM3, 570.86.15"
# What these tests stage (a CPU torch on a GPU node) needs this machine's CPU torch; a CUDA machine skips them.
needs_cpu_torch = pytest.mark.skipif(torch.version.cuda is not None, reason="stages a CPU torch build")


def fake_nvidia_smi(bin_dir: Path, lines: list[str], status: int = 0) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + "".join(f"echo '{x}'\n" for x in lines) + f"exit {status}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


# ------------------------------------------------------------------------ the local Slurm cluster (tests/cluster)
SBATCH = REPO / "scripts" / "slurm" / "rl_train.sbatch"
CHAIN = REPO / "scripts" / "slurm" / "submit_chain.sh"
SLURM_LOCAL = REPO / "scripts" / "slurm" / "local_cluster.sh"  # the throw-away cluster the cluster tier uses


def job_env(**extra) -> dict[str, str]:
    # The repository and python the job uses; PYTHONPATH (if set, e.g. a worktree) passes through.
    return {**os.environ, "RL_REPO": str(REPO), "RL_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


# Resources of the wrapper that do not exist here: no GPUs; each fake node claims the host's 2 CPUs.
TEST_RESOURCES = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]


def sbatch(args: list[str], cwd: Path, env: dict) -> str:
    r = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={cwd}", f"--output={cwd}/slurm-%j.out", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def wait_job(job: str, timeout: int) -> int:
    return subprocess.run(["bash", str(SLURM_LOCAL), "wait", job, str(timeout)], timeout=timeout + 60).returncode


def job_field(job: str, name: str) -> str:
    line = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S+)", line)
    return m.group(1) if m else ""


def step_environments(job: str, nodes=("n1", "n2"), timeout: float = 240) -> dict[str, dict]:
    """Read the environment of the job's processes from /proc while it runs (all fake nodes are this host):
    node -> {"launcher": env, "worker": env}. Processes found with `scontrol listpids`."""
    found: dict[str, dict] = {n: {} for n in nodes}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(len(v) == 2 for v in found.values()):
        for node in nodes:
            r = subprocess.run(["scontrol", "listpids", job, node], capture_output=True, text=True)
            for line in r.stdout.splitlines()[1:]:
                pid = line.split()[0]
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
                except OSError:
                    continue
                env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
                if "rl_training.cluster.launch" in cmd:
                    found[node]["launcher"] = env
                elif "rl_runner.py" in cmd and "RANK" in env:
                    found[node]["worker"] = env
        time.sleep(0.2)
    return found


def run_demo_script(script: str, *args: str, timeout: float = 1200) -> tuple[subprocess.CompletedProcess, float]:
    """A demo script of scripts/ run as a user runs it (offline, from the repository): its result and wall time."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, f"scripts/{script}", *args],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r, wall


def wait_until(cond, what: str, timeout_s: float = 10.0) -> None:
    """Poll `cond()` until it holds; fail naming `what` after `timeout_s` (a deadline, never a guess of how long)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.005)


def data_order(seed: int = 0) -> int:
    """A learning test's data order (train.seed) moved by $RL_DATA_ORDER, as the demos' (scripts/demo.py)."""
    return seed + int(os.environ.get("RL_DATA_ORDER", "0"))


def clears(name: str, value: float, bar: float, at_most: bool = False) -> bool:
    """Whether a learning result clears its bar (value >= bar; `at_most`: value <= bar, an ablation's ceiling),
    recorded as a JSON line {"name", "value", "bar", "margin"} in $RL_MARGINS when set: scripts/check_robustness.sh
    prints every margin of every cell of its matrix, failed ones included. Use as `assert clears(...), summary`."""
    margin = bar - value if at_most else value - bar
    if os.environ.get("RL_MARGINS"):
        row = {"name": name, "value": round(value, 4), "bar": bar, "at_most": at_most, "margin": round(margin, 4)}
        with open(os.environ["RL_MARGINS"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return margin >= 0


def metered(stats) -> dict[str, float]:
    """What an environment's call stats (Environment.call_stats) log: measured into a meter, reduced (one rank)."""
    meter = Meter()
    stats.measure(meter)
    return meter.reduce(torch.device("cpu"))


REAL_MODEL_REQUIRED = "RL_REQUIRE_REAL_MODEL"


def real_model_path() -> Path:
    """The converted SmolLM2-135M-Instruct ($RL_REAL_MODEL, else scripts/get_real_model.py's output), or a skip
    naming `make real-model`; a failure instead where RL_REQUIRE_REAL_MODEL=1 (CI converts it first: .ci/run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("get_real_model", REPO / "scripts" / "get_real_model.py")
    grm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grm)
    path = Path(os.environ.get("RL_REAL_MODEL", REPO / grm.DEFAULT_OUT))
    if not grm.complete(path):
        skip_unless_required(f"no converted real model at {path}: run `make real-model`", REAL_MODEL_REQUIRED)
    return path


class Crash(Exception):
    """What `crash_at` raises: a run that dies between steps, its checkpoints as they were."""


def crash_at(monkeypatch, step: int) -> None:
    """rl_runner's step `step` (0-based) raises Crash: steps before it are logged, later checkpoints not written;
    monkeypatch.undo() (or a new setattr) restores the real step."""
    from rl_training.runners import rl_runner

    real_step = rl_runner.rl_step

    def crashing(run, s):
        if s == step:
            raise Crash
        return real_step(run, s)

    monkeypatch.setattr(rl_runner, "rl_step", crashing)
