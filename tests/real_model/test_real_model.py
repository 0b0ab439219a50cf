"""SmolLM2-135M-Instruct (Q4_1 dequantized) through the trainer and the colocated vLLM engine: its own chat template,
the stop token on every path, the log-prob canary, the weight sync of a LoRA on all seven Llama projections, resume,
SFT, evals.run with pass@k, and synthesize. Every completion here is sampled or greedy from the real model; the
checks are on mechanics (ids, masks, equality of two computations), never on what the model happens to answer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.data.prompts import encode_prompts
from rl_training.data.sources import load_examples
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from rl_training.runners import rl_runner, sft_runner
from rl_training.tasks.build import build_task
from rl_training.train.update import make_micro_batches
from tests.helpers import REAL_RL_CFG as RL_CFG
from tests.helpers import REAL_SFT_CFG as SFT_CFG
from tests.helpers import perturb_adapter, read_metrics

pytestmark = pytest.mark.slow

LLAMA_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
IM_START, IM_END = 1, 2  # SmolLM2's <|im_start|> and <|im_end|> (its EOS, and the tokenizer's pad token)


def test_prompts_are_the_models_own_template_and_the_stop_token_is_trained_on_every_path(real_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_model)
    cfg = load_config(RL_CFG, [f"model.name_or_path={real_model}"])
    assert cfg.data.use_chat_template == "auto" and cfg.data.prompt_template == ""  # the defaults, nothing set
    task = build_task(cfg)
    examples = load_examples(cfg.data.eval, task.parse, limit=4)
    prompts = encode_prompts(examples, cfg.data, tok, task)
    for ex, ids in zip(examples, prompts, strict=True):
        # the template's own rendering of one user turn, with nothing appended to the question (no '=')
        own = tok.apply_chat_template([{"role": "user", "content": ex.question}], add_generation_prompt=True)
        assert ids == own["input_ids"]
        # the template's default system turn, the user turn, the open assistant turn: three <|im_start|>, two ends,
        # no BOS in front (the tokenizer's BOS is <|im_start|> itself) and the assistant header last
        assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2 and ids[0] == IM_START and ids[1] != IM_START
        assert tok.decode(ids[-3:]) == "<|im_start|>assistant\n"
    # SFT: the answer, then <|im_end|> once, both in the loss
    (seq, mask), *_ = sft_runner.encode_pairs(examples, cfg.data, tok, task)
    answer = tok(examples[0].solution, add_special_tokens=False).input_ids
    assert seq == prompts[0] + answer + [IM_END] and mask == [0] * len(prompts[0]) + [1] * (len(answer) + 1)
    assert IM_END not in answer and seq.count(IM_START) == 3


@pytest.fixture(scope="module")
def engine_run(real_model, tmp_path_factory):
    overrides = [
        f"model.name_or_path={real_model}",
        f"run.output_dir={tmp_path_factory.mktemp('runs')}",
        "run.progress_bar=false",
        "rollout.backend=vllm",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=48",
        "train.micro_batch_groups=2",
    ]
    run = rl_runner.setup(load_config(RL_CFG, overrides), dist.init_distributed())
    yield run
    run.backend.close()


def test_vllm_generation_ends_at_the_end_of_turn_and_the_rl_mask_keeps_it(engine_run):
    run = engine_run
    ro = run.backend.generate(run.prompts[:8], SamplingSpec(n=2, max_new_tokens=48, seed=3))
    stopped = [i for i, t in enumerate(ro.truncated) if not t]
    assert stopped, "no completion of 16 ended within 48 tokens"  # the instruct model answers briefly
    for i, ids in enumerate(ro.completion_ids):
        assert ids.count(IM_END) == (0 if ro.truncated[i] else 1)  # one end of turn, and only as the last token
        assert ids[-1] == IM_END or ro.truncated[i]
        assert IM_START not in ids and "<|im_end|>" not in ro.texts[i]
        assert len(ro.logprobs[i]) == len(ids)
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    (mb,) = make_micro_batches(ro, adv, 2, 8, run.tokenizer.pad_token_id, torch.device("cpu"))
    for r in stopped:  # the stop token is a sampled token: the loss reads it (mask 1), as SFT's does
        p, c = len(ro.prompt_ids[r]), len(ro.completion_ids[r])
        assert mb.targets[r, p + c - 2] == IM_END and mb.mask[r, p + c - 2] == 1 and mb.mask[r, p + c - 1 :].sum() == 0
        # pad == EOS for this tokenizer: the padding after it is not in the loss although it is the same id
        assert (mb.input_ids[r, p + c :] == run.tokenizer.pad_token_id).all()


def test_trainer_and_vllm_logprobs_agree_within_the_canary_threshold(engine_run):
    metrics = rl_runner.rl_step(engine_run, 0)
    # float32 on both sides; the canary's threshold for float32 is 1e-3 (rollout.canary_max_logp_diff's default)
    assert metrics["rollout/logp_diff_mean"] < 1e-3, metrics["rollout/logp_diff_mean"]
    assert metrics["is/ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["guard/canary_over_steps"] == 0


def greedy_agrees(model, prompt: list[int], completion: list[int], tol: float = 1e-4) -> bool:
    """Every token of `completion` is the trainer's argmax at its position, or within `tol` of the maximum logit (a
    near-tie, which two correct float32 engines may break differently; after it the texts may differ)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    for pos, token in enumerate(completion):
        top2 = logits[pos].topk(2).values
        if logits[pos, token] < top2[0] - tol:
            return False
        if top2[0] - top2[1] < tol:
            return True  # a tie broken either way: the rest follows from that choice
    return True


