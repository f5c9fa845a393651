"""The primitive families the pipeline reasons about, named once.

Capture, analysis, replay and the shard rules all ask the same questions of an
equation (is it a call whose body can be inlined? does it reduce over a mesh axis?);
they ask them of these sets, so a primitive added here is understood everywhere.

Example:
    >>> "pjit" in CALL_PRIMITIVES and "psum" in SUM_REDUCTIONS <= REDUCTIONS
    True
"""

from __future__ import annotations

from jaxsched.core.axes import as_axes

__all__ = [
    "CALL_PRIMITIVES",
    "SCATTER_REDUCTIONS",
    "COLLECTIVES",
    "reduces_over",
    "reduction_axes",
    "REDUCTIONS",
    "SUM_REDUCTIONS",
    "VMA_TYPING",
]

#: Calls whose body is a jaxpr that can be inlined (jit, custom derivatives).
CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"})
#: Sums over mesh axes: what a gradient reduction is made of (``pmean`` is psum then div).
SUM_REDUCTIONS = frozenset({"psum", "psum_invariant"})
#: Every reduction over mesh axes.
REDUCTIONS = SUM_REDUCTIONS | {"pmax", "pmin", "pmax_invariant", "pmin_invariant"}
#: Sums over mesh axes that leave each device a block: an FSDP parameter's gradient reduction.
SCATTER_REDUCTIONS = frozenset({"reduce_scatter", "psum_scatter"})
#: ``check_vma`` typing primitives: they change a value's type, not its value.
VMA_TYPING = frozenset({"pvary"})
#: Communication the rewritten programs emit: where an engine may cut stages.
COLLECTIVES = REDUCTIONS | {
    "all_gather",
    "all_gather_invariant",
    "psum_scatter",
    "reduce_scatter",
    "ppermute",
    "all_to_all",
}


def reduction_axes(eqn) -> tuple:
    """The mesh axes a reduction equation reduces over, as a tuple."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return axes if isinstance(axes, tuple) else (axes,)


def reduces_over(eqn, axis, family: frozenset = REDUCTIONS) -> bool:
    """Whether ``eqn`` is a reduction of ``family`` over every mesh axis of ``axis`` (a name
    or a tuple of names: a data-parallel axis that spans several mesh axes)."""
    return eqn.primitive.name in family and set(as_axes(axis)) <= set(reduction_axes(eqn))
