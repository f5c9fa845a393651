"""Plans that follow the network as it is measured during training (``schedule(..., replan=)``).

A bucket plan is optimal for one α-β network. When the links change under a running job
(a neighbour's traffic, a degraded link), the optimum moves. With ``replan=`` the
scheduled step keeps measuring the network and switches to a new plan when it drifted:

* **measured**: every ``every`` steps is a decision point. On the host engine its own
  collective stages are timed on the ``repeats`` steps before it (no extra traffic); the
  times of the same large collectives, against those measured when the plan was made, scale
  the plan's β. Elsewhere (or with ``monitor="probe"``), once the step's outputs are ready,
  every process times a small *probe*: each collective the strategy sends (``wfbp``:
  all-reduce; ``dear``: reduce-scatter and all-gather) at two sizes, ``repeats`` times, on
  the step's own mesh, and α and β are fitted per collective. Either way the estimate is the
  median of a sliding window of the last ``window`` measurements, restarted when the newest
  leaves the window's range by more than ``drift`` (a step change is followed at once).
* **agreed**: the processes exchange their estimates through jax.distributed's key-value
  store and all take the slowest (largest α and β): every process computes the same
  decision from the same numbers, so all switch at the same step. A message that does not
  arrive within ``timeout_s``, cannot be read, or comes from another step raises
  `ReplanAgreementError` on every process that waits for it, never a hang.
* **decided**: when the measured cost of the plan's average bucket differs from the cost
  the plan assumed by more than ``drift``, the planner runs again for the measured network
  (the layer profile is the one of the first plan); the step switches only if the
  simulator predicts the new plan at least ``min_gain`` faster than the current one on
  that network.
* **switched**: at the next step boundary. Programs are cached per plan, so a network that
  alternates recompiles nothing after each plan's first use. The state is carried as it
  is: every built-in strategy's state layout is independent of the buckets (``dear``
  shards each leaf flat, not each bucket), so the new program's ``convert`` takes it
  unchanged; a collective that carries state per bucket is refused
  (`refuse_per_bucket_state`).

Example:
    >>> r = Replan(every=20, drift=0.3)
    >>> r.every, r.drift, r.min_gain, r.monitor
    (20, 0.3, 0.05, 'auto')
    >>> Replan(every=0)
    Traceback (most recent call last):
    ...
    jaxsched.JaxschedValueError: Replan(every=0): every must be an int >= 1 (steps between measurements)
"""

from __future__ import annotations
from jaxsched._errors import JaxschedError, JaxschedTypeError, JaxschedValueError

import dataclasses
import hashlib
import json
import math
import statistics
import time
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import numpy as np

from jaxsched.sim.costmodel import CollectiveCost, LayerProfile, NetworkProfile

__all__ = [
    "Decision",
    "KeyValueStore",
    "refuse_per_bucket_state",
    "Replan",
    "ReplanAgreementError",
    "Replanner",
    "SwitchRecord",
    "as_replan",
    "bucket_groups",
    "drift_between",
    "fit_window",
    "measured_network",
    "scaled_network",
    "stage_samples",
    "update_window",
    "window_ratio",
    "without_engine_costs",
]


MONITORS = ("auto", "probe", "stages")


