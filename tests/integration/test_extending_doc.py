"""docs/extending.md runs: every code block of the page, in order, in a directory outside the repository.

- a block whose first line is `# file: NAME` is written there as NAME (the task files, the configs);
- a python block is executed there (data files, the sandbox, loss, backend and metric examples);
- a bash block's commands run there, one by one, with the project's interpreter first on PATH;
- a yaml block is loaded as a config (the fragment at the top).
The only changes: the configs' model is the test's warm model and their step counts are short (total_steps 3,
checkpoints and in-loop evals every 2; the resume command's total_steps=60 becomes 4)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import DOC_EXTENDING as DOC
from tests.helpers import REPO, doc_blocks, doc_file


def shortened(text: str, model: Path) -> str:
    text = re.sub(r"name_or_path: [^,}\n]+", f"name_or_path: {model}", text)
    text = re.sub(r"total_steps: \d+", "total_steps: 3", text)
    return re.sub(r"every: \d+", "every: 2", text)


def commands(body: str) -> list[str]:
    joined = body.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_page_has_the_recipes():
    langs = [lang for lang, _ in doc_blocks()]
    files = [b.split("\n", 1)[0][len("# file: ") :] for _, b in doc_blocks() if b.startswith("# file: ")]
    assert files == ["spell.yaml", "sort_letters.py", "sort.yaml", "guess_letter.py", "guess.yaml", "sum_stdin.py",
                     "my_loss.py", "my_correction.py", "my_backend.py"]  # fmt: skip
    assert langs.count("bash") == 4 and langs.count("python") >= 10
    # the recipes stay one screen each: the single-turn task about 30 lines, the environment about 60
    assert len(doc_file("sort_letters.py").splitlines()) <= 35
    assert len(doc_file("guess_letter.py").splitlines()) <= 60


@pytest.mark.slow  # six real runs of the tiny model (train, resume, evals.run, synthesize; the environment)
def test_every_block_runs_outside_the_repository(warm_model, tmp_path, monkeypatch):
    from rl_training.config.load import load_config

    work = tmp_path / "my_tasks"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    ran = []
    for lang, body in doc_blocks():
        head = body.split("\n", 1)[0]
        if head.startswith("# file: "):
            name = head[len("# file: ") :]
            (work / name).write_text(shortened(body, warm_model) if name.endswith(".yaml") else body)
        elif lang == "python":
            exec(compile(body, f"{DOC}:python block", "exec"), {"__name__": "__doc_block__"})
        elif lang == "yaml":
            (work / "fragment.yaml").write_text(body)
            assert load_config(work / "fragment.yaml").task.args == {"partial": True}
        elif lang == "bash":
            for cmd in commands(body):
                cmd = re.sub(r"train\.total_steps=\d+", "train.total_steps=4", cmd)
                out = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True)
                assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
                ran.append(cmd.split()[2])
        else:
            raise AssertionError(f"a {lang} block: the test does not know how to run it")
    assert ran == ["rl_training.runners.rl_runner", "evals.run"] + ["rl_training.runners.rl_runner"] * 2 + [
        "evals.run",
        "rl_training.synthesize",
    ] + ["rl_training.runners.rl_runner", "evals.run", "rl_training.runners.rl_runner"]

    # reasoning-gym's spell_backward by name, its generated splits read by the in-loop eval and evals.run too.
    spell = work / "runs" / "spell"
    assert [json.loads(x)["step"] for x in (spell / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    step3 = json.loads((spell / "eval" / "task_heldout" / "step_000003.json").read_text())
    assert step3["settings"]["format"] == "reasoning-gym/spell_backward" and step3["num_problems"] == 64
    # The single-turn task trained 3 steps, then continued to 4 from its checkpoint at step 3.
    sort = work / "runs" / "sort"
    steps = [json.loads(x)["step"] for x in (sort / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    saved = yaml.safe_load((sort / "config.yaml").read_text())
    assert saved["task"] == {"name": f"{work}/sort_letters.py:SortLetters", "args": {"partial": True}}
    summary = (sort / "eval" / "sort_heldout" / "summary.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in summary[1:]] == ["0", "2", "3", "4"]  # the base model and every checkpoint
    stats = (work / "synth" / "sort.jsonl.stats.jsonl").read_text().splitlines()
    assert len(stats) == 32
    # The environment: episodes of one-letter turns, its counts in the metrics.
    guess = [json.loads(x) for x in (work / "runs" / "guess" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in guess] == [1, 2, 3]
    for m in guess:
        assert 1 <= m["rollout/turns_mean"] <= 5 and m["rollout/response_len_max"] <= 64
        assert 0 <= m["rollout/found_mean"] <= 1 and m["rollout/guesses_mean"] >= m["rollout/found_mean"]
    assert (work / "runs" / "guess" / "eval" / "guess_heldout" / "summary.csv").exists()
    # The user's loss, correction and backend, in one run: built from their files (saved absolute), run every step.
    mine = work / "runs" / "sort_mine"
    saved = yaml.safe_load((mine / "config.yaml").read_text())
    assert saved["loss"]["type"] == f"{work}/my_loss.py:clipped_advantages" and saved["loss"]["args"] == {"bound": 0.5}
    assert saved["loss"]["correction"] == f"{work}/my_correction.py:DropUnlikely"
    assert saved["rollout"]["backend"] == f"{work}/my_backend.py:CountingHF"
    rows = [json.loads(x) for x in (mine / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2, 3]
    # the backend's count grows by at least each step's 8 prompts x 4 completions of >= 1 token (the in-loop eval
    # generates with it too)
    generated = [m["rollout/generated_tokens"] for m in rows]
    assert all(b - a >= 32 for a, b in zip([0.0, *generated], generated, strict=False)), generated
    assert all(0.0 <= m["is/dropped_frac"] <= 1.0 for m in rows) and "is/trunc_frac" not in rows[0]
