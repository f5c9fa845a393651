"""The guides in docs/ run as written, and the README and the guides stay within their form.

Every ```python block of docs/*.md runs in its own fresh interpreter, as a user who copies
it gets it (the README's blocks run in tests/test_docs.py the same way). A block that
cannot run here (it needs a GPU, root or a cluster) is written as ```bash, or follows a
``<!-- no-run: reason -->`` comment.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
README_LIMIT = 12 * 1024
# "issue #12", "Issue 3", "issues 7 and 9": history belongs in the tracker, not in the docs
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.I)
# a ```python fence, and whether a no-run comment precedes it (blank lines allowed between)
BLOCK = re.compile(r"(<!--\s*no-run:[^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _runnable_blocks() -> list[tuple[str, int, str]]:
    """(page, index, code) of every runnable block; a block that is also in the README runs
    in tests/test_docs.py only."""
    in_readme = set(re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S))
    blocks = []
    for page in sorted(DOCS.glob("*.md")):
        for i, match in enumerate(BLOCK.finditer(page.read_text())):
            if not match.group(1) and match.group(2) not in in_readme:
                blocks.append((page.name, i, match.group(2)))
    return blocks


def test_the_readme_is_at_most_12_kb():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it at most {README_LIMIT}"


@pytest.mark.parametrize("path", [ROOT / "README.md", *_pages()], ids=lambda p: p.name)
def test_no_issue_numbers_in_the_docs(path):
    found = ISSUE_NUMBER.findall(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} names issues: {found}"


def test_every_no_run_block_says_why():
    for page in _pages():
        for reason in re.findall(r"<!--\s*no-run:([^>]*)-->", page.read_text()):
            assert reason.strip(), f"{page.name}: a no-run comment without a reason"


@pytest.mark.slow
@pytest.mark.parametrize("page,index,code", _runnable_blocks(), ids=[f"{p}[{i}]" for p, i, _ in _runnable_blocks()])
def test_guide_python_blocks_run_as_written_in_a_fresh_interpreter(page, index, code, tmp_path):
    """Without the test suite's device setting and without XLA_FLAGS, as in test_docs.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's jaxsched, as an editable install gives
    script = tmp_path / f"{Path(page).stem}_{index}.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{page} python block {index} failed:\n{done.stderr[-3000:]}"
