"""A user's task taken end to end the way a new user would (issue 39, item 8): synthesize from the user's own
directory prints an SFT command that runs there as printed, with the task's arguments, and SFT trains on the rows
synthesize wrote although the task's `parse` reads other records; evals.run reports the grader's errors and
time-outs beside accuracy; a bad task spec under torchrun is one line, not one per rank."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import yaml

from tests.helpers import RL_RUNNER, TESTCFG, torchrun_cmd

# Every completion counts as verified (correct_threshold 0), so synthesize keeps each distinct sample. `parse`
# reads the user's own records ({"word": ...}); the arguments must arrive exactly (a string YAML would read as a
# mapping when unquoted, and an int).
USER_TASK = """
from rl_training.tasks import DataError, Example, Task


class Reverser(Task):
    correct_threshold = 0.0

    def __init__(self, greeting: str, count: int):
        if (greeting, count) != ("it's 1: ok", 3):
            raise ValueError(f"wrong arguments {greeting!r}, {count!r}")

    def parse(self, record, where):
        if not isinstance(record.get("word"), str):
            raise DataError(f"{where}: key 'word' must be a string")
        return Example(question=record["word"], reference=record["word"][::-1], solution=record["word"][::-1])

    def reward(self, completion, example):
        return float(completion.strip() == example.reference)
"""

USER_CFG = """
run: {{output_dir: runs, name: user}}
model: {{name_or_path: {model}}}
lora: {{r: 8, alpha: 16}}
task: {{name: reverser.py:Reverser, args: {{count: 3}}}}
data: {{train: words.jsonl, eval: words.jsonl, prompt_template: "{{question}}="}}
rollout: {{backend: hf, prompts_per_step: 4, group_size: 4, max_new_tokens: 8}}
"""


def test_printed_sft_command_runs_from_the_users_directory(warm_model, tmp_path, monkeypatch, capsys):
    from rl_training.runners import synthesize

    home = tmp_path / "home"
    home.mkdir()
    (home / "reverser.py").write_text(USER_TASK)
    (home / "user.yaml").write_text(USER_CFG.format(model=warm_model))
    (home / "words.jsonl").write_text("".join(json.dumps({"word": w}) + "\n" for w in ["abc", "dcba", "xyz", "hgf"]))
    monkeypatch.chdir(home)  # everything named relative to the user's directory, as a user types it
    argv = ["--cfg", "user.yaml", "--out", "synth/words.jsonl", "--k", "2", 'task.args.greeting="it\'s 1: ok"']
    assert synthesize.main(argv) == 0
    out = home / "synth" / "words.jsonl"
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert rows and all(set(r) >= {"question", "answer", "reference"} for r in rows)

    printed = capsys.readouterr().out.splitlines()
    words = shlex.split(printed[printed.index(next(x for x in printed if x.endswith("SFT on it:"))) + 1])
    assert words[:3] == ["python", "-m", "rl_training.runners.sft_runner"]
    assert words[words.index("--cfg") + 1] == str(home / "user.yaml")
    assert f"data.train={out}" in words
    assert f"task.name={home / 'reverser.py'}:Reverser" in words
    assert f"model.name_or_path={warm_model}" in words
    args = dict(w.removeprefix("task.args.").split("=", 1) for w in words if w.startswith("task.args."))
    assert {k: yaml.safe_load(v) for k, v in args.items()} == {"greeting": "it's 1: ok", "count": 3}

    # As printed, from the user's directory (only the interpreter and the step count are the test's).
    r = subprocess.run(
        [sys.executable, *words[1:], "sft.steps=1"], cwd=home, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run_dir = home / "runs" / words[-1].removeprefix("run.name=")
    assert words[-1].startswith("run.name=") and (run_dir / "final_model" / "config.json").exists()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["task"]["args"] == {"greeting": "it's 1: ok", "count": 3}
    assert saved["data"]["train"] == str(out)


def test_bad_task_spec_under_torchrun_prints_one_line(run_overrides, tmp_path):
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *run_overrides, "task.name=nonexistent.py:X")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode != 0
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:") and "nonexistent.py" in x]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-4000:]
    assert "exitcode  : 2" in r.stderr  # every rank exits with the one-line error's status
