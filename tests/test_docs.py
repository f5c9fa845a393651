"""The README's example and the docstring examples run as written."""
import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MODULES = ["jaxsched.analyze", "jaxsched.bucketing", "jaxsched.capture", "jaxsched.config",
           "jaxsched.data", "jaxsched.layout", "jaxsched.models", "jaxsched.steps",
           "jaxsched.trainer"]


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    exec(compile(blocks[0], "README.md", "exec"), {})
    loss = float(re.search(r"loss after 50 steps: ([\d.]+)", capsys.readouterr().out).group(1))
    assert loss < 1.0  # it trains


@pytest.mark.parametrize("name", MODULES + ["jaxsched.schedule"])
def test_docstring_examples(name):
    import sys

    import jaxsched  # noqa: F401  (jaxsched.schedule the module is shadowed by the function)
    module = sys.modules.get(name) or importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