@dataclasses.dataclass(frozen=True)
class Replan:
    """When and how a scheduled step re-plans its buckets while it trains.

    Attributes:
      every: steps between two measurements (each one a decision point).
      drift: relative change of the plan's average bucket cost (measured vs assumed) above
        which the planner runs again.
      min_gain: the simulator's predicted relative step-time gain the new plan must reach
        before the step switches to it.
      window: measurements kept in the sliding window.
      repeats: timings of each probe collective per measurement (the fastest is kept).
      probe_bytes: the two probe sizes, bytes per collective: a small one that costs about
        α, a large one that costs mostly β.
      timeout_s: how long a process waits for the others' estimates before it raises.
      monitor: where measurements come from: ``"probe"`` (probe collectives, any engine),
        ``"stages"`` (the host engine's own collective stages, timed on the ``repeats``
        steps before each decision point: no extra traffic) or ``"auto"`` (stages on the
        host engine, the probe elsewhere).
    """

    every: int = 50
    drift: float = 0.2
    min_gain: float = 0.05
    window: int = 3
    repeats: int = 3
    probe_bytes: tuple[int, int] = (1 << 12, 1 << 21)
    timeout_s: float = 120.0
    monitor: str = "auto"

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> JaxschedValueError:
            return JaxschedValueError(f"Replan({field}={getattr(self, field)!r}): {field} must be {why}")

        def is_int(x: Any) -> bool:
            return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float, np.number)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.every) or self.every < 1:
            raise bad("every", "an int >= 1 (steps between measurements)")
        if not is_num(self.drift) or self.drift <= 0:
            raise bad("drift", "a number > 0 (relative change of the network, e.g. 0.2)")
        if not is_num(self.min_gain) or not 0 <= self.min_gain < 1:
            raise bad("min_gain", "a number in [0, 1) (predicted relative gain, e.g. 0.05)")
        if not is_int(self.repeats) or self.repeats < 1:
            raise bad("repeats", "an int >= 1")
        if not is_int(self.window) or self.window < 1:
            raise bad("window", "an int >= 1 (measurements kept)")
        sizes = tuple(self.probe_bytes) if isinstance(self.probe_bytes, (tuple, list)) else ()
        if len(sizes) != 2 or not all(is_int(s) and s >= 64 for s in sizes) or sizes[0] >= sizes[1]:
            raise bad("probe_bytes", "two increasing sizes in bytes, each >= 64")
        object.__setattr__(self, "probe_bytes", (int(sizes[0]), int(sizes[1])))
        if not is_num(self.timeout_s) or self.timeout_s <= 0:
            raise bad("timeout_s", "a number of seconds > 0")
        if self.monitor not in MONITORS:
            raise bad("monitor", f"one of {', '.join(map(repr, MONITORS))}")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))


def as_replan(value: Any) -> Replan | None:
    """``schedule(replan=...)`` as a `Replan`: None (off), ``"auto"`` (the defaults) or
    a `Replan`.

    >>> as_replan("auto") == Replan(), as_replan(None)
    (True, None)
    """
    if value is None or isinstance(value, Replan):
        return value
    if isinstance(value, str) and value == "auto":
        return Replan()
    raise JaxschedValueError(
        f"replan={value!r} is not understood; pass None, 'auto' or jaxsched.Replan(every=..., drift=..., min_gain=...)"
    )


class SwitchRecord(NamedTuple):
    """One switch of plan (``sched.replans``).

    Attributes:
      step: the number of steps run before the new plan's first step.
      reason: ``"measured"`` (drift seen by the monitor) or ``"requested"`` (``sched.replan``).
      network: what the new plan was made for: ``"measured"`` or the preset's name.
      alpha_beta: per collective the strategy sends, the network's α-β the new plan was made
        for, measured or given (``{"all_reduce": (alpha_s, beta_s_per_byte)}``; the engine's
        fixed cost per collective, which planning adds to α, is not included).
      drift: the measured drift that triggered it (0 for a requested switch without a measurement).
      old_buckets, new_buckets: the plans, as lists of parameter paths.
      predicted_old_s, predicted_new_s: the simulator's step time of each plan on that network.
      predicted_gain: ``1 - new / old``.
      reused: whether the new plan's program was compiled before (no recompile).
      first_step_s: wall time of the new plan's first step (tracing and compiling included
        when not reused).
    """

    step: int
    reason: str
    network: str
    alpha_beta: Mapping[str, tuple[float, float]]
    drift: float
    old_buckets: tuple[tuple[str, ...], ...]
    new_buckets: tuple[tuple[str, ...], ...]
    predicted_old_s: float
    predicted_new_s: float
    predicted_gain: float
    reused: bool = False
    first_step_s: float | None = None


class Decision(NamedTuple):
    """One decision point of the monitor (``sched.replan_decisions``).

    Attributes:
      step: steps run when it was taken.
      drift: the measured drift (see `drift_between`).
      predicted_gain: the simulator's gain of the re-planned buckets (None: drift below the
        threshold, the planner did not run; 0 when it chose the current plan).
      switched: whether a switch was scheduled for the next step.
      seconds: wall time of the decision: the probe, the agreement and any planning.
    """

    step: int
    drift: float
    predicted_gain: float | None
    switched: bool
    seconds: float


