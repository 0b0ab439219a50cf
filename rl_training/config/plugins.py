"""The one plugin loader: every extension point (task.name, loss.type, loss.correction, rollout.backend) names a
built-in or a user's object the same way, and a bad name is one line.

    spec    := NAME                      a row of that extension point's registry (a built-in)
             | path/to/file.py:NAME      an attribute of a Python file anywhere on disk
             | package.module:NAME       an attribute of an importable module

A user's file is imported once per process as a module of its own, with its folder on sys.path, so it may import
helper modules beside it from any working directory (a run resumed or evaluated elsewhere, a tools' process).
NAME is then a class or a factory called with the extension point's keyword arguments (task.args, loss.args,
loss.correction_args, rollout.backend_args), or an instance (then without arguments). Every way a spec can be
wrong (no such file or module, an exception while importing it, no such attribute, an object of the wrong type,
arguments it does not take) is one ConfigError line naming the key, the spec and the cause.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_training.algs.corrections import CORRECTIONS, Correction
from rl_training.algs.objectives import OBJECTIVES, Objective
from rl_training.base.errors import one_line
from rl_training.config.schema import ConfigError, LossCfg


def split_spec(spec: str) -> tuple[str, str, str]:
    """spec as ('builtin', name, '') | ('file', path, attr) | ('module', dotted module, attr): a spec with a ':'
    names an attribute of a Python file (a path ending in .py) or of an importable module."""
    if ":" not in spec:
        return "builtin", spec, ""
    where, _, attr = spec.rpartition(":")
    return ("file" if where.endswith(".py") else "module"), where, attr


@dataclass(frozen=True)
class Kind:
    """One extension point: its config key, what its objects are, and how to tell one."""

    key: str  # the config key, e.g. 'loss.type'
    noun: str  # what its built-ins are called: 'objective'
    args_key: str  # where its keyword arguments come from, e.g. 'loss.args'
    what: str  # the base class its objects are, dotted: 'rl_training.tasks.Task'
    accepts: Callable[[Any], bool]  # is this object a finished plugin (an instance)?
    is_class: Callable[[Any], bool] = lambda obj: False  # a class of the right base (else a class is refused)

    @classmethod
    def of_class(cls, key: str, noun: str, args_key: str, base: type, what: str = "") -> Kind:
        """An extension point whose objects are instances of `base` (or of its subclasses); `what`: the dotted
        name users import it by (default: where it is defined)."""
        return cls(
            key=key,
            noun=noun,
            args_key=args_key,
            what=what or f"{base.__module__}.{base.__qualname__}",
            accepts=lambda obj: isinstance(obj, base),
            is_class=lambda obj: issubclass(obj, base),
        )


def short(kind: Kind) -> str:
    return kind.what.rpartition(".")[2]


def head(kind: Kind, spec: str) -> str:
    return f"{kind.key}={spec!r}"


def check_builtin(key: str, noun: str, spec: str, names) -> None:
    """ConfigError (one line) when `spec` is a plain name that is not one of `names` (checked at config load)."""
    if ":" not in spec and spec not in names:
        raise ConfigError(
            f"{key}={spec!r} is not a built-in {noun} ({', '.join(names)}) nor a user {noun} "
            "('path/to/file.py:NAME' or 'package.module:NAME'; docs/extending.md)"
        )


# The built-in rollout backends' names, which the config checks at load; what each is and needs is declared in
# rollout/ (rollout/kinds.py KINDS, rollout/factory.py BUILDERS: a test holds the three lists equal).
BACKEND_NAMES = ("hf", "vllm", "server")


def find(kind: Kind, spec: str, builtin: Mapping[str, Any]) -> tuple[Any, bool]:
    """The object `spec` names and whether it is a built-in row; ConfigError (one line) when there is none."""
    form, where, attr = split_spec(spec)
    h = head(kind, spec)
    if form == "builtin":
        check_builtin(kind.key, kind.noun, spec, builtin)
        return builtin[spec], True
    if not attr:
        raise ConfigError(f"{h}: name the object after the ':' ('{where}:NAME')")
    module = import_file(where, h) if form == "file" else import_module(where, h)
    if not hasattr(module, attr):
        found = candidates(module, kind)
        hint = (
            f"; it defines {', '.join(found)}"
            if found
            else f"; it defines no {short(kind)} subclass, factory or instance"
        )
        raise ConfigError(f"{h}: {where} has no attribute {attr!r}{hint}")
    return getattr(module, attr), False


def construct(kind: Kind, spec: str, obj: Any, args: Mapping[str, Any], **context: Any) -> Any:
    """`obj` made into the plugin: an instance as it is (no arguments may reach it), a class or factory called
    with `context` (what the extension point hands every plugin, e.g. a backend's model) and `args`."""
    h, args = head(kind, spec), dict(args)
    if kind.accepts(obj):
        if args:
            raise ConfigError(
                f"{h} is an instance, so {kind.args_key} cannot reach it; point at its class or a factory"
            )
        return obj
    if isinstance(obj, type) and not kind.is_class(obj):
        raise ConfigError(f"{h} is the class {obj.__name__}, not a subclass of {kind.what}")
    if not callable(obj):
        raise ConfigError(f"{h} is of type {type(obj).__name__}, not a {short(kind)} subclass, factory or instance")
    name = getattr(obj, "__name__", "the factory")
    try:
        made = obj(**context, **args)
    except Exception as e:  # noqa: BLE001 -- the user's constructor: a wrong argument or anything it raises
        raise ConfigError(
            f"{h}: {name}(**{kind.args_key}) with {kind.args_key}={args!r} raised {one_line(e)}"
        ) from None
    if not kind.accepts(made):
        raise ConfigError(f"{h}: {name}(...) returned a {type(made).__name__}, not a {kind.what}")
    return made


def load(kind: Kind, spec: str, builtin: Mapping[str, Any], args: Mapping[str, Any] | None = None, **context) -> Any:
    """find + construct: the plugin `spec` names, built with `context` and `args`."""
    obj, _ = find(kind, spec, builtin)
    return construct(kind, spec, obj, args or {}, **context)


# ------------------------------------------------------------------------------------------------ user files
def import_file(path: str, h: str):
    """The user's file as a module of its own, imported once per process (a second load reuses it)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{h}: no such file {p}")
    real = p.resolve()
    name = user_module_name(real)
    if name in sys.modules:
        return sys.modules[name]
    try:
        return module_from_file(name, real)
    except NotPython:
        raise ConfigError(f"{h}: {p} cannot be imported as Python") from None
    except BaseException as e:  # noqa: BLE001 -- whatever the user's file raises (SystemExit too) is one line
        raise ConfigError(f"{h}: importing {p}{_where_in(e, real)} raised {one_line(e)}") from None


def user_module_name(real: Path) -> str:
    """The module name a user's file is imported under: its stem and a hash of its resolved path (two files
    of the same name in different folders are two modules)."""
    return f"rl_user_{real.stem}_{hashlib.sha1(str(real).encode()).hexdigest()[:10]}"


class NotPython(ImportError):
    """A file that importlib cannot load as a Python module (no loader for its name)."""


def module_from_file(name: str, path: str | Path):
    """The Python file at `path` imported as the module `name` (registered in sys.modules before it runs:
    dataclasses and pickling look a module up by name; removed again when it raises), with the file's folder
    on sys.path first, so that it imports the helpers beside it from any working directory. NotPython when the
    file cannot be loaded as Python; whatever the file raises, as it is. The tools' process (tool_worker.py)
    imports a user's task file the same way, under the name this process gave it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotPython(f"{path} cannot be imported as Python")
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_module(dotted: str, h: str):
    try:
        return importlib.import_module(dotted)
    except BaseException as e:  # noqa: BLE001 -- ModuleNotFoundError or anything the module raises at import
        raise ConfigError(f"{h}: importing module {dotted!r} raised {one_line(e)}") from None


