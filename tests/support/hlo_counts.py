"""Reading collectives out of a lowered program's StableHLO text (``sched.lower(...).as_text()``)."""

from __future__ import annotations

import math
import re

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def collectives(text: str) -> dict[str, list[int]]:
    """Per kind, the element count of each collective's result, in program order."""
    found: dict[str, list[int]] = {k: [] for k in KINDS}
    for match in re.finditer(r'"stablehlo\.(all_gather|reduce_scatter|all_reduce)"', text):
        tail = text[match.end() :]
        sig = re.search(r"\)\s*->\s*\(?tensor<([^>]*)>", tail)
        dims = [d for d in sig.group(1).split("x")[:-1]] if sig else []
        found[match.group(1)].append(math.prod(int(d) for d in dims) if dims else 1)
    return found


def counts(text: str) -> dict[str, int]:
    return {k: len(v) for k, v in collectives(text).items()}
