"""``(state, batch) -> (state, aux)`` steps: one pytree state instead of params and opt_state.

Flax's ``TrainState`` step, ``train_step(state, batch) -> (state, metrics)``, keeps the
parameters, the optimizer state and the step counter in one pytree; so does a dataclass or
a dict of your own. `jaxsched.schedule` accepts such a step as it accepts
``train_step(params, opt_state, batch) -> (params, opt_state, aux)``; this module is the
adapter between the two forms.

**Which form.** ``sched.init`` decides at its first call, from what its arguments are
(`step_form`): a first argument that holds both parameters and optimizer state (a
Flax ``TrainState``, a dict or dataclass with ``params`` and ``opt_state`` fields), a single
argument, or a second argument that is a PRNG key (an input of the step, as in
``step(state, rng, batch)``) is the state form; a second argument that is an optimizer
state (optax's states, or a tree with a subtree shaped like the parameters) is the params
form. Only when the arguments do not say does the step's signature decide (two positional
arguments: ``step(state, batch)``), and a warning says which form was read. Arguments after
the state are the step's inputs: given all of them (the batch last), the state is split at
once.

**What the step returns.** After its state, a step returns its aux, or nothing, or one
output per input in the order the inputs come (``step(state, rng, batch) -> (state, rng,
metrics)``, as EasyLM writes it): the scheduled step returns the same.

**Which leaves are trained.** The state's leaves are named by their path (``params/Dense_0
/kernel``, ``opt_state/0/mu/Dense_0/kernel``, ``step``), as bucket plans, ``verify`` and
error messages name them. The step is traced once with every leaf in the role of a
parameter and its gradient reductions found (`jaxsched.core._analyze`); a leaf is
*trained* when it is a float, forward or backward combines it with device-varying data
(the batch), and its new value is computed from a gradient reduction and from its old
value (not only through the reduction). So optimizer moments (never combined with the
batch), step counters and RNG keys (not floats), and statistics that are averaged over
devices (a running mean ``pmean``'ed into place) are not trained. The scheduled step
is the user's step as ``(params, rest, batch) -> (params, rest, aux)``: ``params`` a dict
of the trained leaves and ``rest`` a dict of every other leaf, both keyed by path; static
fields (a ``TrainState``'s ``apply_fn`` and ``tx``) stay in the tree structure.
``sched.finalize(sstate)`` rebuilds the user's state object of the same type.

The split needs a batch to trace the step: ``sched.init(state)`` returns an
`UnsplitState` that the first call splits; ``sched.init(state, batch)`` splits at
once and returns the state in the strategy's layout (a checkpoint restore target).

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import linen as nn
    >>> from flax.training.train_state import TrainState
    >>> from jax.sharding import PartitionSpec as P
    >>> import jaxsched
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> model = nn.Dense(3)
    >>> state = TrainState.create(apply_fn=model.apply, tx=optax.adam(1e-2),
    ...                           params=model.init(jax.random.key(0), jnp.ones((1, 4)))["params"])
    >>> def body(state, batch):
    ...     x, y = batch
    ...     def loss_fn(params):
    ...         logits = state.apply_fn({"params": params}, x)
    ...         return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    ...     loss, grads = jax.value_and_grad(loss_fn)(state.params)
    ...     state = state.apply_gradients(grads=jax.lax.pmean(grads, "data"))
    ...     return state, {"loss": jax.lax.pmean(loss, "data")}
    >>> train_step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")),
    ...                                    out_specs=(P(), P()), check_vma=False))
    >>> sched = jaxsched.schedule(train_step, strategy="dear")
    >>> batch = jax.device_put((jnp.ones((4, 4)), jnp.zeros(4, "int32")),
    ...                        jax.NamedSharding(mesh, P("data")))
    >>> sstate = sched.init(state)
    >>> sstate, aux = sched(sstate, batch)
    >>> sorted(sched.program.planned.paths)       # the trained leaves, by path
    ['params/bias', 'params/kernel']
    >>> new_state = sched.finalize(sstate)        # a TrainState again
    >>> type(new_state).__name__, int(new_state.step)
    ('TrainState', 1)
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import warnings
from typing import Any, Callable, Generic, Iterable, Mapping, NamedTuple, Protocol, Sequence, TypeVar

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.tree_util import PyTreeDef

from jaxsched._errors import JaxschedTypeError, JaxschedValueError, JaxschedWarning
from jaxsched.core._analyze import Analysis, analyze
from jaxsched.core._bucketing import is_float, param_paths, shape_key
from jaxsched.core._capture import STATE_PATHS_ATTRIBUTE, CapturedStep, UnsupportedStepError, capture
from jaxsched.core._describe import describe, describe_outputs, difference
from jaxsched.pipeline._program import LoopCall
from jaxsched.core._static_leaves import MarkedStep

__all__ = [
    "FormWarning",
    "OutputCount",
    "SIGNATURES",
    "StateForm",
    "StateLayout",
    "StateOwner",
    "TreeSchedule",
    "UnsplitState",
    "find_layout",
    "inputs_of",
    "looks_like_key",
    "looks_like_opt_state",
    "looks_like_state",
    "returns_aux",
    "step_form",
    "with_inputs",
    "with_outputs",
]

#: the two step forms jaxsched.schedule accepts, as error messages state them
SIGNATURES = (
    "step(params, opt_state, batch) -> (params, opt_state, aux) or "
    "step(state, batch) -> (state, aux) (or -> state), with any extra inputs (a key, "
    "a constant) between the state and the batch"
)
STATE, TREES = "state", "trees"
#: fields by which a state object is known (Flax's TrainState, EasyLM's, dicts of the same)
STATE_FIELDS = frozenset({"opt_state", "tx", "optimizer", "opt"})


class FormWarning(JaxschedWarning):
    """``sched.init``'s arguments fit both step forms; the warning says which was read."""


