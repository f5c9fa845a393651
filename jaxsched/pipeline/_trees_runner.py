"""The runner of a ``step(params, opt_state, ...)``: the programs `jaxsched.Scheduled` runs.

`Scheduled` decides its step's form once, at the first ``init`` (or call), and from then on
calls one of two runners, each through the `StepRunner` methods: a `TreesRunner` for a
``step(params, opt_state, ...)``, or a `jaxsched.pipeline._state_step.StateForm` for a
``step(state, ...)``, which splits the state and runs a `TreesRunner` of the pure step.
Here too are the checks of a state against the program it is given to.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.pipeline._trees_runner import TreesRunner
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.sgd(0.1)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
    >>> state = sched.init(params, tx.init(params))  # decides the trees form
    >>> isinstance(sched._runner, TreesRunner), sched._runner.num_programs
    (True, 0)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, NoReturn, Protocol, Sequence

import jax
import numpy as np

from jaxsched._errors import JaxschedRuntimeError, JaxschedTypeError, JaxschedValueError
from jaxsched.core._bucketing import param_paths
from jaxsched.core._capture import abstract_leaf, capture
from jaxsched.core._describe import difference
from jaxsched.pipeline._plain_layout import plain_output_shardings, runs_here
from jaxsched.pipeline._program import LoopCall, Program, ProgramCache, retyped
from jaxsched.pipeline._selection import BucketOption, program_of, select
from jaxsched.pipeline._state_step import OutputCount, UnsplitState
from jaxsched.pipeline.replan import Decision, Replanner, SwitchRecord, program_buckets, resolved_key
from jaxsched.runtime.engine import Engine
from jaxsched.sim._costmodel import NetworkProfile
from jaxsched.strategies import Strategy
from jaxsched.strategies._base import ScheduledState

if TYPE_CHECKING:
    from jaxsched.check._inspection import Inspection
    from jaxsched.check._verify import VerifyReport

__all__ = ["Schedule", "StepRunner", "TreesRunner", "check_finalized", "check_scheduled_state", "check_state_fits"]


class Schedule(Protocol):
    """What a `TreesRunner` reads of the `jaxsched.Scheduled` it runs: its options and its
    traced step (``verify`` runs the whole schedule)."""

    strategy: Strategy
    engine: Engine
    buckets_option: BucketOption
    plan_options: dict[str, Any]

    @property
    def traced_step(self) -> Callable: ...


class StepRunner(Protocol):
    """What runs a schedule in the one step form its first ``init`` (or first call) decided:
    `TreesRunner` for a ``step(params, opt_state, ...)``, `StateForm` for a ``step(state,
    ...)``. `Scheduled` checks and marks the user's arguments, then calls the runner's method of
    the same purpose; each form's behaviour is its own class's, none chosen by branching."""

    #: how many of ``init``'s first arguments are the state (``params, opt_state`` or ``state``)
    state_args: int

    def init(self, state: Sequence[Any], batch: Any) -> ScheduledState | UnsplitState: ...

    def loop_call(self, num_inputs: int) -> LoopCall | None: ...

    def call(self, state: Any, batch: Any) -> Any: ...

    def step_batch(self, state: Any, batch: Any) -> Any: ...

    def finalize(self, state: Any) -> Any: ...

    def lower(self, state: Any, batch: Any) -> jax.stages.Lowered: ...

    def inspect(self, state: Any, batch: Any, *, baseline: bool = True) -> Inspection: ...

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
    ) -> VerifyReport: ...

    @property
    def last_program(self) -> Program | None: ...

    @property
    def num_programs(self) -> int: ...

    @property
    def replans(self) -> list[SwitchRecord]: ...

    @property
    def replan_decisions(self) -> list[Decision]: ...

    def replan(self, network: NetworkProfile | str | None) -> SwitchRecord | None: ...


class TreesRunner:
    """The trees form: a ``step(params, opt_state, ...)``, the user's or the pure step a
    `StateForm` splits off a ``step(state, ...)``; its programs, one cache per bucket plan
    (re-planning switches between them), and the abstract ``(params, opt_state)`` they are
    traced for.

    Attributes:
      schedule: the `Scheduled` it runs: its options, its traced step, what ``verify`` runs.
      replanner: the schedule's `Replanner`, None without ``replan=``.
      outputs: what the step returns after its state, as the schedule's traced step records it.
      template: the abstract ``(params, opt_state)`` of the first state (None before one).
      programs: the program cache of the current bucket plan.
    """

    state_args = 2

    def __init__(self, schedule: Schedule, replanner: Replanner | None, outputs: OutputCount) -> None:
        self.schedule = schedule
        self.replanner = replanner
        self.outputs = outputs
        self.template: tuple[Any, Any] | None = None
        self.programs = ProgramCache(self._build)
        self._plans: dict[Hashable, ProgramCache] = {}  # one program cache per bucket plan

    def init(self, state: Sequence[Any], batch: Any) -> ScheduledState:
        """``(params, opt_state)`` in the strategy's state; in its scheduled layout with ``batch``."""
        params, opt_state = state
        self.template = jax.tree.map(abstract_leaf, (params, opt_state))
        scheduled = self.schedule.strategy.initial_state(params, opt_state)
        if batch is None:
            return scheduled
        return self.program_for(scheduled, batch).convert(scheduled)

    def again(self, state: ScheduledState, batch: Any) -> tuple[ScheduledState, Any] | None:
        """The step when ``state`` is what the last program returned and ``batch`` has the
        signature that program checked (`Program.run_again`), else None: a training
        loop's call skips the checks its first call of that signature made."""
        program = self.programs.last
        if program is None or state is not program.returned:
            return None
        return program.run_again(batch)

    def loop_call(self, num_inputs: int) -> LoopCall | None:
        """A training loop's call of the last program (`Program.loop_call`), returning what
        the user's step returns; None where a re-planner has to see every call."""
        return self.loop_call_returning(num_inputs, self.outputs.count)

    def loop_call_returning(self, num_inputs: int, outputs: int | None) -> LoopCall | None:
        """`loop_call` for a step returning ``outputs`` after its state (a `StateForm`'s
        user's step, whose count is not the split step's)."""
        program = self.programs.last
        if self.replanner is not None or program is None:
            return None
        return program.loop_call(num_inputs, outputs, self.programs)

    def call(self, state: ScheduledState, batch: Any) -> Any:
        """`step_batch`'s result as the user's step returns it."""
        return self.outputs.returned(*self.step_batch(state, batch))

    def step_batch(self, state: ScheduledState, batch: Any) -> tuple[ScheduledState, Any]:
        """One step, ``(state, aux)``; through the re-planner where there is one."""
        if self.replanner is not None:
            return self.replanner.step(state, batch, self._run, lambda: self.programs.last, self._use_buckets)
        return self._run(state, batch)

    def _run(self, state: ScheduledState, batch: Any) -> tuple[ScheduledState, Any]:
        result = self.again(state, batch)
        if result is not None:
            return result
        return self.program_for(state, batch).run(state, batch)

    def finalize(self, state: ScheduledState) -> tuple[Any, Any]:
        """``(params, opt_state)`` as the plain step returns them."""
        program = self.programs.last
        if program is None:  # never traced here: only a state in the user's layout
            return self.schedule.strategy.finalize_untraced(state)
        check_state_fits(program, self.template, state)
        returned = plain_returned_shardings(program)
        return check_finalized(program, self.template, program.finalize(state), returned)

    def lower(self, state: ScheduledState, batch: Any) -> jax.stages.Lowered:
        """The lowered scheduled program for ``batch``."""
        return self.program_for(state, batch).lower(state, batch)

    def inspect(self, state: ScheduledState, batch: Any, *, baseline: bool = True) -> Inspection:
        """The compiled program's report, and the plain step's with ``baseline``."""
        from jaxsched.check import _inspection as inspect_lib

        program = self.program_for(state, batch)
        if not baseline:
            return inspect_lib.Inspection(program.inspect(state, batch))
        assert self.template is not None  # set by the program's build
        params, opt_state = self.template
        plain_step = self.schedule.traced_step
        if program.captured.donates_state:  # as the user jitted it: its state updated in place
            plain_step = jax.jit(plain_step, donate_argnums=(0, 1))
        plain = inspect_lib.inspect_jitted(
            plain_step,
            (params, opt_state, batch),
            program.planned.mesh,
            label=inspect_lib.PLAIN_LABEL,
        )
        if plain.estimate_source != inspect_lib.ESTIMATE_FROM_INSTRUCTIONS:
            return inspect_lib.Inspection(program.inspect(state, batch), plain)
        # XLA wrote no schedule for the plain step: judge the scheduled one by the same costs
        report, by_costs = program.inspect_by_costs_too(state, batch)
        return inspect_lib.Inspection(report, plain, by_costs)

    def verify(
        self,
        state: ScheduledState,
        batches: Iterable[Any],
        steps: int,
        rtol: float,
        baseline_factor: float,
        precision: str,
        *,
        progress: bool = False,
    ) -> VerifyReport:
        """`jaxsched.check._verify.verify` of this runner's schedule."""
        from jaxsched.check._verify import verify

        return verify(self.schedule, state, batches, steps, rtol, baseline_factor, precision, progress=progress)

    @property
    def last_program(self) -> Program | None:
        """The program of the most recent call, None before one."""
        return self.programs.last

    @property
    def num_programs(self) -> int:
        """How many batch signatures the current plan has traced."""
        return len(self.programs)

    @property
    def replans(self) -> list[SwitchRecord]:
        """The re-planner's switches of plan, oldest first."""
        return [] if self.replanner is None else list(self.replanner.records)

    @property
    def replan_decisions(self) -> list[Decision]:
        """The re-planner's decision points, oldest first."""
        return [] if self.replanner is None else list(self.replanner.decisions)

    def replan(self, network: NetworkProfile | str | None) -> SwitchRecord | None:
        """The re-planner's pending switch for ``network`` (`Scheduled.replan` checked that
        there is a re-planner and a program)."""
        assert self.replanner is not None and self.programs.last is not None
        return self.replanner.request(self.programs.last, network)

    def program_for(self, state: ScheduledState, batch: Any) -> Program:
        """The program of ``batch``'s signature (traced now if new), ``state`` checked to fit it."""
        if self.template is None:
            self.template = (state.params, state.opt_state)
        program = self.programs.get(batch, retyped(self.template, (state.params, state.opt_state)))
        if not state_fits(program, self.template, state):
            for other in self.programs:
                if other is not program and state_fits(other, self.template, state):
                    raise_for_another_placement(program, other)
        check_state_fits(program, self.template, state)
        return program

    def _build(self, batch: Any, template: Any, buckets: BucketOption = None) -> Program:
        schedule = self.schedule
        try:
            captured = capture(
                schedule.traced_step, template[0], template[1], batch, schedule.strategy.folds_invariant_sums
            )
        except TypeError as err:
            integer = [
                path
                for path, leaf in zip(param_paths(template[0]), jax.tree.leaves(template[0]))
                if not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact)
            ]
            if "grad requires real" not in str(err) or not integer:
                raise
            raise JaxschedTypeError(
                f"the step differentiates params with integer leaves ({', '.join(integer[:3])}"
                f"{', ...' if len(integer) > 3 else ''}): are sched.init's arguments "
                "swapped? Call sched.init(params, opt_state), params first"
            ) from err
        chosen = select(
            captured,
            schedule.strategy,
            schedule.buckets_option if buckets is None else buckets,
            schedule.engine,
            schedule.plan_options,
        )
        # the choices are shown on this schedule's own copy of the strategy, never the user's
        if chosen.choice is not None:
            schedule.strategy.last_choice = chosen.choice  # type: ignore[attr-defined]  # an Auto
        if chosen.bucket_choice is not None:
            schedule.strategy.last_bucket_choice = chosen.bucket_choice
        return program_of(chosen, schedule.engine)

    def _use_buckets(self, buckets: Sequence[Sequence[str]]) -> bool:
        """Run the explicit plan ``buckets`` from the next call on, with its own program
        cache (kept, so that returning to a plan compiles nothing); returns whether that
        plan had been compiled before."""
        current = self.programs.last
        if current is None:
            raise JaxschedRuntimeError("a plan can only be switched after the step has run once")
        self._plans.setdefault(resolved_key(current.planned, program_buckets(current)), self.programs)
        key = resolved_key(current.planned, buckets)
        reused = key in self._plans
        if not reused:
            self._plans[key] = ProgramCache(functools.partial(self._build, buckets=[list(b) for b in buckets]))
        self.programs = self._plans[key]
        return reused


