"""The package's form: layers that import only downwards, no cycles, argument parsing only in
the CLI, an explicit public surface per module, and the public API of before still importing."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxsched"

#: bottom first: a module may import its own layer and those before it, never one after
LAYERS = (
    "_version",
    "_errors",
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
    "_legacy_paths",
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
        "jaxsched.collectives.Hierarchical",
        "jaxsched.strategies.Strategy",
        "jaxsched.costmodel.network_preset",
        "jaxsched.optax.staleness_aware",
        "jaxsched.inspect.Inspection",
        "jaxsched.profile.profile_network",
        "jaxsched.kfac.KFAC",
        "jaxsched.engine.HostEngine",
        "jaxsched.sim.simulate",
    ],
)
def test_the_public_paths_of_before_still_import(path):
    module, _, attribute = path.rpartition(".")
    assert hasattr(importlib.import_module(module), attribute)


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
