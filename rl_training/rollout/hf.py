"""Rollouts with transformers `generate` on the trainer's own (peft) model: the reference backend.

It shares the trainer's weights, so sync only counts the policy version (its completions carry the trainer's
version by construction) and there is nothing to sleep. Sampling is from
softmax(logits / T) over the full vocabulary (top-p when asked), the distribution the trainer scores: every
other knob of `generate` is passed at its neutral value (`neutral_generation_config`), because transformers
fills whatever a passed config leaves unset from the model's own generation_config, and checkpoints ship
their chat defaults (Qwen2.5-Instruct: repetition_penalty 1.05, top_k 20, temperature 0.7; HF's global top_k
is 50).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch

from rl_training.policy.models import ModelLoadError
from rl_training.rollout.base import Rollouts, SamplingSpec, split_completion

# Knobs whose neutral value is None, which transformers replaces by the model's own value: a model that sets
# one cannot be made to sample the plain policy through `generate`, so the backend refuses it.
UNNEUTRALISABLE = (
    "top_h",
    "sequence_bias",
    "bad_words_ids",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
    "watermarking_config",
)


def neutral_generation_config(spec: SamplingSpec, stop_ids: set[int], pad_id: int):
    """A GenerationConfig that samples the raw softmax(logits) and nothing else (greedy: the argmax of the raw
    logits; the sampling-only warpers are then not applied, whatever their values). Temperature and top-p are
    not set here but passed as processors (`sampling_processors`), ahead of the log-prob recorder."""
    from transformers import GenerationConfig

    warpers = (
        {}
        if spec.greedy
        else {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "typical_p": 1.0,
            "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0,
        }
    )
    return GenerationConfig(
        do_sample=not spec.greedy,
        **warpers,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        length_penalty=1.0,
        guidance_scale=1.0,
        min_new_tokens=spec.min_new_tokens,  # overrides any min_length
        num_beams=1,
        num_return_sequences=1,
        renormalize_logits=False,
        remove_invalid_values=False,
        max_new_tokens=spec.max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=pad_id,
        output_scores=False,  # the full-vocabulary scores of every step: ~37 GiB at 256 x 1024 x 152k in fp32
        return_dict_in_generate=True,
    )


class ChosenLogprobRecorder:
    """A logits processor, last in the list, that records log softmax(processed scores)[sampled token] per step
    without keeping the scores: a step's token is known only at the next call (the last column of
    `input_ids`), so one [B, V] log-softmax is held until then, and `finish` takes the last step's from the
    returned sequences. Kept per step: one float per row."""

    def __init__(self):
        self.pending: torch.Tensor | None = None  # [B, V] float32 log-softmax of the step not yet resolved
        self.chosen: list[torch.Tensor] = []  # per step: [B] float32

    def _resolve(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.chosen.append(torch.gather(self.pending, -1, tokens.unsqueeze(-1)).squeeze(-1))
            self.pending = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._resolve(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """[B, new_len] sampled tokens -> [B, new_len] their log-probs."""
        self._resolve(new_tokens[:, -1])
        if len(self.chosen) != new_tokens.shape[1]:
            raise RuntimeError(f"recorded {len(self.chosen)} steps for {new_tokens.shape[1]} generated tokens")
        return torch.stack(self.chosen, dim=1)


def sampling_processors(spec: SamplingSpec, recorder: ChosenLogprobRecorder):
    """Temperature then top-p (transformers' own order), then the recorder: generate() appends its own warpers
    after any passed processors, so they are passed here instead, for the recorder to see what is sampled."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = []
    if not spec.greedy and spec.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(spec.temperature))
    if not spec.greedy and spec.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=spec.top_p))
    return LogitsProcessorList([*warpers, recorder])


