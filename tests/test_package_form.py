"""The package's form: layers that import only downwards, no cycles, argument parsing only in
the CLI, an explicit public surface per module, and the paths of before reachable, each module
loaded under one name."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxsched"

#: bottom first: a module may import its own layer and those before it, never one after
LAYERS = (
    "_version",
    "_errors",
    "_deprecations",
    "zoo",
    "sim",
    "core",
    "runtime",
    "plan",
    "strategies",
    "check",
    "pipeline",
    "_schedule",
    "integrations",
    "demo",
    "tools",
    "__init__",
    "__main__",
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.with_suffix("").relative_to(PACKAGE.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every jaxsched module ``name`` imports, at module level or inside a function."""
    path = MODULES[name]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names]
            candidates = subs if all(s in MODULES for s in subs) else [module, *subs]
        else:
            continue
        for target in candidates:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target.startswith("jaxsched") and target != name:
                targets.add(target)
    return targets


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index("__init__" if len(parts) == 1 else parts[1])


def test_every_module_sits_in_a_known_layer():
    unknown = [n for n in MODULES if len(n.split(".")) > 1 and n.split(".")[1] not in LAYERS]
    assert not unknown, f"modules outside the layers {LAYERS}: {unknown}"


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "imports from a lower layer up:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    # a package importing its own submodules (re-exports) is not a cycle
    def edges(a):
        return [b for b in GRAPH[a] if not (b.startswith(a + ".") or a.startswith(b + "."))]

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges(node):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)


def test_argument_parsing_lives_only_in_the_cli():
    parsers = sorted(
        n for n, p in MODULES.items() if "argparse" in p.read_text() and not n.startswith("jaxsched.tools.cli")
    )
    assert not parsers, f"argparse outside jaxsched.tools.cli: {parsers}"


def test_every_public_module_declares_its_api():
    def declares(path: Path) -> bool:
        return any(
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and "__all__"
            in [getattr(t, "id", None) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
            for node in ast.parse(path.read_text()).body
        )

    missing = sorted(n for n, p in MODULES.items() if not n.rpartition(".")[2].startswith("_") and not declares(p))
    assert not missing, f"modules without __all__ (or a leading underscore): {missing}"


def test_no_module_is_named_after_a_dependency_or_the_standard_library():
    taken = set(sys.stdlib_module_names) | {
        "jax",
        "jaxlib",
        "optax",
        "flax",
        "numpy",
        "scipy",
        "orbax",
        "chex",
        "matplotlib",
        "tqdm",
        "kfac_jax",
    }
    clashes = sorted(n for n in MODULES if n.rpartition(".")[2] in taken)
    assert not clashes, f"modules named like another library: {clashes}"


@pytest.mark.parametrize(
    "path",
    [
        "jaxsched.schedule",
        "jaxsched.compress.TopK",
        "jaxsched.nnx.schedule",
        "jaxsched.kfac.KFAC",
        "jaxsched.strategies.Strategy",
        "jaxsched.sim.simulate",
        "jaxsched.runtime.collectives.Hierarchical",
        "jaxsched.runtime.engine.HostEngine",
        "jaxsched.strategies._approximation.staleness_aware",
        "jaxsched.check._inspection.Inspection",
        "jaxsched.plan._profiling.profile_network",
    ],
)
def test_the_public_paths_import_without_a_warning(path, recwarn):
    import jaxsched

    value = jaxsched
    for attribute in path.split(".")[1:]:  # a submodule its package does not import is imported
        value = getattr(value, attribute, None) or importlib.import_module(f"{value.__name__}.{attribute}")
    assert value is not None
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "jaxsched" in str(w.message)]


def _moved() -> dict[str, str]:
    from jaxsched import _deprecations

    return _deprecations.MOVED


@pytest.mark.parametrize("old, new", sorted(_moved().items()))
def test_an_old_attribute_path_warns_and_is_the_module_at_its_new_home(old, new):
    import jaxsched

    with pytest.warns(DeprecationWarning, match=rf"jaxsched\.{old} is deprecated: .*{re.escape(new)}.*0\.2\.0"):
        module = getattr(jaxsched, old)
    assert module is importlib.import_module(new)
    assert old not in dir(jaxsched)


def test_from_jaxsched_import_an_old_name_warns_once():
    with pytest.warns(DeprecationWarning) as caught:
        from jaxsched import costmodel
    assert costmodel is importlib.import_module("jaxsched.sim._costmodel")
    assert len(caught) == 1 and caught[0].filename == __file__


