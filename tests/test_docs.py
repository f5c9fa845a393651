"""The README's example and the docstring examples run as written."""
import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
def _all_modules() -> list[str]:
    import pkgutil

    import jaxsched
    return sorted(m.name for m in pkgutil.walk_packages(jaxsched.__path__, "jaxsched.")
                  if not m.name.endswith("__main__"))


MODULES = _all_modules()
# Packages whose __init__ only re-exports, and modules of argument parsing or rule tables,
# may have no example; every other module shows one.
WITHOUT_EXAMPLES = {"jaxsched.cli", "jaxsched.collectives", "jaxsched.engine", "jaxsched.rewrite",
                    "jaxsched.rewrite.backward", "jaxsched.rewrite.rules", "jaxsched.sim",
                    "jaxsched.sim.cli", "jaxsched.strategies", "jaxsched.plan._common",
                    "jaxsched.cli.simulate", "jaxsched.cli.train"}


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    exec(compile(blocks[0], "README.md", "exec"), {})
    loss = float(re.search(r"loss after 50 steps: ([\d.]+)", capsys.readouterr().out).group(1))
    assert loss < 1.0  # it trains


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    import sys

    import jaxsched  # noqa: F401  (jaxsched.schedule the module is shadowed by the function)
    module = sys.modules.get(name) or importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or name in WITHOUT_EXAMPLES, f"{name} has no runnable example"
