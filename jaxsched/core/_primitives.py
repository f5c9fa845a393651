"""The primitive families the pipeline reasons about, named once.

Capture, analysis, replay and the shard rules all ask the same questions of an
equation (is it a call whose body can be inlined? does it reduce over a mesh axis?);
they ask them of these sets, so a primitive added here is understood everywhere.

The rule tables (`jaxsched.core.partition._rules`, `jaxsched.core.rewrite._rules`) are filled
from these sets by one registrar per family, as JAX's batching rules are
(``defvectorized``, ``defreducer``): a table takes a whole family or says which of its
members it leaves out, and why.

Example:
    >>> "pjit" in CALL_PRIMITIVES and "psum" in SUM_REDUCTIONS <= REDUCTIONS
    True
    >>> "mul" in ELEMENTWISE and "reduce_sum" in ARRAY_REDUCTIONS
    True
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import JaxprEqn

from jaxsched.core._axes import as_axes

__all__ = [
    "ARRAY_REDUCTIONS",
    "CALL_PRIMITIVES",
    "ELEMENTWISE",
    "PLACEMENT",
    "RANDOM_KEY_OPS",
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


#: Elementwise operations whose operands (scalars aside) and results share one shape: a
#: block or a flat chunk of each operand gives the same block or chunk of the result.
ELEMENTWISE = frozenset(
    """
abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp
clz complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
ne neg nextafter not one_minus_square or polygamma population_count pow real reduce_precision rem round rsqrt
select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
stop_gradient sub tan tanh xor zeta
""".split()
)
#: Operations on PRNG keys, elementwise over a batch of keys; a key's shape is not its
#: data's (``random_wrap`` drops a trailing dimension), so no block of a result is a slice
#: of the same shape of an operand. (``random_bits`` draws a shape of its own: not here.)
RANDOM_KEY_OPS = frozenset(
    {"threefry2x32", "random_fold_in", "random_wrap", "random_unwrap", "random_split", "random_seed", "random_clone"}
)
#: Reductions of an array over some of its dimensions.
ARRAY_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or", "reduce_prod", "reduce_xor"}
)
#: Placement annotations: they say where a value lives, not what it is.
PLACEMENT = frozenset({"reshard", "sharding_constraint", "mesh_cast"})


def scan_counts(params: dict) -> tuple[int, int]:
    """A ``scan`` equation's numbers of constants and carries: its ``num_consts`` and
    ``num_carry`` parameters (jax < 0.11), or the lengths of the first two parts of its
    ``ft_in`` (jax 0.11, which replaced them)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def reduction_axes(eqn: JaxprEqn) -> tuple[Any, ...]:
    """The mesh axes a reduction equation reduces over, as a tuple."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return axes if isinstance(axes, tuple) else (axes,)


def reduces_over(eqn: JaxprEqn, axis: Any, family: frozenset[str] = REDUCTIONS) -> bool:
    """Whether ``eqn`` is a reduction of ``family`` over every mesh axis of ``axis`` (a name
    or a tuple of names: a data-parallel axis that spans several mesh axes)."""
    return eqn.primitive.name in family and set(as_axes(axis)) <= set(reduction_axes(eqn))