class UnsplitState(NamedTuple):
    """``sched.init(state)`` without an example batch: the user's state, split into trained
    parameters and the rest by the first step (which can trace the step).

    Attributes:
      state: the user's state as given.
    """

    state: Any


def positional_arity(step: Callable) -> int | None:
    """How many positional arguments ``step`` requires, or None if its signature does not
    say (``*args``, or no signature). A wrapper's own signature is read first (jaxsched's
    NNX adapter), then the function it wraps (``jax.jit``, ``jax.shard_map``, ``jax.pmap``)."""
    step = step.step if isinstance(step, MarkedStep) else step  # jaxsched's own wrapper: the user's step
    for follow in (False, True):
        try:
            parameters = inspect.signature(step, follow_wrapped=follow).parameters.values()
        except (TypeError, ValueError):  # a callable object (eqx.filter_jit's): what it wraps says
            continue
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
            continue
        return sum(
            1
            for p in parameters
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        )
    return None


def _field_names(x: Any) -> frozenset:
    if isinstance(x, Mapping):
        return frozenset(str(k) for k in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return frozenset(f.name for f in dataclasses.fields(x))
    return frozenset(getattr(x, "_fields", ()))


def _parameter_names(step: Callable) -> list[str]:
    step = step.step if isinstance(step, MarkedStep) else step
    try:
        return list(inspect.signature(step).parameters)
    except (TypeError, ValueError):
        return []


def _signature_text(step: Callable) -> str:
    names = _parameter_names(step)
    return f"step({', '.join(names)})" if names else "a step of 3 positional arguments"


def _missing_opt_state(step: Callable, tree: Any) -> bool:
    """Whether ``init(tree)`` for a ``step(params, opt_state, batch)`` forgot the optimizer
    state: the step's second argument is named as one, and ``tree`` holds none."""
    names = _parameter_names(step)
    if len(names) < 2 or names[1] not in STATE_FIELDS | {"opt_states", "optimizer_state", "opt_st"}:
        return False
    if looks_like_state(tree) or _field_names(tree) & STATE_FIELDS:
        return False
    nodes = jax.tree.leaves(tree, is_leaf=lambda t: type(t).__module__.startswith("optax"))
    return not any(type(t).__module__.startswith("optax") for t in nodes)


def looks_like_state(x: Any) -> bool:
    """Whether ``x`` holds parameters and optimizer state together: a Flax ``TrainState``, or
    a dict, dataclass or NamedTuple with a ``params`` field beside ``opt_state`` (or ``tx``)."""
    names = _field_names(x)
    return "params" in names and bool(names & STATE_FIELDS)


def looks_like_key(x: Any) -> bool:
    """Whether ``x`` is a PRNG key (typed, or raw ``uint32[..., 2]``), or a batch of them."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.dtype(dtype) == np.uint32 and tuple(np.shape(x))[-1:] == (2,)


def looks_like_opt_state(x: Any, params: Any) -> bool:
    """Whether ``x`` is an optimizer state for ``params``: empty, one of optax's states, or a
    tree with a subtree of the parameters' structure (per-parameter moments)."""
    if not jax.tree.leaves(x):
        return True
    nodes = jax.tree.leaves(x, is_leaf=lambda t: type(t).__module__.startswith("optax"))
    if any(type(t).__module__.startswith("optax") for t in nodes):
        return True
    structure = jax.tree.structure(params)
    if not jax.tree.leaves(params) or jax.tree_util.treedef_is_leaf(structure):  # no tree of parameters
        return False
    like = lambda t: not isinstance(t, (int, float)) and jax.tree.structure(t) == structure  # type: ignore[operator]
    return any(like(t) for t in jax.tree.leaves(x, is_leaf=like))


def step_form(step: Callable, args: tuple, batch_keyword: bool) -> str:
    """``"state"`` or ``"trees"`` for ``sched.init(*args)`` (and ``batch=`` or not), read from
    what the arguments are (module doc), else from the step's signature. Raises TypeError,
    stating both accepted signatures, for a call that fits neither."""
    arity = positional_arity(step)
    if arity is not None and arity < 2:
        raise JaxschedTypeError(
            f"the step takes {arity} positional argument(s); jaxsched.schedule accepts {SIGNATURES}"
        )
    n_args = len(args)
    form = None
    if n_args == 1 and arity == 3 and _missing_opt_state(step, args[0]):
        raise JaxschedTypeError(
            f"sched.init got one tree ({describe(args[0])}) and no optimizer state, but the step is "
            f"{_signature_text(step)}: call sched.init(params, opt_state), e.g. "
            "sched.init(params, tx.init(params))"
        )
    if n_args >= 1 and looks_like_state(args[0]):
        form = STATE
    elif n_args == 1:
        form = STATE  # init(state): a step(state, *inputs, batch), whatever its arity
    elif n_args >= 2 and looks_like_key(args[1]):
        form = STATE  # init(state, rng, ...): the key is an input of the step
    elif n_args >= 2 and looks_like_opt_state(args[1], args[0]):
        form = TREES
    elif n_args == 2:
        form = STATE if arity == 2 and not batch_keyword else TREES
        if arity not in (None, 2) and not batch_keyword:
            warnings.warn(
                f"sched.init got 2 arguments ({describe(args[0])}, {describe(args[1])}) for a step of "
                f"{arity} positional arguments, and they fit both forms; jaxsched read them as "
                "(params, opt_state). If the first is the whole state and the second an input of "
                "the step, call sched.init(state) and pass the inputs to each call",
                FormWarning,
                stacklevel=3,
            )
    elif n_args == 3 and not batch_keyword:
        form = TREES
    state_args = 1 if form == STATE else 2
    limit = arity if arity is not None else 3
    if form is None or n_args + batch_keyword > max(limit, state_args + 1) or (arity == 2 and form == TREES):
        takes = {2: "(state, batch)", 3: "(params, opt_state, batch) or (state, input, batch)"}.get(arity or 0)
        init = {
            2: "sched.init(state) or sched.init(state, batch)",
            3: "sched.init(params, opt_state[, batch]) or sched.init(state[, input, batch])",
        }
        raise JaxschedTypeError(
            f"sched.init got {n_args} positional argument(s)"
            + (" and batch=" if batch_keyword else "")
            + (
                f", but the step takes {takes}: call {init[arity]}"
                if takes and arity is not None
                else f"; it takes the first arguments of the step, which is {SIGNATURES}"
            )
        )
    return form


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How the user's state maps to the ``(params, rest)`` dicts of the scheduled step.

    Attributes:
      treedef: the state's tree structure (static fields included).
      names: every leaf's path, in tree order.
      trained: per leaf, whether it is a trained parameter.
      outputs: how many outputs the step returns after its state: 0 (the state alone), 1
        (its aux), or one per input (``(state, rng, metrics)``).
      inputs: how many inputs the step takes after its state (the batch and those before it).
    """

    treedef: PyTreeDef
    names: tuple[str, ...]
    trained: tuple[bool, ...]
    outputs: int = 1
    inputs: int = 1

    @property
    def has_aux(self) -> bool:
        """Whether the step returns anything beside its state."""
        return self.outputs > 0

    def split(self, state: Any, what: str = "the state") -> tuple[dict, dict]:
        """The user's state -> (trained leaves, every other leaf), dicts keyed by path."""
        leaves, treedef = jax.tree.flatten(state)
        if treedef != self.treedef:
            taken = jax.tree.unflatten(self.treedef, [0] * self.treedef.num_leaves)
            raise JaxschedValueError(
                f"{what} is a {describe(state)}, but the step was traced with a {describe(taken)}: it has "
                f"{difference(taken, state)}. Pass the state the previous call (or sched.init) returned; "
                "a step that returns its state alone gives the state alone, so write state = sched(state, batch)"
            )
        params = {n: x for n, x, t in zip(self.names, leaves, self.trained) if t}
        rest = {n: x for n, x, t in zip(self.names, leaves, self.trained) if not t}
        return params, rest

    def join(self, params: dict, rest: dict) -> Any:
        """The two dicts -> the user's state object."""
        return jax.tree.unflatten(self.treedef, [(params if t else rest)[n] for n, t in zip(self.names, self.trained)])

    def pure_step(self, step: Callable, observe: Callable[[Any], None] | None = None) -> Callable:
        """``step(state, batch) -> (state, aux)`` as ``(params, rest, batch) -> (params, rest,
        aux)``, the form the scheduling pipeline takes (``observe`` sees each raw output)."""

        def pure_step(params: dict, rest: dict, batch: Any):
            out = step(self.join(params, rest), batch)
            if observe is not None:
                observe(out)
            new_state, rest_out = _state_and_rest(out, self.treedef, self.inputs)
            return (*self.split(new_state), _as_aux(rest_out))

        pure_step.__name__ = getattr(step, "__name__", "train_step")
        pure_step.__wrapped__ = step  # type: ignore[attr-defined]  # as jaxsched.integrations.nnx: tools that unwrap find the user's step
        setattr(pure_step, STATE_PATHS_ATTRIBUTE, True)  # messages name leaves by their state path
        return pure_step


def inputs_of(step: Callable, state_args: int) -> int | None:
    """How many inputs ``step`` takes after its ``state_args`` state arguments (the batch and
    any extra inputs before it), or None when its signature does not say."""
    arity = positional_arity(step)
    return None if arity is None else max(1, arity - state_args)


def with_inputs(step: Callable, num_inputs: int, state_args: int) -> Callable:
    """``step(*state, *inputs)`` as ``step(*state, inputs)`` with the inputs in one tuple,
    the form the pipeline traces (its batch is one pytree); ``step`` itself for one input."""
    if num_inputs == 1:
        return step

    def on_inputs(*args):
        *state, inputs = args
        return step(*state, *inputs)

    on_inputs.__name__ = getattr(step, "__name__", "train_step")
    on_inputs.__wrapped__ = step  # type: ignore[attr-defined]  # tools that unwrap find the user's step
    return on_inputs


class OutputCount:
    """How many outputs a ``step(params, opt_state, ...)`` returns after its state, recorded
    when it is traced (`with_outputs`).

    Attributes:
      count: 0 (params and opt_state only), 1 (an aux), more (one output per input); None
        before the step was traced.
    """

    def __init__(self) -> None:
        self.count: int | None = None

    def returned(self, state: Any, aux: Any) -> Any:
        """What the scheduled call returns for the pipeline's ``(state, aux)``: as the step does."""
        if self.count == 0:
            return state
        if self.count is not None and self.count > 1:
            return (state, *aux)
        return state, aux


def with_outputs(step: Callable, record: OutputCount, inputs: int = 1) -> Callable:
    """``step(params, opt_state, ...) -> (params, opt_state, *rest)`` as the pipeline's
    ``(params, opt_state, aux)``: ``rest`` of one output is the aux, of several their tuple,
    of none ``None``; the count is kept in ``record``."""

    def three_outputs(*args):
        out = step(*args)
        if not isinstance(out, (tuple, list)) or len(out) < 2 or len(out) - 2 not in _counts(inputs):
            raise UnsupportedStepError(
                f"the step returned {describe_outputs(out)}; a step(params, opt_state, batch) returns "
                "(params, opt_state, aux), or (params, opt_state) alone, or one output per input "
                "after them ((params, opt_state, rng, aux) for a step(params, opt_state, rng, batch))"
            )
        record.count = len(out) - 2
        return out[0], out[1], _as_aux(tuple(out[2:]))

    three_outputs.__name__ = getattr(step, "__name__", "train_step")
    three_outputs.__wrapped__ = step  # type: ignore[attr-defined]  # tools that unwrap find the user's step
    return three_outputs


def _as_aux(rest: tuple) -> Any:
    """The outputs after the state as the pipeline's one aux tree."""
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def returns_aux(out: Any, treedef: PyTreeDef) -> bool:
    """Whether a ``step(state, batch)`` output is ``(state, aux)`` rather than the state alone
    (JAX's own examples return only the new parameters)."""
    return jax.tree.structure(out) != treedef


def _counts(inputs: int) -> tuple[int, ...]:
    """How many outputs a step may return after its state: none, its aux, one per input."""
    return tuple(sorted({0, 1, inputs}))


def _state_and_rest(out: Any, treedef: PyTreeDef, inputs: int = 1) -> tuple[Any, tuple]:
    """A ``step(state, ...)``'s output as its new state and the outputs after it."""
    if not returns_aux(out, treedef):
        return out, ()
    if not isinstance(out, (tuple, list)) or len(out) < 2 or len(out) - 1 not in _counts(inputs):
        raise UnsupportedStepError(
            f"the step returned {describe_outputs(out)}; a step(state, batch) returns (state, aux) or "
            "the state alone, and a step(state, rng, batch) may return (state, rng, aux): one output "
            f"per input after the state (this step takes {inputs} input(s) after its state)"
        )
    if jax.tree.structure(out[0]) != treedef:
        taken = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
        raise UnsupportedStepError(
            f"the step's output state differs from its input state: it returned {describe_outputs(out)}, "
            f"and the first has {difference(taken, out[0])} of the state it takes (a {describe(taken)}). "
            "The step must return its state in the structure it takes, followed by its aux"
        )
    return out[0], tuple(out[1:])


def output_count(out: Any, treedef: PyTreeDef, inputs: int = 1) -> int:
    """How many outputs a ``step(state, ...)`` returned after its state."""
    return len(_state_and_rest(out, treedef, inputs)[1])


def leaf_names(state: Any) -> tuple[str, ...]:
    """Every leaf's path (``params/Dense_0/kernel``), unique; ``jax.tree_util.keystr``
    paths where the short ones would collide."""
    names = param_paths(state)
    if len(set(names)) == len(names):
        return tuple(names)
    return tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0])


