"""Dependencies run one way: every module of rl_training and evals imports alone, the module import graph (read
from the source with ast, deferred imports inside functions included) has no cycle, and the library never
imports the command-line tools built on it (rl_training -> evals)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from rl_training import LAYERS
from tests.helpers import REPO

ROOT = REPO
PACKAGES = ("rl_training", "evals")

# Deferred imports (inside a function) that close a cycle, kept on purpose until their module is split: each
# names the module that imports, the one it imports, and why. The test fails when one disappears from the
# source, so this list cannot go stale. (Empty since the package layout: keep it so.)
DEFERRED_BACK_EDGES: set[tuple[str, str]] = set()

# The package order is rl_training.LAYERS (rl_training/__init__.py): a package imports only packages before it in
# that list (and itself); `rl_training`'s own top-level modules (command shims) sit at the top with the runners, and
# `evals` above everything.


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _type_checking_only(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """{imported module of ours: deferred?}; `from pkg import sub` counts as importing pkg.sub only."""
    is_pkg = path.name == "__init__.py"
    found: dict[str, bool] = {}

    def add(target: str, deferred: bool) -> None:
        if target in modules and target != name:
            found[target] = found.get(target, True) and deferred

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                continue
            inner = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for a in child.names:
                    add(a.name, deferred)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against this module's package
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - child.level + 1]
                    base = ".".join([*pkg, *([child.module] if child.module else [])])
                subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in modules]
                for s in subs:
                    add(s, deferred)
                if len(subs) < len(child.names):
                    add(base, deferred)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def import_graph() -> dict[str, dict[str, bool]]:
    modules = module_files()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(edges, 0)
    for start in sorted(edges):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
            elif colour.get(nxt) == 1:
                path = [n for n, _ in stack]
                return [*path[path.index(nxt) :], nxt]
            elif colour.get(nxt) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(edges[nxt]))))
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle


def test_import_graph_has_no_cycle_and_runs_downward():
    graph = import_graph()
    assert len(graph) > 60  # the scan saw the tree (89 modules when written)
    deferred = {(m, t) for m, deps in graph.items() for t, lazy in deps.items() if lazy}
    stale = DEFERRED_BACK_EDGES - deferred
    assert not stale, f"no longer deferred imports (drop them from DEFERRED_BACK_EDGES): {sorted(stale)}"
    edges = {m: {t for t in deps if (m, t) not in DEFERRED_BACK_EDGES} for m, deps in graph.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    lib = {m: deps for m, deps in graph.items() if m.startswith("rl_training")}
    up = sorted((m, t) for m, deps in lib.items() for t in deps if t.startswith("evals"))
    assert not up, f"the library imports the evals command: {up}"


_IMPORT_EACH = r"""
import importlib, json, os, sys
preload, modules = json.loads(sys.argv[1])
for name in preload:  # third-party libraries, imported once: each child then imports only our module
    try:
        importlib.import_module(name)
    except ImportError:
        pass
