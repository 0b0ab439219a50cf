"""The task builder (rl_training/tasks/build.py): built-in names, user files and modules, task.args, and every way
a spec can be wrong as one line naming the spec and the cause; data.format read as task.name."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.tasks.build import BUILTIN, build_task, make_task
from rl_training.tasks.code.task import CodeTask
from rl_training.tasks.math import MathTask
from rl_training.tasks.python_tool import PythonToolEnvironment
from rl_training.tasks.reasoning_gym import ReasoningGymTask
from rl_training.tasks.reverse import ReverseTask
from rl_training.tasks.search.task import SearchTask
from tests.helpers import TESTCFG

USER_TASK = """
from rl_training.tasks import Environment, Example, Step, Task


class Upper(Task):
    def __init__(self, bonus: float = 0.0):
        self.bonus = bonus

    def reward(self, completion, example):
        return float(completion.strip() == example.question.upper()) + self.bonus


def make_upper(bonus: float = 0.5):
    return Upper(bonus)


INSTANCE = Upper(0.25)
NOT_A_TASK = 42


class Plain:
    pass


def returns_a_string():
    return "no"


class Echo(Environment):
    stop = ("!",)

    def step(self, state, turn):
        return Step(done=True)
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "elsewhere" / "my_task.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent(USER_TASK))
    return path


