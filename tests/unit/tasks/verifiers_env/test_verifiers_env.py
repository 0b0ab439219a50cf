"""verifiers v1 environments as tasks (rl_training/tasks/verifiers_env/, docs/verifiers.md), on the environments of
tests/vf_envs.py: a taskset's tasks as the splits 'task:train' / 'task:heldout', its prompts, v1's grade of a reply
(the task's @vf.reward functions, weighted); an Env's multi-turn run through the real episode engine, token-exact
(prompt + episode is the chat template's rendering of the conversation, observations masked), graded on its
episode's trace; the package form by id; every refusal as one ConfigError line; and grading is total on whatever a
policy writes."""

from __future__ import annotations

import functools
import sys

import pytest
from hypothesis import given

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.data.sources import DataError, load_examples
from rl_training.policy.tiny_model import build_tokenizer
from rl_training.rollout.base import SamplingSpec
from rl_training.rollout.episodes import EpisodeSpec, TurnSample, run_episodes
from rl_training.tasks.base import TaskContext, score_completions
from rl_training.tasks.build import make_task
from rl_training.tasks.verifiers_env.episode import VerifiersEnvironment
from rl_training.tasks.verifiers_env.task import VerifiersTask
from tests.helpers import REPO, doc_file
from tests.hostile import HOSTILE_TEXT
from tests.vf_envs import HERE, hint, package_dir, words

IM_END = 259  # the chat tokenizer's <|im_end|> (tiny_model.py)
VF = str(HERE)
GUESS = {"env": f"{VF}:GuessEnv", "taskset": {"id": f"{VF}:GuessTaskset", "num_tasks": 6}, "heldout_size": 2}


class Data:
    prompt_template, system_prompt, use_chat_template = "{question}=", "", False


class Chat:
    prompt_template, system_prompt, use_chat_template = "{question}", "", True


def reverse(**args) -> VerifiersTask:
    return make_task("verifiers", {"env": f"{VF}:ReverseTaskset", "taskset": {"num_tasks": 12}, **args})


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(chat=True)


def guess(tok, **args) -> VerifiersEnvironment:
    env = make_task("verifiers", {**GUESS, **args}, load_config(None, ["data.use_chat_template=true"]))
    env.start(TaskContext(tokenizer=tok))
    return env


# ------------------------------------------------------------------------------------------------ single turn
def test_a_taskset_is_a_task_whose_splits_prompts_and_grades_are_v1s(tmp_path):
    task = reverse(heldout_size=4, size=6)
    assert type(task) is VerifiersTask and task.part_names == ("letters", "reversed_credit")  # v1's order: by name
    train, held = load_examples("task:train", task.parse), load_examples("task:heldout", task.parse)
    w = words(12)  # gaeihg hfjdi ecbj ijceb | fhi fgf ihhi aiabg jhf fbdj | dcih bfi
    assert [e.question for e in held] == w[:4] and [e.question for e in train] == w[4:10]
    ex = held[0]
    assert (ex.question, ex.reference, ex.solution) == ("gaeihg", "ghieag", "ghieag")  # data.answer: the SFT target
    assert ex.source.endswith("@heldout:task 0") and task.render_prompt(ex, None, Data) == "gaeihg="
    scores = score_completions(task, ["ghieag", " ghixxx\n", "", "ab1"], [ex] * 4, timeout_s=5.0)
    # reversed_credit (weight 1): 6/6, 3/6 (g, h, i), 0 (empty), 0/6; letters has weight 0 (a metric-like part)
    assert scores.rewards == [1.0, 0.5, 0.0, 0.0] and scores.correct == [True, False, False, False]
    assert scores.parts == {"reversed_credit": [1.0, 0.5, 0.0, 0.0], "letters": [6.0, 6.0, 0.0, 2.0]}
    assert scores.formatted == [True, True, False, True] and scores.errors == scores.timeouts == 0
    (tmp_path / "rows.jsonl").write_text('{"question": "abc", "answer": "cba"}\n')
    with pytest.raises(DataError, match="rows.jsonl:1: a verifiers taskset makes its own tasks: set data.train"):
        load_examples(str(tmp_path / "rows.jsonl"), task.parse)  # a data file: the taskset makes the tasks


