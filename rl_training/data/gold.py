"""Gold episodes as SFT sequences (sft.gold_episodes): jsonl rows {"question", "segments": [{"text",
"trainable"}]} (tasks/search/synthetic.py writes them; so does synthesize for a multi-turn task). The prompt is
rendered as in RL, then every segment is tokenized on its own, as the episode engine appends them; the loss
mask is 1 on the trainable (sampled) segments only, so observations are never trained on here either.

An episode RL's engine could not produce under the config's limits (a prompt over data.max_prompt_tokens; for an
environment, a turn, an observation, the whole response or the turn count over multiturn.*) is an error naming
the first one and how many there are: SFT would otherwise teach what RL then cuts short."""

from __future__ import annotations

import json
from pathlib import Path

from rl_training.data.sources import DataError, Example


def encode_gold_episodes(
    path: str | Path, data_cfg, tokenizer, task, limit: int = 0, multiturn=None
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per gold episode of the jsonl file (the first `limit`, 0 = all). `multiturn`: the
    episode limits (config section) to check each episode against, for an environment; None checks the prompt
    length only."""
    out, over = [], []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if limit and len(out) >= limit:
            break
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "question" not in row or not row.get("segments"):
            raise DataError(f"{where}: a gold episode needs 'question' and 'segments'")
        text = task.render_prompt(Example(row["question"], source=where), tokenizer, data_cfg)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        segments = [_segment(seg, where, tokenizer) for seg in _list(row["segments"], where)]
        problem = _past_limits(len(prompt), segments, data_cfg, multiturn)
        if problem:
            over.append(f"line {n}: {problem}")
        ids, mask = list(prompt), [0] * len(prompt)
        for seg_ids, trainable in segments:
            ids += seg_ids
            mask += [int(trainable)] * len(seg_ids)
        out.append((ids, mask))
    if not out:
        raise DataError(f"{path}: no gold episodes")
    if over:
        raise DataError(
            f"{path}: {len(over)} of {len(out)} gold episodes go past the limits RL's episodes have (first, "
            f"{over[0]}); raise the limit in the config or shorten the episodes"
        )
    return out


def _list(segments, where: str) -> list:
    if not isinstance(segments, list):
        raise DataError(f"{where}: 'segments' must be a list of {{'text', 'trainable'}}")
    return segments


def _segment(seg, where: str, tokenizer) -> tuple[list[int], bool]:
    if not (isinstance(seg, dict) and isinstance(seg.get("text"), str) and isinstance(seg.get("trainable"), bool)):
        raise DataError(f"{where}: each segment must be {{'text': string, 'trainable': true/false}}, got {seg!r:.80}")
    return tokenizer(seg["text"], add_special_tokens=False).input_ids, seg["trainable"]


def _past_limits(prompt_len: int, segments: list[tuple[list[int], bool]], data_cfg, m) -> str:
    """What of one episode RL's engine (rollout/episodes.py) could not produce; '' when nothing."""
    if prompt_len > data_cfg.max_prompt_tokens:
        return f"prompt of {prompt_len} tokens > data.max_prompt_tokens={data_cfg.max_prompt_tokens}"
    if m is None:
        return ""
    turns, observations = [], []  # a turn: consecutive trainable segments; an observation: the others between
    for i, (ids, trainable) in enumerate(segments):
        runs = turns if trainable else observations
        if i and segments[i - 1][1] == trainable:
            runs[-1] += len(ids)
        else:
            runs.append(len(ids))
    response = sum(len(ids) for ids, _ in segments)
    if len(turns) > m.max_turns:
        return f"{len(turns)} turns > multiturn.max_turns={m.max_turns}"
    if max(turns, default=0) > m.max_tokens_per_turn:
        return f"a turn of {max(turns)} tokens > multiturn.max_tokens_per_turn={m.max_tokens_per_turn}"
    if max(observations, default=0) > m.max_obs_tokens:
        return f"an observation of {max(observations)} tokens > multiturn.max_obs_tokens={m.max_obs_tokens}"
    if response > m.max_response_tokens:
        return f"{response} response tokens > multiturn.max_response_tokens={m.max_response_tokens}"
    return ""
