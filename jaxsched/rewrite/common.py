"""The backward walk that every strategy shares.

The backward region is replayed equation by equation. Inputs can be *lazy* (an
all-gather emitted just before their first use), and after each equation every bucket
whose gradients are now all computed gets its collective emitted at once: this is what
places communication inside backward, in the order gradients complete.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P

from jaxsched.analyze import Analysis
from jaxsched.bucketing import Bucket
from jaxsched.replay import bind as _bind


@dataclasses.dataclass(frozen=True)
class RewrittenBody:
    """A per-device function and the specs of the shard_map that runs it.

    ``body(*inputs)`` takes and returns flat lists laid out as the strategy's state
    describes; ``fallbacks`` lists (primitive, source line) pairs run on gathered tensors.
    """

    body: Callable
    in_specs: tuple[P, ...]
    out_specs: tuple[P, ...]
    fallbacks: list


def read(env: dict, x) -> Any:
    return x.val if isinstance(x, jex_core.Literal) else env[x]


def walk_backward(analysis: Analysis, env: dict, lazy: dict[Any, Callable[[], None]],
                  buckets: Sequence[Bucket], emit: Callable[[Bucket], None]) -> None:
    """Replay the backward region; ``lazy[var]()`` fills ``env`` the first time ``var`` is read."""
    body = analysis.captured.body
    reds = analysis.reductions
    pending = [b for b in buckets if b.reductions]

    def operand_ready(j: int) -> bool:
        x = reds[j].operand
        return isinstance(x, jex_core.Literal) or x in env

    def flush() -> None:
        for b in list(pending):
            if all(operand_ready(j) for j in b.reductions):
                pending.remove(b)
                emit(b)

    def get(x) -> Any:
        if not isinstance(x, jex_core.Literal) and x not in env and x in lazy:
            lazy.pop(x)()
        return read(env, x)

    flush()  # gradients that are body inputs are ready from the start
    for i in analysis.backward:
        eqn = body.eqns[i]
        for o, val in zip(eqn.outvars, _bind(eqn, [get(x) for x in eqn.invars])):
            env[o] = val
        flush()
    if pending:  # operands computed in the update region cannot happen by construction
        raise AssertionError(f"buckets never became ready: {pending}")
