"""Static leaves: the non-array leaves of a step's pytrees, kept out of the arrays jaxsched moves.

An Equinox model is a pytree whose leaves include its activation functions; Equinox's own
data-parallel step passes a ``jax.sharding.Sharding`` as an argument. ``jax.jit`` cannot
trace such leaves and ``eqx.filter_jit`` treats them as static, which jaxsched does too:
before anything is traced each one is wrapped in a `Static` node, a pytree node
with no children that carries the value in its tree structure. Every flatten inside
jaxsched then sees arrays only; a different static value is a different structure (a new
program, as ``filter_jit`` retraces); the step itself is called with the values restored
(`through`).

Which leaves are static follows the step: under ``eqx.filter_jit`` every leaf that is not
an array (Python scalars too, as ``eqx.is_array`` decides); otherwise only the leaves
``jax.jit`` could not take (functions, shardings, strings, any object), Python scalars
being traced as ``jax.jit`` traces them (a ``TrainState``'s ``step=0``).

Example:
    >>> import jax, numpy as np
    >>> tree = {"w": np.ones(2, np.float32), "act": np.tanh, "n": 3}
    >>> marked = mark(tree, scalars_static=True)
    >>> [type(x).__name__ for x in jax.tree.leaves(marked)]
    ['ndarray']
    >>> unmark(marked)["act"] is np.tanh, unmark(marked)["n"]
    (True, 3)
    >>> len(jax.tree.leaves(mark(tree, scalars_static=False)))  # n is traced, as jax.jit would
    2
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

__all__ = ["MarkedStep", "Static", "is_array_like", "mark", "scalars_static", "through", "unmark"]

_SCALARS = (bool, int, float, complex)


@jax.tree_util.register_pytree_node_class
class Static:
    """A leaf that is not an array: no children, its value in the tree structure."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self) -> tuple[tuple, "_Key"]:
        return (), _Key(self.value)

    @classmethod
    def tree_unflatten(cls, key: "_Key", children: tuple) -> "Static":
        return cls(key.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


class _Key:
    """A static value as tree-structure data: equal when the values are (or are the same
    object), hashable even when the value is not (compared by identity then)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Key):
            return NotImplemented
        if self.value is other.value:
            return True
        try:
            return type(self.value) is type(other.value) and bool(self.value == other.value)
        except Exception:  # an object whose == is elementwise or raises
            return False

    def __hash__(self) -> int:
        try:
            return hash((type(self.value), self.value))
        except TypeError:
            return id(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


def is_array_like(x: Any) -> bool:
    """An array jaxsched can place and trace: a ``jax.Array`` (or tracer), a NumPy array or
    scalar, or an abstract ``jax.ShapeDtypeStruct`` (ahead-of-time compilation)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "aval")
    )


def _static(x: Any, scalars: bool) -> bool:
    if x is None or isinstance(x, Static) or is_array_like(x):
        return False
    return scalars or not isinstance(x, _SCALARS)


def mark(tree: Any, *, scalars_static: bool) -> Any:
    """``tree`` with each static leaf wrapped in `Static` (arrays are left as they are)."""
    if not any(_static(x, scalars_static) for x in jax.tree.leaves(tree)):
        return tree
    return jax.tree.map(lambda x: Static(x) if _static(x, scalars_static) else x, tree)


def unmark(tree: Any) -> Any:
    """``tree`` with its `Static` nodes replaced by their values."""
    is_static = lambda x: isinstance(x, Static)
    if not any(is_static(x) for x in jax.tree.leaves(tree, is_leaf=is_static)):
        return tree
    return jax.tree.map(lambda x: x.value if is_static(x) else x, tree, is_leaf=is_static)


def scalars_static(step: Callable) -> bool:
    """Whether ``step`` treats Python scalars as static: an ``eqx.filter_jit`` step does."""
    return type(step).__module__.split(".")[0] == "equinox"


class MarkedStep:
    """The user's step taking and returning marked trees: its arguments unmarked before it
    runs, its outputs marked (the activation function in a returned Equinox model).

    Attributes:
      step: the user's step.
      scalars_static: whether Python scalars are static for it (`scalars_static`).
      saw_static: whether an output has held a static leaf so far.
    """

    def __init__(self, step: Callable):
        self.step = step
        self.scalars_static = scalars_static(step)
        self.saw_static = False
        functools.update_wrapper(self, step, updated=())  # its name, its signature to follow

    def __call__(self, *args: Any) -> Any:
        out = self.step(*unmark(args))
        marked = mark(out, scalars_static=self.scalars_static)
        if marked is not out:
            self.saw_static = True
        return marked


def through(step: Callable) -> MarkedStep:
    """``step`` as a `MarkedStep` (itself when it is one already)."""
    return step if isinstance(step, MarkedStep) else MarkedStep(step)
