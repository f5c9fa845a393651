"""Scalar sums over devices, deferred and batched into one collective.

A sharded update computes global norms from per-device terms: ``clip_by_global_norm``
sums each leaf's squares on its chunk and then over the devices, one scalar all-reduce per
leaf (46 to 65 per step on a Transformer); LAMB's trust ratios do the same per leaf. Each
is latency, not bandwidth. Here such a sum is kept as a :class:`PendingSum` (this device's
term); sums and scalings of pending sums stay pending (a sum of sums over devices is the
sum over devices of the sums); anything else that reads one first reduces *every* pending
sum at once, stacked into one vector per dtype and axes: one all-reduce where there were
many. The values differ from one all-reduce per leaf by float rounding only (the same
terms, added in another order).

Example:
    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    >>> def norms(x):
    ...     pending = PendingSums()
    ...     a = pending.defer(jnp.sum(x ** 2), "d")
    ...     b = pending.defer(jnp.sum(jnp.abs(x)), "d")
    ...     total = pending.linear("add", [a, b])
    ...     return jnp.stack(pending.resolve([total, a]))
    >>> f = jax.jit(jax.shard_map(norms, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P()))
    >>> [float(v) for v in f(jnp.arange(4.0))]
    [20.0, 14.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["LINEAR", "PendingSum", "PendingSums", "is_pending"]

#: primitives through which a pending sum stays pending: linear in the pending operands
LINEAR = frozenset({"add", "add_any", "sub", "neg", "mul", "div", "convert_element_type"})


@dataclasses.dataclass(eq=False)
class PendingSum:
    """A scalar whose value is the sum over ``axes`` of every device's ``local``.

    Attributes:
      local: this device's term (a 0-d array).
      axes: the mesh axes the sum runs over.
      total: the sum, once reduced (None before).
    """

    local: Any
    axes: Any
    total: Any = None


class PendingSums:
    """The pending sums of one update region: deferred, combined, reduced together."""

    def __init__(self) -> None:
        self.waiting: list[PendingSum] = []

    def defer(self, local: Any, axes: Any) -> PendingSum:
        pending = PendingSum(jnp.asarray(local), axes)
        self.waiting.append(pending)
        return pending

    def linear(self, name: str, values: Sequence[Any], params: dict | None = None) -> PendingSum | None:
        """``name`` applied to ``values`` as a new pending sum, where that is exact: sums and
        differences of pending sums over the same axes, their negation, conversion between
        float types, and products or quotients with a value that is the same on every device
        (``replicated``: not a pending sum). None otherwise."""
        pending = [v for v in values if is_pending(v)]
        if not pending or len(pending) != sum(isinstance(v, PendingSum) for v in values):
            return None  # a reduced sum among them: run on totals
        if name in ("add", "add_any", "sub") and len(values) == 2 and len(pending) == 1:
            zero = values[1 - values.index(pending[0])]  # Python's sum() starts from 0
            if isinstance(zero, (int, float, np.ndarray, np.generic)) and np.ndim(zero) == 0 and zero == 0:
                if name == "sub" and values[1] is pending[0]:
                    return self.defer(-pending[0].local, pending[0].axes)
                return pending[0]
            return None
        axes = pending[0].axes
        if any(p.axes != axes for p in pending):
            return None
        if name in ("add", "add_any", "sub") and len(pending) == len(values):
            a, b = (v.local for v in values)
            return self.defer(a - b if name == "sub" else a + b, axes)
        if name == "neg" and len(values) == 1:
            return self.defer(-values[0].local, axes)
        if name == "convert_element_type" and params is not None and len(values) == 1:
            dtype = params["new_dtype"]
            if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(values[0].local.dtype, jnp.floating):
                return self.defer(values[0].local.astype(dtype), axes)
            return None
        if name in ("mul", "div") and len(values) == 2 and len(pending) == 1:
            i = 0 if isinstance(values[0], PendingSum) else 1
            other = values[1 - i]
            # a constant of the program (the same on every device), not a traced value
            if (name == "div" and i != 0) or not isinstance(other, (int, float, np.ndarray, np.generic)):
                return None
            if np.ndim(other) != 0:
                return None
            local = values[0].local / other if name == "div" else values[i].local * other
            return self.defer(local, axes)
        return None

    def resolve(self, values: Sequence[Any]) -> list:
        """``values`` with every pending sum replaced by its total: all waiting sums reduced
        now, one all-reduce per axes and dtype."""
        if any(is_pending(v) for v in values):
            self.flush()
        return [v.total if isinstance(v, PendingSum) else v for v in values]

    def flush(self) -> None:
        groups: dict = {}
        for pending in self.waiting:
            groups.setdefault((_key(pending.axes), jnp.result_type(pending.local)), []).append(pending)
        for (_, _), members in groups.items():
            axes = members[0].axes
            totals = lax.psum(jnp.stack([jnp.reshape(p.local, ()) for p in members]), axes)
            for k, pending in enumerate(members):
                pending.total = jnp.reshape(totals[k], jnp.shape(pending.local))
        self.waiting = []


def _key(axes: Any) -> Any:
    return tuple(axes) if isinstance(axes, (tuple, list)) else axes


def is_pending(value: Any) -> bool:
    """Whether ``value`` is a sum over devices not yet reduced."""
    return isinstance(value, PendingSum) and value.total is None
