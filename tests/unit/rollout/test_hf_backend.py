"""The HF rollout backend samples the trained policy, whatever the checkpoint's generation_config says."""

from __future__ import annotations

import pytest
import torch

from rl_training.algs.common import token_logprobs
from rl_training.policy.models import ModelLoadError
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.hf import HFBackend, seeded

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


def scores_then_log_softmax(model, backend, prompts, spec):
    """The computation before the fix: generate with output_scores=True (every step's full-vocabulary scores,
    warpers from the GenerationConfig), then stack them and take log_softmax at the sampled tokens."""
    from rl_training.rollout.hf import neutral_generation_config

    config = neutral_generation_config(spec, backend.stop_ids, backend.pad_id)
    config.output_scores = True
    if not spec.greedy:
        config.temperature, config.top_p = spec.temperature, spec.top_p
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[backend.pad_id] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(spec.seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=attn, generation_config=config)
    new = out.sequences[:, width:]
    logp = torch.gather(torch.log_softmax(torch.stack(out.scores, 1).float(), -1), -1, new.unsqueeze(-1)).squeeze(-1)
    return new, logp


@pytest.mark.parametrize(
    "spec",
    [
        SamplingSpec(n=1, max_new_tokens=7, temperature=0.7, top_p=0.9, seed=3),
        SamplingSpec(n=1, max_new_tokens=7, temperature=1.0, seed=4),
        SamplingSpec(n=1, max_new_tokens=7, greedy=True, seed=5),
    ],
)
def test_on_the_fly_logprobs_equal_the_stacked_scores_computation(model_and_tokenizer, spec):
    model, tok = model_and_tokenizer
    backend = HFBackend(model, tok)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    new, old_logp = scores_then_log_softmax(model, backend, prompts, spec)
    with seeded(spec.seed):
        rows, lps = backend._generate_batch(prompts, spec)
    assert rows == new.tolist()  # the same tokens: the warpers run in the same order on the same stream
    torch.testing.assert_close(torch.tensor(lps), old_logp, rtol=0, atol=0)


def test_hf_backend_keeps_one_float_per_row_per_step(model_and_tokenizer, monkeypatch):
    # Before: out.scores held [B, V] float32 per step (B x steps x V in all: ~37 GiB at 256 x 1024 x 152k).
    # Now the recorder holds at most one [B, V] log-softmax plus one float per row per step.
    from rl_training.rollout import hf

    model, tok = model_and_tokenizer
    held: list[int] = []

    class Tracking(hf.ChosenLogprobRecorder):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            held.append(self.pending.numel() + sum(c.numel() for c in self.chosen))
            return out

    monkeypatch.setattr(hf, "ChosenLogprobRecorder", Tracking)
    b, steps, vocab = 4, 9, model.config.vocab_size
    ro = HFBackend(model, tok).generate([[5, 6, 7]] * b, SamplingSpec(n=1, max_new_tokens=steps, seed=1))
    assert max(len(c) for c in ro.completion_ids) == len(held)  # one call per generated step
    # at step k (1-based): the pending [B, V] and k - 1 resolved [B] rows
    assert held == [b * vocab + b * k for k in range(len(held))]
    assert max(held) < 2 * b * vocab  # never steps x B x V


def test_seeded_hf_rollouts_repeat_and_leave_the_global_rng_alone(model_and_tokenizer):
    # The seed makes a call reproducible (a resumed run samples the same), every row of the call draws from
    # one stream (different completions of one prompt), and the caller's RNG stream is not advanced.
    model, tok = model_and_tokenizer
    backend = HFBackend(model, tok)
    spec = SamplingSpec(n=8, max_new_tokens=6, seed=11)
    torch.manual_seed(0)
    a = backend.generate(PROMPTS, spec)
    after = torch.rand(1)
    torch.manual_seed(0)
    b = backend.generate(PROMPTS, spec)
    assert a.completion_ids == b.completion_ids and torch.rand(1) == after
    assert len({tuple(c) for c in a.completion_ids[:8]}) > 1  # the group's completions differ
    c = backend.generate(PROMPTS, SamplingSpec(n=8, max_new_tokens=6, seed=12))
    assert c.completion_ids != a.completion_ids
