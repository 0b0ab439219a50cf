"""The monitor's sample lines show what tells prompts apart: the part between what all of them share."""

from __future__ import annotations

from rl_training.runners.monitor import distinct_parts

CHAT = "<|im_start|>system Hi<|im_end|> <|im_start|>user {q} Give only your answer.<|im_end|> <|im_start|>assistant"


def test_the_shared_template_and_instruction_are_cut():
    prompts = [CHAT.format(q=f"Calculate {x}.") for x in ("12 + 7", "40 - 8", "3 + 3")]
    # common prefix: up to 'user Calculate ' ; common suffix: '. Give only your answer.<|im_end|> ...'
    assert distinct_parts(prompts) == ["12 + 7", "40 - 8", "3 + 3"]
    assert distinct_parts(["abc="]) == ["abc="]  # one prompt: nothing to compare with
    assert distinct_parts(["same", "same"]) == ["same", "same"]  # identical prompts are kept whole
    assert distinct_parts(["abc=", "xyz="]) == ["abc", "xyz"]
