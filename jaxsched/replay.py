"""Replaying jaxpr equations on new operands: the building block of every rewrite.

``bind`` re-emits one equation where the rewritten program is being traced, keeping the
user's source line. Nested calls (jit, custom_jvp/vjp) are inlined rather than re-bound,
and ``check_vma``'s typing primitives are translated, because the rewritten body runs
with ``check_vma=False`` (its collectives are placed by hand).
"""
from __future__ import annotations

from typing import Any, Sequence

from jax import lax
from jax._src import source_info_util  # private: keeps user source lines on re-emitted equations
from jax.extend import core as jex_core


def bind(eqn, values: Sequence[Any]) -> list:
    """Re-emit ``eqn`` on new operands, keeping its source location and context.

    The rewritten body runs with ``check_vma=False`` (its collectives are placed by
    hand), so ``check_vma``'s typing primitives are translated: ``pvary`` only re-types a
    value and is dropped, ``psum_invariant`` is the plain ``psum``.
    """
    if eqn.primitive.name == "pvary":
        return list(values)
    if eqn.primitive.name == "psum_invariant":
        return list(lax.psum(tuple(values), eqn.params["axes"]))
    if eqn.primitive.name in CALL_PRIMITIVES:
        inner = inner_jaxpr(eqn)
        if inner is not None:
            return eval_inline(inner.jaxpr, inner.consts, values)
    params = eqn.primitive.get_bind_params(eqn.params)
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=source_info_util.current_name_stack()
                                       + eqn.source_info.name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"})


def inner_jaxpr(eqn):
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    return inner if hasattr(inner, "jaxpr") else None


def eval_inline(jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list:
    """Evaluate a nested call's body equation by equation.

    Re-binding the call itself would reuse avals typed for the user's ``check_vma``
    setting; inlining lets every primitive re-derive its types in the rewritten body.
    """
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda x: x.val if isinstance(x, jex_core.Literal) else env[x]
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, bind(eqn, [read(x) for x in eqn.invars])))
    return [read(x) for x in jaxpr.outvars]


def is_var(x) -> bool:
    """A jaxpr operand that is a variable rather than a literal."""
    return not isinstance(x, jex_core.Literal)


def source_line(eqn) -> str:
    """The user's source line that produced ``eqn``, for messages."""
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # private API; messages degrade to the primitive name
        return eqn.primitive.name


def nested_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from nested_eqns(sub)
