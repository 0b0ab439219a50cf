"""The plugin loader (rl_training/config/plugins.py) at every extension point: loss.type, loss.correction and
rollout.backend take a built-in name or a user's 'file.py:NAME' / 'package.module:NAME' with keyword arguments,
a user's file imports the helpers beside it from any working directory, and every bad spec is one line."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rl_training.algs.corrections import CORRECTIONS, TruncatedIS
from rl_training.algs.objectives import OBJECTIVES
from rl_training.config.load import load_config
from rl_training.config.plugins import BACKEND_NAMES, load_correction, load_objective
from rl_training.config.resolve import resolve
from rl_training.config.schema import ConfigError
from rl_training.rollout.factory import build_backend, versioned
from rl_training.rollout.hf import HFBackend
from rl_training.train.learner import UpdateHParams

HELPER = """
SCALE = 3.0
"""

PLUGINS = """
import torch

from my_helper import SCALE  # a module beside this file: importable from any working directory
from rl_training.algs.corrections import Correction, CorrectionOut
from rl_training.algs.objectives import OBJECTIVES, Objective, token_mean
from rl_training.rollout.factory import hf_backend

DR = OBJECTIVES["dr_grpo"]
TOKEN_MEAN = Objective("dr_token_mean", "-", DR.baseline, DR.scale, DR.surrogate, token_mean, 0.2, 0.2)


def scaled(factor: float = 1.0):
    def surrogate(*a):
        s = DR.surrogate(*a)
        return s._replace(per_token=s.per_token * factor * SCALE)

    return Objective("scaled", "-", DR.baseline, DR.scale, surrogate, DR.aggregate, 0.2, 0.2)


class Halve(Correction):
    name = "halve"
    counts = {"is/halved_frac": "tokens"}

    def __init__(self, by: float = 2.0):
        self.by = by

    def __call__(self, logp, rollout_logp, mask):
        return CorrectionOut(mask / self.by, {"is/halved_frac": mask.sum()})


def counting_hf(ctx, label: str = "x"):
    backend = hf_backend(ctx)
    backend.name = f"counting-{label}"
    return backend