def _where_in(e: BaseException, path: Path) -> str:
    """':LINE' of the deepest frame of the exception inside the user's file (a SyntaxError carries its own)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    return f":{lines[-1]}" if lines else ""


def candidates(module, kind: Kind) -> list[str]:
    """The module's public names a spec could point at: instances of the extension point, and classes of it
    that the module defines (not the base classes it imports)."""
    out = []
    for k, v in vars(module).items():
        if k.startswith("_"):
            continue
        if isinstance(v, type):
            if kind.is_class(v) and v.__module__ == module.__name__:
                out.append(k)
        elif kind.accepts(v):
            out.append(k)
    return out


# ------------------------------------------------------------------------------------ the loss's extension points
OBJECTIVE = Kind.of_class("loss.type", "objective", "loss.args", Objective)
CORRECTION = Kind.of_class("loss.correction", "correction", "loss.correction_args", Correction)


def load_objective(loss: LossCfg) -> Objective:
    """loss.type: a row of OBJECTIVES, or a user's Objective (an instance, or a factory given loss.args)."""
    return load(OBJECTIVE, loss.type, OBJECTIVES, loss.args)


def load_correction(loss: LossCfg) -> Correction | None:
    """loss.correction (tis_cap read in) built with its arguments; None for none."""
    name, args = loss.correction_spec()
    if name == "none":
        if args:
            raise ConfigError(f"loss.correction=none takes no loss.correction_args (got {args!r})")
        return None
    correction = load(CORRECTION, name, CORRECTIONS, args)
    for count, unit in dict(getattr(correction, "counts", {})).items():  # logged names: base/meter.py
        if not (isinstance(count, str) and "/" in count) or unit not in ("tokens", "sequences"):
            raise ConfigError(
                f"loss.correction={name}: counts must map logged names such as 'is/dropped_frac' to 'tokens' or "
                f"'sequences', got {count!r}: {unit!r}"
            )
    return correction