class ReplanAgreementError(JaxschedError, RuntimeError):
    """The processes could not agree on a re-planning decision (a message was lost,
    unreadable, or from another step); every process that waited for it raises."""


# -- the estimate ----------------------------------------------------------------------------

Samples = Mapping[str, Mapping[int, Sequence[float]]]  # collective -> bytes -> seconds


def update_window(
    window: Samples, new: Samples, size: int, drift: float, reduce: Callable[[Sequence[float]], float] = min
) -> dict:
    """The sliding window after a measurement ``new`` (per collective and probe size, its
    timings): each size keeps the fastest timing (``reduce``) of each of the last ``size``
    measurements; a collective's window restarts from ``new`` alone when at every size it lies
    outside the window's range by more than ``drift`` (a step change, not noise, which the
    range already spans).

    >>> w = update_window({}, {"all_reduce": {8: [1.0, 1.2]}}, 3, 0.2)
    >>> update_window(w, {"all_reduce": {8: [1.1, 1.5]}}, 3, 0.2)["all_reduce"][8]
    [1.0, 1.1]
    >>> update_window(w, {"all_reduce": {8: [3.0, 3.1]}}, 3, 0.2)["all_reduce"][8]
    [3.0]
    """
    out: dict = {}
    for name, sizes in new.items():
        old = window.get(name, {})
        fastest = {nbytes: reduce(times) for nbytes, times in sizes.items() if times}
        jumped = bool(fastest) and all(
            old.get(nbytes) and (t > max(old[nbytes]) * (1 + drift) or t * (1 + drift) < min(old[nbytes]))
            for nbytes, t in fastest.items()
        )
        out[name] = {
            nbytes: ([t] if jumped else list(old.get(nbytes, [])) + [t])[-size:] for nbytes, t in fastest.items()
        }
    return out


def fit_window(window: Samples) -> dict[str, CollectiveCost]:
    """α and β per collective through the window's medians (least squares, both >= 0).

    >>> cost = fit_window({"all_reduce": {100: [2.0, 2.0], 300: [4.0]}})["all_reduce"]
    >>> round(cost.alpha_s, 6), round(cost.beta_s_per_byte, 6)
    (1.0, 0.01)
    """
    from jaxsched.plan.profiling import fit_alpha_beta

    costs = {}
    for name, sizes in window.items():
        points = sorted((nbytes, statistics.median(times)) for nbytes, times in sizes.items() if times)
        if len(points) >= 2:
            costs[name] = fit_alpha_beta(*zip(*points))[0]
    return costs


def without_engine_costs(network: NetworkProfile) -> NetworkProfile:
    """``network`` less the engine's fixed cost per collective that planning added to every
    α (`jaxsched.plan.from_step.step_network_profile`): the network itself."""
    extra = float(network.meta.get("engine_per_collective_s", 0.0) or 0.0)
    if not extra:
        return network
    meta = {k: v for k, v in network.meta.items() if k != "engine_per_collective_s"}
    return dataclasses.replace(
        network,
        meta=meta,
        collectives={
            name: CollectiveCost(max(0.0, c.alpha_s - extra), c.beta_s_per_byte)
            for name, c in network.collectives.items()
        },
    )


def measured_network(basis: NetworkProfile, costs: Mapping[str, CollectiveCost]) -> NetworkProfile:
    """``basis`` with the measured collectives' costs; collectives not measured are scaled by
    the measured ones' mean β ratio (the same links carry them).

    >>> from jaxsched.sim.costmodel import network_preset
    >>> net = measured_network(network_preset("1gbe", 2), {"all_reduce": CollectiveCost(1e-4, 1.6e-7)})
    >>> round(net.cost("all_gather").beta_s_per_byte / network_preset("1gbe", 2).cost("all_gather").beta_s_per_byte)
    20
    """
    ratios = [
        costs[n].beta_s_per_byte / basis.collectives[n].beta_s_per_byte
        for n in costs
        if n in basis.collectives and basis.collectives[n].beta_s_per_byte > 0
    ]
    scale = float(np.mean(ratios)) if ratios else 1.0
    collectives = {
        name: costs.get(name, CollectiveCost(c.alpha_s, c.beta_s_per_byte * scale))
        for name, c in basis.collectives.items()
    }
    collectives.update({n: c for n, c in costs.items() if n not in collectives})
    meta = {k: v for k, v in basis.meta.items() if k not in ("preset", "fit_max_relative_error")}
    return dataclasses.replace(
        basis, collectives=collectives, meta={**meta, "source": "jaxsched.pipeline.replan (measured while training)"}
    )


