"""Rollouts with transformers `generate` on the trainer's own (peft) model: the reference backend.

It shares the trainer's weights, so sync is a no-op and there is nothing to sleep. Sampling is over the
full vocabulary (top_k=0, HF's default of 50 would make rollout log-probs differ from the trainer's).
"""

from __future__ import annotations

import torch

from rl_training.rollout.base import Rollouts, SamplingSpec, split_completion


def stop_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for e in (gen_eos, tokenizer.eos_token_id):
        if isinstance(e, int):
            ids.add(e)
        elif e is not None:
            ids.update(e)
    return ids


class HFBackend:
    name = "hf"

    def __init__(self, model, tokenizer, batch_size: int = 256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], spec: SamplingSpec):
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        # Left padding so every row's next token sits at the same column; generate derives position ids
        # from the attention mask, so the pads shift nothing.
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        sampling = {} if spec.greedy else {"temperature": spec.temperature, "top_p": spec.top_p, "top_k": 0}
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            do_sample=not spec.greedy,
            max_new_tokens=spec.max_new_tokens,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        new = out.sequences[:, width:]
        # `scores` are the processed logits the sampler drew from (temperature / top-p applied).
        scores = torch.stack(out.scores, dim=1).float()  # [B, new_len, V]
        logp = torch.gather(torch.log_softmax(scores, -1), -1, new.unsqueeze(-1)).squeeze(-1)
        return new.cpu().tolist(), logp.cpu().tolist()

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> Rollouts:
        was_training = self.model.training
        self.model.eval()
        expanded = [p for p in prompts for _ in range(spec.n)]
        completions, logprobs, truncated = [], [], []
        for s in range(0, len(expanded), self.batch_size):
            rows, lps = self._generate_batch(expanded[s : s + self.batch_size], spec)
            for row, lp in zip(rows, lps, strict=True):
                toks, trunc = split_completion(row, self.stop_ids)
                completions.append(toks)
                logprobs.append(lp[: len(toks)])
                truncated.append(trunc)
        self.model.train(was_training)
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        return Rollouts(expanded, completions, logprobs, truncated, texts)

    def sync_weights(self, model) -> None:
        pass  # generation runs on the trainer's model itself

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
