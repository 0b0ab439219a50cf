"""Side by side with TRL's GRPOTrainer on the same work, plus the floor (the work itself, no trainer): one table.

    make bench-trl                                    # sets up .venv-trl (TRL, optional) and runs this
    .venv-trl/bin/python scripts/bench_trl.py [--steps 20 --block 5 --warmup 3] [--points short,long]
        [--contenders trl,ours-vllm,ours-hf,ours-hf-noprobe,floor] [--out bench_results/bench_trl.json]
    .venv-trl/bin/python scripts/bench_trl.py --points real --steps 6 --block 2 --warmup 1 \
        --contenders trl,trl-vllm,ours-vllm,ours-vllm-noskip,ours-hf,floor          # needs `make real-model`
        (also ours-hf-pack / ours-vllm-pack: with train.pack_sequences=true; ours-hf-noskip / ours-vllm-noskip:
        with train.drop_zero_adv_groups=false, every group forwarded and back-propagated as TRL does; ours-hf-shared /
        ours-vllm-shared: with train.share_prompt=true, each group's prompt through the model once)

The work (issue 21): Dr-GRPO (TRL: loss_type="dr_grpo", scale_rewards="none", beta=0), LoRA r=8 alpha=16
dropout 0 on q,k,v,o,gate,up,down, AdamW lr 1e-4 constant, grad-norm clip 1.0, 16 prompts x 8 completions per
step, temperature 1, top_p 1, one update per batch, no gradient checkpointing, float32, 2 torch threads, on the
project's tiny 4-layer hidden-128 Qwen2 (byte tokenizer) after an SFT warm start. Two points:
- short: two-digit addition ('37+48=' -> '85', completions of ~3 tokens), at most 16 new tokens;
- long: reversing 24-40 letter strings (completions of ~30 tokens), at most 48 new tokens.
The reward is the same function for every contender (rewards.reverse_reward: matching positions).
- real (issue 48): the real model, SmolLM2-135M-Instruct (Q4_1 dequantized; `make real-model`), from its base
  weights, on chat prompts (its own template) of the real-model demo's reasoning-gym task (cfg/smollm2_rl.yaml), 4
  prompts x 8 completions of at most 64 new tokens; the reward is that task's grader (reasoning-gym's score_answer
  on the <answer> tag) for every contender. Generation dominates here. trl-vllm is TRL with use_vllm=True in its
  colocate mode (the same vLLM build as ours, in the same process), where it runs.

Each contender is its own long-lived process (so its peak RSS is its own and no engine shares a process), built
once; the script tells them in turn to run `--block` steps, so the machine's noise hits all of them alike, and
takes the median step time of the `--steps` timed steps after `--warmup`. All of it is repeated `--runs` times
(3 by default; fresh processes, the contenders' order rotated each run): the table gives the median over the
runs and their spread (min-max), for the step times and for each ratio. The floor is the same generation
(HF generate) plus one forward/backward/AdamW step in plain transformers + peft: how close each trainer is to
the work itself. Writes the table and JSON (bench_results/bench_trl.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SKIPPED = "skipped_token_frac"  # our rows' train/skipped_token_frac, carried beside the phases
POINTS = {
    "short": {"task": "add", "max_new": 16, "prompts": 16, "group": 8, "micro": 16},
    "long": {"task": "reverse_long", "max_new": 48, "prompts": 16, "group": 8, "micro": 16},
    "real": {"task": "real", "max_new": 64, "prompts": 4, "group": 8, "micro": 1},
}
# "micro": prompt groups per forward/backward (gradients accumulated over prompts / micro of them, one optimizer
# step), the same for every contender. The real point's 32 sequences in one forward took 10 GB in one contender and
# the kernel's OOM killer ended it beside the others (24 GiB): one group (8 sequences) a micro-batch.
REAL_CFG = REPO / "cfg" / "smollm2_rl.yaml"  # the real-model demo's task: its data, prompts and grader


# ----------------------------------------------------------------------------------------- preparation
def task_rows(task: str, n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    if task == "add":
        return [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10, 100) for b in range(10, 100)]
    rows = []
    for _ in range(n):
        s = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(24, 40)))
        rows.append({"question": s, "answer": s[::-1]})
    return rows


def prepare(work: Path, task: str) -> tuple[Path, Path]:
    """(SFT-warmed model dir, train jsonl) for a task; built once and kept under `work`."""
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.runners import sft_runner

    if task == "real":
        return prepare_real(work)
    d = work / task
    model, data = d / "sft" / "warm" / "final_model", d / "train.jsonl"
    if (model / "config.json").exists() and data.exists():
        return model, data
    d.mkdir(parents=True, exist_ok=True)
    rows = task_rows(task, 4000)
    random.Random(1).shuffle(rows)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = make_tiny_model(d / "base", seed=0)
    over = [
        f"model.name_or_path={base}",
        f"data.train={data}",
        f"data.eval={data}",
        f"run.output_dir={d / 'sft'}",
        "run.name=warm",
        "run.progress_bar=false",
        "sft.steps=150",
        "data.max_prompt_tokens=64",
    ]
    assert sft_runner.main(["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), *over]) == 0
    return model, data


def real_task():
    from rl_training.config.load import load_config
    from rl_training.tasks.build import build_task

    cfg = load_config(REAL_CFG, [])
    return cfg, build_task(cfg)


def prepare_real(work: Path) -> tuple[Path, Path]:
    """(the real model's directory, its train split as jsonl: the question, the answer and reasoning-gym's entry,
    which its grader reads) for every contender."""
    from rl_training.config.load import load_config

    model = REPO / load_config(REPO / "cfg" / "smollm2_sft.yaml", []).model.name_or_path
    if not (model / "PROVENANCE.md").is_file():
        raise SystemExit(f"bench_trl: the real point needs {model}: run `make real-model`")
    data = work / "real" / "train.jsonl"
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        _, task = real_task()
        rows = [
            {"question": e.question, "answer": e.reference, "entry": e.meta["entry"]} for e in task.examples("train")
        ]
        data.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return model, data


# --------------------------------------------------------------------------------------------- workers
# Each contender's `step()` runs one RL step and returns (seconds, generated tokens, {phase: seconds}).
def ours(model: Path, data: Path, spec: dict, backend: str, probes: bool, out: Path, extra: list[str] = ()):
    from rl_training.base import dist
    from rl_training.config.load import load_config
    from rl_training.runners.rl_runner import rl_step, setup

    prompts, group = spec["prompts"], spec["group"]
    if spec["task"] == "real":  # the demo's reasoning-gym task: its splits, chat prompts and grader
        cfg, _ = real_task()
        task = [f"task.name={cfg.task.name}", f"task.args={json.dumps(cfg.task.args)}", "data.train=task:train"]
        task += ["data.eval=task:heldout", "data.max_prompt_tokens=128", "vllm.kv_cache_gb=0.5"]
    else:
        task = [f"data.train={data}", f"data.eval={data}", "task.name=reverse", "data.max_prompt_tokens=64"]
        task += ["vllm.kv_cache_gb=0.25"]
    over = [
        f"model.name_or_path={model}",
        *task,
        f"rollout.backend={backend}",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.group_size={group}",
        f"rollout.max_new_tokens={spec['max_new']}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "lora.r=8",
        "lora.alpha=16",
        "lora.dropout=0.0",
        f"lora.target_modules=[{','.join(TARGETS)}]",
        "optim.lr=1e-4",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "optim.max_grad_norm=1.0",
        f"train.micro_batch_groups={spec['micro']}",
        "train.total_steps=100000",
        f"probe.enabled={str(probes).lower()}",
        "eval.every=0",
        f"run.output_dir={out}",
        f"run.name=ours_{backend}_{int(probes)}",
        "run.tensorboard=false",
        "run.progress_bar=false",
        *extra,
    ]
    run = setup(load_config(None, over), dist.init_distributed())
    state = {"step": 0}

    def step():
        t0 = time.perf_counter()
        m = rl_step(run, state["step"])
        dt = time.perf_counter() - t0
        state["step"] += 1
        skip = ("perf/step_s", "perf/tokens_per_s", "perf/gen_tokens_per_s")  # not phases
        phases = {k[5:-2]: v for k, v in m.items() if k.startswith("perf/") and k.endswith("_s") and k not in skip}
        phases[SKIPPED] = m["train/skipped_token_frac"]  # the share of tokens train.drop_zero_adv_groups skipped
        return dt, m["rollout/response_len_mean"] * prompts * group, phases

    step.run = run  # for scripts that time the backend directly (bench_sync.py)
    return step


def floor(model_dir: Path, data: Path, spec: dict):
    """Generation + one forward/backward/AdamW step over the same batch in plain transformers + peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    prompts, group, max_new = spec["prompts"], spec["group"], spec["max_new"]
    if spec["task"] == "real":  # the model's chat template, as ours and TRL render it
        chat = [{"role": "user", "content": r["question"]} for r in rows]
        texts = [tok.apply_chat_template([c], tokenize=False, add_generation_prompt=True) for c in chat]
    else:
        texts = [r["question"] + "=" for r in rows]
    gen = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new, pad_token_id=tok.pad_token_id
    )
    gen.eos_token_id = tok.eos_token_id
    state = {"i": 0}

    def step():
        t0 = time.perf_counter()
        batch = texts[state["i"] : state["i"] + prompts]
        state["i"] = (state["i"] + prompts) % (len(rows) - prompts)
        enc = tok(batch, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        model.eval()
        with torch.no_grad():
            out = model.generate(**enc, generation_config=gen, num_return_sequences=group)
        plen = enc.input_ids.shape[1]
        comp = out[:, plen:]
        done = (comp == tok.eos_token_id).cumsum(1)
        keep = (done == 0) | ((done == 1) & (comp == tok.eos_token_id))  # up to and including the first EOS
        mask = torch.cat([enc.attention_mask.repeat_interleave(group, 0), keep.long()], 1)
        model.train()
        adv = torch.randn(comp.shape[0], 1)
        opt.zero_grad(set_to_none=True)
        width = spec["micro"] * group
        for s in range(0, comp.shape[0], width):  # micro-batches of `micro` groups, gradients accumulated
            part = slice(s, s + width)
            logits = model(input_ids=out[part], attention_mask=mask[part]).logits[:, plen - 1 : -1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, comp[part].unsqueeze(-1)).squeeze(-1)
            loss = -(adv[part] * logp * keep[part]).sum() / (comp.shape[0] * max_new)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0, float(keep.sum()), {}

    return step


def trl_worker(model_dir: Path, data: Path, spec: dict, out: Path, commands, reply, use_vllm: bool = False):
    """TRL's own loop, paused by a callback every `block` steps to take the next command. `use_vllm`: TRL's vLLM
    colocate mode (the real point)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_training.tasks.reverse import reverse_reward

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    prompts, group, max_new = spec["prompts"], spec["group"], spec["max_new"]
    tokens = {"n": 0.0}
    if spec["task"] == "real":  # conversational prompts: TRL renders them with the model's chat template
        from rl_training.data.sources import Example

        _, task = real_task()
        ds = Dataset.from_list(
            [{"prompt": [{"role": "user", "content": r["question"]}], "entry": json.dumps(r["entry"])} for r in rows]
        )

        def grade(completion, entry: str) -> float:
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            e = json.loads(entry)
            return task.reward(text, Example("", str(e["answer"]), str(e["answer"]), "", {"entry": e}))

        def reward(prompts, completions, entry, completion_ids=None, **kw):
            tokens["n"] += sum(len(c) for c in completion_ids) if completion_ids is not None else 0.0
            return [grade(c, e) for c, e in zip(completions, entry, strict=True)]
    else:
        ds = Dataset.from_list([{"prompt": r["question"] + "=", "reference": r["answer"]} for r in rows])

        def reward(prompts, completions, reference, completion_ids=None, **kw):
            tokens["n"] += sum(len(c) for c in completion_ids) if completion_ids is not None else 0.0
            return [reverse_reward(c, r) for c, r in zip(completions, reference, strict=True)]

    class Pause(TrainerCallback):
        def __init__(self):
            self.todo, self.times, self.t0 = 0, [], 0.0

        def _next(self, control):
            reply({"steps": self.times, "tokens": tokens["n"]})
            self.times, tokens["n"] = [], 0.0
            cmd = commands()
            if cmd is None:
                control.should_training_stop = True
            else:
                self.todo = cmd

        def on_train_begin(self, args, state, control, **kw):
            cmd = commands()
            self.todo = cmd or 0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)
            self.todo -= 1
            if self.todo <= 0:
                self._next(control)

    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=spec["micro"] * group,  # TRL's micro-batch; its generation batch is
        gradient_accumulation_steps=prompts // spec["micro"],  # per_device x accumulation = prompts x group
        num_generations=group,
        max_completion_length=max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dr_grpo",
        scale_rewards="none",
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        num_iterations=1,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        max_steps=100000,
        seed=0,
        remove_unused_columns=False,
        disable_dropout=True,
        **(
            {
                "use_vllm": True,
                "vllm_mode": "colocate",
                "vllm_gpu_memory_utilization": 0.1,
                "vllm_enable_sleep_mode": False,
            }
            if use_vllm
            else {}
        ),
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
        callbacks=[Pause()],
    )
    trainer.train()


def worker_main(name: str, point: str, work: Path) -> None:
    """Serve commands on stdin ('run K' / 'quit'); answer each with one JSON line on stdout."""
    import resource

    import torch

    torch.set_num_threads(2)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # libraries' prints must not corrupt the protocol
    spec = POINTS[point]
    model, data = prepare(work, spec["task"])
    out = work / "runs" / f"{name}_{point}"

    def reply(obj: dict) -> None:
        obj["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        real_stdout.write(json.dumps(obj) + "\n")
        real_stdout.flush()

    def commands() -> int | None:
        line = sys.stdin.readline().strip()
        return int(line.split()[1]) if line.startswith("run ") else None

    if name in ("trl", "trl-vllm"):
        trl_worker(model, data, spec, out, commands, reply, use_vllm=name == "trl-vllm")
        return
    if name == "floor":
        step = floor(model, data, spec)
    else:
        backend = "vllm" if name.startswith("ours-vllm") else "hf"
        extra = ["train.pack_sequences=true"] if name.endswith("-pack") else []  # padding-free micro-batches
        extra += ["train.drop_zero_adv_groups=false"] if name.endswith("-noskip") else []  # TRL's work: every group
        extra += ["train.share_prompt=true"] if name.endswith("-shared") else []  # each group's prompt once
        step = ours(model, data, spec, backend, probes=name != "ours-hf-noprobe", out=out, extra=extra)
    reply({"ready": True})
    while (k := commands()) is not None:
        rows = [step() for _ in range(k)]
        reply({"steps": [r[0] for r in rows], "tokens": sum(r[1] for r in rows), "phases": [r[2] for r in rows]})


# ---------------------------------------------------------------------------------------- orchestrator
def python_for(name: str) -> str:
    trl_python = REPO / ".venv-trl" / "bin" / "python"
    return str(trl_python) if name.startswith("trl") else sys.executable


class Proc:
    def __init__(self, name: str, point: str, work: Path, log: Path):
        self.name = name
        self.log = log.open("w")
        self.p = subprocess.Popen(
            [python_for(name), __file__, "--worker", name, "--point", point, "--work", str(work)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
            | ({"VLLM_CPU_KVCACHE_SPACE": "1"} if name == "trl-vllm" else {}),  # TRL sets no KV size on a CPU
        )

    def ask(self, k: int | None) -> dict:
        try:
            self.p.stdin.write("quit\n" if k is None else f"run {k}\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(self.death()) from None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(self.death())
        return json.loads(line)

    def death(self) -> str:
        """One line on a contender that stopped answering: its exit status, and the likely cause of a SIGKILL."""
        try:
            code = self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        why = {
            None: "closed its output but is still running",
            -9: "killed by SIGKILL (on a full machine: the kernel's OOM killer; `dmesg | grep -i oom` names it)",
        }.get(code, f"exited with status {code}")
        return f"contender {self.name} died: {why}; its log: {self.log.name}"

    def close(self) -> None:
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def bench_point(point: str, names: list[str], a, work: Path) -> dict:
    procs = {n: Proc(n, point, work, work / f"{n}_{point}.log") for n in names}
    res = {n: {"steps": [], "tokens": 0.0, "phases": []} for n in names}
    try:
        for n, p in procs.items():  # build; TRL's first command also starts its loop
            if not n.startswith("trl"):
                if not p.p.stdout.readline():  # {"ready": true}
                    raise RuntimeError(p.death())
        for p in procs.values():
            p.ask(a.warmup)  # warm-up steps, discarded
        for _ in range(max(1, a.steps // a.block)):
            for n, p in procs.items():  # round-robin: the machine's noise hits every contender alike
                r = p.ask(a.block)
                res[n]["steps"] += r["steps"]
                res[n]["tokens"] += r["tokens"]
                res[n]["phases"] += r.get("phases", [])
                res[n]["rss_gb"] = r["rss_gb"]
    finally:
        for p in procs.values():
            p.close()
    out = {}
    for n, r in res.items():
        med = statistics.median(r["steps"])
        row = {
            "s_per_step": med,
            "completions_per_s": POINTS[point]["prompts"] * POINTS[point]["group"] / med,
            "tokens_per_s": r["tokens"] / sum(r["steps"]),
            "peak_rss_gb": r["rss_gb"],
            "steps": len(r["steps"]),
        }
        if r["phases"]:
            row["phases_s"] = {k: statistics.median(p[k] for p in r["phases"]) for k in r["phases"][0]}
        out[n] = row
    return out


def combine(runs: list[dict]) -> dict:
    """Per point and contender: the medians over the runs, each run's value and the ratios per run (TRL's s/step
    over the row's, the row's over the floor's: computed within a run, where the contenders ran side by side)."""
    out: dict = {}
    for point in runs[0]:
        out[point] = {}
        for n in runs[0][point]:
            per = [run[point][n] for run in runs]
            row = {k: statistics.median(r[k] for r in per) for k in ("s_per_step", "completions_per_s", "tokens_per_s")}
            row["peak_rss_gb"] = max(r["peak_rss_gb"] for r in per)
            row["s_per_step_runs"] = [r["s_per_step"] for r in per]
            for ref, key in (("trl", "vs_trl_runs"), ("floor", "vs_floor_runs")):
                if ref in runs[0][point]:
                    pairs = [(run[point][ref]["s_per_step"], run[point][n]["s_per_step"]) for run in runs]
                    row[key] = [a / b if ref == "trl" else b / a for a, b in pairs]
            if "phases_s" in per[0]:
                row["phases_s"] = {k: statistics.median(r["phases_s"][k] for r in per) for k in per[0]["phases_s"]}
            out[point][n] = row
    return out


def _spread(values: list[float], fmt: str) -> str:
    """'median [min-max]' over the runs."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{mid:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]" if len(values) > 1 else f"{mid:{fmt}}"


def table(results: dict, n_runs: int) -> str:
    lines = []
    for point, rows in results.items():
        spec = POINTS[point]
        lines.append(f"\n{point}: {spec['prompts']} prompts x {spec['group']}, max {spec['max_new']} new tokens")
        lines.append(
            f"{'contender':<17}{'s/step':>22}{'compl/s':>9}{'tok/s':>9}{'RSS GB':>8}{'vs TRL':>20}{'vs floor':>20}"
            f"{'skipped':>9}  phases (s)"
        )
        for n, r in rows.items():
            vs_trl = _spread(r["vs_trl_runs"], ".2f") if "vs_trl_runs" in r else "-"
            vs_floor = _spread(r["vs_floor_runs"], ".2f") if "vs_floor_runs" in r else "-"
            ph = " ".join(f"{k} {v:.3f}" for k, v in r.get("phases_s", {}).items() if k != SKIPPED)
            skipped = f"{r['phases_s'][SKIPPED]:.2f}" if SKIPPED in r.get("phases_s", {}) else "-"
            lines.append(
                f"{n:<17}{_spread(r['s_per_step_runs'], '.3f'):>22}{r['completions_per_s']:>9.0f}"
                f"{r['tokens_per_s']:>9.0f}{r['peak_rss_gb']:>8.2f}{vs_trl:>20}{vs_floor:>20}{skipped:>9}  {ph}"
            )
    lines.append(
        f"\nMedian over {n_runs} runs [min-max]. 'vs TRL': TRL's s/step over the row's within each run (throughput "
        "ratio, > 1 is faster); 'vs floor': the row's s/step over the floor's; 'skipped': the median share of "
        "generated tokens in zero-advantage groups, not forwarded or back-propagated (train.drop_zero_adv_groups)."
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3, help="repeats of the whole measurement (the spread is over them)")
    ap.add_argument("--points", default="short,long")
    ap.add_argument("--contenders", default="trl,ours-vllm,ours-hf,ours-hf-noprobe,floor")
    ap.add_argument("--work", type=Path, default=REPO / "bench_results" / "trl_work")
    ap.add_argument("--out", type=Path, default=REPO / "bench_results" / "bench_trl.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--point", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker_main(a.worker, a.point, a.work)
        return 0
    names = a.contenders.split(",")
    if "trl" in names and not (REPO / ".venv-trl" / "bin" / "python").exists():
        ap.error("TRL is not set up: run scripts/setup_trl.sh (or make bench-trl), or leave trl out of --contenders")
    a.work.mkdir(parents=True, exist_ok=True)
    for point in a.points.split(","):  # build the models once, before any timing
        prepare(a.work, POINTS[point]["task"])
    runs = []
    for i in range(a.runs):  # fresh processes each run; the order rotates so that no contender always goes first
        order = names[i % len(names) :] + names[: i % len(names)]
        runs.append({p: bench_point(p, order, a, a.work) for p in a.points.split(",")})
        print(
            f"run {i + 1}/{a.runs}: "
            + ", ".join(f"{p} {n} {r['s_per_step']:.3f}" for p in runs[-1] for n, r in runs[-1][p].items()),
            flush=True,
        )
    results = combine([{p: {n: run[p][n] for n in names} for p in run} for run in runs])
    print(table(results, a.runs))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    settings = vars(a) | {"work": str(a.work), "out": str(a.out)}
    a.out.write_text(json.dumps({"settings": settings, "results": results, "runs": runs}, indent=1))
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
