"""The HF rollout backend samples the trained policy, whatever the checkpoint's generation_config says."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.dr_grpo import token_logprobs
from rl_training.models import ModelLoadError
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64).eval()
    # What a chat checkpoint ships (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, temperature 0.7),
    # exaggerated so that any of it reaching generate() changes the tokens.
    g = model.generation_config
    g.repetition_penalty, g.top_k, g.temperature, g.no_repeat_ngram_size, g.min_new_tokens = 5.0, 3, 0.3, 2, 6
    g.do_sample = True
    return model, AutoTokenizer.from_pretrained(tiny_model)


def argmax_decode(model, prompt, max_new_tokens, stop_ids):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(t)
            if t in stop_ids:
                break
    return ids[len(prompt) :]


def test_greedy_rollouts_are_the_argmax_decode_despite_the_models_generation_config(model_and_tokenizer):
    model, tok = model_and_tokenizer
    backend = HFBackend(model, tok)
    ro = backend.generate(PROMPTS, SamplingSpec(n=1, max_new_tokens=10, greedy=True))
    expected = [argmax_decode(model, p, 10, backend.stop_ids) for p in PROMPTS]
    assert ro.completion_ids == expected
    # Negative control: generate() left to the model's own config (repetition_penalty 5, no_repeat_ngram 2,
    # min_new_tokens 6) decodes something else.
    own = model.generate(input_ids=torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=10)
    assert own[0, len(PROMPTS[0]) :].tolist() != expected[0]


def test_sampled_rollout_logprobs_are_the_full_vocabulary_policy(model_and_tokenizer):
    # T = 1, top_p = 1: the sampler's log-prob of each token must be log softmax(logits) over the whole
    # vocabulary, what the trainer computes (top_k 3 or temperature 0.3 from the model's config would not be).
    model, tok = model_and_tokenizer
    ro = HFBackend(model, tok).generate(PROMPTS, SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=0))
    for p, c, lp in zip(ro.prompt_ids, ro.completion_ids, ro.logprobs, strict=True):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            trainer = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0, len(p) - 1 :]
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64), trainer, rtol=0, atol=1e-5)


def test_a_generation_config_knob_that_cannot_be_neutralised_is_refused(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config.suppress_tokens = [3]
    with pytest.raises(ModelLoadError, match="generation_config sets suppress_tokens"):
        HFBackend(model, AutoTokenizer.from_pretrained(tiny_model))