def test_the_held_out_split_may_be_the_taskset_under_other_settings_less_any_shared_problem():
    # seed 1's words: jbeb hhgdbh ggj hed faa iag gaid hidfdd; seed 0's first four are gaeihg hfjdi ecbj ijceb
    task = reverse(size=4, heldout_size=3, heldout={"seed": 1})
    assert [e.question for e in task.examples("heldout")] == ["jbeb", "hhgdbh", "ggj"]
    assert [e.question for e in task.examples("train")] == ["gaeihg", "hfjdi", "ecbj", "ijceb"]
    assert task.overlap_dropped == 0
    same = reverse(size=4, heldout_size=2, heldout={"num_tasks": 2})  # the same first tasks: held out, not trained
    assert [e.question for e in same.examples("train")] == ["ecbj", "ijceb"] and same.overlap_dropped == 2
    with pytest.raises(DataError, match="holds no tasks out: set task.args.heldout_size"):
        reverse().examples("heldout")


def test_an_installed_package_by_id_is_the_same_task(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(package_dir(tmp_path, "vf-reverse", ["ReverseTaskset"])))
    by_id = make_task("verifiers/vf-reverse", {"taskset": {"num_tasks": 12}, "heldout_size": 4})
    by_file = reverse(heldout_size=4)
    assert type(by_id) is VerifiersTask and by_id.name == "verifiers/vf-reverse"
    assert [e.question for e in by_id.examples("train")] == [e.question for e in by_file.examples("train")]
    ex = by_id.examples("heldout")[1]  # hfjdi
    assert score_completions(by_id, ["idjfh", "idj"], [ex, ex], 5.0).rewards == [1.0, 0.6]  # 5/5, 3/5


# ------------------------------------------------------------------------------------------------ multi-turn
class Replies:
    """A TurnGenerator whose episode of word w answers turn t with replies[w][t-1] then <|im_end|>."""

    def __init__(self, tok, replies: dict[str, list[str]]):
        self.tok, self.replies, self.stop_ids = tok, replies, {IM_END, 1}

    def generate_turn(self, contexts, max_tokens, seeds, spec, stop):
        out = []
        for ctx in contexts:
            text = self.tok.decode(ctx)
            (word,) = [w for w in self.replies if f"user\n{w}<|im_end|>" in text]
            reply = self.replies[word][text.count("<|im_start|>assistant") - 1]
            ids = [*self.tok(reply, add_special_tokens=False).input_ids, IM_END]
            out.append(TurnSample(ids, [-0.5] * len(ids)))
        return out


SPEC = EpisodeSpec(max_turns=5, max_tokens_per_turn=16, max_obs_tokens=64)


def episodes(env, tok, replies, spec=SPEC):
    train = {e.question: e for e in env.examples("train")}  # ecbj ijceb fhi fgf
    exs = [train[w] for w in replies]
    prompts = [tok(env.render_prompt(ex, tok, Chat), add_special_tokens=False).input_ids for ex in exs]
    return (
        exs,
        prompts,
        run_episodes(Replies(tok, replies), env, tok, prompts, exs, SamplingSpec(n=1, max_new_tokens=0), spec),
    )


def test_an_env_runs_through_the_episode_engine_token_exact_and_is_graded_on_its_trace(tok):
    env = guess(tok)
    assert env.part_names == ("credit", "seen", "solved") and env.episode_counts == ("stopped",)
    exs, prompts, ro = episodes(env, tok, {"fhi": ["ihx", "ihf"]})
    ids, mask = ro.completion_ids[0], ro.loss_mask[0]
    conv = [
        {"role": "system", "content": "Reverse the word."},
        {"role": "user", "content": "fhi"},
        {"role": "assistant", "content": "ihx"},
        {"role": "user", "content": hint("ihx", "ihf")},  # "no: 2 of 3 letters right": the Env's run wrote it
        {"role": "assistant", "content": "ihf"},
    ]
    # prompt + episode is the template's rendering of the whole conversation (it ends "<|im_end|>\n")
    assert tok.decode(prompts[0] + ids) + "\n" == tok.apply_chat_template(conv, tokenize=False)
    sampled = [t for t, m in zip(ids, mask, strict=True) if m]
    enc = tok("ihx ihf", add_special_tokens=False).input_ids  # byte-level: 'ihx', ' ', 'ihf'
    assert sampled == [*enc[:3], IM_END, *enc[4:], IM_END]  # exactly the engine's ids, never re-encoded
    assert tok.decode(sampled, skip_special_tokens=True) == "ihxihf" == ro.texts[0]  # only the sampled tokens
    assert sum(mask) == 2 * 4 and all(lp == 0.0 for lp, m in zip(ro.logprobs[0], mask, strict=True) if not m)
    assert ro.episodes[0]["turns"] == 2 and ro.episodes[0]["stopped"] == 0 and ro.episodes[0]["error"] == ""
    scores = score_completions(env, ro.texts, exs, 5.0)
    # its trace's last reply solves it: solved 1 (weight 1) + credit 1 (weight .5) + seen 3/3 (weight .25) + the
    # Env's finalize: fewer_turns 1/2 turns (weight .25) = 1.875; graded on the episode's trace, not the text
    assert scores.rewards == [1.875] and scores.counts == {"untraced": 0.0}
    assert scores.parts == {"credit": [1.0], "seen": [1.0], "solved": [1.0]}
    # the same text again has no episode left: graded as one reply "ihxihf" (credit 2/6: i, h; seen 3/3; 1 turn)
    again = score_completions(env, ro.texts, exs, 5.0)
    assert again.rewards == [pytest.approx(0.5 * 2 / 6 + 0.25 + 0.25)] and again.counts == {"untraced": 1.0}


