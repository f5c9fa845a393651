"""``jaxsched.schedule``: capture -> analyze -> plan -> strategy -> engine.

Example:
    >>> import jax, optax
    >>> import jaxsched
    >>> from jaxsched.demo import steps
    >>> from jaxsched.zoo import models
    >>> params, apply_fn = models.pure(models.build("mlp", (8, 8, 1), 10, hidden=(16,)))
    >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    >>> tx = optax.adam(1e-3)
    >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
    >>> state = sched.init(params, tx.init(params))
    >>> batch = steps.shard_batch((jax.numpy.ones((4, 8, 8, 1)), jax.numpy.zeros(4, "int32")), mesh)
    >>> state, aux = sched(state, batch)
    >>> new_params, new_opt_state = sched.finalize(state)
    >>> jax.tree.structure(new_params) == jax.tree.structure(params)
    True
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING, Any, Callable, Iterable, overload

import jax

from jaxsched._errors import JaxschedRuntimeError, JaxschedTypeError, JaxschedValueError
from jaxsched.core import _static_leaves as static_leaves
from jaxsched.runtime.collectives._base import Collective
from jaxsched.runtime.engine import Engine, make_engine
from jaxsched.pipeline._program import LoopCall, Program
from jaxsched.pipeline._selection import BucketOption
from jaxsched.core._describe import describe
from jaxsched.pipeline._trees_runner import StepRunner, TreesRunner, check_scheduled_state
from jaxsched.pipeline._state_step import (
    STATE,
    TREES,
    OutputCount,
    StateForm,
    UnsplitState,
    inputs_of,
    step_form,
    with_inputs,
    with_outputs,
)
from jaxsched.pipeline.replan import Decision, Replan, Replanner, SwitchRecord, as_replan
from jaxsched.sim._costmodel import NetworkProfile
from jaxsched.strategies import STRATEGIES, SchedState, Strategy, make_strategy
from jaxsched.strategies._base import ScheduledState

if TYPE_CHECKING:
    from jaxsched.check._inspection import Inspection
    from jaxsched.check._verify import VerifyReport

PLAN_OPTIONS = ("layer_profile", "network_profile", "planner")

__all__ = ["STRATEGIES", "SchedState", "Scheduled", "schedule"]


class Scheduled:
    """A scheduled training step: ``init``, ``__call__``, ``finalize`` (see `schedule`).

    The step form (``step(params, opt_state, ...)`` or ``step(state, ...)``) is read from the
    first ``init``'s arguments, after `schedule` returned this object; it is decided then,
    once, and every later call runs that form (a private runner of each form does the work).

    Args:
      step: the user's train step (as `schedule`'s ``train_step``).
      strategy: a registered name or a `Strategy` instance (the schedule works on a copy).
      buckets: the bucket plan (as `schedule`'s ``buckets``).
      compiler_options: options of the ``xla`` engine.
      engine: an engine name or an `Engine`.
      collective: a `Collective` that the strategy sends its buckets through.
      compression: a compressor, the same as ``collective`` (not both).
      replan: ``None``, ``"auto"`` or a `Replan` (re-plan while training).
      **options: the strategy's own options and, with ``buckets="auto"``, the planning options.

    Example:
        >>> import jax, optax, jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> sched = jaxsched.Scheduled(steps.make_step(apply_fn, tx, mesh), strategy="allreduce")
        >>> sched.strategy.name
        'allreduce'
    """

    def __init__(
        self,
        step: Callable,
        strategy: str | Strategy = "wfbp",
        buckets: BucketOption = None,
        compiler_options: dict[str, Any] | None = None,
        *,
        engine: str | Engine = "auto",
        collective: Collective | None = None,
        compression: Collective | None = None,
        replan: str | Replan | None = None,
        **options: Any,
    ):
        if not callable(step):
            raise JaxschedTypeError(f"schedule() needs the user's train step, got {type(step).__name__}")
        if collective is not None and compression is not None:
            raise JaxschedTypeError("pass compression= or collective= (a compressor is a collective wrapper), not both")
        plan_options = {k: v for k, v in options.items() if k in PLAN_OPTIONS}
        strategy_options = {k: v for k, v in options.items() if k not in PLAN_OPTIONS}
        #: the user's step, taking and returning its non-array leaves (an Equinox model's
        #: functions) as static tree structure (`jaxsched.core._static_leaves`)
        self.step = static_leaves.through(step)
        try:
            # a copy: what selection records on it (``last_choice``) never reaches the user's instance
            self.strategy: Strategy = copy.copy(
                make_strategy(
                    strategy, collective=compression if collective is None else collective, **strategy_options
                )
            )
        except TypeError as err:
            if not strategy_options:
                raise
            raise JaxschedTypeError(
                f"schedule() got unknown options {sorted(strategy_options)}: neither "
                f"strategy {strategy!r} takes them ({err}) nor buckets='auto', whose "
                f"options are {', '.join(PLAN_OPTIONS)}"
            ) from None
        engine_options = {} if compiler_options is None else {"compiler_options": compiler_options}
        self.engine: Engine = make_engine(engine, **engine_options)
        self.replan_options = as_replan(replan)
        if self.replan_options is not None and buckets is None:
            buckets = "auto"  # re-planning plans; so does the first plan
        self.buckets_option = buckets
        self.plan_options = plan_options
        #: monitors the network and switches plans (None without ``replan=``)
        self._replanner = (
            None if self.replan_options is None else Replanner(self.replan_options, getattr(step, "__name__", "step"))
        )
        self._form: str | None = None  # "trees" or "state": decided once, by the first init or call
        #: the runner of that form (`TreesRunner` or `StateForm`), None until it is decided
        self._runner: StepRunner | None = None
        self._num_inputs: int | None = None  # the batch and the extra inputs before it
        self._outputs = OutputCount()  # what a step(params, opt_state, ...) returns after its state
        self._fixed_form: str | None = None  # set by an adapter that knows its step's form
        self._statics_seen = False  # whether an input has held a static leaf so far
        #: a training loop's call (`jaxsched.pipeline.Program.loop_call`): set after each
        #: checked call, None where static leaves or a re-planner need every call checked
        self._loop_call: LoopCall | None = None
        functools.update_wrapper(self, step, updated=())

    # -- public API -----------------------------------------------------------------------
    def init(self, *args: Any, batch: Any = None) -> ScheduledState | UnsplitState:
        """Ordinary trees in, scheduled state out.

        ``init(params, opt_state[, batch])`` for a ``step(params, opt_state, batch)``,
        ``init(state[, batch])`` for a ``step(state, batch)``, and the step's other inputs
        before the batch where it takes some (``init(state, rng, batch)`` for a ``step(state,
        rng, batch)``). The first ``init`` decides the form for good
        (`jaxsched.pipeline._state_step` says how it is read from the arguments).

        Without the step's inputs the leaves keep the user's layout until the first step
        converts them (the step can only be traced once a batch is known). With all of them
        (an example batch last, or as ``batch=``) the state comes back in its scheduled layout
        at once, which is what a checkpoint restore needs as its target.

        Args:
          *args: the step's state (``params, opt_state`` or ``state``), then optionally its
            inputs: the extra ones and the batch last.
          batch: the example batch, instead of as the last positional argument.

        Returns:
          The scheduled state (a `SchedState`), or for a ``step(state, batch)`` without a
          batch an `UnsplitState` that the first call splits.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
            >>> state = sched.init(params, tx.init(params))
            >>> jax.tree.structure(state.params) == jax.tree.structure(params)  # the user's layout until a step
            True
        """
        args, batch = self._marked(args), self._marked(batch)
        if not args:
            raise JaxschedTypeError(
                "sched.init() got no arguments; call sched.init(params, opt_state) for a "
                "step(params, opt_state, batch), or sched.init(state) for a step(state, batch)"
            )
        form = self._fixed_form or step_form(self.step, args, batch is not None)
        if self._form not in (None, form):
            raise JaxschedTypeError(
                f"this schedule was initialized in the {self._form} form "
                f"({'init(state)' if self._form == STATE else 'init(params, opt_state)'})"
                f"; sched.init got the {form} form's arguments"
            )
        runner = self._decide(form)
        if self._num_inputs is None:
            self._num_inputs = inputs_of(self.step, runner.state_args)
        example = self._example_inputs(args[runner.state_args :], batch)
        return runner.init(args[: runner.state_args], example)

    def __call__(self, state: ScheduledState | UnsplitState, *inputs: Any) -> Any:
        """One training step, called as the plain step is, with the scheduled state.

        The first call of each batch signature traces and compiles the scheduled program;
        later calls run it (a state this schedule just returned skips the checks).

        Args:
          state: what `init` or the previous call returned (never the user's trees:
            ``sched(params, opt_state, batch)`` is refused with the call that was meant).
          *inputs: the step's inputs after its state: the batch, or the extra inputs
            and then the batch for a ``step(state, key, batch)``.

        Returns:
          What the plain step returns, with the scheduled state in place of the user's:
          ``(state, aux)``; the state alone for a step that returns only its state;
          ``(state, key, aux)`` for a step that returns an output per input.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
            >>> state = sched.init(params, tx.init(params))
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> state, aux = sched(state, batch)
            >>> state, aux = sched(state, batch)  # the compiled program again
        """
        loop_call = self._loop_call
        if loop_call is not None:
            result = loop_call(state, inputs)
            if result is not None:
                return result
        self._loop_call = None  # until this call returns: one that raises leaves none
        batch = self._batch_of(self._marked(inputs), state)
        runner = self._runner_for(state)
        result = runner.call(state, batch)
        static = self._has_static()
        # the next call of a training loop: the last program's, where nothing has to see it
        self._loop_call = None if static else runner.loop_call(len(inputs))  # inputs checked by _batch_of
        if type(result) is tuple and static:  # the outputs after the state
            return (result[0], *static_leaves.unmark(result[1:]))
        return result

    def step_batch(self, state: ScheduledState | UnsplitState, batch: Any) -> Any:
        """One step with the step's inputs after the state as one pytree, as ``verify`` and
        adapters call it (no checks of the inputs, no static leaves marked).

        Args:
          state: what `init` or the previous step returned.
          batch: the batch, or the tuple of a step's extra inputs and its batch.

        Returns:
          ``(state, aux)`` for a ``step(params, opt_state, ...)`` (aux ``None`` for a step
          that returns no aux); for a ``step(state, ...)`` what a call returns.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> state, aux = sched.step_batch(sched.init(params, tx.init(params)), batch)
            >>> sorted(aux)
            ['accuracy', 'loss']
        """
        return self._runner_for(state).step_batch(state, batch)

    def replan(self, network: NetworkProfile | str | None = None) -> SwitchRecord | None:
        """Re-plan the buckets now; the step switches at its next call.

        Needs ``replan=`` and one step run; every process calls it at the same step
        (`jaxsched.pipeline.replan`).

        Args:
          network: a `NetworkProfile` or a preset name such as ``"1gbe"``; None for the
            network measured while training.

        Returns:
          The pending switch (a `SwitchRecord`), or None when the plan for that network is
          the current one.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), replan=jaxsched.Replan(every=1000))
            >>> try:
            ...     sched.replan("1gbe")  # before the first call: nothing to re-plan yet
            ... except jaxsched.JaxschedError as err:
            ...     print(err)
            sched.replan() needs the step traced first: call it once
        """
        if self._replanner is None:
            raise JaxschedValueError(
                "sched.replan() needs a schedule made with replan='auto' or replan=jaxsched.Replan(...)"
            )
        runner = self._runner
        if runner is None or runner.last_program is None:
            raise JaxschedRuntimeError("sched.replan() needs the step traced first: call it once")
        return runner.replan(network)

    @property
    def replans(self) -> list[SwitchRecord]:
        """Every switch of plan so far (`SwitchRecord`), oldest first.

        Example:
            >>> import jaxsched
            >>> jaxsched.schedule(lambda params, opt_state, batch: None, replan="auto").replans
            []
        """
        return [] if self._runner is None else self._runner.replans

    @property
    def replan_decisions(self) -> list[Decision]:
        """Every decision point of the re-planning monitor (`Decision`: measured drift,
        predicted gain, whether it switched, what the measurement cost), oldest first.

        Example:
            >>> import jaxsched
            >>> jaxsched.schedule(lambda params, opt_state, batch: None, replan="auto").replan_decisions
            []
        """
        return [] if self._runner is None else self._runner.replan_decisions

    def finalize(self, state: ScheduledState | UnsplitState) -> Any:
        """Back to the user's trees (performs pending all-gathers).

        Args:
          state: what `init` or the last call returned.

        Returns:
          ``(params, opt_state)`` as the plain step returns them, or the user's state object
          for a ``step(state, batch)``.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="dear")
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> state, aux = sched(sched.init(params, tx.init(params)), batch)
            >>> new_params, new_opt_state = sched.finalize(state)
            >>> jax.tree.structure(new_params) == jax.tree.structure(params)
            True
        """
        check_scheduled_state(state, "sched.finalize(state)")
        return static_leaves.unmark(self._runner_for(state).finalize(state))

    def lower(self, state: ScheduledState | UnsplitState, batch: Any) -> jax.stages.Lowered:
        """The lowered scheduled program (StableHLO), e.g. to inspect where collectives sit.

        Args:
          state: what `init` or a call returned.
          batch: the step's inputs after the state (a batch, or a tuple of its inputs).

        Returns:
          The ``jax.stages.Lowered`` program (traced now if its signature is new).

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> "all_reduce" in sched.lower(sched.init(params, tx.init(params)), batch).as_text()
            True
        """
        return self._runner_for(state).lower(state, self._marked(batch))

    def inspect(self, state: ScheduledState | UnsplitState, batch: Any, *, baseline: bool = True) -> Inspection:
        """Compile this step for its mesh's devices and read what the compiler scheduled.

        Works ahead of time: with a mesh over compile-only devices (`jaxsched.tools.aot.devices`)
        and abstract ``state`` / ``batch`` (``jax.ShapeDtypeStruct`` leaves with shardings,
        ``state`` from ``sched.init``), nothing touches a device.

        Args:
          state: what `init` or a call returned (abstract leaves are enough).
          batch: the step's inputs after the state.
          baseline: whether to compile the user's step unchanged too, as XLA compiles it
            with its default options: the peer every strategy is compared with.

        Returns:
          A `jaxsched.check._inspection.Inspection`: the scheduled step's `CompiledReport`
          (every collective, async or not, the compute in its window, XLA's estimated step
          and exposed communication) and, with ``baseline``, the plain step's.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh))
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> report = sched.inspect(sched.init(params, tx.init(params)), batch, baseline=False)
            >>> report.baseline is None
            True
        """
        return self._runner_for(state).inspect(state, self._marked(batch), baseline=baseline)

    def fresh(self) -> Scheduled:
        """A new schedule of the same step with the same options and no traced programs
        (``verify`` traces the step again in float64 with it; it plans once, never re-plans).

        Returns:
          The new `Scheduled`, of this one's step form if an adapter fixed it.

        Example:
            >>> import jaxsched
            >>> sched = jaxsched.schedule(lambda params, opt_state, batch: None, strategy="dear")
            >>> sched.fresh().strategy.name
            'dear'
        """
        fresh = Scheduled(self.step, self.strategy, self.buckets_option, engine=self.engine, **self.plan_options)
        fresh._fixed_form = self._fixed_form
        return fresh

    def with_step(self, step: Callable) -> Scheduled:
        """A new schedule of ``step`` with this one's options, in the trees form (the state
        form schedules the pure ``step(params, rest, batch)`` it splits off the user's).

        Args:
          step: a ``step(params, opt_state, batch) -> (params, opt_state, aux)``.

        Returns:
          The new `Scheduled`; its strategy is this one's (what selection records shows here).

        Example:
            >>> import jaxsched
            >>> sched = jaxsched.schedule(lambda state, batch: None, strategy="dear")
            >>> inner = sched.with_step(lambda params, opt_state, batch: None)
            >>> inner.strategy is sched.strategy
            True
        """
        inner = Scheduled(
            step,
            self.strategy,
            self.buckets_option,
            engine=self.engine,
            replan=self.replan_options,
            **self.plan_options,
        )
        inner._fixed_form = TREES  # the adapter's pure step(params, rest, batch)
        inner.strategy = self.strategy  # shared: what selection records shows on this schedule
        return inner

    def verify(
        self,
        state: ScheduledState | UnsplitState,
        batches: Iterable[Any],
        steps: int = 10,
        rtol: float = 1e-5,
        baseline_factor: float = 100.0,
        precision: str = "float64",
        *,
        progress: bool = False,
    ) -> VerifyReport:
        """Run the plain step and this scheduled step side by side on ``batches``.

        By default every run is made in float64, where rounding cannot pass for a defect
        (`jaxsched.check._verify`); ``precision="float32"`` compares the step as it trains.

        Args:
          state: what `init` returned.
          batches: the step's inputs after the state, one element per step (a tuple of
            them for a step with extra inputs).
          steps: how many steps to compare.
          rtol: the relative difference a leaf may reach beyond its rounding baseline.
          baseline_factor: how far above the rounding baseline a leaf may drift.
          precision: ``"float64"`` or ``"float32"``.
          progress: whether to show a progress bar.

        Returns:
          A `jaxsched.check._verify.VerifyReport`: per leaf the largest relative difference,
          the rounding baseline it is judged against, and the first step at which each leaf
          left its tolerance, or that it is chaotic (``print(report)`` shows a table).

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="allreduce")
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> report = sched.verify(sched.init(params, tx.init(params)), [batch], steps=1, precision="float32")
            >>> report.ok
            True
        """
        checked = map(self._check_inputs, batches)
        return self._runner_for(state).verify(
            state, checked, steps, rtol, baseline_factor, precision, progress=progress
        )

    @property
    def program(self) -> Program:
        """The program of the most recent call.

        Example:
            >>> import jax, optax, jaxsched
            >>> from jaxsched.demo import steps
            >>> from jaxsched.zoo import models
            >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
            >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
            >>> tx = optax.sgd(0.1)
            >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp")
            >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
            >>> state, aux = sched(sched.init(params, tx.init(params)), batch)
            >>> sched.program.strategy.name
            'wfbp'
        """
        last = None if self._runner is None else self._runner.last_program
        if last is None:
            raise JaxschedRuntimeError("the step has not been traced yet: call it once (or lower()) first")
        return last

    @property
    def num_programs(self) -> int:
        """How many input signatures have been traced (one program each).

        Example:
            >>> import jaxsched
            >>> jaxsched.schedule(lambda params, opt_state, batch: None).num_programs
            0
        """
        return 0 if self._runner is None else self._runner.num_programs

    @property
    def traced_step(self) -> Callable:
        """The user's step with its inputs after the state in one tuple, as the pipeline
        traces it (the step itself when it takes only a batch).

        Example:
            >>> import jaxsched
            >>> def train_step(params, opt_state, batch):
            ...     return params, opt_state, {"loss": 0.0}
            >>> jaxsched.schedule(train_step).traced_step(1, 2, None)
            (1, 2, {'loss': 0.0})
        """
        state_args = 1 if self._form == STATE else 2
        step = with_inputs(self.step, self._num_inputs or 1, state_args)
        return step if self._form == STATE else with_outputs(step, self._outputs, self._num_inputs or 1)

    # -- internals -------------------------------------------------------------------------
    def _decide(self, form: str) -> StepRunner:
        """The runner of ``form``, made now if this schedule's form was not decided yet (the
        form never changes afterwards: `init` refuses the other form's arguments)."""
        if self._runner is None:
            self._form = form
            self._runner = StateForm(self, self._trees_runner_of) if form == STATE else self._own_trees_runner()
        return self._runner

    def _runner_for(self, state: Any) -> StepRunner:
        """The runner of this schedule's form; decided by ``state`` where no `init` decided it:
        an `UnsplitState` (what ``init(state)`` returns) is the state form's, anything else the
        trees form's (a state in the trees layout, the only one usable before a split)."""
        if self._runner is None:
            return self._decide(STATE if isinstance(state, UnsplitState) else TREES)
        return self._runner

    def _trees_runner_of(self, step: Callable) -> TreesRunner:
        """The runner of the trees-form schedule of ``step`` (`with_step`): what the state form
        runs once it split the user's state, its schedule what ``verify`` runs."""
        inner = self.with_step(step)
        inner._num_inputs = 1  # the pure step(params, rest, batch) takes the batch alone
        runner = inner._own_trees_runner()
        inner._form, inner._runner = TREES, runner
        return runner

    def _own_trees_runner(self) -> TreesRunner:
        return TreesRunner(self, self._replanner, self._outputs)

    def _program_for(self, state: ScheduledState, batch: Any) -> Program:
        """The trees form's program for ``batch`` (as `jaxsched.check._verify` reads it)."""
        runner = self._runner_for(state)
        assert isinstance(runner, TreesRunner), "verify runs the trees form"
        return runner.program_for(state, batch)

    def _example_inputs(self, given: tuple, batch: Any) -> Any:
        """The step's inputs after the state given to ``init`` as the pipeline's one batch
        pytree, or None when the batch is not among them."""
        given = tuple(given) + (() if batch is None else (batch,))
        if not given:
            return None
        expected = self._num_inputs if self._num_inputs is not None else len(given)
        if len(given) > expected:
            raise JaxschedTypeError(
                f"sched.init got {len(given)} input(s) after the state; the step takes {expected} "
                "(its extra inputs, then the batch)"
            )
        if len(given) < expected:
            if batch is not None:
                raise JaxschedTypeError(
                    f"sched.init got batch= and {len(given) - 1} other input(s); the step takes "
                    f"{expected} inputs after its state: pass the ones before the batch too"
                )
            return None  # the extra inputs alone (a key): the first call splits the state
        self._num_inputs = expected
        return given[0] if expected == 1 else tuple(given)

    def _marked(self, tree: Any) -> Any:
        """``tree`` with its non-array leaves as static structure, as the step treats them."""
        marked = static_leaves.mark(tree, scalars_static=self.step.scalars_static)
        if marked is not tree:
            self._statics_seen = True
        return marked

    def _has_static(self) -> bool:
        """Whether an input or an output of the step has held a static leaf so far."""
        return self._statics_seen or self.step.saw_static

    def _check_inputs(self, item: Any) -> Any:
        """One element of ``verify``'s batches, checked as a call checks its inputs: for a step
        taking several inputs after its state, a tuple of that many."""
        expected = self._num_inputs
        if expected is not None and expected > 1 and (not isinstance(item, (tuple, list)) or len(item) != expected):
            got = f"{len(item)} items" if isinstance(item, (tuple, list)) else describe(item)
            raise JaxschedTypeError(
                f"verify got a batch of {got}, but the step takes {expected} inputs after its state: give "
                "each element of batches as the tuple of inputs a call takes after the state ("
                + ", ".join(["input"] * (expected - 1) + ["batch"])
                + ")"
            )
        return self._marked(item)

    def _batch_of(self, inputs: tuple, state: Any) -> Any:
        """The inputs after the state as the one batch pytree the pipeline traces."""
        check_scheduled_state(state, "sched(state, batch)", num_arguments=1 + len(inputs))
        if not inputs:
            raise JaxschedTypeError(
                "sched(state, batch) got no batch; call it as the step is called, state first, then the step's inputs"
            )
        expected = self._num_inputs if self._num_inputs is not None else len(inputs)
        if len(inputs) != expected:
            raise JaxschedTypeError(
                f"the scheduled step got {len(inputs)} input(s) after the state; the "
                f"step takes {expected} (call sched(state, "
                + ", ".join(["input"] * (expected - 1) + ["batch"])
                + "))"
                + (
                    "; if the step is step(params, opt_state, batch), the schedule was initialized with "
                    "one tree: call sched.init(params, opt_state)"
                    if self._form == STATE and len(inputs) < expected
                    else ""
                )
            )
        self._num_inputs = expected
        return inputs[0] if expected == 1 else tuple(inputs)


