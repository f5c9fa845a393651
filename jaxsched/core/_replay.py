"""Replaying jaxpr equations on new operands: the building block of every rewrite.

``bind`` re-emits one equation where the rewritten program is being traced, keeping the
user's source line. Nested calls (jit, custom_jvp/vjp) are inlined rather than re-bound,
and ``check_vma``'s typing primitives are translated, because the rewritten body runs
with ``check_vma=False`` (its collectives are placed by hand). ``interpret`` is the one
loop every rewrite runs equations with.

Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    >>> env = dict(zip(closed.jaxpr.invars, [0.5]))
    >>> interpret(closed.jaxpr.eqns, lambda x: read(env, x), env.__setitem__)
    >>> bool(jnp.isclose(read(env, closed.jaxpr.outvars[0]), 2 * jnp.sin(0.5)))
    True
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Sequence, cast

import numpy as np

from jax import lax
from jax.core import ShapedArray
from jax.extend import core as jex_core
from jax.extend.core import JaxprEqn
from jax.extend import source_info_util

from jaxsched.core._primitives import CALL_PRIMITIVES, VMA_TYPING

__all__ = [
    "at_source",
    "aval_of",
    "bind",
    "eval_inline",
    "inner_jaxpr",
    "interpret",
    "invariant_sums_as_products",
    "is_var",
    "live_equations",
    "nested_eqns",
    "read",
    "Run",
    "source_line",
]

#: How one equation runs on its operands' values: ``(eqn, values) -> results``.
Run = Callable[[JaxprEqn, list], Sequence[Any]]


def aval_of(x: jex_core.Var | jex_core.Literal) -> ShapedArray:
    """``x``'s abstract value, as an array's (what every operand the rules read is)."""
    return cast(ShapedArray, x.aval)


def bind(eqn: JaxprEqn, values: Sequence[Any]) -> list:
    """Re-emit ``eqn`` on new operands, keeping its source location and context.

    The rewritten body runs with ``check_vma=False`` (its collectives are placed by
    hand), so ``check_vma``'s typing primitives are translated: ``pvary`` only re-types a
    value and is dropped, ``psum_invariant`` is the plain ``psum``.
    """
    if eqn.primitive.name in VMA_TYPING:
        return list(values)
    if eqn.primitive.name in CALL_PRIMITIVES:
        inner = inner_jaxpr(eqn)
        if inner is not None:
            return eval_inline(inner.jaxpr, inner.consts, values)
    with at_source(eqn):
        if eqn.primitive.name == "psum_invariant":
            return list(lax.psum(tuple(values), eqn.params["axes"]))
        out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def at_source(eqn: JaxprEqn) -> Iterator[None]:
    """A context in which new equations carry ``eqn``'s source location, name and context."""
    with (
        source_info_util.user_context(
            eqn.source_info.traceback, name_stack=source_info_util.current_name_stack() + eqn.source_info.name_stack
        ),
        eqn.ctx.manager,
    ):
        yield


def invariant_sums_as_products(mesh_shape: dict) -> Run:
    """A ``run`` for `eval_inline` that computes ``psum`` of a device-invariant value
    as a product, without communication.

    Under ``check_vma``, ``lax.psum`` of a value that is the same on every device (a
    ``pmean`` of gradients JAX already reduced in backward, as ``nnx.shard_map`` steps
    write it) traces to ``pvary`` then ``psum_invariant``, and XLA all-reduces identical
    buffers. The sum is ``x * axis size``. ``pvary`` marks its (invariant) operand; a
    ``psum_invariant`` operand so marked is multiplied instead of reduced.
    """
    marked: dict[int, tuple[Any, frozenset]] = {}  # id -> (value kept alive, its axes)

    def run(eqn: JaxprEqn, values: list) -> list:
        name = eqn.primitive.name
        if name == "pvary":
            for v in values:
                marked[id(v)] = (v, frozenset(eqn.params["axes"]))
            return list(values)
        if name == "psum_invariant":
            axes = eqn.params["axes"]
            named = [a for a in axes if isinstance(a, str)]
            if len(named) == len(axes) and all(
                id(v) in marked and marked[id(v)][0] is v and set(named) <= marked[id(v)][1] for v in values
            ):
                size = 1
                for a in named:
                    size *= mesh_shape[a]
                with at_source(eqn):
                    return [v * np.asarray(size, dtype=v.dtype) for v in values]
        if name in CALL_PRIMITIVES:
            inner = inner_jaxpr(eqn)
            if inner is not None:
                return eval_inline(inner.jaxpr, inner.consts, values, run)
        return bind(eqn, values)

    return run


def inner_jaxpr(eqn: JaxprEqn) -> jex_core.ClosedJaxpr | None:
    """The closed jaxpr a call equation runs, or None."""
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    return inner if hasattr(inner, "jaxpr") else None


def read(env: dict, x) -> Any:
    """The value of operand ``x``: a literal's own value, else what ``env`` holds."""
    return x.val if isinstance(x, jex_core.Literal) else env[x]


def interpret(
    eqns: Iterable,
    read_operand: Callable[[Any], Any],
    write: Callable[[Any, Any], None],
    run: Run = bind,
    after: Callable[[Any], None] | None = None,
) -> None:
    """The one interpreter loop: ``run`` each equation on its operands, ``write`` its results.

    ``read_operand`` may compute a value on first use (a deferred all-gather), ``run`` may
    be a rule table (shard rules), and ``after`` sees each equation once it has run (where
    a rewrite issues the collectives that just became possible).
    """
    for eqn in eqns:
        results = run(eqn, [read_operand(x) for x in eqn.invars])
        for var, value in zip(eqn.outvars, results, strict=True):
            write(var, value)
        if after is not None:
            after(eqn)


def eval_inline(jaxpr, consts: Sequence[Any], args: Sequence[Any], run: Run = bind) -> list:
    """Evaluate a jaxpr equation by equation where the caller is tracing.

    Re-binding a call would reuse avals typed for the user's ``check_vma`` setting;
    inlining lets every primitive re-derive its types in the rewritten body.
    """
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    interpret(jaxpr.eqns, lambda x: read(env, x), env.__setitem__, run)
    return [read(env, x) for x in jaxpr.outvars]


def is_var(x) -> bool:
    """A jaxpr operand that is a variable rather than a literal."""
    return not isinstance(x, jex_core.Literal)


def source_line(eqn: JaxprEqn) -> str:
    """The user's source line that produced ``eqn``, for messages."""
    try:
        line = source_info_util.summarize(eqn.source_info)
    except Exception:  # messages degrade to the primitive name
        line = ""
    if line:
        return line
    stack = str(eqn.source_info.name_stack) or "the step's top level"
    return f"<no user source line: {eqn.primitive.name} inserted by JAX in {stack}>"


def live_equations(jaxpr) -> set[int]:
    """Indices of the equations whose results reach an output, or that have effects: the
    rest is dead code, which XLA removes after compiling but a rewrite would otherwise read
    (and, for instance, gather operands for)."""
    needed = {x for x in jaxpr.outvars if is_var(x)}
    live = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(o in needed for o in eqn.outvars):
            live.add(i)
            needed.update(x for x in eqn.invars if is_var(x))
    return live


def nested_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from nested_eqns(sub)
