"""Prompt data: GSM8K-, MATH- and synthetic-format records from local files or a `datasets` name.

A source is a path (.jsonl, .json, .parquet) or a Hugging Face `datasets` spec 'name[:config]@split'
(read from the local cache in offline mode). Every malformed record is an error naming file:line and key.
References are normalised once here, so rewards receive the bare final answer:
- gsm8k: the text after the last '####', thousands separators removed ("1,234" -> "1234");
- math: the last \\boxed{...} of the answer/solution field, or the field itself when it has no \\boxed;
- reverse: the answer field as is;
- search (and search_subem): Search-R1's rows as their scripts/data_process/*.py write them (question,
  reward_model.ground_truth.target = the golden answers, data_source) or plain jsonl
  {"question", "golden_answers": [...]} (or a single "answer"); see `search_example`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_training.code import CODE_FORMATS
from rl_training.config import SEARCH_FORMATS
from rl_training.errors import UserError


class DataError(UserError, ValueError):
    """Malformed data; the message names the file and line (or row) and the key."""


def _one_line(e: BaseException) -> str:
    """A library's message on one line (datasets and pyarrow messages may span several)."""
    return " ".join(str(e).split()) or type(e).__name__


@dataclass(frozen=True)
class Example:
    question: str
    reference: str  # normalised final answer the reward compares against
    solution: str  # the full answer field (SFT target text)
    source: str  # "file:line" or "dataset@split:row", for error messages and per-problem eval files
    # Structured data a task's grader needs beyond one reference string (a code task's tests and entry
    # point, a search task's list of golden answers); JSON-serialisable, empty for single-answer tasks.
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) whose braces close, stripped; None if there is none.

    Braces are matched, so '\\boxed{\\frac{1}{2}}' gives '\\frac{1}{2}'; escaped ones ('\\{', '\\}') do not
    count. A box left open (a completion cut off inside it) is passed over for the one before it.
    """
    for m in reversed(list(_BOX_OPEN.finditer(text))):
        depth, j = 1, m.end()
        while j < len(text):
            if text[j] == "\\":  # a command or an escaped brace: never a delimiter
                j += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[m.end() : j].strip()
            j += 1
    return None


def reference_of(fmt: str, answer: str, where: str) -> str:
    if fmt == "gsm8k":
        if "####" not in answer:
            raise DataError(f"{where}: gsm8k answer has no '#### N' final answer: {answer[-80:]!r}")
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    if fmt == "math":
        boxed = last_boxed(answer)
        return boxed if boxed is not None else answer.strip()
    return answer


def _golden_answers(rec: dict, where: str, answer_key: str) -> list[str]:
    gt = rec.get("reward_model")
    if isinstance(gt, dict) and isinstance(gt.get("ground_truth"), dict) and "target" in gt["ground_truth"]:
        golden, key = gt["ground_truth"]["target"], "reward_model.ground_truth.target"
    elif "golden_answers" in rec:
        golden, key = rec["golden_answers"], "golden_answers"
    elif answer_key in rec:
        golden, key = [rec[answer_key]], answer_key
    else:
        raise DataError(
            f"{where}: no golden answers (reward_model.ground_truth.target, golden_answers or {answer_key})"
        )
    if isinstance(golden, str | int | float):
        golden = [golden]
    if not isinstance(golden, list) or not golden or not all(isinstance(g, str | int | float) for g in golden):
        raise DataError(f"{where}: key '{key}' must be a non-empty list of strings, got {golden!r:.80}")
    return [str(g) for g in golden]


def search_example(rec: dict, where: str, question_key: str = "question", answer_key: str = "answer") -> Example:
    """A Search-R1 row (or its plain jsonl form) as an Example: the question as is (Search-R1's data scripts
    already added the '?'), reference = the first golden answer, meta = {"golden_answers": all of them,
    "data_source": ...}. The row's `prompt` column (their instruction around the question) is not read:
    the prompt comes from data.prompt_template, so one template serves every source (docs/search.md)."""
    q = rec.get(question_key)
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{where}: key '{question_key}' must be a non-empty string (has: {', '.join(map(str, rec))})")
    golden = _golden_answers(rec, where, answer_key)
    meta = {"golden_answers": golden, "data_source": str(rec.get("data_source", ""))}
    return Example(q.strip(), golden[0], golden[0], where, meta)


def _records_from_file(path: Path):
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
            raise DataError(f"{path}: unreadable parquet file ({type(e).__name__}: {_one_line(e)})") from None
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
            f"({type(e).__name__}: {_one_line(e)})"
        ) from None
    for i, rec in enumerate(ds):
        yield f"{spec}:row {i}", rec


def load_examples(
    spec: str, fmt: str, question_key: str = "question", answer_key: str = "answer", limit: int = 0
) -> list[Example]:
    path = Path(spec)
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.exists():
            raise DataError(f"data file not found: {spec}")
        records = _records_from_file(path)
    else:
        records = _records_from_hub(spec)
    out = []
    for where, rec in records:
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        if fmt in SEARCH_FORMATS or fmt in CODE_FORMATS:  # structured data goes to Example.meta
            if fmt in SEARCH_FORMATS:
                out.append(search_example(rec, where, question_key, answer_key))
            else:
                from rl_training.code.tasks import code_example  # rl_training/code/tasks.py

                out.append(code_example(fmt, rec, where))
            if limit and len(out) >= limit:
                break
            continue
        for key in (question_key, answer_key):
            if key not in rec:
                raise DataError(f"{where}: missing key '{key}' (has: {', '.join(map(str, rec))})")
            if not isinstance(rec[key], str | int | float):
                raise DataError(f"{where}: key '{key}' must be a string, got {type(rec[key]).__name__}")
        answer = str(rec[answer_key])
        out.append(Example(str(rec[question_key]), reference_of(fmt, answer, where), answer, where))
        if limit and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{spec}: no records")
    return out