def _private() -> dict[str, str]:
    from jaxsched import _deprecations

    return _deprecations.PRIVATE


@pytest.mark.parametrize("old, new", sorted(_private().items()))
def test_a_module_made_private_is_served_at_its_old_path_with_a_warning(old, new):
    """optax's form: implementation modules are ``_x.py``; the old attribute path still gives
    the one module object, and the warning names where its public names are."""
    package, _, name = old.rpartition(".")
    home = importlib.import_module("jaxsched._deprecations").public_home(new)
    module = importlib.import_module(new)
    if home is not None and name in getattr(module, "__all__", []):  # named after its function: that, now
        assert getattr(importlib.import_module(package), name) is getattr(module, name)
    else:
        with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated: .*{re.escape(new)}.*0\.2\.0"):
            assert getattr(importlib.import_module(package), name) is module
    assert new.rpartition(".")[2] == "_" + name
    with pytest.raises(ModuleNotFoundError):  # an import statement names the new path
        importlib.import_module(old)
    if home is not None:  # every public name of the module is re-exported by its package
        exported = importlib.import_module(home)
        missing = [n for n in getattr(module, "__all__", []) if getattr(exported, n, None) is not getattr(module, n)]
        assert not missing, f"{home} does not re-export {missing} of {new}"
        assert set(getattr(module, "__all__", [])) <= set(exported.__all__)


def test_from_a_package_import_a_private_module_of_before_warns_once():
    with pytest.warns(DeprecationWarning) as caught:
        from jaxsched.sim import costmodel
    assert costmodel is importlib.import_module("jaxsched.sim._costmodel")
    assert len(caught) == 1 and caught[0].filename == __file__
    assert "use jaxsched.sim, which exports its public names" in str(caught[0].message)


def test_implementation_modules_are_private():
    """Each module is a private ``_x.py`` behind its package's re-exports, except the few
    modules users import as namespaces of their own."""
    namespaces = {
        "jaxsched.demo.config",
        "jaxsched.demo.steps",
        "jaxsched.demo.trainer",
        "jaxsched.integrations.checkpoint",
        "jaxsched.integrations.kfac",
        "jaxsched.integrations.nnx",
        "jaxsched.tools.bench",
        "jaxsched.tools.cluster",
        "jaxsched.tools.launch",
        "jaxsched.zoo.data",
        "jaxsched.zoo.models",
        "jaxsched.zoo.stacked_lm",
    }
    public = sorted(
        name
        for name, path in MODULES.items()
        if path.name not in ("__init__.py", "__main__.py") and not path.name.startswith("_")
    )
    assert public == sorted(namespaces)


@pytest.mark.parametrize("name", ["inspect", "profile", "optax"])
def test_names_of_other_libraries_are_no_attribute_or_module(name):
    """Named like the standard library or a dependency, they are not revived as old paths."""
    import jaxsched

    assert name not in _moved()
    assert not hasattr(jaxsched, name)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"jaxsched.{name}")


def test_no_module_is_loaded_under_two_names():
    """Every path of before, reached, leaves each module file run once, under its own name."""
    import jaxsched

    for old in _moved():
        with pytest.warns(DeprecationWarning):
            getattr(jaxsched, old)
    for old in ["jaxsched.compress.topk", "jaxsched.engine.host", "jaxsched.costmodel"]:
        with pytest.raises(ModuleNotFoundError):  # an import statement must name the new path
            importlib.import_module(old)
    loaded = {k: m for k, m in list(sys.modules.items()) if k == "jaxsched" or k.startswith("jaxsched.")}
    renamed = sorted(f"{k} is {m.__name__}" for k, m in loaded.items() if m.__name__ != k)
    assert not renamed, renamed
    by_file: dict[str, list[str]] = {}
    for k, m in loaded.items():
        by_file.setdefault(str(getattr(m, "__file__", None) or k), []).append(k)
    twice = {f: names for f, names in by_file.items() if len(names) > 1}
    assert not twice, twice