def find_layout(step: Callable, state: Any, batch: Any, inputs: int = 1) -> StateLayout:
    """Trace ``step(state, batch)`` and decide which leaves are trained (module doc)."""
    leaves, treedef = jax.tree.flatten(state)
    if not leaves:
        raise UnsupportedStepError(f"the state (a {describe(state)}) has no array leaves: nothing to train")
    names = leaf_names(state)
    everything = StateLayout(treedef, names, (True,) * len(names), inputs=inputs)
    all_params, _ = everything.split(state)
    outputs: list = []
    captured = capture(everything.pure_step(step, outputs.append), all_params, {}, batch)
    n_outputs = output_count(outputs[0], treedef, inputs)
    analysis = analyze(captured)
    reaches_varying, from_reduction, from_itself = _dependencies(captured, analysis)
    # the captured step's params are a dict: their leaf order is jax's order of its keys
    position = {path[0].key: i for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(all_params)[0])}
    trained = []
    for name, leaf in zip(names, leaves):
        i = position[name]
        trained.append(is_float(_dtype(leaf)) and reaches_varying[i] and from_reduction[i] and from_itself[i])
    if not any(trained):
        raise UnsupportedStepError(
            _nothing_trained(names, leaves, position, reaches_varying, from_reduction, from_itself, captured.axis_name)
        )
    return StateLayout(treedef, names, tuple(trained), n_outputs, inputs)