def test_the_seats_max_turns_and_a_trace_stop_end_the_exchange(tok):
    env = guess(tok)
    exs, _, ro = episodes(env, tok, {"ecbj": ["aaa", "aaa", "aaa", "aaa"], "ijceb": ["pass", "x"]})
    # ecbj: 3 wrong turns, then GuessConfig's max_turns=3 refuses the 4th; ijceb: the gave_up @stop after "pass"
    assert [(e["turns"], e["stopped"]) for e in ro.episodes] == [(3, 1), (1, 1)]
    assert ro.texts == ["aaaaaaaaa", "pass"]
    scores = score_completions(env, ro.texts, exs, 5.0)
    # no letter of jbce or becji in aaa or pass: only the Env's fewer_turns, 1/3 and 1/1, x .25
    assert scores.rewards == [pytest.approx(0.25 / 3), 0.25]
    assert scores.counts == {"untraced": 0.0}


def test_an_env_that_fails_ends_only_its_episode(tok):
    env = guess(tok, env=f"{VF}:BestOfTwoEnv")
    _, _, ro = episodes(env, tok, {"fhi": ["ihf", "ihf"]})
    assert ro.episodes[0]["turns"] == 1 and ro.episodes[0]["error"].startswith("env_error: ")
    assert "a second rollout in one episode" in ro.episodes[0]["error"]


def test_the_guides_environment_file_trains_as_it_says(tok, tmp_path):
    (tmp_path / "reverse_env.py").write_text(doc_file("reverse_env.py", REPO / "docs" / "verifiers.md"))
    spec = f"{tmp_path / 'reverse_env.py'}"
    task = make_task("verifiers", {"env": f"{spec}:ReverseTaskset", "heldout_size": 4})
    ex = task.examples("heldout")[1]  # aej: the second of its 48 words (a-d, e-h, i-l)
    assert (ex.question, ex.solution) == ("aej", "jea") and score_completions(task, ["jea"], [ex], 5.0).rewards == [1.0]
    chat = load_config(None, ["data.use_chat_template=true"])
    env = make_task("verifiers", {"env": f"{spec}:GuessEnv", "taskset": {"id": f"{spec}:ReverseTaskset"}}, chat)
    env.start(TaskContext(tokenizer=tok))
    exs, _, ro = episodes(env, tok, {"aei": ["iex", "iea"]})  # a hint ("no, it ends with a"), then the answer
    assert ro.episodes[0]["turns"] == 2 and score_completions(env, ro.texts, exs, 5.0).rewards == [1.0]


# ------------------------------------------------------------------------------------------------ refusals
def refusal(name: str, args: dict) -> str:
    with pytest.raises(ConfigError) as e:
        make_task(name, args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"task.name={name!r}: "), msg
    return msg