def stop_on_strings(tokenizer, stop, prompt_width: int):
    """A stopping criterion: a row is done once the text of its last generated tokens contains a stop string
    (finished rows then get pads, which `turn_end` cuts off). Only a tail window is decoded per step."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    window = max((len(s) for s in stop), default=0) + 1

    class StopOnStrings(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            tail = input_ids[:, max(prompt_width, input_ids.shape[1] - window) :]
            texts = tokenizer.batch_decode(tail, skip_special_tokens=True)
            return torch.tensor([any(s in t for s in stop) for t in texts], device=input_ids.device)

    return StoppingCriteriaList([StopOnStrings()])


def stop_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos, tokenizer.eos_token_id):
        if isinstance(e, int):
            ids.add(e)
        elif e is not None:
            ids.update(e)
    return ids


@contextmanager
def seeded(seed: int | None):
    """Sample from a stream that is a function of `seed` alone (the runner's per-(seed, rank, step) seed), and
    leave the global RNGs as they were; None: the global streams. Every row of a generate call draws from this
    one stream (torch.multinomial over the batch), so no two completions share their random numbers."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class HFBackend:
    name = "hf"

    def __init__(self, model, tokenizer, batch_size: int = 256, start_version: int = 0):
        """`start_version`: the optimizer steps the model has taken (a resumed run's step); +1 per sync."""
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.version = start_version
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id
        gen = getattr(model, "generation_config", None)
        fixed = [k for k in UNNEUTRALISABLE if getattr(gen, k, None) is not None]
        if fixed:
            raise ModelLoadError(
                f"the model's generation_config sets {', '.join(fixed)}, which transformers' generate would apply "
                "to HF rollouts (not the trained policy); remove it from generation_config.json or use the vllm backend"
            )

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], spec: SamplingSpec, stop: tuple[str, ...] = ()):
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding so every row's next token sits at the same column; generate derives position ids
        # from the attention mask, so the pads shift nothing.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        recorder = ChosenLogprobRecorder()
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            generation_config=neutral_generation_config(spec, self.stop_ids, self.pad_id),
            logits_processor=sampling_processors(spec, recorder),
            **({"stopping_criteria": stop_on_strings(self.tokenizer, stop, width)} if stop else {}),
        )
        new = out.sequences[:, width:]
        # log-probs of the processed scores the sampler drew from (temperature / top-p applied)
        return new.cpu().tolist(), recorder.finish(new).cpu().tolist()

    def generate(self, prompts: list[list[int]], spec: SamplingSpec, examples=None) -> Rollouts:
        was_training = self.model.training
        self.model.eval()
        expanded = [p for p in prompts for _ in range(spec.n)]
        completions, logprobs, truncated = [], [], []
        with seeded(spec.seed):
            for s in range(0, len(expanded), self.batch_size):
                rows, lps = self._generate_batch(expanded[s : s + self.batch_size], spec)
                for row, lp in zip(rows, lps, strict=True):
                    toks, trunc = split_completion(row, self.stop_ids)
                    completions.append(toks)
                    logprobs.append(lp[: len(toks)])
                    truncated.append(trunc)
        self.model.train(was_training)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollouts(expanded, completions, logprobs, truncated, texts, [self.version] * len(completions))

    def generate_turn(self, contexts, max_tokens, seeds, spec: SamplingSpec, stop) -> list:
        """One turn of multi-turn episodes (rollout/episodes.py). Rows stop at EOS or a stop string
        (`StopOnStrings`) and are cut where vLLM cuts (`turn_end`). All rows of a call draw from one stream
        seeded by the first row's seed (HF samples the batch with one torch generator)."""
        from rl_training.rollout.episodes import TurnSample, turn_end

        was_training = self.model.training
        self.model.eval()
        turns = []
        with seeded(seeds[0] if seeds else None):
            for s in range(0, len(contexts), self.batch_size):
                batch, caps = contexts[s : s + self.batch_size], max_tokens[s : s + self.batch_size]
                turn_spec = dataclasses.replace(spec, n=1, max_new_tokens=max(caps))
                rows, lps = self._generate_batch(batch, turn_spec, tuple(stop))
                for row, lp, cap in zip(rows, lps, caps, strict=True):
                    k = turn_end(row, self.tokenizer, tuple(stop), self.stop_ids, cap)
                    turns.append(TurnSample(row[:k], lp[:k], self.version))
        self.model.train(was_training)
        return turns

    def sync_weights(self, model) -> None:
        self.version += 1  # generation runs on the trainer's model itself: nothing to send

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