def _dtype(leaf: Any) -> np.dtype:
    """A leaf's dtype: arrays, ``jax.ShapeDtypeStruct`` and Python scalars alike."""
    return leaf.dtype if hasattr(leaf, "dtype") else jax.numpy.result_type(leaf)


def _dependencies(captured: CapturedStep, analysis: Analysis) -> tuple[list[bool], list[bool], list[bool]]:
    """Per params leaf of ``captured``: whether a device-varying value is computed from it,
    whether its new value depends on the reduction of a gradient of its own shape, and
    whether it depends on the leaf's old value other than through a reduction. One forward
    pass over the body with a bitset of leaves and one of reductions per variable.

    A loss scale, a step count or an EMA may depend on the reduced gradients as a whole
    (the all-finite check, a global norm) but has no gradient of its own: not trained."""
    body = captured.body
    reds = analysis.reductions
    reduction_of = {(r.eqn_index, r.operand_pos): j for j, r in enumerate(reds)}
    reducing = {r.eqn_index for r in reds}
    leaves_of: dict[Any, int] = {}  # variable -> bitset of params leaves it is computed from
    reduced: dict[Any, int] = {}  # variable -> bitset of the reductions it is computed from
    for v, src in zip(body.invars, captured.sources):
        if src.role == "params":
            leaves_of[v] = 1 << src.index
    is_var = lambda x: isinstance(x, jex_core.Var)
    for i, eqn in enumerate(body.eqns):
        if i in reducing:  # the result depends on the reduction, not on the leaves directly
            for pos, o in enumerate(eqn.outvars):
                reduced[o] = 1 << reduction_of[(i, pos)] if (i, pos) in reduction_of else 0
            continue
        ins = [x for x in eqn.invars if is_var(x)]
        bits = red_bits = 0
        for x in ins:
            bits |= leaves_of.get(x, 0)
            red_bits |= reduced.get(x, 0)
        for o in eqn.outvars:
            leaves_of[o] = bits
            if red_bits:
                reduced[o] = red_bits
    varying_bits = 0
    for v in analysis.data_varying:
        varying_bits |= leaves_of.get(v, 0)
    n = captured.num_params
    outs = [body.outvars[captured.outputs[i]] for i in range(n)]
    reaches_varying = [bool(varying_bits >> i & 1) for i in range(n)]
    shape_of = {
        src.index: shape_key(v.aval.shape) for v, src in zip(body.invars, captured.sources) if src.role == "params"
    }
    own_gradient = [
        sum(1 << j for j, r in enumerate(reds) if shape_key(r.result.aval.shape) == shape_of.get(i)) for i in range(n)
    ]
    from_reduction = [is_var(o) and bool(reduced.get(o, 0) & own_gradient[i]) for i, o in enumerate(outs)]
    from_itself = [is_var(o) and bool(leaves_of.get(o, 0) >> i & 1) for i, o in enumerate(outs)]
    return reaches_varying, from_reduction, from_itself


