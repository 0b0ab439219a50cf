"""SmolLM2-135M-Instruct (Q4_1 dequantized) through the trainer and the colocated vLLM engine: its own chat template,
the stop token on every path, the log-prob canary, and the weight sync of a LoRA on all seven Llama projections.
Every completion here is sampled or greedy from the real model; the checks are on mechanics (ids, masks, equality
of two computations), never on what the model happens to answer. Runs, resume, SFT, evals, synthesize:
test_real_model_runs.py."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.data.prompts import encode_prompts
from rl_training.data.sources import load_examples
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend
from rl_training.runners import rl_runner, sft_runner
from rl_training.tasks.build import build_task
from rl_training.train.batches import forward_logits, make_micro_batches
from tests.helpers import REAL_RL_CFG as RL_CFG
from tests.helpers import perturb_adapter

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
        # the header's last <|im_start|> opens the turn ('assistant' is two tokens: 'ass' 'istant', then '\n')
        header = ids[len(ids) - 1 - ids[::-1].index(IM_START) :]
        assert tok.decode(header, skip_special_tokens=False) == "<|im_start|>assistant\n"
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


def test_shared_prompt_rows_give_the_padded_rows_and_vllms_logprobs(engine_run):
    """train.share_prompt on the real model's chat prompts (train/shared_prompt.py): each group's prompt once, and the
    log-probs of the padded rows (float32: summation order only) and of the sampler (the canary's threshold)."""
    run = engine_run
    ro = run.backend.generate(run.prompts[:4], SamplingSpec(n=4, max_new_tokens=16, seed=5))
    adv = torch.linspace(-1, 1, len(ro), dtype=torch.float64)
    pad, cpu = run.tokenizer.pad_token_id, torch.device("cpu")
    (mb,) = make_micro_batches(ro, adv, 4, 4, pad, cpu)
    (sh,) = make_micro_batches(ro, adv, 4, 4, pad, cpu, share_prompt=True)
    assert sh.shared.input_ids.numel() < mb.input_ids.numel() / 2  # a template prompt of ~70 tokens, once not 4x
    with torch.no_grad():
        padded = mb.unpack(token_logprobs(forward_logits(run.model, mb), mb.row_targets))
        shared = sh.unpack(token_logprobs(forward_logits(run.model, sh), sh.row_targets))
    m = mb.mask.bool()
    assert m.sum() == sum(len(c) for c in ro.completion_ids)
    assert (shared - padded)[m].abs().max() < 1e-4
    assert (shared - mb.rollout_logp)[m].abs().mean() < 1e-3  # rollout.canary_max_logp_diff's float32 default


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
