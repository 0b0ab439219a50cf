"""Every metric key the docs name is one the code logs: the keys in backticks in README.md and docs/*.md, and
the keys the library's docstrings name (its interfaces' promises), checked against what a run logs
(tests/fixtures/step_metrics.json, recorded by tests/integration/test_step_metrics.py), the key strings in the
code, and the names the built-in tasks and corrections declare. A doc key with a placeholder
(`reward/<name>_mean`, `is/*_frac`) must match a logged key or a key template of the code."""

from __future__ import annotations

import ast
import collections
import json
import re

import pytest

from rl_training.algs.corrections import CORRECTIONS
from rl_training.tasks.base import Environment
from rl_training.tasks.build import BUILTIN, make_task
from rl_training.tasks.tools import ERROR_CLASSES
from tests.helpers import REPO

NS = r"(?:rollout|train|perf|mem|is|probe|guard|eval|reward|tool|retrieval|lora|sync)"
KEY = NS + r"/[A-Za-z0-9_@<>{}*.:/-]*[A-Za-z0-9_>}*@]"
PLACEHOLDER = r"<[^>]*>|\{[^}]*\}|\*|\b[A-Z]{2,}\b|\d+\.\.\d+"  # <name>, {k}, *, NAME, 1..3
EVAL_AT_K = r"eval/(?:[\w-]+/)?(?:pass|maj)@\d+"  # pass@k / maj@k for every k of eval.ks (pass_at_k.py)


def doc_keys() -> dict[str, str]:
    """key -> where it is named."""
    out = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in re.finditer(rf"`({KEY})`", path.read_text()):
            out.setdefault(m.group(1), path.name)
    for path, tree in sources():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for m in re.finditer(rf"(?<![\w/.])({KEY})", node.value.value):
                    out.setdefault(m.group(1), str(path.relative_to(REPO)))
    # doc shorthand: ns/a_min/max names two keys (a_min, a_max), name:max is a keep_best spec, a path is not a key
    keys = {}
    for k, where in out.items():
        k = k.split(":")[0]
        if k.endswith(".py"):
            continue
        m = re.fullmatch(r"([^/]+/[^/]*_)(min)/(max)", k)
        for expanded in [m[1] + m[2], m[1] + m[3]] if m else [k]:
            keys[expanded] = where
    return keys


def sources():
    for path in sorted([*(REPO / "rl_training").rglob("*.py"), *(REPO / "evals").rglob("*.py")]):
        yield path, ast.parse(path.read_text())


def code_strings() -> tuple[set[str], list[str]]:
    """(the string constants of the code, its f-string templates as regexes); docstrings left out."""
    exact, templates = set(), []
    for _, tree in sources():
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if id(node) in docs:
                continue
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                exact.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                templates.append(
                    "".join(re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values)
                )
    return exact, templates


def declared() -> set[str]:
    """The keys the built-in tasks and corrections declare by name (their reward parts, counts, episode counts)."""
    out = set()
    for name in BUILTIN:
        try:
            task = make_task(name)
        except Exception:  # noqa: BLE001 -- a family that needs task.args (reasoning-gym) declares nothing alone
            continue
        out |= {f"reward/{p}_mean" for p in task.part_names} | {f"reward/{c}" for c in task.count_names}
        if isinstance(task, Environment):
            out |= set(task.episode_metrics(collections.defaultdict(lambda: 1.0)))
            out |= {f"tool/errors_{c}" for c in getattr(task, "error_classes", ())}  # a tool environment's classes
    out |= {f"is/{k}_frac" for c in CORRECTIONS.values() for k in c.counts}
    out |= {f"tool/errors_{c}" for c in ERROR_CLASSES}
    return out


def logged() -> set[str]:
    rows = json.loads((REPO / "tests" / "fixtures" / "step_metrics.json").read_text())
    return {k for run in rows.values() for row in run for k in row}


def test_every_key_the_docs_name_is_logged():
    keys = doc_keys()
    assert len(keys) > 100  # the docs do name keys: the scan works
    exact, templates = code_strings()
    known = logged() | declared() | exact
    missing = []
    for key, where in sorted(keys.items()):
        pattern = re.sub(PLACEHOLDER, ".+", re.escape(key).replace(r"\*", "*").replace(r"\.\.", ".."))
        pattern = re.sub(r"\\(<|>|\{|\})", r"\1", pattern)
        pattern = re.sub(PLACEHOLDER, ".+", pattern)
        if pattern == re.escape(key):  # a concrete key: logged, declared, or a string of the code
            ok = key in known or re.fullmatch(EVAL_AT_K, key)
        else:  # a pattern: some logged key, or a template of the code (or one its prefix names)
            example = re.sub(PLACEHOLDER, "x", key)
            ok = any(re.fullmatch(pattern, k) or k.startswith(example.rstrip("x") + "/") for k in known) or any(
                re.fullmatch(t, example) or re.fullmatch(t, key) for t in templates
            )
        ok = (
            ok
            or any(k.startswith(key + "/") for k in known)
            or any(t.startswith(re.escape(key + "/")) for t in templates)
        )
        if not ok:
            missing.append(f"{key} ({where})")
    assert not missing, missing


@pytest.mark.parametrize("stale", ["reward/errors", "is/mask_frac", "is/truncated_frac"])
def test_a_key_no_code_logs_is_caught(stale, monkeypatch):
    """The names the issue found stale (a docstring promised reward/errors; docs named is/mask_frac)."""
    real = doc_keys
    monkeypatch.setattr(f"{__name__}.doc_keys", lambda: {**real(), stale: "a page"})
    with pytest.raises(AssertionError, match=re.escape(stale)):
        test_every_key_the_docs_name_is_logged()