def _nothing_trained(
    names: Sequence[str],
    leaves: Sequence[Any],
    position: Mapping[str, int],
    reaches_varying: Sequence[bool],
    from_reduction: Sequence[bool],
    from_itself: Sequence[bool],
    axis: str | tuple[str, ...],
) -> str:
    rows = []
    for name, leaf in zip(names, leaves):
        i = position[name]
        why = (
            "not a float"
            if not is_float(_dtype(leaf))
            else "forward and backward never combine it with the batch"
            if not reaches_varying[i]
            else f"its new value does not come from the reduction over {axis!r} of a gradient of its shape"
            if not from_reduction[i]
            else "its new value is only the reduction's result"
        )
        rows.append(f"{name} ({why})")
    shown = ", ".join(rows[:8]) + (f", ... {len(rows) - 8} more" if len(rows) > 8 else "")
    return (
        "found no trained parameter in the state: a trained leaf is a float that forward "
        "and backward read and whose new value is computed from its old value and a "
        f"gradient reduced over {axis!r} (lax.pmean(grads, {axis!r})); the state's leaves: "
        f"{shown}"
    )


class TreeSchedule(Protocol):
    """What the state form needs of the trees-form runner of its pure ``step(params, rest,
    batch)`` (`jaxsched._schedule`'s): the same methods the state form offers, on the split
    state."""

    def init(self, state: Sequence[Any], batch: Any) -> Any: ...

    def loop_call_returning(self, num_inputs: int, outputs: int | None) -> LoopCall | None: ...

    def step_batch(self, state: Any, batch: Any) -> tuple[Any, Any]: ...

    def finalize(self, state: Any) -> tuple[Any, Any]: ...

    def lower(self, state: Any, batch: Any) -> jax.stages.Lowered: ...

    def inspect(self, state: Any, batch: Any, *, baseline: bool = True) -> Any: ...

    def verify(
        self,
        state: Any,
        batches: Iterable[Any],
        steps: int,
        rtol: float,
        baseline_factor: float,
        precision: str,
        *,
        progress: bool = False,
    ) -> Any: ...

    @property
    def last_program(self) -> Any: ...

    @property
    def num_programs(self) -> int: ...

    @property
    def replans(self) -> list[Any]: ...

    @property
    def replan_decisions(self) -> list[Any]: ...

    def replan(self, network: Any) -> Any: ...


