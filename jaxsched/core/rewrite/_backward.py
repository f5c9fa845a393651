"""The backward walk that every bucketing strategy shares.

The backward region is replayed equation by equation. Inputs can be *lazy* (an
all-gather emitted just before their first use), and after each equation every bucket
whose gradients are now all computed gets its collective emitted at once: this is what
places communication inside backward, in the order gradients complete.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jax.extend import core as jex_core

from jaxsched.core._analyze import Analysis
from jaxsched.core._bucketing import Bucket
from jaxsched.core._replay import interpret, read

__all__ = ["walk_backward"]


def walk_backward(
    analysis: Analysis,
    env: dict,
    lazy: dict[Any, Callable[[], None]],
    buckets: Sequence[Bucket],
    emit: Callable[[Bucket], None],
) -> None:
    """Replay the backward region; ``lazy[var]()`` fills ``env`` the first time ``var`` is read."""
    body = analysis.captured.body
    reds = analysis.reductions
    pending = [b for b in buckets if b.reductions]

    def operand_ready(j: int) -> bool:
        x = reds[j].operand
        return isinstance(x, jex_core.Literal) or x in env

    def flush(_eqn: Any = None) -> None:
        for b in list(pending):
            if all(operand_ready(j) for j in b.reductions):
                pending.remove(b)
                emit(b)

    def get(x) -> Any:
        if not isinstance(x, jex_core.Literal) and x not in env and x in lazy:
            lazy.pop(x)()
        return read(env, x)

    flush()  # gradients that are body inputs are ready from the start
    interpret((body.eqns[i] for i in analysis.backward), get, env.__setitem__, after=flush)
    if pending:  # operands computed in the update region cannot happen by construction
        raise AssertionError(f"buckets never became ready: {pending}")