def test_vllm_greedy_is_the_trainers_after_a_lora_update_on_every_projection(engine_run):
    run = engine_run
    adapted = {n.split(".")[-2] for n, _ in run.model.named_modules() if n.endswith(".lora_A")}
    assert LLAMA_PROJECTIONS <= adapted, adapted  # lora.target_modules all-linear reaches all seven
    greedy = SamplingSpec(n=1, max_new_tokens=16, greedy=True)
    prompts = run.prompts[:12]
    before = run.backend.generate(prompts, greedy).completion_ids
    perturb_adapter(run.model, 0.02, seed=0)  # every B matrix of every projection random, as a trained adapter
    run.backend.sync_weights(run.model)
    after = run.backend.generate(prompts, greedy).completion_ids
    assert after != before  # the sync changed what vLLM generates
    run.model.eval()
    assert all(greedy_agrees(run.model, p, c) for p, c in zip(prompts, after, strict=True))
    hf = HFBackend(run.model, run.tokenizer).generate(prompts, greedy).completion_ids
    assert sum(a == b for a, b in zip(after, hf, strict=True)) >= len(prompts) - 2  # identical but for near-ties


@pytest.fixture(scope="module")
def resumed_runs(real_model, tmp_path_factory):
    """A straight 3-step run and one that stopped after step 2's checkpoint and resumed to 3 (vLLM backend)."""
    out = tmp_path_factory.mktemp("resume")
    base = [
        f"model.name_or_path={real_model}",
        f"run.output_dir={out}",
        "run.progress_bar=false",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "train.micro_batch_groups=2",
        "ckpt.every=2",
        "ckpt.keep_last=5",
        "eval.num_prompts=8",
        "eval.num_samples=4",
        "eval.ks=[1,4]",
        "probe.lora_health_every=2",
        "optim.lr=1e-3",  # a step that moves this model measurably in 3 steps
    ]
    assert rl_runner.main(["--cfg", str(RL_CFG), *base, "run.name=straight", "train.total_steps=3"]) == 0
    assert rl_runner.main(["--cfg", str(RL_CFG), *base, "run.name=resumed", "train.total_steps=2"]) == 0
    resume = ["run.name=resumed", "train.total_steps=3", "ckpt.resume=latest"]
    assert rl_runner.main(["--cfg", str(RL_CFG), *base, *resume]) == 0
    return out / "straight", out / "resumed"


def test_resume_reproduces_the_straight_runs_metrics(resumed_runs):
    straight, resumed = (read_metrics(d) for d in resumed_runs)
    assert [m["step"] for m in straight] == [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed, strict=True):
        assert set(a) == set(b)
        for k, v in a.items():
            if not k.startswith(("perf/", "mem/")):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9, nan_ok=True), (a["step"], k)
    assert any(m["train/grad_norm"] > 0 for m in straight)  # it trained
    assert straight[1]["lora/stable_rank/min"] >= 1  # LoRA health ran on the real model (every 2 steps)


def test_sft_evals_and_synthesize_run_on_the_real_model(real_model, resumed_runs, tmp_path):
    from evals import run as evals_run
    from rl_training.runners import synthesize

    straight = resumed_runs[0]
    # evals.run on every checkpoint and the base model, pass@k from 4 samples a problem
    assert evals_run.main(["--run-dir", str(straight), "--backend", "vllm"]) == 0
    (out,) = (straight / "eval").glob("*heldout*")
    results = {p.name: json.loads(p.read_text()) for p in out.glob("step_*.json")}
    assert sorted(results) == ["step_000000.json", "step_000002.json", "step_000003.json"]
    for r in results.values():
        assert r["num_problems"] == 8 and {"pass@1", "pass@4", "accuracy"} <= set(r["metrics"])
        assert r["metrics"]["pass@4"] >= r["metrics"]["pass@1"]
    # SFT: a LoRA adapter merged into a saved model that loads
    sft = [f"model.name_or_path={real_model}", f"run.output_dir={tmp_path}", "sft.steps=3", "sft.batch_size=4"]
    assert sft_runner.main(["--cfg", str(SFT_CFG), *sft]) == 0
    model = tmp_path / "smollm2_sft" / "final_model"
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"
    # synthesize: rejection-sampled SFT data, graded by the training grader
    synth = tmp_path / "synth.jsonl"
    args = ["--cfg", str(RL_CFG), "--out", str(synth), "--k", "4", "--max-problems", "8", f"model.name_or_path={model}"]
    assert synthesize.main([*args, "rollout.max_new_tokens=16"]) == 0
    stats = [json.loads(x) for x in synth.with_name(synth.name + ".stats.jsonl").read_text().splitlines()]
    assert len(stats) == 8 and all(s["samples"] == 4 for s in stats)
    shutil.rmtree(model)  # 540 MB