S = TypeVar("S", bound=TreeSchedule)


class StateOwner(Protocol):
    """The schedule of the user's ``step(state, batch)`` that owns a `StateForm`: what the
    split reads of it once a batch is known."""

    _num_inputs: int | None

    @property
    def traced_step(self) -> Callable: ...


class StateForm(Generic[S]):
    """The state form of a `jaxsched.Scheduled`, decided by its first ``init(state)``: the
    layout of the user's state (found at the first split) and ``inner``, the runner (of type
    ``S``) of the pure ``step(params, rest, batch)`` split off the user's.

    Every method takes the state the user holds (an `UnsplitState` before the split, else the
    inner runner's state), splits it where needed and runs the inner runner's method of the
    same purpose; the user's step's outputs come back as it returns them.

    Args:
      owner: the schedule of the user's step (its traced step and input count).
      runner_of: makes the runner of the pure step split off the user's.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jaxsched
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> def body(state, x):
        ...     grads = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
        ...     return {"w": state["w"] - 0.1 * jax.lax.pmean(grads, "data"), "opt_state": state["opt_state"]}
        >>> step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
        >>> sched = jaxsched.schedule(step)
        >>> sstate = sched.init({"w": jnp.ones((3, 1)), "opt_state": ()})
        >>> sstate = sched(sstate, jax.device_put(jnp.ones((4, 3)), jax.NamedSharding(mesh, P("data"))))
        >>> sorted(sched.program.planned.paths)
        ['w']
    """

    state_args = 1

    def __init__(self, owner: StateOwner, runner_of: Callable[[Callable], S]):
        self.owner = owner
        self.runner_of = runner_of
        self.layout: StateLayout | None = None
        self.inner: S | None = None

    def init(self, state: Sequence[Any], batch: Any = None) -> Any:
        """``sched.init(state[, batch])``: an `UnsplitState` without the batch, else the
        inner runner's state (the state split by the traced step)."""
        (whole,) = state
        if batch is None:
            return UnsplitState(whole)
        inner, layout = self.inner_for(whole, batch)
        return inner.init(layout.split(whole), batch)

    @property
    def step(self) -> Callable:
        """The user's step as ``step(state, batch)`` (extra inputs in the batch tuple)."""
        return self.owner.traced_step

    def inner_for(self, state: Any, batch: Any) -> tuple[S, StateLayout]:
        """The runner of the pure step and the layout, splitting the state on first use."""
        if self.layout is None or self.inner is None:
            self.layout = find_layout(self.step, state, batch, self.owner._num_inputs or 1)
            self.inner = self.runner_of(self.layout.pure_step(self.step))
        return self.inner, self.layout

    def scheduled_state(self, sstate: Any, batch: Any) -> tuple[S, Any]:
        """The inner runner and ``sstate`` in its form (an `UnsplitState` split)."""
        if isinstance(sstate, UnsplitState):
            inner, layout = self.inner_for(sstate.state, batch)
            return inner, inner.init(layout.split(sstate.state), None)
        if self.inner is None:
            raise JaxschedValueError(
                "this scheduled state comes from another schedule (or a checkpoint) "
                "but this one has not split a state yet; call sched.init(state, "
                "example_batch) first (the checkpoint restore target)"
            )
        return self.inner, sstate

    def _returned(self, sstate: Any, aux: Any) -> Any:
        """The inner step's ``(state, aux)`` as the user's step returns its outputs."""
        assert self.layout is not None  # set by the split that made the inner runner
        if self.layout.outputs == 0:
            return sstate
        return (sstate, *aux) if self.layout.outputs > 1 else (sstate, aux)

    def loop_call(self, num_inputs: int) -> LoopCall | None:
        """A training loop's call of the inner runner's last program, returning the user's
        step's outputs (`TreesRunner.loop_call`); None before the split."""
        if self.inner is None or self.layout is None:
            return None
        return self.inner.loop_call_returning(num_inputs, self.layout.outputs)

    def step_batch(self, sstate: Any, batch: Any) -> Any:
        """One step: the inner runner's, its outputs as the user's step returns them."""
        inner, sstate = self.scheduled_state(sstate, batch)
        return self._returned(*inner.step_batch(sstate, batch))

    call = step_batch  # a call of the state form returns what step_batch does

    def lower(self, sstate: Any, batch: Any) -> jax.stages.Lowered:
        """The inner runner's ``lower`` on the scheduled state."""
        inner, sstate = self.scheduled_state(sstate, batch)
        return inner.lower(sstate, batch)

    def inspect(self, sstate: Any, batch: Any, *, baseline: bool = True) -> Any:
        """The inner runner's ``inspect`` on the scheduled state."""
        inner, sstate = self.scheduled_state(sstate, batch)
        return inner.inspect(sstate, batch, baseline=baseline)

    def verify(
        self,
        sstate: Any,
        batches: Iterable[Any],
        steps: int,
        rtol: float,
        baseline_factor: float,
        precision: str,
        *,
        progress: bool = False,
    ) -> Any:
        """The inner runner's ``verify`` on the scheduled state (an `UnsplitState` split by
        the first batch)."""
        taken = list(itertools.islice(iter(batches), steps))
        inner, sstate = self.scheduled_state(sstate, taken[0] if taken else None)
        return inner.verify(sstate, taken, steps, rtol, baseline_factor, precision, progress=progress)

    def finalize(self, sstate: Any) -> Any:
        """The user's state object (an `UnsplitState` as given)."""
        if isinstance(sstate, UnsplitState):
            return sstate.state
        if self.inner is None or self.layout is None:
            raise JaxschedValueError(
                "finalize got a scheduled state, but this schedule has not split a "
                "state yet; call sched.init(state, example_batch) first"
            )
        return self.layout.join(*self.inner.finalize(sstate))

    @property
    def last_program(self) -> Any:
        """The inner runner's last program; None before the split."""
        return None if self.inner is None else self.inner.last_program

    @property
    def num_programs(self) -> int:
        """The inner runner's count of traced signatures; 0 before the split."""
        return 0 if self.inner is None else self.inner.num_programs

    @property
    def replans(self) -> list[Any]:
        """The inner runner's switches of plan."""
        return [] if self.inner is None else self.inner.replans

    @property
    def replan_decisions(self) -> list[Any]:
        """The inner runner's re-planning decisions."""
        return [] if self.inner is None else self.inner.replan_decisions

    def replan(self, network: Any) -> Any:
        """The inner runner's pending switch for ``network`` (the caller checked that it has
        run a program)."""
        assert self.inner is not None
        return self.inner.replan(network)