def drift_between(
    assumed: NetworkProfile, measured: NetworkProfile, collectives: Sequence[str], nbytes: float
) -> float:
    """The largest relative difference, over ``collectives``, of the time one bucket of
    ``nbytes`` takes on ``measured`` against ``assumed``.

    >>> from jaxsched.sim.costmodel import network_preset
    >>> a, b = network_preset("1gbe", 2), network_preset("10gbe", 2)
    >>> round(drift_between(a, b, ["all_reduce"], 1e6), 2)
    0.9
    """
    worst = 0.0
    for name in collectives:
        before, now = assumed.time(name, nbytes), measured.time(name, nbytes)
        if before > 0:
            worst = max(worst, abs(now / before - 1.0))
    return worst


def bucket_groups(
    buckets: Sequence[Sequence[str]], members: Sequence[Sequence[int]], paths: Sequence[str]
) -> list[list[int]]:
    """A plan of parameter paths as the simulator's groups of layers (forward order): each
    layer goes to the bucket holding most of its parameters (a plan made by the planners
    never splits a layer).

    >>> bucket_groups([["b/w", "b/b"], ["a/w"]], [[2], [0, 1]], ["b/b", "b/w", "a/w"])
    [[0], [1]]
    """
    where = {p: k for k, bucket in enumerate(buckets) for p in bucket}
    owner = []
    for layer in members:
        votes = [where[paths[i]] for i in layer if paths[i] in where]
        owner.append(max(set(votes), key=votes.count) if votes else None)
    # contiguous runs of layers of one bucket (a bucket split by dtype or by how its
    # gradients are reduced may hold layers apart: each run is one group)
    groups: list[list[int]] = []
    last = None
    for layer, k in enumerate(owner):
        k = last if k is None else k
        if groups and k == last:
            groups[-1].append(layer)
        else:
            groups.append([layer])
        last = k
    return groups


# -- agreement -------------------------------------------------------------------------------


class KeyValueStore:
    """jax.distributed's key-value store: what the processes exchange their estimates
    through, with a timeout (a collective would hang on a lost message)."""

    def __init__(self, client: Any = None):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        if client is None:
            raise ReplanAgreementError(
                "re-planning across processes needs jax.distributed."
                "initialize() (its key-value store carries the agreement)"
            )
        self.client = client

    def set(self, key: str, value: str) -> None:
        self.client.key_value_set(key, value)

    def get(self, key: str, timeout_s: float) -> str:
        return self.client.blocking_key_value_get(key, int(timeout_s * 1000))

    def count(self, key: str) -> int:
        """1, 2, ... on successive calls with ``key`` (this process's own counter in the
        store): schedules made in the same order on every process get the same number."""
        return int(self.client.key_value_increment(key, 1))


def agree(
    store: Any, prefix: str, round_: int, message: Mapping[str, Any], processes: int, process: int, timeout_s: float
) -> list[dict]:
    """Publish this process's ``message`` for ``round_`` and read every process's (its own
    included, so a message lost on the way fails here too); each must name the same round
    and step. Raises `ReplanAgreementError` naming the process and why."""
    body = dict(message, round=round_, process=process)
    store.set(f"{prefix}/{round_}/{process}", json.dumps(body, sort_keys=True))
    received = []
    for p in range(processes):
        key = f"{prefix}/{round_}/{p}"
        try:
            raw = store.get(key, timeout_s)
        except Exception as err:  # the store's timeout or a dead coordinator
            raise ReplanAgreementError(
                f"process {process}: no re-planning message from process {p} for round {round_} "
                f"(step {message['step']}) within {timeout_s:g} s ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); a process stopped, lost its "
                "message, or is at another step, so no process switches plans"
            ) from None
        try:
            got = json.loads(raw)
            if not isinstance(got, dict) or got.get("process") != p or got.get("round") != round_:
                raise JaxschedValueError("wrong round or process")
        except ValueError:
            raise ReplanAgreementError(
                f"process {process}: the re-planning message of process {p} for round {round_} "
                f"(step {message['step']}) is unreadable: {raw[:80]!r}"
            ) from None
        if got.get("step") != message["step"] or got.get("plan") != message.get("plan"):
            raise ReplanAgreementError(
                f"process {process}: processes disagree on the re-planning point: process {p} "
                f"is at step {got.get('step')} with plan {got.get('plan')}, process {process} at "
                f"step {message['step']} with plan {message.get('plan')}; no process switches"
            )
        received.append(got)
    return received