failed = {}
for name in modules:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            msg = b""
        except BaseException as e:  # noqa: BLE001 (reported to the parent, whatever it is)
            msg = f"{type(e).__name__}: {e}".encode()
        os.write(w, msg[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    os.waitpid(pid, 0)
    if msg:
        failed[name] = msg
print(json.dumps(failed))
"""


def third_party_top_level() -> list[str]:
    """The non-project packages imported at module scope somewhere in the tree (preloaded by the parent)."""
    names = set()
    for path in module_files().values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return sorted(names - set(PACKAGES) - set(sys.stdlib_module_names) - {"__future__"})


def package_of(module: str) -> str:
    """'rl_training.tasks.code.task' -> 'tasks'; a top-level module of rl_training -> 'runners' (command shims);
    anything under evals -> 'evals'."""
    parts = module.split(".")
    if parts[0] == "evals":
        return "evals"
    if len(parts) == 1:
        return "rl_training"
    return parts[1] if parts[1] in LAYERS else "runners"


def test_packages_depend_downward_only():
    """Every import between two packages goes from a later package of LAYERS to an earlier one, deferred
    imports included: no package cycle, and a package's place in the list says what it may use."""
    rank = {p: i for i, p in enumerate(LAYERS)} | {"evals": len(LAYERS), "rl_training": -1}
    graph = import_graph()
    found = {
        m.split(".")[1]
        for m in graph
        if m.startswith("rl_training.") and (ROOT / "rl_training" / m.split(".")[1]).is_dir()
    }
    assert found == set(LAYERS), f"packages not in LAYERS (or LAYERS names a missing one): {found ^ set(LAYERS)}"
    up = sorted(
        (m, t)
        for m, deps in graph.items()
        for t in deps
        if package_of(m) != package_of(t) and rank[package_of(t)] > rank[package_of(m)]
    )
    assert not up, "imports against the package order (LAYERS in rl_training/__init__.py): " + ", ".join(
        f"{m} -> {t}" for m, t in up
    )
    pkg_edges: dict[str, set[str]] = {}
    for m, deps in graph.items():
        pkg_edges.setdefault(package_of(m), set()).update(package_of(t) for t in deps if package_of(t) != package_of(m))
    assert find_cycle(pkg_edges) is None


def declared_imports(package: str) -> set[str]:
    """The packages a package's __init__.py docstring says it may import: its 'May import: a, b, c.' sentence
    ('nothing of ...' is none; 'every package' is all before it in LAYERS)."""
    doc = ast.get_docstring(ast.parse((ROOT / "rl_training" / package / "__init__.py").read_text())) or ""
    m = re.search(r"May import:\s*([^.]*)\.", doc)
    assert m, f"rl_training/{package}/__init__.py: no 'May import: ...' sentence in its docstring"
    said = m.group(1)
    if said.startswith("nothing"):
        return set()
    if said.startswith("every package"):
        return set(LAYERS[: LAYERS.index(package)])
    return set(re.findall(r"\w+", said)) - {"and"}


def test_every_package_says_what_it_is_and_what_it_may_import():
    """Each package's __init__.py opens with its job, what it may import and what it owns (issue 39, item 7). The
    'May import' list is held to the code: every package the package really imports is in it, and it names only
    packages before it in LAYERS. Subpackages (tasks/code/, tasks/search/) and rl_training itself have a docstring."""
    graph = import_graph()
    wrong = []
    for i, package in enumerate(LAYERS):
        doc = ast.get_docstring(ast.parse((ROOT / "rl_training" / package / "__init__.py").read_text())) or ""
        if "Owns" not in doc:
            wrong.append(f"{package}: no 'Owns' in its docstring")
        declared = declared_imports(package)
        if not declared <= set(LAYERS[:i]):
            wrong.append(f"{package}: says it may import {sorted(declared - set(LAYERS[:i]))}, not before it in LAYERS")
        used = {package_of(t) for m, deps in graph.items() if package_of(m) == package for t in deps} - {package}
        if not used <= declared:
            wrong.append(f"{package}: imports {sorted(used - declared)}, not in its 'May import' sentence")
    assert not wrong, wrong
    inits = sorted((ROOT / "rl_training").rglob("__init__.py"))
    undocumented = [str(f.relative_to(ROOT)) for f in inits if not ast.get_docstring(ast.parse(f.read_text()))]
    assert len(inits) > len(LAYERS) and not undocumented, undocumented


def test_a_task_family_is_imported_only_by_itself_and_the_registry():
    """Infrastructure is not a task (issue 39): a task family's folder (tasks/code/, tasks/search/) is imported, within
    tasks/, only by its own modules and tasks/build.py, so what two tasks share (the sandbox pool the code task and
    the python tool both use, the retrievers) lives in a package of its own, not in one family's internals."""
    tasks = ROOT / "rl_training" / "tasks"
    families = {d.name for d in tasks.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    assert {"code", "search"} <= families

    def family(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[:2] == ["rl_training", "tasks"] and parts[2] in families else None

    reach = sorted(
        (m, t)
        for m, deps in import_graph().items()
        if m.startswith("rl_training.tasks") and m != "rl_training.tasks.build"
        for t in deps
        if family(t) and family(t) != family(m)
    )
    assert not reach, f"modules of tasks/ that reach into another family's folder: {reach}"


# Modules of rl_training, outside runners/ and the top-level shims, that run as a program: each is a process another
# process or a build step starts, not a command of the library's users, and says so here.
PROCESS_ENTRIES = {
    "rl_training.ckpt.upload": "the background upload helper the checkpoint store starts",
    "rl_training.cluster.launch": "srun's per-node launcher (scripts/slurm/rl_train.sbatch)",
    "rl_training.cluster.servers": "a SLURM job's per-node vLLM servers (scripts/slurm/vllm_server.sh)",
    "rl_training.retrieval.server": "the retrieval service (cluster.launch starts one per node)",
    "rl_training.sandbox.worker": "the process inside each sandbox (run as source by the pool)",
}


def test_every_command_lives_in_runners():
    """A module that runs as a program (`if __name__ == "__main__"`) is a command in runners/, a top-level shim that
    forwards an old command line to one (`python -m evals.run` too), or a process entry of PROCESS_ENTRIES."""
    modules = module_files()
    mains = set()
    for module, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
                mains.add(module)
    shims = {m for m in mains if m.count(".") == 1 and m.startswith("rl_training.")}
    for shim in shims:
        tree = ast.parse(modules[shim].read_text())
        forwarded = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert forwarded == [f"rl_training.runners.{shim.split('.')[1]}"], f"{shim} is not a shim of a runner"
    for shim in {m for m in mains if m.startswith("evals.")}:  # the eval command's old name forwards to its runner
        forwarded = {n.module for n in ast.walk(ast.parse(modules[shim].read_text())) if isinstance(n, ast.ImportFrom)}
        assert forwarded == {"rl_training.runners.eval_runner"}, f"{shim} is not a shim of a runner"
    library = {m for m in mains - shims if m.startswith("rl_training.") and not m.startswith("rl_training.runners.")}
    assert library == set(PROCESS_ENTRIES), f"commands outside runners/: {sorted(library ^ set(PROCESS_ENTRIES))}"


def test_the_top_level_of_rl_training_holds_packages():
    """At most 6 top-level modules (today: __init__ and the two command shims); everything else in a package."""
    modules = sorted(p.name for p in (ROOT / "rl_training").glob("*.py"))
    assert modules == ["__init__.py", "monitor.py", "synthesize.py"]


def test_every_module_imports_alone():
    """Each module in a fresh child (forked before any of our modules is imported): an import that only works
    after another module was imported first fails here."""
    modules = sorted(module_files())
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, json.dumps([third_party_top_level(), modules])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_no_test_module_imports_another():
    """Tests share code through tests/helpers.py and fixtures through the conftest.py files, never by importing a
    test module (or a conftest) from another: a test module stays movable and its tier its own."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module
                else []
            )
            for name in names:
                leaf = name.split(".")
                if leaf[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in leaf[1:]):
                    found.append(f"{path.relative_to(REPO)} imports {name}")
    assert not found, found


MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80  # issue 51, item 7: a module is one job, a function one screen


def test_no_library_file_or_function_is_over_its_limit():
    over = []
    for path in sorted((ROOT / "rl_training").rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(ROOT)
        if len(src.splitlines()) > MAX_FILE_LINES:
            over.append(f"{rel}: {len(src.splitlines())} lines")
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    over.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert not over, f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {over}"