@pytest.mark.parametrize(
    "env, args, says",
    [
        ("ToolTaskset", {}, "ToolTask has tools: MCP servers a harness calls through its own tool-call protocol"),
        ("BoxTaskset", {}, "BoxTask needs a container (NEEDS_CONTAINER): no box runs here"),
        ("SetupTaskset", {}, "SetupTask.setup prepares or reads a runtime (a sandbox box): none runs here"),
        ("RuntimeRewardTaskset", {}, "@vf.reward file_written reads the runtime (a sandbox box): none runs here"),
        ("InterceptTaskset", {}, "InterceptTask has @vf.intercept hooks: they rewrite requests or responses"),
        ("RequestStopTaskset", {}, "@vf.stop long_request reads a request or response; only Trace stops run here"),
        ("ReverseTaskset", {"taskset": {"task": {"judges": [{"id": "reference"}]}}}, "judge 'reference' calls a model"),
        ("ReverseTaskset", {"env_args": {"agent": {"harness": {"id": "bash"}}}}, "seat 'agent''s harness 'bash' runs"),
        ("ReverseTaskset", {"env_args": {"agent": {"model": "gpt-5"}}}, "seat 'agent' is played by another model"),
        ("ReverseTaskset", {"env_args": {"agent": {"sampling": {"temperature": 0.3}}}}, "seat 'agent' sets sampling"),
        ("TwoSeatEnv", {"taskset": {"id": f"{VF}:ReverseTaskset"}}, "TwoSeatEnv has 2 seats (solver, user)"),
        ("GuessEnv", {}, "the Env GuessEnv plays a taskset: name it in task.args.taskset.id"),
        ("WordData", {}, "is WordData, not a verifiers.v1.Taskset or verifiers.v1.Env subclass"),
        (
            "ReverseTaskset",
            {"taskset": {"task": {"rewards": {"bonus": {"fn": "vf_absent_module:bonus"}}}}},
            "reading the hooks of ReverseTask raised ModuleNotFoundError: No module named 'vf_absent_module'",
        ),
    ],
)
def test_what_only_v1s_own_loop_can_run_is_refused_at_load_in_one_line(env, args, says):
    assert says in refusal("verifiers", {"env": f"{VF}:{env}", **args})


def test_the_refusals_that_need_the_config_or_the_package(tmp_path, monkeypatch):
    from rl_training.config.schema import Config

    cfg = Config()
    cfg.data.use_chat_template = False  # an Env's user turns are the chat template's (auto, the default, may have it)
    with pytest.raises(ConfigError, match="GuessEnv writes user turns, which need data.use_chat_template: true"):
        make_task("verifiers", GUESS, cfg)
    assert "loading the environment package 'vf-absent' raised ModuleNotFoundError" in refusal(
        "verifiers/vf-absent", {}
    )
    monkeypatch.syspath_prepend(str(package_dir(tmp_path, "vf-guess", ["GuessTaskset", "GuessEnv"])))
    chat = load_config(None, ["data.use_chat_template=true"])
    assert type(make_task("verifiers/vf-guess", {}, chat)) is VerifiersEnvironment  # the Env the package exports
    assert "task.args.env and taskset.id are verifiers's" in refusal("verifiers/vf-guess", {"env": f"{VF}:GuessEnv"})
    package_dir(tmp_path, "vf-own", ["ReverseTaskset", "OwnHarness"])
    assert "the package's own harness 'vf-own' runs an agent program that calls the model" in refusal(
        "verifiers/vf-own", {}
    )
    assert "ReverseConfig refuses it (num_taskz: Extra inputs are not permitted)" in refusal(
        "verifiers", {"env": f"{VF}:ReverseTaskset", "taskset": {"num_taskz": 3}}
    )
    monkeypatch.setitem(sys.modules, "verifiers", None)  # not installed: an optional extra
    with pytest.raises(ConfigError) as e:
        make_task("verifiers", {"env": f"{VF}:ReverseTaskset"})
    assert str(e.value).startswith("task.name='verifiers' needs the verifiers package (ModuleNotFoundError: ")
    assert str(e.value).endswith("; requirements-extras.txt)") and "\n" not in str(e.value)


def test_a_task_that_needs_a_box_is_refused_when_its_data_loads():
    task = make_task("verifiers", {"env": f"{VF}:ImageTaskset"})
    with pytest.raises(DataError, match="runs in the container image 'python:3.11': no box runs here"):
        task.examples("train")


# ------------------------------------------------------------------------------- model-written text (issue 38)
@functools.cache
def one_reverse_task() -> VerifiersTask:
    return reverse(heldout_size=1)


@given(HOSTILE_TEXT)
def test_grading_is_total_on_whatever_a_policy_writes(text):
    task = one_reverse_task()
    ex = task.examples("heldout")[0]
    scores = score_completions(task, [text, text + "\n"], [ex, ex], timeout_s=5.0)
    assert scores.errors == scores.timeouts == scores.invalid == 0
    assert all(0.0 <= r <= 1.0 for r in scores.rewards) and scores.rewards[0] == scores.rewards[1]  # stripped
