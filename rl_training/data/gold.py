"""Gold episodes as SFT sequences (sft.gold_episodes): jsonl rows {"question", "segments": [{"text",
"trainable"}]} (tasks/search/synthetic.py writes them; so does synthesize for a multi-turn task). The prompt is
rendered as in RL, then every segment is tokenized on its own, as the episode engine appends them; the loss
mask is 1 on the trainable (sampled) segments only, so observations are never trained on here either."""

from __future__ import annotations

import json
from pathlib import Path

from rl_training.data.sources import DataError, Example


def encode_gold_episodes(
    path: str | Path, data_cfg, tokenizer, task, limit: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per gold episode of the jsonl file (the first `limit`, 0 = all)."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if limit and len(out) >= limit:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "question" not in row or not row.get("segments"):
            raise DataError(f"{path}:{n}: a gold episode needs 'question' and 'segments'")
        text = task.render_prompt(Example(row["question"], source=f"{path}:{n}"), tokenizer, data_cfg)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        mask = [0] * len(ids)
        for seg in row["segments"]:
            seg_ids = tokenizer(seg["text"], add_special_tokens=False).input_ids
            ids += seg_ids
            mask += [int(bool(seg["trainable"]))] * len(seg_ids)
        out.append((ids, mask))
    if not out:
        raise DataError(f"{path}: no gold episodes")
    return out
