"""The program: what one (captured step, strategy, buckets, engine) builds.

`build_program` is a pure function of those four; `ProgramCache` keeps one
program per abstract input signature (tree structure, shapes, dtypes, shardings), as
``jax.jit`` caches, so a batch of a new shape gets its own program.

Example:
    >>> import jax.numpy as jnp
    >>> a = abstract_signature((jnp.zeros((4, 2)), 1))
    >>> a == abstract_signature((jnp.ones((4, 2)), 2)), a == abstract_signature((jnp.zeros((3, 2)), 1))
    (True, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterator, Protocol, cast, runtime_checkable

import jax
import numpy as np

from jax.tree_util import PyTreeDef

from jaxsched._errors import JaxschedTypeError, JaxschedValueError
from jaxsched.core._capture import CapturedStep
from jaxsched.pipeline._plain_layout import needs_plain_aux_layout, plain_output_shardings
from jaxsched.runtime.engine._base import Engine, PerDeviceProgram, SignatureChanged
from jaxsched.plan._planned_step import PlannedStep, is_abstract
from jaxsched.strategies._base import ScheduledState, Strategy

__all__ = [
    "BatchKey",
    "LoopCall",
    "abstract_signature",
    "leaf_dtype",
    "PhasedStrategy",
    "Program",
    "ProgramCache",
    "retyped",
]


#: a batch leaf's signature: type, shape, dtype, weak type, sharding (None: a host array)
BatchKey = tuple[type[Any], tuple[int, ...], np.dtype, bool, jax.sharding.Sharding | None]
#: a training loop's call of a program: ``(state, inputs)`` to the user's outputs, or None
LoopCall = Callable[[Any, tuple], Any]


@runtime_checkable
class PhasedStrategy(Protocol):
    """A strategy whose programs differ by step (`jaxsched.strategies._diloco.DiLoCo`): the
    program compiles one core per phase and counts the step on the host."""

    def phase_key(self, step: int | None) -> Hashable:
        """The phase of step ``step`` (None: the representative phase `rewrite` builds)."""
        ...

    def host_step(self, state: Any) -> int | None:
        """The step ``state`` is at, read on the host."""
        ...

    def rewrite_phase(self, planned: PlannedStep, key: Hashable) -> Callable[..., Any]:
        """The per-device body of phase ``key``."""
        ...


class _Lowerable(Protocol):
    """An engine's compiled core that can be lowered (as ``jax.jit``'s result can)."""

    def lower(self, *args: Any) -> jax.stages.Lowered: ...


def abstract_signature(tree: Any) -> Hashable:
    """What a program depends on in ``tree``: structure, and per leaf shape, dtype, weak
    type (a Python scalar or ``jnp.asarray(0.5)`` traces to other dtypes than a float32
    array, as for ``jax.jit``), sharding."""
    leaves, treedef = jax.tree.flatten(tree)

    def leaf_key(x: Any) -> tuple:
        if isinstance(x, jax.Array):  # the common case, without numpy's slower paths
            return x.shape, x.dtype, is_weakly_typed(x), x.sharding
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        dtype = np.dtype(dtype) if not hasattr(dtype, "_impl") else dtype
        return tuple(np.shape(x)), dtype, is_weakly_typed(x), None

    return treedef, tuple(leaf_key(x) for x in leaves)


def is_weakly_typed(x: Any) -> bool:
    """Whether ``x`` traces weakly typed, as ``jax.jit`` takes it: a Python int, float or
    complex, or a weakly typed array (never a bool or a NumPy value)."""
    if isinstance(x, jax.Array):
        return bool(getattr(x, "weak_type", False))  # a typed PRNG key array has none
    return type(x) in (int, float, complex)


def leaf_dtype(x: Any) -> np.dtype:
    """The dtype ``x`` has in a traced program (a Python scalar's canonical dtype)."""
    return x.dtype if hasattr(x, "dtype") else jax.dtypes.canonicalize_dtype(np.result_type(x))


def retyped(template: Any, state: Any) -> Any:
    """``template`` (the state's trees as first traced) with the dtypes ``state``'s leaves
    have now, or ``template`` itself when none differs.

    A step may return a leaf in another dtype than it took (adam's ``mu_dtype=bfloat16``
    on a float32 optimizer state): the next call is a program for the new dtypes, as
    ``jax.jit`` traces again, never the old program with its outputs cast back. Shapes
    stay the template's, since a strategy may hold a leaf in its own layout (``dear``'s
    flat shards) whose dtype, not shape, is the user's.
    """
    leaves, treedef = jax.tree.flatten(template)
    now = jax.tree.leaves(state)
    if len(now) != len(leaves) or all(leaf_dtype(a) == leaf_dtype(b) for a, b in zip(leaves, now)):
        return template
    from jaxsched.core._capture import abstract_leaf

    def retype(old: Any, new: Any) -> Any:
        if leaf_dtype(old) == leaf_dtype(new):
            return old
        old = abstract_leaf(old)
        return jax.ShapeDtypeStruct(old.shape, leaf_dtype(new), sharding=old.sharding)

    return jax.tree.unflatten(treedef, [retype(a, b) for a, b in zip(leaves, now)])


def _unshared(donated: list, kept: list) -> list:
    """``donated`` with a copy of each array that appears twice in it or also among ``kept``
    (the batch, the constants): XLA refuses to donate one buffer twice, or a buffer the same
    call also reads. A state the program returned never shares one; ``init``'s may (the same
    zeros in two slots, the parameters as a strategy's copy of them)."""
    seen = {id(x) for x in kept}
    out = []
    for x in donated:
        if isinstance(x, jax.Array) and id(x) in seen:
            x = x.copy()
        seen.add(id(x))
        out.append(x)
    return out


class Program:
    """A compiled scheduled step and the conversions of its state.

    Attributes:
      planned: the captured step with its analysis and buckets.
      strategy, engine: what built it.
      rewritten: the strategy's per-device body and state specs.
      per_device: the explicit program handed to the engine.
      core: the engine's callable on flat global arrays (for a strategy whose programs differ
        by step, ``phase_key``: the one the most recent call ran).
    """

    def __init__(self, planned: PlannedStep, strategy: Strategy, engine: Engine):
        self.planned, self.strategy, self.engine = planned, strategy, engine
        self.rewritten = rewritten = strategy.rewrite(planned)
        #: the plain step's output shardings of the state, once read
        #: (`jaxsched.pipeline._trees_runner.plain_returned_shardings`; [] where XLA would not say)
        self.plain_returned: list | None = None
        self.per_device = PerDeviceProgram(
            rewritten.body,
            planned.mesh,
            planned.axis_name,
            tuple(rewritten.state_in_specs) + planned.batch_specs + planned.const_specs,
            tuple(rewritten.state_out_specs) + planned.aux_specs,
            rewritten.check_vma,
            rewritten.compiler_defaults or strategy.compiler_defaults,
            planned.bucket_bytes,
            dict(strategy.compiler_overrides),
            rewritten.global_body,
            planned.captured.manual_axes,
            planned.pattern.gathers_ahead is not None,
            len(planned.aux_specs),
            self._plain_aux_shardings(),
            len(rewritten.state_in_specs) if planned.captured.donates_state and strategy.donates_state else 0,
            (len(rewritten.state_in_specs), len(rewritten.state_in_specs) + len(planned.batch_specs)),
        )
        self.engine = engine.resolve(self.per_device)
        self.core = self.engine.compile(self.per_device)
        self._returned: ScheduledState | None = None  # the state the last run returned
        #: a strategy whose programs differ by step (``phase_key``): one core per phase, and
        #: the step after the last run, counted on the host so that no call waits to read it
        self._phase_cores: dict[Hashable, Callable[..., tuple]] = {}
        # decided once: a runtime Protocol check costs tens of microseconds per call
        self._phased = isinstance(strategy, PhasedStrategy)
        self._next_step: int | None = None
        #: whether the state comes out in the dtypes it went in (None: not run yet)
        self.keeps_dtypes: bool | None = None
        self._placed_consts: list | None = None
        self._state_shapes: list | None = None
        self._checked_returned = False
        #: the returned state's structure. Its leaves are read again on every call, as
        #: ``jax.jit`` reads its arguments: a user may set one in place between steps
        #: (``opt_state.hyperparams["learning_rate"] = 0.01`` under ``optax.inject_hyperparams``)
        self._state_treedef: PyTreeDef | None = None
        #: the batch signature `run_again` accepts: structure, per leaf a `BatchKey`, and
        #: per leaf None (goes in as given) or the spec it is placed on
        self._batch_treedef: PyTreeDef | None = None
        self._batch_keys: list[BatchKey] | None = None
        self._batch_places: list = []
        #: whether a training loop's batch may go to the core unchecked (`loop_call`), and
        #: the loop calls built for it, per (inputs, outputs)
        self._batch_unchecked = False
        self._loop_calls: dict[tuple[int, int | None], LoopCall] = {}

    def _plain_aux_shardings(self) -> tuple | None:
        """The aux's shardings as the plain step returns them, where the program leaves axes
        to XLA and returns arrays (`jaxsched.pipeline._plain_layout`): read by compiling
        the plain step once, which also tells `finalize` where the state goes."""
        captured = self.planned.captured
        n_state = captured.num_params + captured.num_opt
        aux = [captured.body.outvars[k] for k in captured.outputs[n_state:]]
        if not needs_plain_aux_layout(captured, [len(v.aval.shape) for v in aux]):
            return None
        outputs = plain_output_shardings(captured)
        if outputs is None or len(outputs) != len(captured.outputs):
            return None
        self.plain_returned = outputs[: len(captured.state_outputs)]
        return tuple(outputs[n_state:])

    # what users and tests inspect ----------------------------------------------------------
    @property
    def captured(self) -> CapturedStep:
        return self.planned.captured

    @property
    def buckets(self):
        return self.planned.buckets

    @property
    def fallbacks(self) -> list:
        return self.rewritten.fallbacks

    @property
    def bucket_report(self) -> list:
        """Per bucket, whether its update ran on shards and, if not, which primitives and
        source lines forced the fallback (`BucketReport`;
        the `FallbackWarning` as data). Empty for strategies
        that run the update on full tensors. Complete once the step has been traced (a
        call, ``lower`` or ``inspect``).

        Example:
            >>> import jax, optax
            >>> import jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.adamw(optax.linear_schedule(1e-2, 0.0, 10))
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> state, aux = sched(sched.init(params, tx.init(params)), batch)
            >>> [(r.bucket, r.on_shards, r.fallbacks) for r in sched.program.bucket_report]
            [(0, True, ())]
        """
        make = self.rewritten.bucket_report
        return [] if make is None else make()

    @property
    def layer_profile(self):
        return self.planned.layer_profile

    @property
    def network_profile(self):
        return self.planned.network_profile

    # running -------------------------------------------------------------------------------
    def convert(self, state: ScheduledState) -> ScheduledState:
        """The state in this program's layout; idempotent."""
        # every strategy's state is a NamedTuple with params and opt_state fields
        return cast(ScheduledState, self.strategy.convert(self.planned, state))

    def inputs(self, state: ScheduledState, batch: Any) -> list:
        """The compiled core's flat arguments for one step."""
        return self._inputs(self.convert(state), batch)

    def _inputs(self, converted: ScheduledState, batch: Any, consts: list | None = None) -> list:
        planned = self.planned
        batch_leaves = jax.tree.leaves(batch)
        if len(batch_leaves) != planned.captured.num_batch:
            raise JaxschedValueError(
                f"the batch has {len(batch_leaves)} leaves; the step was traced with {planned.captured.num_batch}"
            )
        if consts is None:
            consts = [planned.placed(c, s) for c, s in zip(planned.captured.consts, planned.const_specs, strict=True)]
        return (
            jax.tree.leaves(converted)
            + [planned.placed(b, s) for b, s in zip(batch_leaves, planned.batch_specs, strict=True)]
            + consts
        )

    def _device_consts(self) -> list:
        """The step's constants on the mesh, placed once: a host array passed on every call
        would be copied to every device on every call."""
        if self._placed_consts is None:
            planned = self.planned
            self._placed_consts = [
                jax.device_put(c, planned._sharding(s))
                if not isinstance(c, jax.Array) or c.sharding != planned._sharding(s)
                else c
                for c, s in zip(planned.captured.consts, planned.const_specs, strict=True)
            ]
        return self._placed_consts

    def _core_for(self, state: ScheduledState, returned: bool) -> tuple[Callable[..., tuple], int | None]:
        """The compiled core for ``state``'s step, and that step (None: one core for all)."""
        if not self._phased:
            return self.core, None
        strategy = cast(PhasedStrategy, self.strategy)
        step = self._next_step if returned and self._next_step is not None else strategy.host_step(state)
        key = strategy.phase_key(step)
        if not self._phase_cores:  # the core built from `rewrite` is the representative phase's
            self._phase_cores[strategy.phase_key(None)] = self.core
        if key not in self._phase_cores:
            body = strategy.rewrite_phase(self.planned, key)
            self._phase_cores[key] = self.engine.compile(dataclasses.replace(self.per_device, body=body))
        return self._phase_cores[key], step

    def run(self, state: ScheduledState, batch: Any) -> tuple[ScheduledState, Any]:
        """One step, every input checked; the batch's signature is learnt for `run_again`."""
        returned = state is self._returned
        batch_leaves, batch_treedef = jax.tree.flatten(batch)
        if not returned or any(isinstance(b, jax.ShapeDtypeStruct) for b in batch_leaves):
            if is_abstract(state) or is_abstract(batch):
                raise JaxschedTypeError(
                    "the state or batch is abstract (jax.ShapeDtypeStruct leaves): it "
                    "can be lowered, compiled and inspected (sched.lower, "
                    "sched.inspect), not run; pass arrays to run a step"
                )
        if returned:  # a state this program returned is in place already, unless a user
            leaves, treedef = jax.tree.flatten(state)  # changed its trees' structure in place
            returned = treedef == self._state_treedef
        if not returned:
            state = self.convert(state)
            leaves, treedef = jax.tree.flatten(state)
        planned = self.planned
        if len(batch_leaves) != planned.captured.num_batch:
            raise JaxschedValueError(
                f"the batch has {len(batch_leaves)} leaves; the step was traced with {planned.captured.num_batch}"
            )
        placed = [planned.placed(b, s) for b, s in zip(batch_leaves, planned.batch_specs, strict=True)]
        if self._batch_keys is None:
            self._learn_batch(batch_leaves, batch_treedef, placed)
        return self._execute(state, leaves, treedef, placed, returned)

    def run_again(self, batch: Any) -> tuple[ScheduledState, Any] | None:
        """The step from the state the last run returned, for a batch of the signature
        `run` learnt (None for any other: `run` then checks it).

        The state is this program's own output, in its layout already, and the batch's
        structure, shapes, dtypes and shardings were checked and its placement decided when
        its signature was first seen, so that what remains is a flatten of each and a
        comparison of the batch's leaves. A training loop's call goes faster still
        (`loop_call`)."""
        keys = self._batch_keys
        if keys is None or not self.keeps_dtypes or self._returned is None:
            return None
        batch_leaves, batch_treedef = jax.tree.flatten(batch)
        if batch_treedef != self._batch_treedef or len(batch_leaves) != len(keys):
            return None
        for leaf, (kind, shape, dtype, weak, sharding) in zip(batch_leaves, keys):
            if type(leaf) is not kind or leaf.shape != shape or leaf.dtype != dtype:
                return None
            if is_weakly_typed(leaf) != weak:
                return None
            if sharding is not None and leaf.sharding != sharding:
                return None
        planned = self.planned
        placed = [b if s is None else planned.placed(b, s) for b, s in zip(batch_leaves, self._batch_places)]
        state_leaves, state_treedef = jax.tree.flatten(self._returned)
        if state_treedef != self._state_treedef:  # changed in place: `run` checks it
            return None
        return self._execute(self._returned, state_leaves, state_treedef, placed, True)

    def loop_call(self, num_inputs: int, outputs: int | None, cache: ProgramCache) -> LoopCall | None:
        """A training loop's call of this program as one function: ``(state, inputs)`` to
        what the user's step returns, or None for a call it does not take (the checked path
        then runs it). None where the engine's core does not check its inputs itself or the
        batch needs placing.

        It takes a state this program returned and inputs of the signature `run` learnt,
        whose leaves are arrays placed as the program takes them (the same sharding object,
        as a loader's ``device_put`` gives, is one identity test), and calls the core with
        nothing else checked: the engine's core compares shapes and dtypes in C++ as
        ``jax.jit`` dispatches, and raises `SignatureChanged` instead of running for other
        ones (``Engine.checks_signatures``). Every line of Python before the dispatch
        delays the step, and right after a step it runs several times slower than alone
        (the benchmarks page), hence one function with no call but the flattens and the core.

        Args:
          num_inputs: the inputs after the state the step takes (their tuple is the batch
            where there are several).
          outputs: what the user's step returns after its state: 0 nothing, 1 (or None) an
            aux, more one output per input.
          cache: the cache holding this program, whose ``last`` each call sets to it (what
            ``sched.program`` and ``finalize`` read), as a checked call does.
        """
        if not (self._batch_unchecked and self.keeps_dtypes and self._returned is not None):
            return None
        key = (num_inputs, outputs)
        if key not in self._loop_calls:
            self._loop_calls[key] = self._build_loop_call(num_inputs, outputs, cache)
        return self._loop_calls[key]

    def _build_loop_call(self, num_inputs: int, outputs: int | None, cache: ProgramCache) -> LoopCall:
        assert self._batch_keys is not None and self._state_treedef is not None
        program, flatten, unflatten = self, jax.tree.flatten, jax.tree.unflatten
        batch_treedef, state_treedef, aux_tree = self._batch_treedef, self._state_treedef, self.captured.aux_tree
        flatten_state = state_treedef.flatten_up_to  # cheaper than a flatten and a comparison
        leaf_kinds = [(kind, sharding) for kind, _, _, _, sharding in self._batch_keys]
        first_shape = self._batch_keys[0][1]
        consts, n = tuple(self._placed_consts or ()), state_treedef.num_leaves
        several = outputs is not None and outputs > 1

        def loop_call(state: Any, inputs: tuple) -> Any:
            if state is not program._returned or len(inputs) != num_inputs:
                return None
            try:  # read as jax.jit reads its arguments: a leaf set in place counts
                state_leaves = flatten_state(state)
            except ValueError:  # its trees changed in place: the checked path says how
                return None
            leaves, treedef = flatten(inputs[0] if num_inputs == 1 else inputs)
            if treedef != batch_treedef:
                return None
            for leaf, (kind, placed) in zip(leaves, leaf_kinds):
                if type(leaf) is not kind:
                    return None
                sharding = leaf.sharding
                if sharding is not placed and sharding != placed:
                    return None
            if leaves[0].shape != first_shape:  # most changes of signature, at no trace's cost
                return None
            try:
                outs = program.core(*state_leaves, *leaves, *consts)
            except SignatureChanged:  # other shapes or dtypes: another program's batch
                return None
            except ValueError:  # refused before it ran: the checked path from now on
                program._batch_unchecked = False
                return None
            new_leaves = outs[:n]
            new_state = unflatten(state_treedef, new_leaves)
            program._returned = new_state
            cache.last = program
            if outputs == 0:
                return new_state
            aux = unflatten(aux_tree, outs[n:])
            return (new_state, *aux) if several else (new_state, aux)

        return loop_call

    def _learn_batch(self, leaves: list, treedef: PyTreeDef, placed: list) -> None:
        """Remember the batch signature `run_again` accepts (``jax.Array`` and NumPy
        leaves only) and, per leaf, whether it goes in as given (None) or is placed on every
        call (its spec: a host array, or one on another sharding)."""
        keys: list[BatchKey] = []
        for leaf in leaves:
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                keys.append((type(leaf), leaf.shape, leaf.dtype, is_weakly_typed(leaf), leaf.sharding))
            elif type(leaf) is np.ndarray:
                keys.append((np.ndarray, leaf.shape, leaf.dtype, False, None))
            else:
                return  # a Python scalar, a NumPy scalar: the checked path every call
        self._batch_treedef, self._batch_keys = treedef, keys
        self._batch_places = [
            None if given is put else spec for given, put, spec in zip(leaves, placed, self.planned.batch_specs)
        ]
        self._batch_unchecked = (
            bool(keys)
            and self.engine.checks_signatures
            and not self._phased
            and all(kind is not np.ndarray for kind, *_ in keys)
            and all(place is None for place in self._batch_places)
        )
        self._loop_calls.clear()

    def _execute(
        self, state: ScheduledState, leaves: list, treedef: PyTreeDef, batch_leaves: list, returned: bool
    ) -> tuple[ScheduledState, Any]:
        """Run the compiled core on the state's ``leaves`` and the placed batch leaves."""
        core, step = self._core_for(state, returned)
        self.core = core
        consts = self._device_consts()
        if self.per_device.donated_inputs and not returned:
            leaves = _unshared(leaves, [*batch_leaves, *consts])
        outs = core(*leaves, *batch_leaves, *consts)
        self._next_step = None if step is None else step + 1
        if self.keeps_dtypes is None:
            self.keeps_dtypes = all(leaf_dtype(a) == leaf_dtype(b) for a, b in zip(leaves, outs))
        n = len(leaves)
        new_leaves = list(outs[:n])
        new_state = jax.tree.unflatten(treedef, new_leaves)
        if not self._checked_returned:
            self._check_returned(new_state)
        self._returned, self._state_treedef = new_state, treedef
        return new_state, jax.tree.unflatten(self.captured.aux_tree, outs[n:])

    def _check_returned(self, state: ScheduledState) -> None:
        """Once per program: a strategy that keeps the user's layout returns every params and
        opt_state leaf in the shape and dtype the plain step returns it (never another)."""
        self._checked_returned = True
        want = self.captured.state_outputs
        if not self.strategy.keeps_user_layout or not want:
            return
        got = jax.tree.leaves((state.params, state.opt_state))
        for k, (leaf, expected) in enumerate(zip(got, want, strict=True)):
            if tuple(leaf.shape) != tuple(expected.shape) or leaf.dtype != expected.dtype:
                raise AssertionError(
                    f"jaxsched: {self.strategy.name} returned state leaf {k} as {leaf.dtype}{list(leaf.shape)}, "
                    f"where the plain step returns {expected.dtype}{list(expected.shape)}; this is a bug "
                    "in jaxsched, please report it"
                )

    @property
    def returned(self) -> ScheduledState | None:
        """The state the last run returned (it is in this program's layout already)."""
        return self._returned

    def finalize(self, state: ScheduledState) -> tuple[Any, Any]:
        return self.strategy.finalize(self.planned, state)

    def state_shapes(self, template: Any) -> list[tuple[int, ...]]:
        """Shapes of the params and opt_state leaves in this program's layout, for trees
        like ``template`` (abstract leaves): what a state this program made looks like."""
        if self._state_shapes is None:
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template)
            converted = self.convert(self.strategy.initial_state(*abstract))
            self._state_shapes = [tuple(x.shape) for x in jax.tree.leaves((converted.params, converted.opt_state))]
        return self._state_shapes

    def lower(self, state: ScheduledState, batch: Any) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of this program for ``state`` and ``batch``, concrete or
        abstract (``jax.ShapeDtypeStruct`` leaves with shardings: nothing touches a device)."""
        converted = self.convert(state)
        core = cast(_Lowerable, self._core_for(converted, False)[0])  # jit-like: every engine's core lowers
        return core.lower(*self._inputs(converted, batch))

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The XLA options the engine compiles this program with (``{}``: XLA's defaults)."""
        options_for = getattr(self.engine, "options_for", None)
        return {} if options_for is None else options_for(self.per_device)

    def inspect(self, state: ScheduledState, batch: Any, label: str | None = None, *, estimate: bool = True):
        """Compile for the mesh's devices and read the scheduled program and XLA's estimate
        (a `jaxsched.check._inspection.CompiledReport`, with the options it was
        compiled with). ``estimate``: where XLA writes no schedule, estimate the step from
        XLA's instruction costs (which compiles a probe program per collective)."""
        from jaxsched.check import _inspection as inspect_lib

        return inspect_lib.inspect_lowered(
            self.lower(state, batch),
            self.planned.mesh,
            label=label or self.strategy.name,
            target=inspect_lib.describe_mesh(self.planned.mesh),
            compiler_options=self.compiler_options,
            estimate=estimate,
        )

    def inspect_by_costs_too(self, state: ScheduledState, batch: Any) -> tuple[Any, Any]:
        """`inspect`'s report, and the program estimated from XLA's instruction costs too
        (`jaxsched.check.inspect_lowered_by_costs_too`), from one compile."""
        from jaxsched.check import _inspection as inspect_lib

        return inspect_lib.inspect_lowered_by_costs_too(
            self.lower(state, batch),
            self.planned.mesh,
            label=self.strategy.name,
            target=inspect_lib.describe_mesh(self.planned.mesh),
            compiler_options=self.compiler_options,
        )


class ProgramCache:
    """One program per abstract signature of the batch and dtypes of the state: the
    state's shapes are fixed per schedule, its dtypes are not (`retyped`)."""

    def __init__(self, build: Callable[[Any, Any], Program]):
        self._build = build
        self._programs: dict[Hashable, Program] = {}
        self.last: Program | None = None

    def get(self, batch: Any, template: Any = None) -> Program:
        """The program for ``batch`` and a state like ``template`` (``(params, opt_state)``)."""
        key = (abstract_signature(batch), tuple(leaf_dtype(x) for x in jax.tree.leaves(template)))
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._build(batch, template)
        self.last = program
        return program

    def __len__(self) -> int:
        return len(self._programs)

    def __iter__(self) -> Iterator[Program]:
        return iter(self._programs.values())
