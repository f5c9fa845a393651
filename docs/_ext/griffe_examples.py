"""A griffe extension for the API reference: read ``Example:`` as a Google examples section.

jaxsched's docstrings head their doctests ``Example:`` (singular). Griffe's Google parser
knows only ``Examples:`` and would render the doctest as Markdown (``>>>`` as quotes,
``[1, 2]`` as links). This renames the heading in the text griffe parses; the source and
the doctests are untouched. A doctest outside any section (at the docstring's own
indentation) is fenced as a ``pycon`` code block for the same reason.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)


def _fence_bare_doctests(text: str) -> str:
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        if lines[i].startswith(">>>"):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out += ["```pycon", *lines[i:j], "```"]
            i = j
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headings to ``Examples:``, and fence bare doctests."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        text = docstring.value
        if "Example:" in text:
            text = _HEADING.sub(r"\1Examples:", text)
        if ">>>" in text:
            text = _fence_bare_doctests(text)
        docstring.value = text