@overload
def schedule(
    train_step: Callable,
    strategy: str | Strategy = ...,
    buckets: BucketOption = ...,
    compiler_options: dict[str, Any] | None = ...,
    *,
    engine: str | Engine = ...,
    collective: Collective | None = ...,
    compression: Collective | None = ...,
    replan: str | Replan | None = ...,
    **options: Any,
) -> Scheduled: ...


@overload
def schedule(
    train_step: None = ...,
    strategy: str | Strategy = ...,
    buckets: BucketOption = ...,
    compiler_options: dict[str, Any] | None = ...,
    *,
    engine: str | Engine = ...,
    collective: Collective | None = ...,
    compression: Collective | None = ...,
    replan: str | Replan | None = ...,
    **options: Any,
) -> Callable[[Callable], Scheduled]: ...


def schedule(
    train_step: Callable | None = None,
    strategy: str | Strategy = "wfbp",
    buckets: BucketOption = None,
    compiler_options: dict[str, Any] | None = None,
    *,
    engine: str | Engine = "auto",
    collective: Collective | None = None,
    compression: Collective | None = None,
    replan: str | Replan | None = None,
    **options: Any,
) -> Scheduled | Callable[[Callable], Scheduled]:
    """Schedule the gradient communication of a data-parallel ``train_step``.

    Args:
      train_step: ``(params, opt_state, batch) -> (params, opt_state, aux)``, or ``(state,
        batch) -> (state, aux)`` over any pytree state (a Flax ``TrainState``, a dataclass, a
        dict; `jaxsched.pipeline._state_step`), with any inputs (a key) before the batch.
        Every data-parallel step is accepted: a ``jax.jit`` step on global arrays with any
        shardings (the batch split over the data axes; the parameters replicated or
        sharded: FSDP, HSDP, tensor parallelism; `jaxsched.core.partition`), or a
        per-device body (``jax.shard_map``, jitted or not, or ``jax.pmap``) that reduces
        its gradients with ``lax.pmean``/``lax.psum`` (or implicitly via ``check_vma``).
        Omit it to use ``schedule`` as a decorator: ``@jaxsched.schedule(strategy="wfbp")``.
      strategy: a registered name or a `Strategy` instance (never changed: the schedule
        works on its own copy, ``sched.strategy``). ``jaxsched.STRATEGIES`` lists the
        names: ``allreduce`` (the step unchanged, one reduction after backward),
        ``wfbp`` (the default: one all-reduce per bucket, placed in backward), ``dear``
        (reduce-scatter in backward, sharded update, all-gather deferred to the next
        forward), ``approx`` (step ``t-k``'s gradients reduced at step ``t``), ``kfac``
        (K-FAC preconditioned gradients), ``diloco`` (inner steps on the fast axes, an
        outer step every H steps) and ``auto`` (chooses among the exact strategies;
        ``sched.strategy.last_choice`` says which and why).
      buckets: ``None`` (25 MB threshold in gradient-completion order), a byte threshold,
        an explicit plan (a list of lists of parameter paths such as ``"head/kernel"``), or
        ``"auto"``: planned against the simulator (`jaxsched.plan._from_step`), with
        options ``layer_profile`` (a measured `LayerProfile`),
        ``network_profile`` (a profile or preset name; default: measured on the mesh) and
        ``planner`` (default ``"optimal"``).
      compiler_options: options of the ``xla`` engine: per-function XLA options; by
        default the platform's set from `jaxsched.runtime.engine._xla` (latency-hiding
        scheduler on, combiners off, on GPU).
      engine: ``"auto"`` (the host engine on multi-process CPU meshes with a spare local
        device per process, else ``"xla"``), ``"xla"``, ``"host"``, another registered
        name (``jaxsched.runtime.engine.engine_names()``) or an `Engine`.
      collective: a `Collective` that the strategy sends its
        buckets through; ``compression=`` is the same for compressors.
      replan: ``None`` (plan once), ``"auto"`` or a `Replan`: measure
        the network while training and switch to a new bucket plan when it drifted
        (`jaxsched.replan`; ``sched.replan(network=...)`` switches on demand,
        ``sched.replans`` lists the switches). Plans with ``buckets="auto"`` unless
        ``buckets`` is given.
      options: the strategy's own options (passed to its constructor) and, with
        ``buckets="auto"``, the planning options above.

    Returns:
      A `Scheduled` step (with ``train_step`` given), or a decorator that makes one.

    The step is traced once per abstract batch signature (structure, shapes, dtypes,
    shardings): a smaller last batch gets its own program.

    Example:
        >>> import jax, optax, jaxsched
        >>> from jaxsched.demo import steps
        >>> from jaxsched.zoo import models
        >>> params, apply_fn = models.pure(models.build("mlp", (4,), 2, hidden=(3,)))
        >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        >>> tx = optax.sgd(0.1)
        >>> sched = jaxsched.schedule(steps.make_step(apply_fn, tx, mesh), strategy="wfbp")
        >>> batch = steps.shard_batch((jax.numpy.ones((2, 4)), jax.numpy.zeros(2, "int32")), mesh)
        >>> state, aux = sched(sched.init(params, tx.init(params)), batch)
        >>> @jaxsched.schedule(strategy="dear")  # as a decorator
        ... def train_step(params, opt_state, batch):
        ...     return params, opt_state, None
        >>> type(train_step).__name__, train_step.strategy.name
        ('Scheduled', 'dear')
    """

    def wrap(step: Callable) -> Scheduled:
        return Scheduled(
            step,
            strategy,
            buckets,
            compiler_options,
            engine=engine,
            collective=collective,
            compression=compression,
            replan=replan,
            **options,
        )

    return wrap if train_step is None else wrap(train_step)