def one_line_error(name: str, args: dict | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        make_task(name, args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"task.name={name!r}"), msg
    return msg


def test_builtin_names_build_their_family():
    types = {
        "gsm8k": MathTask, "math": MathTask, "reverse": ReverseTask, "search": SearchTask,
        "search_subem": SearchTask, "humaneval": CodeTask, "mbpp": CodeTask, "stdio": CodeTask,
        "python_gsm8k": PythonToolEnvironment, "python_math": PythonToolEnvironment,
    }  # fmt: skip
    assert set(BUILTIN) == set(types) | {"reasoning-gym", "verifiers"}  # these two need task.args
    for name, cls in types.items():
        assert type(make_task(name)) is cls, name
    assert type(make_task("reasoning-gym", {"datasets": {"spell_backward": {}}})) is ReasoningGymTask
    assert type(make_task("reasoning-gym/spell_backward")) is ReasoningGymTask  # a member of the family
    assert make_task("gsm8k").fmt == "gsm8k" and make_task("search_subem").match == "subem"
    assert make_task("mbpp").fmt == "mbpp"


def test_config_reaches_the_builtin_tasks():
    cfg = load_config(None, ["task.name=math", "data.question_key=problem", "task.args.answer_key=solution"])
    task = build_task(cfg)
    # data.question_key is the default of the record field names; task.args names them explicitly
    assert (task.question_key, task.answer_key) == ("problem", "solution")
    cfg = load_config(None, ["task.name=search", "search.topk=5", "task.args={match: subem, format_score: 0.1}"])
    task = build_task(cfg)
    assert (task.topk, task.match, task.format_score) == (5, "subem", 0.1)


def test_user_file_class_factory_and_instance(user_file):
    task = make_task(f"{user_file}:Upper", {"bonus": 0.125})
    assert type(task).__name__ == "Upper" and task.bonus == 0.125
    assert make_task(f"{user_file}:make_upper").bonus == 0.5  # a factory, its own default
    assert make_task(f"{user_file}:INSTANCE").bonus == 0.25
    # imported once per process: both builds give instances of the same class
    assert type(make_task(f"{user_file}:Upper")) is type(task)
    assert make_task(f"{user_file}:Echo").stop == ("!",)


def test_user_module_spec(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    assert make_task("my_task:Upper", {"bonus": 1.0}).bonus == 1.0


def test_relative_task_file_is_saved_absolute(user_file, monkeypatch):
    from rl_training.config.resolve import resolve

    monkeypatch.chdir(user_file.parent.parent)
    cfg = resolve(load_config(None, ["task.name=elsewhere/my_task.py:Upper"]), backend=False).cfg
    assert cfg.task.name == f"{user_file}:Upper"
    monkeypatch.chdir("/")
    assert type(build_task(cfg)).__name__ == "Upper"  # found from any working directory


@pytest.mark.parametrize(
    "spec, args, cause",
    [
        ("reverso", None, "is not a built-in task (gsm8k, math, reverse, search, search_subem, humaneval"),
        ("reverse", {"colour": 1}, "task.args={'colour': 1} do not fit it (TypeError: "),
        ("{tmp}/none.py:X", None, "no such file {tmp}/none.py"),
        ("{file}:Missing", None, "has no attribute 'Missing'; it defines Upper, INSTANCE, Echo"),
        ("{file}:NOT_A_TASK", None, "is of type int, not a Task subclass, factory or instance"),
        ("{file}:Plain", None, "is the class Plain, not a subclass of rl_training.tasks.Task"),
        ("{file}:returns_a_string", None, "returns_a_string(...) returned a str, not a rl_training.tasks.Task"),
        ("{file}:Upper", {"malus": 1}, "Upper(**task.args) with task.args={'malus': 1} raised TypeError: "),
        ("{file}:INSTANCE", {"bonus": 1}, "is an instance, so task.args cannot reach it"),
        ("{file}:", None, "name the object after the ':'"),
        ("no_such_module_xyz:Task", None, "importing module 'no_such_module_xyz' raised ModuleNotFoundError"),
    ],
)
def test_bad_specs_are_one_line(user_file, tmp_path, spec, args, cause):
    spec = spec.format(tmp=tmp_path, file=user_file)
    assert cause.replace("{tmp}", str(tmp_path)) in one_line_error(spec, args)


def test_an_exception_while_importing_names_the_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import os\n\nVALUE = 1 / 0\n")
    msg = one_line_error(f"{bad}:Task")
    assert f"importing {bad}:3 raised ZeroDivisionError: division by zero" in msg
    bad.write_text("class T(\n")
    assert f"importing {bad}:1 raised SyntaxError" in one_line_error(f"{bad}:T2")
    bad.write_text("import sys\nsys.exit(3)\n")  # even SystemExit is one line, not an exit
    assert f"importing {bad}:2 raised SystemExit: 3" in one_line_error(f"{bad}:T3")


def test_declared_names_are_checked(tmp_path):
    f = tmp_path / "names.py"
    f.write_text(
        "from rl_training.tasks import Environment, Task\n"
        "class BadParts(Task):\n    part_names = 'em'\n"
        "class BadStop(Environment):\n    stop = ('',)\n"
    )
    assert "BadParts.part_names must be a tuple of non-empty strings, got 'em'" in one_line_error(f"{f}:BadParts")
    assert "BadStop.stop must be a tuple of non-empty strings, got ('',)" in one_line_error(f"{f}:BadStop")


def test_the_runner_reports_a_bad_task_before_loading_the_model(tmp_path, capsys):
    """The model path does not exist: the task's error must come first, as the one line of the run."""
    from rl_training.runners import rl_runner, sft_runner

    args = ["--cfg", TESTCFG, "model.name_or_path=/no/such/model", f"run.output_dir={tmp_path}"]
    for main in (rl_runner.main, sft_runner.main):
        assert main([*args, f"task.name={tmp_path}/none.py:T"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: task.name='{tmp_path}/none.py:T': no such file {tmp_path}/none.py"]


# ----------------------------------------------------------------------------------------------- config
def test_data_format_is_read_as_task_name(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text("data:\n  format: gsm8k\n  question_key: q\n")
    cfg = load_config(old)
    assert cfg.task.name == "gsm8k" and cfg.data.question_key == "q"
    assert load_config(None, ["data.format=math"]).task.name == "math"  # the old override too
    assert load_config(old, ["task.name=reverse"]).task.name == "reverse"  # an override of either wins
    assert load_config(old, ["data.format=reverse"]).task.name == "reverse"
    both = tmp_path / "both.yaml"
    both.write_text("task:\n  name: math\ndata:\n  format: gsm8k\n")
    with pytest.raises(ConfigError, match=r"data.format='gsm8k' and task.name='math' disagree; data.format is the"):
        load_config(both)
    same = tmp_path / "same.yaml"
    same.write_text("task:\n  name: gsm8k\ndata:\n  format: gsm8k\n")
    assert load_config(same).task.name == "gsm8k"


def test_task_args_from_yaml_and_overrides(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("task:\n  name: x.py:T\n  args: {alpha: 1, beta: [1, 2]}\n")
    cfg = load_config(f, ["task.args.alpha=2.5", "task.args.gamma=hello", "task.args.nested.depth=3"])
    assert cfg.task.args == {"alpha": 2.5, "beta": [1, 2], "gamma": "hello", "nested": {"depth": 3}}
    f.write_text("task:\n  args: [1, 2]\n")
    with pytest.raises(ConfigError, match=r"t.yaml:2: task.args must be a mapping with string keys, got list"):
        load_config(f)