def slowest(estimates: Sequence[Mapping[str, Sequence[float]]]) -> dict[str, CollectiveCost]:
    """Per collective, the largest α and β any process measured: a collective runs at the
    pace of its slowest member, and every process computes the same result."""
    names = sorted({n for e in estimates for n in e})
    return {
        n: CollectiveCost(max(e[n][0] for e in estimates if n in e), max(e[n][1] for e in estimates if n in e))
        for n in names
    }


# -- the host engine's stages ----------------------------------------------------------------

#: collective primitives of a communication stage, as the cost model names them
STAGE_COLLECTIVES = {
    "psum": "all_reduce",
    "psum_invariant": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "psum_scatter": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_invariant": "all_gather",
}


#: collectives smaller than this are left out of the stage monitor when larger ones exist
STAGE_MIN_BYTES = 1 << 16


def stage_bytes(stage: Any) -> int:
    """Bytes the collective of a communication stage sends (its operands)."""
    eqn = stage.eqns[-1]
    return sum(
        int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize
        for v in eqn.invars
        if hasattr(v, "aval") and hasattr(v.aval, "shape")
    )


def stage_threshold(stages: Sequence[Any]) -> int:
    """The smallest collective the stage monitor reads: `STAGE_MIN_BYTES`, or the
    largest collective's size when none is that large (a small model)."""
    sizes = [stage_bytes(s) for s in stages if s.kind == "comm" and s.eqns[-1].primitive.name in STAGE_COLLECTIVES]
    return min(STAGE_MIN_BYTES, max(sizes, default=STAGE_MIN_BYTES))


def stage_samples(
    stages: Sequence[Any], timings: Sequence[Any], min_bytes: int = STAGE_MIN_BYTES
) -> dict[str, dict[int, list[float]]]:
    """Seconds each large collective of one staged step took (``done - started`` of its
    stage, `jaxsched.runtime.engine.host.StageTiming`), per collective and bytes. Collectives
    smaller than ``min_bytes`` are left out: their time is mostly start-up and the timing
    thread's wake-up, not the network's bandwidth (a loss's pmean, packed biases)."""
    out: dict[str, dict[int, list[float]]] = {}
    for stage, timing in zip(stages, timings, strict=True):
        if stage.kind != "comm":
            continue
        name = STAGE_COLLECTIVES.get(stage.eqns[-1].primitive.name)
        nbytes = stage_bytes(stage)
        seconds = timing.done - timing.started
        if name is None or nbytes < min_bytes or seconds <= 0:  # 0: no resolution, no sample
            continue
        out.setdefault(name, {}).setdefault(nbytes, []).append(seconds)
    return out


def merge_samples(a: Samples, b: Samples) -> dict:
    out = {n: {k: list(v) for k, v in sizes.items()} for n, sizes in a.items()}
    for n, sizes in b.items():
        for k, v in sizes.items():
            out.setdefault(n, {}).setdefault(k, []).extend(v)
    return out


def window_ratio(reference: Samples, now: Samples) -> dict[str, float]:
    """Per collective, how much longer the same bucket sizes take now than in ``reference``:
    the sum of their medians now over the sum then (sizes in both windows only).

    >>> window_ratio({"all_reduce": {8: [1.0], 16: [2.0]}}, {"all_reduce": {16: [20.0, 20.0]}})
    {'all_reduce': 10.0}
    """
    ratios = {}
    for name, sizes in now.items():
        common = [n for n in sizes if sizes[n] and reference.get(name, {}).get(n)]
        before = sum(statistics.median(reference[name][n]) for n in common)
        if common and before > 0:
            ratios[name] = sum(statistics.median(sizes[n]) for n in common) / before
    return ratios


