"""The README's examples and the docstring examples run as written; the README quotes the
committed benchmark results."""

import doctest
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def _all_modules() -> list[str]:
    import pkgutil

    import jaxsched

    return sorted(
        m.name for m in pkgutil.walk_packages(jaxsched.__path__, "jaxsched.") if not m.name.endswith("__main__")
    )


# The heaviest examples (compiles of collectives over 8 devices) run in `make test-slow`.
SLOW_EXAMPLES = {
    "jaxsched.runtime.compress._gtopk",
    "jaxsched.runtime.kernels._error_feedback",
    "jaxsched.integrations.checkpoint",
    "jaxsched.plan._profiling",
    "jaxsched.strategies._kfac",
    "jaxsched.check._verify",
    "jaxsched.integrations.nnx",
    "jaxsched.demo.trainer",
    "jaxsched.tools.aot._compare",
}
MODULES = [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_EXAMPLES else m for m in _all_modules()]
# Packages whose __init__ only re-exports, and modules of argument parsing or rule tables,
# may have no example; every other module shows one.
WITHOUT_EXAMPLES = {
    "jaxsched.core",
    "jaxsched.runtime",
    "jaxsched.zoo",
    "jaxsched.pipeline",
    "jaxsched.check",
    "jaxsched.integrations",
    "jaxsched.demo",
    "jaxsched.tools",
    "jaxsched._version",
    "jaxsched.tools.cli._bench",
    "jaxsched.tools.cli",
    "jaxsched.runtime.collectives",
    "jaxsched.runtime.engine",
    "jaxsched.core.rewrite",
    "jaxsched.core.rewrite._backward",
    "jaxsched.core.rewrite._rules",
    "jaxsched.sim",
    "jaxsched.strategies",
    "jaxsched.plan._common",
    "jaxsched.tools.cli._simulate",
    "jaxsched.tools.cli._train",
    "jaxsched.tools.cli._cluster",
    "jaxsched.tools.cli._options",
    "jaxsched.tools.cli._verify",
    "jaxsched.tools.cli._inspection",
}


def _readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.slow
def test_readme_examples_run_as_written_in_a_fresh_interpreter(tmp_path):
    """Each python block runs in its own new process, without the test suite's device
    setting and without XLA_FLAGS: what a user who copies it gets."""
    blocks = _readme_python_blocks()
    assert blocks
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's jaxsched, as an editable install gives
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(block)
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"README python block {i} failed:\n{done.stderr[-3000:]}"
        # nothing on stderr but what the block prints itself: no plugin or driver noise
        assert not done.stderr.strip(), f"README python block {i} wrote to stderr:\n{done.stderr[-3000:]}"
        if "loss after 50 steps" in block:
            loss = float(re.search(r"loss after 50 steps: ([\d.]+)", done.stdout).group(1))
            assert loss < 1.0  # it trains


def _readme_overhead_table() -> dict[tuple[str, int], tuple[float, float, float, float]]:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## What the transform costs") : text.index("## `jax.jit` steps")]
    rows = {}
    for line in section.splitlines():
        match = re.match(
            r"\| (MLP 4x512|Transformer 2x128) \| (\d+) \| ([\d.]+) / ([\d.]+) \| "
            r"([\d.]+) / ([\d.]+) \|",
            line,
        )
        if match:
            model = {"MLP 4x512": "mlp-4x512", "Transformer 2x128": "transformer-2x128"}[match[1]]
            rows[(model, int(match[2]))] = tuple(float(match[i]) for i in range(3, 7))
    return rows


def test_benchmarks_page_overhead_table_quotes_the_committed_benchmark_results():
    """`make bench` rewrites the JSON; the benchmarks page's table must be updated with it."""
    result = json.loads((ROOT / "benchmarks/results/transform_overhead.json").read_text())
    by_case = {(r["model"], r["devices"], r["strategy"]): r for r in result["rows"]}
    table = _readme_overhead_table()
    cases = {(model, devices) for model, devices, _ in by_case}
    assert set(table) == cases
    for (model, devices), quoted in table.items():
        wfbp, dear = by_case[(model, devices, "wfbp")], by_case[(model, devices, "dear")]
        measured = (wfbp["compile_ratio"], dear["compile_ratio"], wfbp["step_ratio"], dear["step_ratio"])
        assert quoted == tuple(round(x, 2) for x in measured), (model, devices)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    import sys

    import jaxsched  # noqa: F401  (jaxsched.schedule the module is shadowed by the function)

    module = sys.modules.get(name) or importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0 or name in WITHOUT_EXAMPLES, f"{name} has no runnable example"


def _report_with_gaps(gaps: list[float]):
    from jaxsched.check._verify import VerifyReport

    leaf_gap = {f"params/w{i}": g for i, g in enumerate(gaps)}
    return VerifyReport(
        strategy="wfbp",
        steps=2,
        rtol=1e-5,
        baseline_factor=10.0,
        leaf_gap=leaf_gap,
        baseline_gap=dict.fromkeys(leaf_gap, 0.0),
        step_gap=[max(gaps)] * 2,
        step_baseline=[0.0, 0.0],
        first_divergent_step=None,
        worst_leaf="params/w0",
    )


def test_verify_report_summarises_the_leaves_it_does_not_list_truthfully():
    """The rows past the table's 12: 'all equal' when they are exactly equal (never
    'all below 0.00e+00'), else the largest gap among them."""
    equal = str(_report_with_gaps([1e-7] * 12 + [0.0] * 15))
    assert "15 more leaves, all equal" in equal
    assert "0.00e+00" not in equal.splitlines()[-1]
    some = str(_report_with_gaps([1e-7] * 12 + [0.0] * 14 + [3e-9]))
    assert some.splitlines()[-1].strip() == "... 15 more leaves, each at most 3.00e-09"


#: reStructuredText roles, which the API reference (Markdown) would show as raw text
_SPHINX_ROLE = re.compile(r":(class|mod|func|meth|attr|data|exc|obj):(?:`|<code>)")


def test_the_site_builds_strictly_and_shows_no_sphinx_roles(tmp_path):
    """`make docs`: every cross-reference resolves (strict), and no docstring's Sphinx role
    reaches the HTML as raw text (about 5 s)."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    # `make test` installs the docs tools, so a missing mkdocs is a broken set-up, not a skip
    assert mkdocs.exists(), f"{mkdocs} is missing: install requirements-docs.lock (make test does)"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pages = list((tmp_path / "site").rglob("*.html"))
    assert any(p.parent.name == "api" or p.parent.parent.name == "api" for p in pages)
    raw = {
        str(p.relative_to(tmp_path / "site")): sorted(set(_SPHINX_ROLE.findall(p.read_text())))
        for p in pages
        if _SPHINX_ROLE.search(p.read_text())
    }
    assert not raw, f"raw Sphinx roles in the generated HTML: {raw}"
