"""The `Replanner`: the monitoring, agreement and switching of one scheduled step.

Example:
    >>> plan_key([["b", "a"], ["c"]]) == plan_key([["c"], ["a", "b"]])
    True
"""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from jaxsched._errors import JaxschedRuntimeError, JaxschedTypeError, JaxschedValueError
from jaxsched.pipeline._program import Program
from jaxsched.pipeline.replan._agreement import KeyValueStore, agree, slowest
from jaxsched.pipeline.replan._estimate import (
    Samples,
    bucket_groups,
    drift_between,
    fit_window,
    measured_network,
    merge_samples,
    scaled_network,
    update_window,
    window_ratio,
    without_engine_costs,
)
from jaxsched.pipeline.replan._monitor import probe, probe_programs, stage_samples, stage_threshold
from jaxsched.pipeline.replan._options import Decision, Replan, SwitchRecord
from jaxsched.plan._planned_step import PlannedStep
from jaxsched.runtime.engine._base import StageTimer
from jaxsched.sim._costmodel import CollectiveCost, LayerProfile, NetworkProfile

__all__ = ["plan_key", "program_buckets", "refuse_per_bucket_state", "Replanner", "resolved_key"]


def plan_key(buckets: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """A plan (lists of parameter paths) in one canonical order, to compare and cache by.

    >>> plan_key([["b", "a"], ["c"]]) == plan_key([["c"], ["a", "b"]])
    True
    """
    return tuple(sorted(tuple(sorted(b)) for b in buckets if b))


def program_buckets(program: Program) -> list[list[str]]:
    """The buckets a program runs, as lists of parameter paths (buckets without parameters,
    a loss summed with the gradients, are rebuilt by any plan and left out)."""
    planned = program.planned
    return [[planned.paths[i] for i in b.params] for b in planned.buckets if b.params]


def resolved_key(planned: PlannedStep, buckets: Sequence[Sequence[str]]) -> tuple:
    """The key of the buckets an explicit plan ``buckets`` becomes for ``planned`` (a group
    holding several dtypes is split, one collective per dtype)."""
    from jaxsched.core._bucketing import plan_buckets as resolve

    made = resolve(planned.analysis, planned.paths, [list(b) for b in buckets])
    return plan_key([[planned.paths[i] for i in b.params] for b in made if b.params])


def _digest(key: tuple) -> str:
    return hashlib.sha1(repr(key).encode()).hexdigest()[:12]


class Replanner:
    """The monitoring and switching of one `Scheduled` (held by it
    as ``sched._replanner``; users see ``sched.replan(...)`` and ``sched.replans``).

    It needs three things from its schedule: ``run(state, batch)`` under the current plan,
    the program that ran last (``program()``), and ``use(buckets)``, which makes the next
    call run the plan ``buckets`` (one program cache per plan) and says whether that plan
    was compiled before. Everything else is its own.
    """

    def __init__(self, options: Replan, tag: str):
        self.options = options
        self.tag = tag  # names this schedule's agreement messages
        self.steps = 0  # steps run
        self.records: list[SwitchRecord] = []
        self.decisions: list[Decision] = []
        self.window: Samples = {}
        self.store: KeyValueStore | None = None  # set on first use
        self._round = 0
        self._stages = False  # whether the engine's stages are timed (`Engine.stage_timer`)
        self._stage_window: Samples = {}  # stage timings since the last decision
        self._reference: Samples | None = None  # the stage timings the current basis stands for
        self._prefix: str | None = None  # this schedule's messages in the store
        self._pending: tuple[tuple, SwitchRecord] | None = None
        self._basis: NetworkProfile | None = None  # the network the current plan assumes
        self._layers: tuple[LayerProfile, list[list[int]]] | None = None
        self._probes: dict[str, Callable[[jax.Array], jax.Array]] | None = None
        self._timing: SwitchRecord | None = None
        self._last_gain: float | None = None

    # -- what the schedule calls -------------------------------------------------------------
    def step(
        self,
        state: Any,
        batch: Any,
        run: Callable[[Any, Any], Any],
        program: Callable[[], Program | None],
        use: Callable[[tuple[tuple[str, ...], ...]], bool],
    ) -> Any:
        """One step: switch first if a switch is pending, run, then measure and decide."""
        if self._pending is not None:
            buckets, record = self._pending
            self._pending = None
            reused = use(buckets)
            self._timing = record._replace(step=self.steps, reused=reused)
        start = time.perf_counter()
        out = run(state, batch)
        current = program()
        if current is None:  # `run` builds or reuses a program: never the case
            raise JaxschedRuntimeError("the replanner ran a step but its schedule has no program")
        if self.steps == 0:
            refuse_per_bucket_state(current)
            self._stages = self._use_stages(current)
        if self._timing is not None:
            jax.block_until_ready(out)
            self.records.append(self._timing._replace(first_step_s=time.perf_counter() - start))
            self._timing = None
        self.steps += 1
        if self._stages:
            self._collect_stages(current)
        if self.steps % self.options.every == 0:
            jax.block_until_ready(out)  # probe an idle network, one multi-device call in flight
            self.measure_and_decide(current)
        return out

    def _use_stages(self, program: Program) -> bool:
        staged = self._timer(program) is not None
        if self.options.monitor == "stages" and not staged:
            raise JaxschedValueError(
                "Replan(monitor='stages') times the host engine's collective stages; "
                f"this step runs on the {program.engine.name!r} engine: use "
                "monitor='probe' (or 'auto')"
            )
        return staged and self.options.monitor in ("auto", "stages")

    @staticmethod
    def _timer(program: Program) -> StageTimer | None:
        return program.engine.stage_timer(program.core)

    def _collect_stages(self, program: Program) -> None:
        """Keep the stage timings of the step that ran; time the next one if it is among the
        ``repeats`` steps before a decision point (timing costs a thread per stage)."""
        timer = self._timer(program)
        if timer is None:
            return
        for timings in timer.take_timings():
            self._stage_window = merge_samples(
                self._stage_window, stage_samples(timer.stages, timings, stage_threshold(timer.stages))
            )
        left = self.options.every - self.steps % self.options.every
        timer.time_calls(left <= self.options.repeats)

    def request(self, program: Program, network: NetworkProfile | str | None = None) -> SwitchRecord | None:
        """Plan now for ``network`` (a `NetworkProfile` or preset name; None: the
        measured one, probing now if nothing was measured yet); the switch happens at the
        next step boundary. Returns the pending switch, or None when the plan would not
        change. Every process must call it at the same step, as it calls the step."""
        target: NetworkProfile | str
        if network is None:
            basis = self._basis_for(program)
            # the same branch on every process: what it decides by (decisions taken, not
            # what this process happened to measure) is the same everywhere
            if self._stages and self.decisions:
                ratios = window_ratio(self._reference or {}, self.window)
                costs = self._agreed(program, {n: CollectiveCost(0.0, r) for n, r in ratios.items()}, "request")
                target = scaled_network(basis, {n: c.beta_s_per_byte for n, c in costs.items()})
            else:  # nothing measured the way the plan's network was: probe now
                probed = update_window({}, self._probe(program), self.options.window, self.options.drift)
                target = measured_network(basis, self._agreed(program, fit_window(probed), "request"))
            label = "measured"
        elif isinstance(network, str):
            target, label = network, network
        elif isinstance(network, NetworkProfile):
            target, label = network, str(network.meta.get("preset", "given"))
        else:
            raise JaxschedTypeError(
                f"sched.replan(network=...) takes a jaxsched.sim._costmodel.NetworkProfile "
                f"or a preset name, got {type(network).__name__}"
            )
        return self._consider(program, target, label, "requested", drift=0.0, min_gain=None)

    @property
    def pending(self) -> SwitchRecord | None:
        return None if self._pending is None else self._pending[1]

    # -- measuring and deciding --------------------------------------------------------------
    def measure_and_decide(self, program: Program) -> SwitchRecord | None:
        start = time.perf_counter()
        basis = self._basis_for(program)
        if self._stages:  # compared with themselves: the first measurement is the reference
            # Every process takes part in the agreement below whatever it measured (nothing,
            # right after a switch or when no stage was resolved): skipping it on one process
            # only would put the processes out of step.
            new, self._stage_window = self._stage_window, {}
            ratios: dict[str, float] = {}
            if new:
                self.window = update_window(
                    self.window, new, self.options.window, self.options.drift, statistics.median
                )
                ratios = window_ratio(self._reference or {}, self.window)
                if not ratios:  # the first measurement, or no size in common with the reference
                    self._reference, ratios = self.window, {n: 1.0 for n in self.window}
            # agreed like α-β: the largest ratio of any process (carried as β)
            costs = self._agreed(program, {n: CollectiveCost(0.0, r) for n, r in ratios.items()}, "measured")
            measured = scaled_network(basis, {n: c.beta_s_per_byte for n, c in costs.items()})
        else:
            self.window = update_window(self.window, self._probe(program), self.options.window, self.options.drift)
            costs = self._agreed(program, fit_window(self.window), "measured")
            measured = measured_network(basis, costs)
        names = [n for n in program.strategy.cost.collectives() if n in costs]
        drift = drift_between(basis, measured, names, _mean_bucket_bytes(program))
        record, gain = None, None
        if drift > self.options.drift:
            record = self._consider(program, measured, "measured", "measured", drift, self.options.min_gain)
            gain = self._last_gain
            if self._stages:  # the timings the new basis stands for
                self._reference = self.window
        self.decisions.append(Decision(self.steps, drift, gain, record is not None, time.perf_counter() - start))
        return record

    def _consider(
        self,
        program: Program,
        network: NetworkProfile | str,
        label: str,
        reason: str,
        drift: float,
        min_gain: float | None,
    ) -> SwitchRecord | None:
        from jaxsched.plan._from_step import group_paths, step_network_profile
        from jaxsched.plan import plan_buckets
        from jaxsched.sim import simulate

        planned = program.planned
        profile, members = self._layer_profile(program)
        engine_costs = None if planned.engine is None else planned.engine.costs(planned.mesh)
        planning = step_network_profile(planned.analysis, network, engine_costs)
        pattern = program.strategy.cost
        groups = plan_buckets(
            profile,
            planning,
            planned.plan_options.get("planner", "optimal"),
            strategy=pattern,
            compression=planned.compression,
        )
        new_paths = group_paths(groups, members, planned.paths)
        old_paths = program_buckets(program)
        new, old = resolved_key(planned, new_paths), plan_key(old_paths)

        def predict(g: list[list[int]]) -> float:
            return float(
                simulate(
                    profile, planning, pattern, g, iterations=6, compression=planned.compression, keep_spans=False
                ).iteration_s
            )

        before = predict(bucket_groups(old_paths, members, planned.paths))
        after = predict(groups)
        gain = 1.0 - after / before if before > 0 else 0.0
        self._last_gain = 0.0 if new == old else gain
        # the plan now stands for this network (switching or not): drift is measured from it
        self._basis = without_engine_costs(planning)
        self._reference = None  # stage timings: the next measurement is the new reference
        if new == old or (min_gain is not None and gain < min_gain):
            return None
        alpha_beta = {
            n: (self._basis.cost(n).alpha_s, self._basis.cost(n).beta_s_per_byte) for n in pattern.collectives()
        }
        record = SwitchRecord(
            self.steps,
            reason,
            label,
            alpha_beta,
            drift,
            tuple(map(tuple, old_paths)),
            tuple(map(tuple, new_paths)),
            before,
            after,
            gain,
        )
        self._pending = (tuple(map(tuple, new_paths)), record)
        return record

    def _agreed(self, program: Program, costs: Mapping[str, CollectiveCost], kind: str) -> dict[str, CollectiveCost]:
        """The slowest process's α-β per collective, the same on every process."""
        if jax.process_count() == 1:
            return dict(costs)
        if self.store is None:
            self.store = KeyValueStore()
        if self._prefix is None:  # two schedules of one step must not share messages
            pid = jax.process_index()
            self._prefix = (
                f"jaxsched/replan/{self.tag}/{self.store.count(f'jaxsched/replan/{self.tag}/schedules/{pid}')}"
            )
        self._round += 1
        message = {
            "step": self.steps,
            "kind": kind,
            "plan": _digest(plan_key(program_buckets(program))),
            "costs": {n: [c.alpha_s, c.beta_s_per_byte] for n, c in costs.items()},
        }
        received = agree(
            self.store,
            self._prefix,
            self._round,
            message,
            jax.process_count(),
            jax.process_index(),
            self.options.timeout_s,
        )
        return slowest([{n: tuple(v) for n, v in m["costs"].items()} for m in received])

    def _probe(self, program: Program) -> dict:
        planned = program.planned
        first = self._probes is None
        if self._probes is None:
            self._probes = probe_programs(planned.mesh, planned.axis_name, program.strategy.cost.collectives())
        return probe(
            self._probes,
            planned.mesh,
            planned.axis_name,
            planned.axis_size,
            self.options.probe_bytes,
            self.options.repeats,
            warm=first,
        )

    def _basis_for(self, program: Program) -> NetworkProfile:
        if self._basis is None:
            planned = program.planned
            if planned.network_profile is not None:
                self._basis = without_engine_costs(planned.network_profile)
            else:  # a plan the user gave: its network is the first one probed (every process
                # gets here at the same decision point: the probe is collective)
                from jaxsched.sim._costmodel import network_preset

                probed = update_window({}, self._probe(program), self.options.window, self.options.drift)
                costs = self._agreed(program, fit_window(probed), "basis")
                self._basis = measured_network(network_preset("1gbe", planned.axis_size), costs)
        return self._basis

    def _layer_profile(self, program: Program) -> tuple[LayerProfile, list[list[int]]]:
        if self._layers is None:
            from jaxsched.plan._from_step import step_layer_profile

            planned = program.planned
            measured = planned.layer_profile or planned.plan_options.get("layer_profile")
            self._layers = step_layer_profile(planned.analysis, planned.paths, measured)
        return self._layers


def refuse_per_bucket_state(program: Program) -> None:
    """Refuse a collective that carries state per bucket (error-feedback residuals, low-rank
    factors): a new plan cuts the gradients differently, and carrying that state across
    would be wrong numbers, so re-planning is refused rather than done approximately."""
    template = program.strategy.collective_template(program.planned)
    if jax.tree.leaves(template):
        raise JaxschedValueError(
            f"replan= cannot be used with {type(program.strategy.collective).__name__}: "
            "it carries state per bucket, which a new bucket plan would not match; "
            "schedule this step without replan=, or with a stateless collective"
        )


def _mean_bucket_bytes(program: Program) -> float:
    """The plan's average bucket size in bytes (what drift is judged at)."""
    from jaxsched.core._bucketing import bucket_nbytes

    planned = program.planned
    sizes = [bucket_nbytes(planned.analysis, b) for b in planned.buckets if b.params]
    return float(np.mean(sizes)) if sizes else 1.0