def scaled_network(basis: NetworkProfile, ratios: Mapping[str, float]) -> NetworkProfile:
    """``basis`` with each collective's β multiplied by its ratio (α kept: a stage's time of a
    large bucket says little about it); collectives without a ratio scale by their mean.

    >>> from jaxsched.sim.costmodel import network_preset
    >>> net = scaled_network(network_preset("1gbe", 2), {"all_reduce": 10.0})
    >>> round(net.cost("all_reduce").beta_s_per_byte / network_preset("1gbe", 2).cost("all_reduce").beta_s_per_byte)
    10
    """
    costs = {
        n: CollectiveCost(basis.collectives[n].alpha_s, basis.collectives[n].beta_s_per_byte * r)
        for n, r in ratios.items()
        if n in basis.collectives
    }
    return measured_network(basis, costs)


# -- the probe -------------------------------------------------------------------------------


def probe_programs(mesh: Any, axis: Any, names: Sequence[str]) -> dict[str, Callable]:
    """Jitted collectives on ``mesh`` over ``axis`` (a name or tuple of names), one per name."""
    from jax.sharding import PartitionSpec as P

    bodies = {
        "all_reduce": lambda x: jax.lax.psum(x, axis),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x[0], axis, tiled=True)[None],
        "all_gather": lambda x: jax.lax.all_gather(x[0], axis, tiled=True)[None],
    }
    return {
        n: jax.jit(jax.shard_map(bodies[n], mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))
        for n in names
        if n in bodies
    }