def check_scheduled_state(state: Any, call: str, num_arguments: int = 1) -> None:
    """Refuse what is not a state from ``sched.init`` with the call that was meant."""
    if isinstance(state, UnsplitState):
        return
    fields = getattr(state, "_fields", None)
    if isinstance(state, tuple) and fields and "params" in fields and "opt_state" in fields:
        return
    hint = ""
    if num_arguments == 3:
        hint = "; sched(params, opt_state, batch) is the plain step's call, the scheduled step carries its own state"
    elif isinstance(state, tuple) and len(state) == 2:
        hint = "; (params, opt_state) as a tuple is the user's trees, not the scheduled state"
    raise JaxschedTypeError(
        f"{call} got a {type(state).__name__} where the state sched.init returns "
        f"belongs{hint}. Call state = sched.init(params, opt_state) once "
        "(sched.init(state) for a step(state, batch)), then state, aux = "
        "sched(state, batch), and params, opt_state = sched.finalize(state) at the end"
    )


def state_fits(program: Program, template: Any, state: Any) -> bool:
    """Whether ``state``'s leaves have the user's shapes or ``program``'s scheduled ones."""
    trees = (state.params, state.opt_state)
    if jax.tree.structure(trees) != jax.tree.structure(template):  # type: ignore[operator]
        return False
    got = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(trees)]
    return got == [tuple(x.shape) for x in jax.tree.leaves(template)] or got == program.state_shapes(template)


