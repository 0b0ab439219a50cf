"""Config loading: every shipped YAML loads; bad keys, types, bounds and batch layouts fail clearly."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rl_training.config.load import load_config, to_yaml
from rl_training.config.reference import reference, write_reference
from rl_training.config.resolve import resolve
from rl_training.config.rules import check_trainable_dtype
from rl_training.config.schema import ConfigError, all_keys, derive
from rl_training.data.sources import DataError
from tests.helpers import REPO

CFG_DIR = REPO / "cfg"


@pytest.mark.parametrize("path", sorted(CFG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_cfg_loads_and_derives(path):
    cfg = load_config(path)
    d = derive(cfg, world_size=1)
    assert d.accum_steps * cfg.train.micro_batch_groups == cfg.rollout.prompts_per_step


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(CFG_DIR / "tiny_cpu.yaml", ["train.total_steps=7", "lora.target_modules=[q_proj,v_proj]"])
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg
    assert cfg.train.total_steps == 7 and cfg.lora.target_modules == ["q_proj", "v_proj"]


def test_derived_values():
    cfg = load_config(
        None,
        [
            "rollout.prompts_per_step=16",
            "rollout.group_size=8",
            "train.micro_batch_groups=2",
            "rollout.max_new_tokens=32",
        ],
    )
    d = derive(cfg, world_size=2)
    # 16 groups / 2 ranks = 8 groups per rank; 8 / 2 per micro = 4 micro-batches; 8 x 8 = 64 seqs per rank
    assert (d.groups_per_rank, d.accum_steps, d.seqs_per_rank, d.micro_batch_seqs) == (8, 4, 64, 16)


def test_unknown_key_names_nearest(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("loss:\n  kl_coeff: 0.1\n")  # the typo that disabled KL forever in the earlier codebase
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown config key 'loss.kl_coeff'; did you mean 'loss.kl_coef'"):
        load_config(p)


def test_file_errors_name_the_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  name: x\n\ntrain:\n  seed: 1\n  total_steps: -3\n")
    # total_steps is on line 6 (run, name, blank, train, seed, total_steps)
    with pytest.raises(ConfigError, match=r"c.yaml:6: train.total_steps=-3 must be >= 1"):
        load_config(p)
    # an override replaces the file's value, so a bad override is not blamed on the file's line
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.total_steps=0"])
    assert str(e.value) == f"{p}: train.total_steps=0 must be >= 1"
    assert load_config(p, ["train.total_steps=2"]).train.total_steps == 2


@pytest.mark.parametrize(
    "override, nearest",
    [
        ("eval.evry=3", "eval.every"),  # same section first, not ckpt.every
        ("eval.temprature=0.5", "eval.temperature"),  # not rollout.temperature
        ("train.lr=1e-4", "optim.lr"),  # the exact name in another section
        ("trian.total_steps=3", "train.total_steps"),  # a misspelt section
    ],
)
def test_nearest_key_prefers_the_same_section(override, nearest):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"command line: unknown config key '{key}'; did you mean '{nearest}'?"


def test_unknown_section_and_override():
    with pytest.raises(ConfigError, match="unknown config key 'trian.total_steps'; did you mean 'train.total_steps'"):
        load_config(None, ["trian.total_steps=3"])
    with pytest.raises(
        ConfigError, match="unknown config key 'rollout.max_tokens'; did you mean 'rollout.max_new_tokens'"
    ):
        load_config(None, ["rollout.max_tokens=3"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.total_steps=abc", "train.total_steps must be an integer, got 'abc'"),
        ("train.total_steps=1.5", "train.total_steps must be an integer"),
        ("train.total_steps=0", "train.total_steps=0 must be >= 1"),
        ("rollout.temperature=0", "rollout.temperature=0.0 must be > 0"),
        ("rollout.backend=tgi", "rollout.backend='tgi' is not a built-in backend (auto, hf, vllm, server"),
        ("run.tensorboard=yes please", "run.tensorboard must be true or false"),
        ("lora.target_modules=q_proj", "lora.target_modules must be a list"),
        ("ckpt.resume=/no/such/ckpt", "ckpt.resume='/no/such/ckpt': no such checkpoint directory"),
    ],
)
def test_type_and_bound_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_config(None, [override])


def test_drop_zero_adv_groups_refused_with_kl(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.drop_zero_adv_groups=true", "loss.kl_coef=0.05"])
    assert str(e.value) == (
        "train.drop_zero_adv_groups=true with loss.kl_coef=0.05: a zero-advantage group still has a KL "
        "gradient, which dropping it would silently remove; set one of them off"
    )
    # Each alone is fine (and so is a zero coefficient, which only logs the KL).
    load_config(None, ["train.drop_zero_adv_groups=true", "loss.kl_coef=0"])
    load_config(None, ["train.drop_zero_adv_groups=false", "loss.kl_coef=0.05"])


def test_dynamic_sampling_refused_with_kl():
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling=true with loss.kl_coef=0.05: a group whose"):
        load_config(None, ["rollout.dynamic_sampling=true", "loss.kl_coef=0.05"])
    load_config(None, ["rollout.dynamic_sampling=true"])


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ("rollout.max_async_level=1", "rollout.max_async_level > 0: the plan reads the step's first round"),
        ("rollout.dynamic_sampling=true", "rollout.dynamic_sampling: both choose which groups a step trains on"),
        ("rollout.allocation_first=17", "rollout.allocation_first=17 over the k_max of 16"),
    ],
)
def test_per_prompt_allocation_refuses_what_it_cannot_plan_with(other, message):
    needs = {"probe.advisor": ["model.gradient_checkpointing=false"], "rollout.max_async_level": ["loss.tis_cap=2.0"]}
    extra = needs.get(other.split("=")[0], [])
    with pytest.raises(ConfigError, match=re.escape(f"rollout.allocation=per_prompt with {message}")):
        load_config(None, ["rollout.allocation=per_prompt", other, *extra])
    load_config(None, ["rollout.allocation=per_prompt", "rollout.allocation_first=16"])  # k_max 2 x 8
    # the advisor's ANOVA reads unequal groups (probes/anova.py): allowed
    load_config(None, ["rollout.allocation=per_prompt", "probe.advisor=true", "model.gradient_checkpointing=false"])


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ("model.attn_implementation=flash_attention_2", "a custom attention mask, which flash-attention does not take"),
        ("train.pack_sequences=true", "a micro-batch runs as one layout; choose one"),
    ],
)
def test_shared_prompts_refused_where_a_micro_batch_cannot_take_them(other, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.share_prompt=true", other])
    load_config(None, ["train.share_prompt=true"])  # alone: sdpa, padded otherwise
    load_config(None, [other])


@pytest.mark.parametrize(
    ("overrides", "dropped"),
    [
        ([], True),  # the default: auto, and kl_coef defaults to 0, where dropping is exact
        (["loss.kl_coef=0.05"], False),  # auto with a KL term: those groups still carry its gradient
        (["train.drop_zero_adv_groups=false"], False),
        (["train.drop_zero_adv_groups=auto", "loss.kl_coef=0"], True),
    ],
)
def test_drop_zero_adv_groups_auto_is_on_exactly_without_kl(overrides, dropped):
    cfg = load_config(None, overrides)
    assert resolve(cfg).cfg.train.drop_zero_adv_groups is dropped
    assert cfg.train.drop_zero_adv_groups in ("auto", dropped)  # the loaded config keeps what was written


def test_drop_zero_adv_groups_takes_only_auto_true_false():
    # 1 == True in Python: the Literal check is typed, so an integer is refused, not stored as 1.
    with pytest.raises(ConfigError, match=r"train.drop_zero_adv_groups=1 is not one of 'auto', True, False"):
        load_config(None, ["train.drop_zero_adv_groups=1"])


def test_float_written_without_dot_is_accepted():
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == pytest.approx(3e-4)


def test_non_divisible_batches():
    cfg = load_config(None, ["rollout.prompts_per_step=6"])
    with pytest.raises(ConfigError, match="prompts_per_step=6 is not divisible by the world size 4"):
        derive(cfg, world_size=4)
    cfg = load_config(None, ["rollout.prompts_per_step=6", "train.micro_batch_groups=4"])
    with pytest.raises(ConfigError, match=r"prompt groups per rank \(6 .*micro_batch_groups=4"):
        derive(cfg, world_size=1)


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  total_steps: 3\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(p)


@pytest.mark.parametrize("correction", [["loss.tis_cap=2.0"], ["loss.correction=seq_geo_mask"]])
def test_corrections_refused_with_top_p_below_one(correction):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*correction, "rollout.top_p=0.9"])
    name = "tis" if "tis" in correction[0] else "seq_geo_mask"
    assert str(e.value) == (
        f"loss.correction={name} with rollout.top_p=0.9: the sampler's log-probs come from the top-p renormalised "
        "distribution, so pi_train/pi_rollout would not be an importance ratio; set rollout.top_p=1 or "
        "loss.correction=none"
    )
    load_config(None, ["loss.tis_cap=2.0", "rollout.top_p=1.0"])
    # evals read saved configs (training=False): a run made before these refusals existed is still evaluated
    cfg = load_config(
        None,
        ["loss.tis_cap=2.0", "rollout.top_p=0.9", "train.drop_zero_adv_groups=true", "loss.kl_coef=0.05"],
        training=False,
    )
    assert (cfg.loss.tis_cap, cfg.rollout.top_p, cfg.loss.kl_coef) == (2.0, 0.9, 0.05)
    load_config(None, ["loss.tis_cap=0", "rollout.top_p=0.9"])


def test_training_refuses_float16(capsys):
    # No GradScaler: loading a config for training (the RL and SFT runners) refuses float16 before anything is
    # built; loading it for evals (training=False) still accepts it.
    from rl_training.runners import rl_runner, sft_runner

    cfg = load_config(None, ["model.dtype=float16"], training=False)
    message = (
        "model.dtype=float16 cannot train: there is no fp16 gradient scaler (small gradients underflow to 0); "
        "use bfloat16 or float32"
    )
    with pytest.raises(ConfigError) as e:
        check_trainable_dtype(cfg)
    assert str(e.value) == message
    check_trainable_dtype(load_config(None, ["model.dtype=bfloat16"]))
    for runner, name in ((rl_runner, "testconfig.yaml"), (sft_runner, "tiny_sft.yaml")):
        assert runner.main(["--cfg", str(CFG_DIR / name), "model.dtype=float16"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {message}"]


@pytest.mark.parametrize(
    "override, problem",
    [
        ("lora.target_modules=[q_proj", "expected ',' or ']', but got '<stream end>'"),
        ("optim.lr=[1", "expected ',' or ']', but got '<stream end>'"),
        ("train.seed=@3", "found character '@' that cannot start any token"),
    ],
)
def test_unparsable_override_is_one_line_error(override, problem, capsys):
    key, raw = override.split("=", 1)
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == f"command line: {key}={raw!r} is not a valid YAML value ({problem})"
    # Through a runner's CLI: exit status 2 and exactly that one line on stderr.
    from rl_training.runners import rl_runner

    assert rl_runner.main(["--cfg", str(CFG_DIR / "testconfig.yaml"), override]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {e.value}"]


@pytest.mark.parametrize("text, kind", [("- run\n- model\n", "list"), ("just a string\n", "str")])
def test_yaml_root_must_be_a_mapping(tmp_path, text, kind):
    p = tmp_path / "root.yaml"
    p.write_text(text)
    for overrides in ([], ["train.seed=1"]):  # with an override it used to be an AttributeError
        with pytest.raises(ConfigError) as e:
            load_config(p, overrides)
        expected = f"{p}: the top level must be a mapping of sections (run:, model:, ...), got a YAML {kind}"
        assert str(e.value) == expected


def test_override_into_empty_section(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("lora:\ntrain:\n  seed: 3\n")  # 'lora:' with nothing under it is YAML null
    cfg = load_config(p, ["lora.r=4"])
    assert (cfg.lora.r, cfg.train.seed) == (4, 3)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


def test_unreadable_file_is_one_line_naming_it(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))  # e-acute is the single byte 0xe9 in Latin-1
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: not UTF-8 text (byte 16: 0xe9)"  # 'run:\n' 5 bytes + '  name: caf' 11
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)  # a directory: IsADirectoryError, an OSError
    assert str(e.value) == f"{tmp_path}: cannot read (Is a directory)"


def test_required_keys_must_be_in_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    for text in ["model:\n  dtype: float32\n", "model:\n"]:  # without the key, an empty section (empty: above)
        p.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_config(p, required=["model.name_or_path"])
        assert str(e.value) == f"{p}: no model.name_or_path (the file must set it; defaults are not assumed)"
    assert load_config(p).model.name_or_path == "models/tiny-qwen2"  # not required: the default, as before
    p.write_text("model:\n  name_or_path: m\n")
    assert load_config(p, required=["model.name_or_path"]).model.name_or_path == "m"


def test_reference_documents_every_key():
    ref = reference()
    for key in all_keys():
        assert f"`{key}`" in ref


def test_config_reference_page_is_current(tmp_path):
    from rl_training.runners.config_reference import table

    page = (CFG_DIR.parent / "docs" / "config.md").read_text()
    assert page.endswith(table() + "\n"), "regenerate it: make config-ref"
    # Regenerating keeps the hand-written text above the table and replaces a stale table.
    stale = tmp_path / "config.md"
    stale.write_text(
        "# Intro kept\n\n| key | type | default | meaning |\n|---|---|---|---|\n| `old.key` | int | `1` | x |\n"
    )
    write_reference(stale, reference())
    assert stale.read_text() == "# Intro kept\n\n" + reference() + "\n"


def test_string_overrides_are_verbatim():
    cfg = load_config(None, ["data.prompt_template=Q: {question}\nA:", "run.name=123"])
    assert cfg.data.prompt_template == "Q: {question}\nA:" and cfg.run.name == "123"


def test_resolve_paths_makes_local_paths_absolute(tmp_path, monkeypatch):
    from rl_training.config.resolve import resolve_paths

    monkeypatch.chdir(tmp_path)
    for d in ["models/m", "math500", "latest"]:  # 'latest' as a directory: ckpt.resume=latest is still the keyword
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "train.jsonl").write_text("")
    over = ["model.name_or_path=models/m", "data.train=./train.jsonl", "data.eval=math500:main@test"]
    cfg = load_config(None, [*over, "run.output_dir=runs", "ckpt.resume=latest"])
    resolve_paths(cfg)
    assert cfg.model.name_or_path == f"{tmp_path}/models/m"
    assert cfg.data.train == f"{tmp_path}/train.jsonl"  # './' dropped
    assert cfg.data.eval == f"{tmp_path}/math500:main@test"  # a local `datasets` directory, config and split kept
    assert cfg.run.output_dir == f"{tmp_path}/runs"  # made by the run: absolute before it exists
    assert cfg.ckpt.resume == "latest"
    # Hub ids and `datasets` names that are not on disk stay as they are; absolute paths too.
    hub = ["model.name_or_path=Qwen/Qwen2.5-1.5B-Instruct", "data.train=openai/gsm8k:main@train"]
    cfg = load_config(None, [*hub, "data.eval=/abs/heldout.jsonl", f"ckpt.resume={tmp_path / 'latest'}"])
    resolve_paths(cfg)
    assert (cfg.model.name_or_path, cfg.data.train) == ("Qwen/Qwen2.5-1.5B-Instruct", "openai/gsm8k:main@train")
    assert cfg.data.eval == "/abs/heldout.jsonl" and cfg.ckpt.resume == f"{tmp_path}/latest"


def test_resume_changes_compares_target_modules_as_a_set(tmp_path):
    from rl_training.ckpt.store import CheckpointError, resume_changes

    saved = load_config(None, ["lora.target_modules=[q_proj,v_proj]", "optim.lr=0.001"])
    (tmp_path / "config.yaml").write_text(to_yaml(saved))
    same_set = load_config(None, ["lora.target_modules=[v_proj,q_proj]", "optim.lr=0.001"])
    assert resume_changes(tmp_path, to_yaml(same_set)) == []  # peft adapts the same modules
    other_lr = load_config(None, ["lora.target_modules=[q_proj,v_proj]", "optim.lr=0.002"])
    assert resume_changes(tmp_path, to_yaml(other_lr)) == ["optim.lr: 0.001 -> 0.002"]
    with pytest.raises(
        CheckpointError, match=r"saved with lora.target_modules=\['q_proj', 'v_proj'\], now \['q_proj'\]"
    ):
        resume_changes(tmp_path, to_yaml(load_config(None, ["lora.target_modules=[q_proj]", "optim.lr=0.001"])))


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n"])
def test_empty_yaml_is_an_error(tmp_path, text, capsys):
    # PyYAML reads all three as None; `None or {}` used to train on every default without a word.
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: the file is empty (no sections); it would silently train on every default"
    from rl_training.runners import rl_runner

    assert rl_runner.main(["--cfg", str(p)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {e.value}"]


def _float_keys() -> list[str]:
    import typing

    from rl_training.config.schema import Config, _field_types

    out = []
    for key in all_keys():
        *sections, name = key.split(".")
        node = Config()
        for section in sections:
            node = getattr(node, section)
        tp = _field_types(type(node))[name]
        if tp is float or float in typing.get_args(tp):
            out.append(key)
    return out


def test_every_float_field_rejects_nan_and_infinity():
    # nan compares False with every bound (nan < 0 and nan > 0 are both False), so `ge`/`gt` checks let it
    # through; before the check optim.lr=nan reached torch. Every float key, three spellings YAML reads as
    # non-finite floats.
    keys = _float_keys()
    assert len(keys) >= 30 and "optim.lr" in keys and "loss.kl_coef" in keys  # the walk found the float fields
    for key in keys:
        for raw, shown in ((".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("nan", "nan")):
            with pytest.raises(ConfigError) as e:
                load_config(None, [f"{key}={raw}"])
            assert str(e.value) == f"{key}={shown} must be a finite number", (key, raw)


def test_nan_in_a_file_names_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  name_or_path: x\noptim:\n  lr: .nan\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}:4: optim.lr=nan must be a finite number"


@pytest.mark.parametrize(
    "name, why",
    [
        ("../../x", "has a path separator"),
        ("/abs", "has a path separator"),
        ("a/b", "has a path separator"),
        ("a\\b", "has a path separator"),
        ("..", "is '.' or '..'"),
        (".", "is '.' or '..'"),
        ("", "is empty"),  # string overrides are verbatim: `run.name=` is the empty name
        (" ", "is empty"),
    ],
)
def test_run_name_is_a_single_path_component(tmp_path, name, why, capsys):
    from rl_training.runners import rl_runner

    with pytest.raises(ConfigError) as e:
        load_config(None, [f"run.name={name}"])
    assert str(e.value) == f"run.name={name!r} {why}; it must be a single path component (a directory name)"
    out = tmp_path / "out" / "deep"
    out.mkdir(parents=True)
    argv = ["--cfg", str(CFG_DIR / "testconfig.yaml"), f"run.output_dir={out}", f"run.name={name}"]
    assert rl_runner.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {CFG_DIR / 'testconfig.yaml'}: {e.value}"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deep", "out"]  # nothing written, inside or out
    load_config(None, ["run.name=my-run_2.v1"])  # dots, dashes inside a name are fine


def test_the_data_defaults_to_the_task_s_own_splits_and_config_names_no_task_family(tmp_path):
    # Task families declare their own splits (Task.examples); config/ names none of them (issue 51, item 3): with
    # no data named, every task reads 'task:train' / 'task:heldout', which a task that reads files refuses by name.
    from rl_training.data.sources import load_examples
    from rl_training.tasks.build import make_task
    from rl_training.tasks.reverse import make_reverse_splits

    default = load_config(None, [])
    assert (default.data.train, default.data.eval) == ("task:train", "task:heldout")
    for name in ("reasoning-gym/spell_backward", "verifiers/my-env", "gsm8k"):
        assert load_config(None, [f"task.name={name}"]).data.train == "task:train"
    yaml_file = tmp_path / "rg.yaml"
    yaml_file.write_text("task: {name: reasoning-gym, args: {datasets: {spell_backward: {}}}}\ndata: {eval: h.jsonl}\n")
    cfg = load_config(yaml_file)
    assert (cfg.data.train, cfg.data.eval) == ("task:train", "h.jsonl")  # what the config names stays
    assert load_config(None, ["task.name=reasoning-gym/x", "data.train=f.jsonl"]).data.train == "f.jsonl"
    # the reverse task's own splits are the records scripts/make_synthetic_data.py writes, in their order
    reverse = make_task("reverse")
    train, heldout = make_reverse_splits(4000, 256)
    for split, recs in (("train", train), ("heldout", heldout)):
        got = load_examples(f"task:{split}", reverse.parse)
        assert [(ex.question, ex.reference, ex.solution) for ex in got] == [
            (r["question"], r["answer"], r["answer"]) for r in recs
        ]
    assert {ex.question for ex in load_examples("task:train", reverse.parse)}.isdisjoint(q["question"] for q in heldout)
    with pytest.raises(DataError, match="the reverse task makes the splits train, heldout"):
        load_examples("task:valid", reverse.parse)
    with pytest.raises(DataError, match="makes no problems of its own; name its data files in data.train"):
        load_examples("task:train", make_task("gsm8k").parse)
    config_code = "\n".join(p.read_text() for p in (REPO / "rl_training" / "config").glob("*.py"))
    assert "data/reverse" not in config_code and "SPLITS" not in config_code  # the help strings name families


def test_the_help_of_a_registered_name_is_generated_from_its_registry():
    # The help strings cannot import the registries above config/ (tasks, rollout), so none restates one; the
    # reference generator adds each registry's names to its key's help (runners/config_reference.py): a task, a
    # family, an objective, a correction or a backend added there is named in docs/config.md with nothing else edited.
    from rl_training.algs.corrections import CORRECTIONS
    from rl_training.algs.objectives import OBJECTIVES
    from rl_training.config.generation import RolloutCfg
    from rl_training.config.schema import LossCfg, TaskCfg
    from rl_training.rollout.kinds import KINDS
    from rl_training.runners.config_reference import table
    from rl_training.tasks.build import BUILTIN, FAMILIES

    def help_of(cls, key):
        (f,) = [f for f in dataclasses.fields(cls) if f.name == key]
        return f.metadata["doc"]

    rows = {line.split("`")[1]: line for line in table().splitlines()[2:]}
    registries = {
        ("task.name", TaskCfg, "name"): [*BUILTIN, *(f"{f}/<member>" for f in FAMILIES)],
        ("loss.type", LossCfg, "type"): list(OBJECTIVES),
        ("loss.correction", LossCfg, "correction"): list(CORRECTIONS),
        ("rollout.backend", RolloutCfg, "backend"): list(KINDS),
    }
    for (key, cls, name), names in registries.items():
        assert len(names) >= 3 and [n for n in names if n not in rows[key]] == [], key
        assert [n for n in names if f" {n}," in help_of(cls, name) or f" {n} (" in help_of(cls, name)] == [], key
    assert "(a colocated in-process vLLM engine, asleep while training)" in rows["rollout.backend"]  # KINDS' own words