NOT_A_PLUGIN = 7
"""


@pytest.fixture
def plugin_file(tmp_path, monkeypatch):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_helper.py").write_text(textwrap.dedent(HELPER))
    (folder / "my_plugins.py").write_text(textwrap.dedent(PLUGINS))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither the file's folder nor the checkout
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(folder))])
    return folder / "my_plugins.py"


def cfg_with(*overrides):
    return load_config(None, list(overrides))


def test_builtin_rows_are_the_registries():
    assert load_objective(cfg_with().loss) is OBJECTIVES["dr_grpo"]
    assert load_objective(cfg_with("loss.type=gspo").loss) is OBJECTIVES["gspo"]
    assert load_correction(cfg_with().loss) is None  # none
    tis = load_correction(cfg_with("loss.tis_cap=1.5").loss)  # the shorthand
    assert isinstance(tis, TruncatedIS) and tis.cap == 1.5
    mask = load_correction(cfg_with("loss.correction=token_mask", "loss.correction_args.high=3.0").loss)
    assert (mask.low, mask.high) == (0.125, 3.0)
    assert set(CORRECTIONS) == {"tis", "token_mask", "seq_geo_mask"} and set(BACKEND_NAMES) == {"hf", "vllm", "server"}


def test_the_trainer_builds_what_the_config_names(plugin_file):
    # UpdateHParams.from_config is what the runner's setup calls (runners/rl_runner.py): the names reach the update
    hp = UpdateHParams.from_config(resolve(cfg_with("loss.type=grpo", "loss.tis_cap=2.0"), objective=True).cfg)
    assert hp.objective is OBJECTIVES["grpo"] and isinstance(hp.correction, TruncatedIS) and hp.correction.cap == 2.0
    cfg = cfg_with(
        f"loss.type={plugin_file}:scaled", "loss.args.factor=0.5",
        f"loss.correction={plugin_file}:Halve", "loss.correction_args.by=4",
    )  # fmt: skip
    hp = UpdateHParams.from_config(resolve(cfg, objective=True).cfg)
    assert hp.objective.name == "scaled" and type(hp.correction).__name__ == "Halve" and hp.correction.by == 4
    # the factor and the helper's SCALE reach the surrogate: 0.5 * 3 = 1.5 x Dr-GRPO's per-token loss
    logp, adv, mask = torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2)
    dr = OBJECTIVES["dr_grpo"].surrogate(logp, logp, adv, mask, 0.2, 0.2).per_token
    mine = hp.objective.surrogate(logp, logp, adv, mask, 0.2, 0.2).per_token
    torch.testing.assert_close(mine, 1.5 * dr)
    assert hp.correction(logp, logp, mask).weights.tolist() == [[0.25, 0.25]]


def test_an_instance_and_the_resolved_config_keep_working_from_elsewhere(plugin_file, tmp_path, monkeypatch):
    monkeypatch.chdir(plugin_file.parent)
    cfg = resolve(cfg_with("loss.type=my_plugins.py:TOKEN_MEAN", "loss.tis_cap=2.0"), objective=True).cfg
    assert cfg.loss.type == f"{plugin_file}:TOKEN_MEAN"  # saved absolute, like task.name
    assert (cfg.loss.correction, cfg.loss.correction_args) == ("tis", {"cap": 2.0})  # the shorthand, resolved
    monkeypatch.chdir(tmp_path)
    assert load_objective(cfg.loss).name == "dr_token_mean"
    assert resolve(cfg, objective=True).cfg.loss == cfg.loss  # resolving again changes nothing


def test_a_user_backend_is_built_with_its_context_and_args(plugin_file, tiny_model):
    from rl_training.base.dist import DistInfo
    from rl_training.policy.models import build_policy

    cfg = cfg_with(f"model.name_or_path={tiny_model}", f"rollout.backend={plugin_file}:counting_hf",
                   "rollout.backend_args.label=mine")  # fmt: skip
    tok, model = build_policy(cfg, torch.device("cpu"))
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    backend = build_backend(cfg, model, tok, info)
    assert isinstance(backend, HFBackend) and backend.name == "counting-mine"
    with pytest.raises(ConfigError, match=r"needs a versioned backend .* has no pinned, republish, version_dirs"):
        versioned(backend, cfg_with("rollout.backend=server", "server.urls=[http://h:1]", "loss.tis_cap=2",
                                    "rollout.max_async_level=1"))  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.type=ppo"], "loss.type='ppo' is not a built-in objective (dr_grpo, grpo, dapo, gspo, cispo, rloo"),
        (["loss.correction=icepop"], "loss.correction='icepop' is not a built-in correction (none, tis, token_mask"),
        (["rollout.backend=sglang"], "rollout.backend='sglang' is not a built-in backend (auto, hf, vllm, server)"),
        (["loss.tis_cap=2", "loss.correction=token_mask"], "loss.tis_cap=2.0 with loss.correction=token_mask"),
        (
            ["loss.tis_cap=2", "loss.correction=tis", "loss.correction_args.cap=3"],
            "loss.correction_args.cap=3 disagree",
        ),
    ],
)
def test_bad_names_are_one_line_at_load(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("loss.type={file}:nope", "has no attribute 'nope'; it defines DR, TOKEN_MEAN"),
        ("loss.type={file}:NOT_A_PLUGIN", "is of type int, not a Objective subclass, factory or instance"),
        ("loss.type={file}:Halve", "is the class Halve, not a subclass of rl_training.algs.objectives.Objective"),
        ("loss.type={file}:counting_hf", "counting_hf(**loss.args) with loss.args={} raised TypeError"),
        ("loss.type={tmp}/none.py:X", "no such file"),
        ("loss.type=no_such_pkg.mod:X", "importing module 'no_such_pkg.mod' raised ModuleNotFoundError"),
        ("loss.correction={file}:scaled", "scaled(...) returned a Objective, not a rl_training.algs.corrections."),
        ("loss.correction={file}:Halve", "Halve(**loss.correction_args) with loss.correction_args={'x': 1} raised"),
    ],
)
def test_bad_user_specs_are_one_line_naming_the_key(plugin_file, tmp_path, spec, message):
    extra = ["loss.correction_args.x=1"] if spec.endswith(":Halve") and spec.startswith("loss.correction") else []
    cfg = cfg_with(spec.format(file=plugin_file, tmp=tmp_path), *extra)
    with pytest.raises(ConfigError) as e:
        resolve(cfg, objective=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(spec.split("=")[0] + "="), msg
    assert message in msg, msg