def probe(
    programs: Mapping[str, Callable],
    mesh: Any,
    axis: Any,
    workers: int,
    sizes: Sequence[int],
    repeats: int,
    warm: bool = True,
) -> dict[str, dict[int, list[float]]]:
    """Seconds of each probe collective at each size (full-tensor bytes), ``repeats`` each,
    after one untimed call when ``warm`` (the first time: compiles it). Every process must
    call it at the same step (they are collectives)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P(axis))
    out: dict[str, dict[int, list[float]]] = {}
    for name, program in programs.items():
        out[name] = {}
        for size in sizes:
            elements = max(workers, size // 4 // workers * workers)
            shape = (workers, elements // workers) if name == "all_gather" else (workers, elements)
            host = np.ones(shape, np.float32)
            x = jax.make_array_from_callback(shape, sharding, lambda index, _h=host: _h[index])
            if warm:
                jax.block_until_ready(program(x))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(program(x))
                times.append(time.perf_counter() - start)
            out[name][elements * 4] = times
    return out


# -- the replanner ---------------------------------------------------------------------------


def plan_key(buckets: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    """A plan (lists of parameter paths) in one canonical order, to compare and cache by.

    >>> plan_key([["b", "a"], ["c"]]) == plan_key([["c"], ["a", "b"]])
    True
    """
    return tuple(sorted(tuple(sorted(b)) for b in buckets if b))


def program_buckets(program: Any) -> list[list[str]]:
    """The buckets a program runs, as lists of parameter paths (buckets without parameters,
    a loss summed with the gradients, are rebuilt by any plan and left out)."""
    planned = program.planned
    return [[planned.paths[i] for i in b.params] for b in planned.buckets if b.params]


def resolved_key(planned: Any, buckets: Sequence[Sequence[str]]) -> tuple:
    """The key of the buckets an explicit plan ``buckets`` becomes for ``planned`` (a group
    holding several dtypes is split, one collective per dtype)."""
    from jaxsched.core.bucketing import plan_buckets as resolve

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
        self.window: dict = {}
        self.store: Any = None  # the key-value store (set on first use)
        self._round = 0
        self._stages = False  # whether the host engine's stages are timed
        self._stage_window: dict = {}  # stage timings since the last decision
        self._reference: dict | None = None  # the stage timings the current basis stands for
        self._prefix: str | None = None  # this schedule's messages in the store
        self._pending: tuple[tuple, SwitchRecord] | None = None
        self._basis: NetworkProfile | None = None  # the network the current plan assumes
        self._layers: tuple[LayerProfile, list[list[int]]] | None = None
        self._probes: dict[str, Callable] | None = None
        self._timing: SwitchRecord | None = None
        self._last_gain: float | None = None

    # -- what the schedule calls -------------------------------------------------------------
    def step(self, state: Any, batch: Any, run: Callable, program: Callable, use: Callable) -> Any:
        """One step: switch first if a switch is pending, run, then measure and decide."""
        if self._pending is not None:
            buckets, record = self._pending
            self._pending = None
            reused = use(buckets)
            self._timing = record._replace(step=self.steps, reused=reused)
        start = time.perf_counter()
        out = run(state, batch)
        current = program()
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

    def _use_stages(self, program: Any) -> bool:
        staged = hasattr(program.core, "record_timings") and hasattr(program.core, "stages")
        if self.options.monitor == "stages" and not staged:
            raise JaxschedValueError(
                "Replan(monitor='stages') times the host engine's collective stages; "
                f"this step runs on the {program.engine.name!r} engine: use "
                "monitor='probe' (or 'auto')"
            )
        return staged and self.options.monitor in ("auto", "stages")

    def _collect_stages(self, program: Any) -> None:
        """Keep the stage timings of the step that ran; time the next one if it is among the
        ``repeats`` steps before a decision point (timing costs a thread per stage)."""
        core = program.core
        while core.timings:
            self._stage_window = merge_samples(
                self._stage_window, stage_samples(core.stages, core.timings.pop(0), stage_threshold(core.stages))
            )
        left = self.options.every - self.steps % self.options.every
        core.record_timings = left <= self.options.repeats

    def request(self, program: Any, network: Any = None) -> SwitchRecord | None:
        """Plan now for ``network`` (a `NetworkProfile` or preset name; None: the
        measured one, probing now if nothing was measured yet); the switch happens at the
        next step boundary. Returns the pending switch, or None when the plan would not
        change. Every process must call it at the same step, as it calls the step."""
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
                f"sched.replan(network=...) takes a jaxsched.sim.costmodel.NetworkProfile "
                f"or a preset name, got {type(network).__name__}"
            )
        return self._consider(program, target, label, "requested", drift=0.0, min_gain=None)

    @property
    def pending(self) -> SwitchRecord | None:
        return None if self._pending is None else self._pending[1]

    # -- measuring and deciding --------------------------------------------------------------
    def measure_and_decide(self, program: Any) -> SwitchRecord | None:
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
        self, program: Any, network: Any, label: str, reason: str, drift: float, min_gain: float | None
    ) -> SwitchRecord | None:
        from jaxsched.plan.from_step import group_paths, step_network_profile
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

    def _agreed(self, program: Any, costs: Mapping[str, CollectiveCost], kind: str) -> dict[str, CollectiveCost]:
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

    def _probe(self, program: Any) -> dict:
        planned = program.planned
        first = self._probes is None
        if first:
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

    def _basis_for(self, program: Any) -> NetworkProfile:
        if self._basis is None:
            planned = program.planned
            if planned.network_profile is not None:
                self._basis = without_engine_costs(planned.network_profile)
            else:  # a plan the user gave: its network is the first one probed (every process
                # gets here at the same decision point: the probe is collective)
                from jaxsched.sim.costmodel import network_preset

                probed = update_window({}, self._probe(program), self.options.window, self.options.drift)
                costs = self._agreed(program, fit_window(probed), "basis")
                self._basis = measured_network(network_preset("1gbe", planned.axis_size), costs)
        return self._basis

    def _layer_profile(self, program: Any) -> tuple[LayerProfile, list[list[int]]]:
        if self._layers is None:
            from jaxsched.plan.from_step import step_layer_profile

            planned = program.planned
            measured = planned.layer_profile or planned.plan_options.get("layer_profile")
            self._layers = step_layer_profile(planned.analysis, planned.paths, measured)
        return self._layers


def refuse_per_bucket_state(program: Any) -> None:
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


def _mean_bucket_bytes(program: Any) -> float:
    """The plan's average bucket size in bytes (what drift is judged at)."""
    from jaxsched.core.bucketing import bucket_nbytes

    planned = program.planned
    sizes = [bucket_nbytes(planned.analysis, b) for b in planned.buckets if b.params]
    return float(np.mean(sizes)) if sizes else 1.0
