"""Records and Examples (data/sources.py): the rows synthesize writes are read back as the Examples they were
sampled from, by any task, with the sampled text as the SFT target."""

from __future__ import annotations

import json

import pytest

from rl_training.data.sources import DataError, Example, load_examples, synthesized_row


def refuse(record, where):  # a user task's parse that reads only its own records
    raise DataError(f"{where}: key 'word' missing")


def test_synthesized_rows_are_read_as_their_examples_without_the_tasks_parse(tmp_path):
    ex = Example("dcab", "abcd", "abcd", "words.jsonl:3", meta={"tests": ["t1"]})
    path = tmp_path / "synth.jsonl"
    rows = [synthesized_row(ex, "abdc"), synthesized_row(Example("ba", "ab"), "ab")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_examples(str(path), refuse)
    # the prompt's question, the grader's reference and meta as parse made them; the sampled text is the solution
    assert got == [Example("dcab", "abcd", "abdc", f"{path}:1"), Example("ba", "ab", "ab", f"{path}:2")]
    assert [e.meta for e in got] == [{"tests": ["t1"]}, {}]
    assert rows[0]["question"] == "dcab" and rows[0]["answer"] == "abdc"  # what a built-in's question_key reads


def test_other_records_go_through_the_tasks_parse(tmp_path):
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps({"question": "dcab", "answer": "abcd"}) + "\n")
    with pytest.raises(DataError, match="key 'word' missing"):
        load_examples(str(path), refuse)


@pytest.mark.parametrize("bad", [{"question": 3}, {"answer": None}, {"meta": []}])
def test_a_malformed_synthesized_row_names_its_place(tmp_path, bad):
    path = tmp_path / "synth.jsonl"
    path.write_text(json.dumps(synthesized_row(Example("ba", "ab"), "ab") | bad) + "\n")
    with pytest.raises(DataError, match=rf"{path}:1: "):
        load_examples(str(path), refuse)