def raise_for_another_placement(program: Program, other: Program) -> NoReturn:
    """Refuse a state laid out for ``other``, the program of a batch placed over other data
    axes: the strategy lays its state out over the data axes, so it does not fit ``program``."""
    name = program.strategy.name

    def over(planned: Any) -> str:  # the axes and, where they are named alike, the mesh
        mesh = planned.mesh
        count = f"{mesh.devices.size} device" + ("s" if mesh.devices.size != 1 else "")
        return f"{planned.axis_name!r} of a mesh {dict(mesh.shape)} ({count})"

    raise JaxschedValueError(
        f"this batch is placed over the data axes {over(program.planned)}, and the state "
        f"is laid out for batches over {over(other.planned)} (batch specs "
        f"{list(program.planned.batch_specs)} against {list(other.planned.batch_specs)}): {name} "
        "lays its state out over the data axes, so the state does not fit this batch. Place "
        "every batch over the same axes, or call sched.finalize(state) and init again with "
        "the result to go on with the new placement"
    )


def check_state_fits(program: Program, template: Any, state: Any) -> None:
    """Refuse a state this schedule did not make (another strategy's layout, another model),
    before JAX fails on it with a sharding error that names no leaf."""
    trees = (state.params, state.opt_state)
    if jax.tree.structure(trees) != jax.tree.structure(template):  # type: ignore[operator]
        raise JaxschedValueError(
            "this state's trees differ from the ones this schedule was initialized "
            f"with: they have {difference(template, trees)}. Was it made by another schedule? "
            "Pass the state this schedule's init returned, or finalize the other "
            "schedule's state and init this one with the result"
        )
    if state_fits(program, template, state):
        return
    user = [tuple(x.shape) for x in jax.tree.leaves(template)]
    got = [tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(trees)]
    scheduled = program.state_shapes(template)
    paths = [("params/" if p.startswith("0") else "opt_state/") + p.partition("/")[2] for p in param_paths(trees)]
    for path, have, want_user, want_scheduled in zip(paths, got, user, scheduled):
        if have not in (want_user, want_scheduled):
            raise JaxschedValueError(
                f"state leaf {path} has shape {have}; expected the user's {want_user} or the "
                f"scheduled {want_scheduled} ({program.strategy.name} layout). Does the state come "
                "from another schedule (another strategy or buckets) or another model? Pass the "
                "state this schedule's init returned, or finalize the other schedule's state with "
                "that schedule and init this one with the result"
            )