def test_a_compressor_is_one_class_under_the_public_and_the_module_path():
    import jaxsched
    import jaxsched.runtime.compress._topk as topk

    assert jaxsched.compress is importlib.import_module("jaxsched.runtime.compress")
    assert jaxsched.compress.TopK is topk.TopK
    assert isinstance(topk.TopK(0.1), jaxsched.compress.TopK)
    with pytest.raises(ModuleNotFoundError):  # not a second run of topk.py with a TopK of its own
        importlib.import_module("jaxsched.compress.topk")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_host_engine_module_imports_in_a_fresh_interpreter():
    """Once, however it is reached first: an old path does not run it again (and register the
    ``host`` engine twice)."""
    code = (
        "import importlib, jaxsched\n"
        "try:\n    importlib.import_module('jaxsched.engine.host')\nexcept ModuleNotFoundError:\n    pass\n"
        "import jaxsched.runtime.engine._host\n"
        "from jaxsched.runtime.engine import HostEngine\n"
        "assert HostEngine is jaxsched.runtime.engine._host.HostEngine\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_python_dash_m_jaxsched_runs_the_command_line():
    result = subprocess.run([sys.executable, "-m", "jaxsched", "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: jaxsched")
    old = subprocess.run([sys.executable, "-m", "jaxsched.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert old.returncode != 0 and "No module named jaxsched.cli" in old.stderr, old.stderr  # not half served


_WITHOUT_OPTAX = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "optax" or name.startswith("optax."):
            raise ModuleNotFoundError("No module named 'optax'", name="optax")
        return None

sys.meta_path.insert(0, Blocker())
import warnings
warnings.simplefilter("ignore", DeprecationWarning)
import jaxsched
"""


@pytest.mark.parametrize("attribute", ["strategies", "schedule", "steps"])
def test_a_missing_dependency_is_named_not_hidden_behind_an_attribute_error(attribute):
    code = (
        _WITHOUT_OPTAX + f"try:\n    jaxsched.{attribute}\n"
        "except ModuleNotFoundError as error:\n    assert error.name == 'optax', error\n"
        "else:\n    raise SystemExit('imported without optax')\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_the_package_exposes_only_its_api():
    import jaxsched

    helpers = [n for n in ("Any", "TYPE_CHECKING", "annotations", "importlib") if hasattr(jaxsched, n)]
    assert not helpers, f"module-level helpers exposed as jaxsched attributes: {helpers}"
    extra = sorted(n for n in dir(jaxsched) if n not in jaxsched.__all__ and not n.startswith("__"))
    assert not extra, extra
    namespace: dict = {}
    exec("from jaxsched import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(jaxsched.__all__)


#: where users read or copy import paths
_EXAMPLE_FILES = [
    PACKAGE.parent / "README.md",
    *sorted((PACKAGE.parent / "docs").rglob("*.md")),
    *sorted(
        p for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "_deprecations.py") or p.parent != PACKAGE
    ),
    *sorted((PACKAGE.parent / "examples").rglob("*.py")),
    *sorted((PACKAGE.parent / "benchmarks").glob("*.py")),
    *sorted(
        p for p in (PACKAGE.parent / "tests").rglob("*") if p.suffix in (".py", ".md") and p.name != Path(__file__).name
    ),
]


def test_docs_examples_and_tests_use_the_current_paths():
    names = "|".join(sorted([*_moved(), "inspect", "profile", "optax"], key=len, reverse=True))
    dotted = re.compile(rf"(?<![\w.])jaxsched\.({names})\b")
    from_import = re.compile(rf"from jaxsched import ([\w, ]*\b({names})\b)")
    # public attributes, but no module of that name: ``import jaxsched.compress`` fails
    attribute_only = re.compile(r"(from|import) jaxsched\.(compress|kfac|nnx)\b")
    # a module named after its function (``jaxsched.check.verify``): that path is the function now
    shadowed = {
        old
        for old in _private()
        if old.rpartition(".")[2] in getattr(importlib.import_module(old.rpartition(".")[0]), "__all__", ())
    }
    private = re.compile(
        "|".join(re.escape(old) + r"\b(?!\.py)" for old in sorted(set(_private()) - shadowed, key=len, reverse=True))
    )
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in _EXAMPLE_FILES
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if dotted.search(line) or from_import.search(line) or attribute_only.search(line) or private.search(line)
    ]
    assert not found, "old import paths:\n" + "\n".join(found)


def test_every_name_in_all_imports():
    import jaxsched

    for name in jaxsched.__all__:
        assert getattr(jaxsched, name) is not None, name


def test_the_command_line_help_does_not_import_jax():
    code = (
        "import sys, jaxsched.tools.cli as cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
