"""Data records from local files or a `datasets` name, and the Example a task makes of each record.

A source is a path (.jsonl, .json, .parquet) or a Hugging Face `datasets` spec 'name[:config]@split' (read from
the local cache in offline mode). What a record means is the task's business (`Task.parse`, rl_training/tasks):
this module only reads records, names where each came from ('file:line', 'file:row i', 'spec:row i') and makes
every malformed file an error naming that place. The one exception is a row `python -m rl_training.synthesize`
wrote (`synthesized_row`): it holds the Example the task's parse made, and is read back as that Example. A spec
'task:SPLIT' is no source at all: the task makes that split itself (reasoning-gym's generated problems).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_training.base.errors import UserError, one_line


class DataError(UserError, ValueError):
    """Malformed data; the message names the file and line (or row) and the key."""


@dataclass(frozen=True)
class Example:
    """One problem: what the prompt is rendered from and what the grader compares against."""

    question: str
    reference: str = ""  # normalised final answer the reward compares against
    solution: str = ""  # the full answer (the SFT target text)
    source: str = ""  # "file:line" or "dataset@split:row", for error messages and per-problem eval files
    # Structured data a task's grader needs beyond one reference string (a code task's tests and entry
    # point, a search task's list of golden answers); JSON-serialisable, empty for single-answer tasks.
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def records_from_file(path: Path):
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open() as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
                yield f"{path}:{lineno}", rec
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of records")
        for i, rec in enumerate(data):
            yield f"{path}[{i}]", rec
    elif suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:  # ArrowIOError is an OSError, ArrowInvalid a ValueError
            raise DataError(f"{path}: unreadable parquet file ({one_line(e)})") from None
        for i, rec in enumerate(rows):
            yield f"{path}:row {i}", rec
    else:
        raise DataError(f"{path}: unsupported data file type '{suffix}' (use .jsonl, .json or .parquet)")


def _records_from_hub(spec: str):
    import datasets
    import pyarrow as pa

    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    # OSError: not on the hub / not cached offline / no such local directory (DatasetNotFoundError,
    # ConnectionError, FileNotFoundError); ValueError: unknown split or config; Arrow: a corrupt data file.
    except (OSError, ValueError, datasets.exceptions.DatasetsError, pa.ArrowException) as e:
        raise DataError(
            f"data spec '{spec}' is not a local .jsonl/.json/.parquet file and `datasets` cannot load it "
            f"({one_line(e)})"
        ) from None
    for i, rec in enumerate(ds):
        yield f"{spec}:row {i}", rec


def read_records(spec: str):
    """(where, record) for every record of a source: a local file or a `datasets` spec."""
    path = Path(spec)
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.exists():
            raise DataError(f"data file not found: {spec}")
        yield from records_from_file(path)
    else:
        yield from _records_from_hub(spec)


SYNTHESIZED = "synthesized"  # the key that marks a row synthesize wrote (its value: true)


def synthesized_row(ex: Example, answer: str) -> dict:
    """A verified sample as synthesize writes it: the Example the task's parse made and the sampled text as
    `answer` (question/answer: what a built-in task reads with data.question_key/answer_key too)."""
    row = {"question": ex.question, "answer": answer, "reference": ex.reference, "source": ex.source}
    return row | ({"meta": ex.meta} if ex.meta else {}) | {SYNTHESIZED: True}


def synthesized_example(rec: dict, where: str) -> Example:
    """A `synthesized_row` as its Example, with the sampled answer as the solution (SFT's target). Read without
    the task's parse, which reads the task's own records (a user's {"word": ...}), not these rows."""
    for key in ("question", "answer", "reference"):
        if not isinstance(rec.get(key), str):
            raise DataError(f"{where}: a synthesized row needs a string '{key}', got {type(rec.get(key)).__name__}")
    if not isinstance(rec.get("meta", {}), dict):
        raise DataError(f"{where}: a synthesized row's 'meta' must be a mapping")
    return Example(rec["question"], rec["reference"], rec["answer"], where, rec.get("meta", {}))


TASK_SPLIT = "task:"  # a data spec 'task:SPLIT' names a split the task makes itself (Task.examples)


def load_examples(spec: str, parse: Callable[[dict, str], Example], limit: int = 0) -> list[Example]:
    """The Examples `parse` (a task's `parse`) makes of the first `limit` records (0 = all), a row synthesize
    wrote read as its own Example instead; an Example without a source gets the record's place. A spec
    'task:SPLIT' reads no records: the task whose bound `parse` this is makes the split (`examples(SPLIT)`)."""
    if spec.startswith(TASK_SPLIT):
        return _task_split(spec, parse, limit)
    out = []
    for where, rec in read_records(spec):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        ex = synthesized_example(rec, where) if rec.get(SYNTHESIZED) is True else parse(rec, where)
        if not isinstance(ex, Example):
            raise DataError(f"{where}: the task's parse returned {type(ex).__name__}, not an Example")
        out.append(ex if ex.source else dataclasses.replace(ex, source=where))
        if limit and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{spec}: no records")
    return out


def _task_split(spec: str, parse: Callable, limit: int) -> list[Example]:
    """The first `limit` problems of a split the task makes itself; every caller passes the task's bound parse,
    so the task is found through it and no entry point needs a second argument."""
    make = getattr(getattr(parse, "__self__", None), "examples", None)
    if make is None:
        raise DataError(f"data spec {spec!r} names a task's own split, and {parse!r} is not a task's parse")
    out = make(spec[len(TASK_SPLIT) :])
    if not all(isinstance(ex, Example) for ex in out):
        raise DataError(f"data spec {spec!r}: the task's examples() returned something that is not an Example")
    if not out:
        raise DataError(f"{spec}: no problems")
    return out[:limit] if limit else out