def plain_returned_shardings(program: Program) -> list | None:
    """The shardings XLA gives the plain ``jax.jit`` step's new params and optimizer state,
    where they may differ from the state's layout: None where they cannot.

    The scheduled state keeps each leaf as it came in (or as ``out_shardings`` or a sharding
    constraint say), and so does the plain step, except that XLA's propagation may return
    a leaf placed replicated split over a data axis (an FSDP step's replicated bias, whose
    gradient XLA reduce-scatters). Compiled once per program (`Program.plain_returned`),
    for ``finalize``, where a state leaf is replicated beside sharded ones on devices that
    run (never for compile-only targets)."""
    captured = program.captured
    if captured.kind != "jit" or captured.mesh.devices.size < 2 or not captured.state_outputs:
        return None
    whole = [all(s is None for s in program.planned.output_spec(k)) for k in range(len(captured.state_outputs))]
    if all(whole) or not any(whole) or not runs_here(captured.mesh.devices.flat[0]):
        return None
    cached = program.plain_returned
    if cached is None:
        outputs = plain_output_shardings(captured)
        cached = [] if outputs is None else outputs[: len(whole)]
        program.plain_returned = cached
    return cached or None


def check_finalized(
    program: Program, template: Any, trees: tuple[Any, Any], returned: Sequence[Any] | None = None
) -> tuple[Any, Any]:
    """``finalize``'s ``(params, opt_state)`` as the plain step returns them: every leaf in the
    shape and dtype the step gives it, and on the mesh with the sharding the step's output has
    (``returned``, where `plain_returned_shardings` read it from XLA).

    A leaf in another shape or dtype is a defect of the strategy's layout, refused with the
    leaf's path rather than handed back; a leaf on the host or on an equivalent but
    differently written sharding is placed as the plain step's output is."""
    captured, planned = program.captured, program.planned
    want = captured.state_outputs
    leaves, treedef = jax.tree.flatten(trees)
    if not want or treedef != jax.tree.structure((template[0], template[1])):  # type: ignore[operator]
        return trees
    names = ["params/" + p for p in param_paths(trees[0])] + ["opt_state/" + p for p in param_paths(trees[1])]
    given = [getattr(t, "sharding", None) for t in jax.tree.leaves((template[0], template[1]))]
    fixed = []
    for k, (name, leaf, expected, placed) in enumerate(zip(names, leaves, want, given, strict=True)):
        shape, dtype = tuple(jax.numpy.shape(leaf)), jax.numpy.result_type(leaf)
        if shape != tuple(expected.shape) or dtype != expected.dtype:
            raise AssertionError(
                f"jaxsched: {program.strategy.name}'s finalize gave {name} as {dtype}{list(shape)}, where the "
                f"plain step returns {expected.dtype}{list(expected.shape)}; this is a bug in jaxsched, "
                "please report it. Run the step unscheduled (strategy='allreduce') meanwhile"
            )
        if captured.kind != "pmap":
            target = jax.sharding.NamedSharding(planned.mesh, planned.output_spec(k))
            xla = returned[k] if returned else None
            if isinstance(xla, jax.sharding.NamedSharding) and xla.mesh.shape == planned.mesh.shape:
                target = jax.sharding.NamedSharding(planned.mesh, xla.spec)
            if isinstance(placed, jax.sharding.NamedSharding) and placed.is_equivalent_to(target, len(shape)):
                target = placed  # the user's own sharding, spelled as the user spelled it
            leaf = _placed_as_output(leaf, target)
        fixed.append(leaf)
    return jax.tree.unflatten(treedef, fixed)


def _placed_as_output(leaf: Any, sharding: jax.sharding.NamedSharding) -> Any:
    """``leaf`` on ``sharding``: left alone where it is there already (under any spec that lays
    it out the same), placed from the host value (every process holds it whole) otherwise."""
    if isinstance(leaf, jax.Array):
        if leaf.sharding == sharding:
            return leaf
        if leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return jax.device_put(leaf, sharding)  # the same layout: no data moves
        if leaf.is_fully_addressable == sharding.is_fully_addressable:
            return jax.device_put(leaf, sharding)  # across processes too: a resharding program
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
