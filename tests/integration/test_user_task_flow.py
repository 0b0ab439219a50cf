"""A user's task taken end to end the way a new user would (issue 39, item 8): synthesize from the user's own
directory prints an SFT command that runs there as printed, with the task's arguments, and SFT trains on the rows
synthesize wrote although the task's `parse` reads other records; evals.run reports the grader's errors and
time-outs beside accuracy; a bad task spec under torchrun is one line, not one per rank."""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys

import yaml

from tests.helpers import MOODY_TASK, RL_RUNNER, TESTCFG, torchrun_cmd

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


def test_evals_report_grader_errors_and_timeouts(warm_model, tmp_path, capsys):
    from evals import run as evals_run
    from rl_training.runners import rl_runner

    # ok, ok, raise, hang: the grader raises for one problem's completions and runs past the limit on another's
    (tmp_path / "moody.py").write_text(MOODY_TASK)
    data = tmp_path / "moody.jsonl"
    rows = [{"q": q, "mode": m} for q, m in zip("abcd", ["ok", "ok", "raise", "hang"])]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec, limit = f"task.name={tmp_path / 'moody.py'}:Moody", "reward.timeout_s=0.3"
    paths = [f"data.train={data}", f"data.eval={data}", f"run.output_dir={tmp_path / 'runs'}"]
    argv = ["--cfg", TESTCFG, f"model.name_or_path={warm_model}", spec, limit, *paths, "train.total_steps=2"]
    assert rl_runner.main([*argv, "eval.every=0"]) == 0
    run_dir = tmp_path / "runs" / "testconfig"
    capsys.readouterr()
    args = ["--run-dir", str(run_dir), "--steps", "2", "--no-base", "--backend", "hf", "--n", "2", "--k", "1,2"]
    assert evals_run.main([*args, "--name", "e"]) == 0
    printed = capsys.readouterr().out
    # 4 problems x (1 greedy + 2 sampled): the 'raise' problem's 3 completions raised, the 'hang' one's timed out
    result = json.loads((run_dir / "eval" / "e" / "step_000002.json").read_text())
    assert result["metrics"]["grader_errors"] == 3 and result["metrics"]["grader_timeouts"] == 3
    assert result["metrics"]["reward_mean"] == 0.25  # the two 'ok' problems' greedy completions score 0.5
    (row,) = csv.DictReader((run_dir / "eval" / "e" / "summary.csv").open())
    assert (float(row["grader_errors"]), float(row["grader_timeouts"])) == (3, 3)
    header = next(x for x in printed.splitlines() if x.split()[:2] == ["step", "accuracy"])
    table_row = next(x for x in printed.splitlines() if x.split()[:1] == ["2*"])
    cells = dict(zip(header.split(), table_row.split(), strict=True))
    assert (cells["errors"], cells["timeouts"]) == ("3", "3")


def test_bad_task_spec_under_torchrun_prints_one_line(run_overrides, tmp_path):
    cmd = torchrun_cmd(2, RL_RUNNER, "--cfg", TESTCFG, *run_overrides, "task.name=nonexistent.py:X")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode != 0
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:") and "nonexistent.py" in x]
    assert len(lines) == 1, r.stdout[-2000:] + r.stderr[-4000:]
    assert "exitcode  : 2" in r.stderr  # every rank exits with the one-line error's status
