"""Event-driven simulation of steady-state data-parallel iterations (Shi's DAG model).

Why: before buying GPUs or choosing a strategy, a user wants to know where a step's time
goes. The base model has one compute stream and one communication stream. Compute runs
tasks in program order (forward layers ``0..L-1``, backward ``L-1..0``, optimizer
update); a layer's gradient is ready when its backward ends; collectives run one at a
time, in the order they are issued (or by priority for ByteScheduler). Several
iterations are simulated so overlap across iterations (DeAR, ByteScheduler, approximated
parameters) is counted; the reported iteration time is the mean period over the second
half of them.

Buckets are contiguous groups of layer indices in **forward order** (``[[0, 1], [2]]``);
a bucket's collective is issued when its lowest-index layer's backward ends.

Durations may be ``float`` or `fractions.Fraction` (exact arithmetic, used by the
tests that compare against closed forms).

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
    >>> net = network_preset("10gbe", 8)
    >>> r = simulate(layers, net, "wfbp")
    >>> r.bound_s <= r.iteration_s <= simulate(layers, net, "allreduce").iteration_s
    True
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import warnings
from typing import Any, Sequence

from jaxsched._errors import JaxschedError, JaxschedRuntimeError
from jaxsched.sim._costmodel import CommPattern, Layer, LayerProfile, NetworkProfile, comm_pattern, comm_pattern_names

__all__ = [
    "BYTESCHEDULER",
    "check_buckets",
    "comm_slowdown_from_ceiling",
    "Compression",
    "COMPRESSIONS",
    "default_buckets",
    "gradient_comm_time",
    "HostCosts",
    "lower_bound",
    "MB",
    "SimResult",
    "simulate",
    "SimulationError",
    "Span",
    "SIMULATED",
    "worker_loads_seconds",
]

#: The priority scheduler the simulator models itself (it is not a bucket pattern).
BYTESCHEDULER = "bytescheduler"


class _SimulatedNames(Sequence):
    """The names `simulate` accepts, read live from the one table of cost patterns
    (`jaxsched.sim._costmodel`): every strategy of ``jaxsched.STRATEGIES`` that the per-step
    simulator models (a registered strategy adds its pattern there), the schedules it models
    as baselines (``mgwfbp``, ``fsdp``) and ByteScheduler. ``diloco`` is simulated by
    `jaxsched.sim._diloco`, and ``auto`` is whichever exact strategy it picks."""

    def _names(self) -> tuple[str, ...]:
        modelled = [n for n in comm_pattern_names() if n not in _NOT_PER_STEP and not comm_pattern(n).periodic_sync]
        return tuple(modelled) + (BYTESCHEDULER,)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


#: strategies with a pattern that the per-step simulator does not run as such
_NOT_PER_STEP = frozenset({"auto"})  # it registers wfbp's pattern but runs whichever it picks
SIMULATED = _SimulatedNames()


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":  # the one strategy table is jaxsched.STRATEGIES
        warnings.warn(
            "jaxsched.sim.STRATEGIES is deprecated: the strategies are jaxsched.STRATEGIES, and the "
            "names simulate accepts are jaxsched.sim.SIMULATED (it goes in jaxsched 0.2.0)",
            DeprecationWarning,
            stacklevel=2,
        )
        return SIMULATED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


COMPRESSIONS = ("topk", "gtopk")
MB = 1 << 20


class SimulationError(JaxschedError, ValueError):
    """Bad simulator input (strategy, buckets, options); the message says what to change.

    A `ValueError` too, so that callers that validate input with ``except ValueError`` catch it.

    Example:
      >>> import jaxsched
      >>> from jaxsched import sim
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer("l0", 10**6, 4 * 10**6, 1e-3, 2e-3)])
      >>> try:
      ...     jaxsched.simulate(layers, jaxsched.network_preset("10gbe", 8), "wfbp", iterations=2)
      ... except sim.SimulationError as err:
      ...     print(err)
      iterations=2 must be >= 3 (one warm-up, two to measure)
    """


@dataclasses.dataclass(frozen=True)
class Compression:
    """Sparsify each bucket to a ``density`` fraction of its elements before sending.

    ``topk``: every worker all-gathers its k values and k int32 indices (Aji & Heafield,
    2017; Lin et al., 2018). ``gtopk``: a tree of ``ceil(log2 P)`` pairwise top-k merges,
    then the result is broadcast back down the tree (Shi et al., ICDCS 2019), modelled as
    ``2 * ceil(log2 P)`` point-to-point messages of 8k bytes. Selection costs
    ``selection_s_per_byte`` seconds of compute per gradient byte.

    Attributes:
      kind: ``"topk"`` or ``"gtopk"`` (`COMPRESSIONS`).
      density: the fraction of elements sent, in (0, 1].
      selection_s_per_byte: compute seconds to select them, per gradient byte.

    Raises:
      SimulationError: an unknown kind or a density outside (0, 1].

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> from jaxsched import sim
      >>> dense = jaxsched.simulate(layers, net, "wfbp").iteration_s
      >>> sparse = jaxsched.simulate(layers, net, "wfbp", compression=sim.Compression("topk", 0.01)).iteration_s
      >>> sparse < dense
      True
    """

    kind: str
    density: float
    selection_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in COMPRESSIONS:
            raise SimulationError(f"compression kind {self.kind!r} is unknown; use one of {', '.join(COMPRESSIONS)}")
        if not 0 < self.density <= 1:
            raise SimulationError(f"compression density={self.density} must be in (0, 1]")


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """What the ``host`` engine (jaxsched.runtime.engine._host) adds to a step on CPU clusters.

    Why: that engine dispatches every stage from the Python thread that shares the host's
    core with compute, copies each collective's operands to a spare local device and back,
    and gloo and the kernel's network work take CPU from compute while bytes move. Without
    these the simulator predicted 14-34% too fast. All default to "nothing", so
    a simulation without them is unchanged.

    Attributes:
      stage_s: seconds of Python per collective (a communication stage, the compute
        stage after it, two device copies dispatched): charged on the compute stream just
        before the collective is issued (`jaxsched.runtime.engine._host.measure_stage_overhead`).
      copy_s_per_byte: copying one byte between the compute device and the spare one;
        every collective's bytes are copied there before it (compute stream, before it is
        issued) and back after it (compute stream, before what reads the result).
      comm_slowdown: compute runs this many times slower while a collective is moving
        bytes (>= 1); `comm_slowdown_from_ceiling` derives it from a measured ceiling.

    Raises:
      SimulationError: a negative cost, or ``comm_slowdown`` below 1.

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> from jaxsched import sim
      >>> plain = jaxsched.simulate(layers, net, "wfbp").iteration_s
      >>> hosted = jaxsched.simulate(layers, net, "wfbp", host=sim.HostCosts(stage_s=1e-3)).iteration_s
      >>> round(hosted - plain, 6)  # comm-bound: 1 ms of the 4 stages of 1 ms shows
      0.001
    """

    stage_s: float = 0.0
    copy_s_per_byte: float = 0.0
    comm_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.stage_s < 0 or self.copy_s_per_byte < 0:
            raise SimulationError(
                f"HostCosts stage_s={self.stage_s}, copy_s_per_byte={self.copy_s_per_byte} must be >= 0"
            )
        if not self.comm_slowdown >= 1:
            raise SimulationError(
                f"HostCosts comm_slowdown={self.comm_slowdown} must be >= 1 (compute is never faster while bytes move)"
            )


def comm_slowdown_from_ceiling(compute_s: float, comm_s: float, ceiling_s: float, limit: float = 100.0) -> float:
    """The compute slow-down while bytes move that explains a measured ceiling.

    The ceiling is compute (``compute_s`` alone) and one collective (``comm_s`` alone)
    started together. If compute runs ``s`` times slower while the collective runs and the
    collective is the longer, it has done ``comm_s / s`` of its work when the collective
    ends, so ``ceiling = comm_s + compute_s - comm_s / s``; symmetrically when compute is
    the longer. Solved for ``s``; 1 when the ceiling is at the bound ``max(compute, comm)``,
    ``limit`` when nothing overlapped (ceiling >= compute + comm). With compute = comm it
    is ``1 / (2 - ceiling / bound)``.

    Args:
      compute_s: the compute alone, seconds.
      comm_s: the collective alone, seconds.
      ceiling_s: both started together, seconds.
      limit: the value returned when nothing overlapped.

    Returns:
      The slow-down ``s`` (1 to ``limit``), for `HostCosts` ``comm_slowdown``.

    Raises:
      SimulationError: a time that is not positive.

    Example:
        >>> from jaxsched import sim
        >>> round(sim.comm_slowdown_from_ceiling(0.3, 0.3, 0.33), 4)   # ceiling 1.1x the bound
        1.1111
    """
    if min(compute_s, comm_s, ceiling_s) <= 0:
        raise SimulationError(f"compute_s={compute_s}, comm_s={comm_s}, ceiling_s={ceiling_s} must all be > 0")
    if ceiling_s <= max(compute_s, comm_s):
        return 1.0
    overlapped = compute_s + comm_s - ceiling_s  # compute work done while the collective ran
    if overlapped <= 0:
        return limit
    # the window is the collective (compute outlasted it): compute did comm_s / s of work
    return float(min(limit, max(1.0, comm_s / overlapped)))


@dataclasses.dataclass(frozen=True)
class Span:
    """One task as executed: which stream, what, which iteration, when.

    Attributes:
      stream: ``"compute"`` or ``"comm"``.
      name: the task, e.g. ``"bwd l3"``.
      kind: ``forward``, ``backward``, ``update``, ``compress``, ``all_reduce``,
        ``reduce_scatter``, ...
      iteration: the simulated iteration it belongs to.
      start: its start, seconds.
      end: its end, seconds.

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> jaxsched.simulate(layers, net, "wfbp").spans[0]
      Span(stream='compute', name='fwd l0', kind='forward', iteration=0, start=0, end=0.001)
    """

    stream: str  # "compute" or "comm"
    name: str
    kind: str  # forward, backward, update, compress, all_reduce, reduce_scatter, ...
    iteration: int
    start: float
    end: float


@dataclasses.dataclass
class SimResult:
    """What one strategy costs per steady-state iteration, and why.

    Attributes:
      strategy: the strategy simulated (a name or a `jaxsched.sim._costmodel.CommPattern`).
      buckets: the buckets, layer indices in forward order.
      iteration_s: the steady iteration time: the mean period over the second half of
        the simulated iterations.
      compute_busy_s: compute per iteration.
      comm_busy_s: communication per iteration.
      compute_idle_s: the compute stream's idle time per iteration (what overlap could save).
      comm_idle_s: the communication stream's idle time per iteration.
      bound_s: `lower_bound`: no strategy's iteration is shorter.
      compute_min_s: the bound's compute part.
      comm_min_s: the bound's communication part.
      gaps: the compute stream's idle intervals in one steady iteration.
      spans: every task as executed (`Span`; empty with ``keep_spans=False``).
      options: the simulation's options.

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> r = jaxsched.simulate(layers, net, "wfbp")
      >>> r.bound_s <= r.iteration_s, r.buckets
      (True, [[0], [1], [2], [3]])
    """

    strategy: str | CommPattern
    buckets: list[list[int]]
    iteration_s: float
    compute_busy_s: float
    comm_busy_s: float
    compute_idle_s: float
    comm_idle_s: float
    bound_s: float
    compute_min_s: float
    comm_min_s: float
    gaps: list[tuple[float, float]]  # compute-stream idle intervals in one steady iteration
    spans: list[Span]
    options: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        """JSON-friendly numbers (no spans), for reports and ``jaxsched simulate --json``.

        Returns:
          A dict of plain floats and lists.

        Example:
          >>> import jaxsched
          >>> layers = jaxsched.LayerProfile([jaxsched.Layer("l0", 10**6, 4 * 10**6, 1e-3, 2e-3)])
          >>> s = jaxsched.simulate(layers, jaxsched.network_preset("10gbe", 8), "wfbp").summary()
          >>> sorted(s)[:4]
          ['bound_s', 'buckets', 'comm_busy_s', 'comm_idle_s']
        """
        return {
            "iteration_s": float(self.iteration_s),
            "buckets": self.buckets,
            "compute_busy_s": float(self.compute_busy_s),
            "comm_busy_s": float(self.comm_busy_s),
            "compute_idle_s": float(self.compute_idle_s),
            "comm_idle_s": float(self.comm_idle_s),
            "bound_s": float(self.bound_s),
            "options": self.options,
            "gaps": [[float(a), float(b)] for a, b in self.gaps],
        }


def check_buckets(buckets: Sequence[Sequence[int]], num_layers: int) -> list[list[int]]:
    """Validate that ``buckets`` is a partition of ``range(num_layers)`` into contiguous,
    ascending groups listed in forward order; returns it as lists.

    Args:
      buckets: groups of layer indices, forward order.
      num_layers: how many layers the profile has.

    Returns:
      ``buckets`` as a list of lists.

    Raises:
      SimulationError: not such a partition.

    Example:
      >>> from jaxsched import sim
      >>> sim.check_buckets(((0, 1), (2,)), 3)
      [[0, 1], [2]]
    """
    flat = [i for bucket in buckets for i in bucket]
    if flat != list(range(num_layers)) or any(len(b) == 0 for b in buckets):
        raise SimulationError(
            f"buckets {list(map(list, buckets))[:6]}... must split layers 0..{num_layers - 1} "
            f"into non-empty contiguous groups in forward order, e.g. [[0, 1], [2, 3]]"
        )
    return [list(b) for b in buckets]


def default_buckets(strategy: str | CommPattern, num_layers: int) -> list[list[int]]:
    """One bucket where communication waits for all of backward (``allreduce``); one per
    layer otherwise (plan others with `jaxsched.plan`).

    Args:
      strategy: a strategy name or pattern.
      num_layers: how many layers.

    Returns:
      The buckets, layer indices in forward order.

    Example:
      >>> from jaxsched import sim
      >>> sim.default_buckets("wfbp", 3), sim.default_buckets("allreduce", 3)
      ([[0], [1], [2]], [[0, 1, 2]])
    """
    if strategy != BYTESCHEDULER and not comm_pattern(strategy).in_backward:
        return [list(range(num_layers))]
    return [[i] for i in range(num_layers)]


def gradient_comm_time(network: NetworkProfile, nbytes: float, compression: Compression | None = None) -> float:
    """Seconds to all-reduce (or sparsely aggregate) ``nbytes`` of gradient.

    Args:
      network: the α-β network.
      nbytes: the gradient's bytes.
      compression: sparsification (None: a dense all-reduce).

    Returns:
      Seconds: an all-reduce, a top-k all-gather of ``8k`` bytes per worker, or gTop-k's
      ``2 * ceil(log2 P)`` point-to-point messages.

    Example:
      >>> import jaxsched
      >>> from jaxsched import sim
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> dense = sim.gradient_comm_time(net, 4 * 10**6)
      >>> dense > sim.gradient_comm_time(net, 4 * 10**6, sim.Compression("topk", 0.01))
      True
    """
    if compression is None:
        return network.time("all_reduce", nbytes)
    if nbytes <= 0 or network.workers == 1:
        return 0
    k = math.ceil(compression.density * nbytes / 4)
    if compression.kind == "topk":
        return network.time("all_gather", network.workers * 8 * k)
    rounds = math.ceil(math.log2(network.workers))
    return 2 * rounds * network.time("ppermute", 8 * k)


def lower_bound(
    layers: LayerProfile, network: NetworkProfile, compression: Compression | None = None
) -> tuple[float, float, float]:
    """``(bound, compute_min, comm_min)``: no strategy's steady iteration beats ``bound``.

    compute_min: all forward and backward, plus the cheapest update (sharded over the
    workers, as DeAR does). comm_min: all gradient bytes in one collective, the cheaper of
    one all-reduce or reduce-scatter + all-gather (alpha >= 0 makes merging never worse).

    Args:
      layers: the model's layers.
      network: the α-β network.
      compression: sparsification (None: dense).

    Returns:
      ``(bound, compute_min, comm_min)`` in seconds, ``bound`` their maximum.

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> from jaxsched import sim
      >>> bound, compute_min, comm_min = sim.lower_bound(layers, net)
      >>> bound == max(compute_min, comm_min), round(compute_min, 6)  # 4 x (1 + 2) ms
      (True, 0.012)
    """
    total = layers.total_bytes
    compute_min = sum(l.forward_s + l.backward_s for l in layers.layers) + _share(
        sum(l.update_s for l in layers.layers), network.workers
    )
    if network.dispatch_s:  # every strategy launches the step once (kept exact when zero)
        compute_min += network.dispatch_s
    if compression is not None:
        compute_min += compression.selection_s_per_byte * total
        comm_min = gradient_comm_time(network, total, compression)
    else:
        comm_min = min(
            network.time("all_reduce", total), network.time("reduce_scatter", total) + network.time("all_gather", total)
        )
    return max(compute_min, comm_min), compute_min, comm_min


def _share(seconds: float, workers: int) -> float:
    """``seconds / workers``, keeping exact zero (and Fractions) exact."""
    return seconds / workers if seconds else seconds


@dataclasses.dataclass
class _Task:
    stream: str
    name: str
    kind: str
    iteration: int
    duration: float
    deps: list[int]
    nbytes: float = 0
    priority: tuple = ()


class _Graph:
    def __init__(self, shared_stream: bool = False) -> None:
        self.tasks: list[_Task] = []
        self.compute_order: list[int] = []
        self.shared_stream = shared_stream

    def add(self, task: _Task) -> int:
        if self.shared_stream:  # collectives run inline, in program order, on the one stream
            task.stream = "compute"
        self.tasks.append(task)
        idx = len(self.tasks) - 1
        if task.stream == "compute":
            self.compute_order.append(idx)
        return idx


def _build(
    layers: LayerProfile,
    network: NetworkProfile,
    strategy: str | CommPattern,
    buckets: list[list[int]],
    iterations: int,
    compression: Compression | None,
    partition_bytes: int,
    shared_stream: bool = False,
    host: HostCosts | None = None,
) -> _Graph:
    """The task graph of ``iterations`` iterations (see the table in docs/simulator.md).

    Everything but ByteScheduler is read off the strategy's `CommPattern`."""
    graph = _Graph(shared_stream)
    lay = layers.layers
    num = len(lay)
    workers = network.workers
    bucket_lo = {b[0]: k for k, b in enumerate(buckets)}  # lowest layer -> bucket index
    bucket_bytes = [sum(lay[i].bytes for i in b) for b in buckets]
    bucket_update = [sum(lay[i].update_s for i in b) for b in buckets]
    total_update = sum(l.update_s for l in lay)
    prev_comm: list[int] = []  # gradient collectives of the previous iteration
    prev_gather: dict[int, int] = {}  # dear: bucket -> all-gather task of previous iteration
    prev_chunks: dict[int, list[int]] = {}  # bytescheduler: layer -> chunk tasks
    priority = strategy == BYTESCHEDULER
    pattern = CommPattern(in_backward=False, packs_buckets=False) if priority else comm_pattern(strategy)
    # Rewrites that pack each bucket into one buffer pay a copy before and after it.
    copy = network.copy_s_per_byte if pattern.packs_buckets else 0

    def copy_task(label: str, k: int, n: int, deps: list[int]) -> list[int]:
        if not copy:
            return deps
        return [graph.add(_Task("compute", f"{label} b{k}", label, n, copy * bucket_bytes[k], deps))]

    host = host or HostCosts()

    def to_spare(k: int, n: int, deps: list[int]) -> list[int]:
        """The host engine's dispatch of a collective and the copy of its bytes to the spare device."""
        cost = host.stage_s + host.copy_s_per_byte * bucket_bytes[k] if host.copy_s_per_byte else host.stage_s
        if not cost:
            return deps
        return [graph.add(_Task("compute", f"to spare b{k}", "stage", n, cost, deps))]

    def from_spare(k: int, n: int, deps: list[int]) -> list[int]:
        if not host.copy_s_per_byte:
            return deps
        return [
            graph.add(_Task("compute", f"from spare b{k}", "copy", n, host.copy_s_per_byte * bucket_bytes[k], deps))
        ]

    def grad_collective(k: int, n: int, deps: list[int]) -> int:
        after = to_spare(k, n, copy_task("pack", k, n, deps))
        if compression is not None and compression.selection_s_per_byte:
            after = [
                graph.add(
                    _Task(
                        "compute",
                        f"compress b{k}",
                        "compress",
                        n,
                        compression.selection_s_per_byte * bucket_bytes[k],
                        after,
                    )
                )
            ]
        if compression is None or pattern.gradient != "all_reduce":
            kind = pattern.gradient
            return graph.add(_Task("comm", f"{kind} b{k}", kind, n, network.time(kind, bucket_bytes[k]), after))
        kind = compression.kind
        return graph.add(
            _Task("comm", f"{kind} b{k}", kind, n, gradient_comm_time(network, bucket_bytes[k], compression), after)
        )

    second_order = pattern.factors is not None and any(l.factor_bytes or l.factor_s for l in lay)
    fsdp = pattern.gathers_ahead is not None
    gathers_ahead = pattern.gathers_ahead or 0
    prev_updates: list[int] = []  # fsdp: the previous iteration's updates, before its gathers
    for n in range(iterations):
        comm: list[int] = []
        factor_comm: list[int] = []
        factor_tasks: list[tuple[int, int]] = []  # (layer, compute task) awaiting their collective
        reduce_of_bucket: dict[int, int] = {}
        chunks: dict[int, list[int]] = {}
        if network.dispatch_s:  # the step program is launched once per iteration
            graph.add(_Task("compute", "dispatch", "dispatch", n, network.dispatch_s, []))
        forward_tasks: list[int] = []
        for i in range(num):
            if priority and n > 0:
                graph.add(_Task("compute", f"update l{i}", "update", n, lay[i].update_s, prev_chunks[i]))
            deps = []
            if pattern.parameters and n > 0 and i in bucket_lo:
                deps = copy_task("unpack", bucket_lo[i], n, from_spare(bucket_lo[i], n, [prev_gather[bucket_lo[i]]]))
            if fsdp:  # the layer's shards gathered, issued gathers_ahead layers ahead
                ahead = i - gathers_ahead - 1
                after = [forward_tasks[ahead]] if ahead >= 0 else list(prev_updates)
                deps = deps + [_gather(graph, network, lay[i], f"gather fwd {lay[i].name}", n, after)]
            forward_tasks.append(
                graph.add(_Task("compute", f"fwd {lay[i].name}", "forward", n, lay[i].forward_s, deps))
            )
        backward_tasks: dict[int, int] = {}
        for i in reversed(range(num)):
            deps = []
            if fsdp:  # gathered again for backward (FSDP frees them after forward)
                ahead = i + gathers_ahead + 1
                after = [backward_tasks[ahead]] if ahead < num else [forward_tasks[-1]]
                deps = [_gather(graph, network, lay[i], f"gather bwd {lay[i].name}", n, after)]
            bwd = graph.add(_Task("compute", f"bwd {lay[i].name}", "backward", n, lay[i].backward_s, deps))
            backward_tasks[i] = bwd
            if second_order and (lay[i].factor_bytes or lay[i].factor_s):
                fac = graph.add(_Task("compute", f"factors {lay[i].name}", "factors", n, lay[i].factor_s, []))
                if pattern.factors_in_backward:
                    factor_comm.append(_factor_collective(graph, network, pattern, lay[i], n, [fac]))
                else:
                    factor_tasks.append((i, fac))
            if pattern.in_backward and i in bucket_lo:
                k = bucket_lo[i]
                reduce_of_bucket[k] = grad_collective(k, n, [bwd])
                comm.append(reduce_of_bucket[k])
            if priority:
                pieces = max(1, math.ceil(lay[i].bytes / partition_bytes))
                sizes = [partition_bytes] * (pieces - 1) + [lay[i].bytes - partition_bytes * (pieces - 1)]
                chunks[i] = [
                    graph.add(
                        _Task(
                            "comm",
                            f"all_reduce l{i}.{c}",
                            "all_reduce",
                            n,
                            network.time("all_reduce", size),
                            [bwd],
                            size,
                            (n, i, c),
                        )
                    )
                    for c, size in enumerate(sizes)
                ]
        if not pattern.in_backward and not priority:
            bwd_end = graph.compute_order[-1]
            comm = [grad_collective(k, n, [bwd_end]) for k in reversed(range(len(buckets)))]
        if second_order:
            bwd_end = graph.compute_order[-1]
            factor_comm += [_factor_collective(graph, network, pattern, lay[i], n, [bwd_end]) for i, _ in factor_tasks]
            second_order_tail = _inversions(graph, network, pattern, lay, n, factor_comm)
        else:
            second_order_tail = []

        def shard_update(k: int, n: int = n) -> Any:
            """Bucket ``k``'s update on this worker's shards, once its reduce-scatter is done."""
            task = _Task(
                "compute",
                f"update b{k} shard",
                "update",
                n,
                _share(bucket_update[k], workers),
                from_spare(k, n, [reduce_of_bucket[k]]),
            )
            return graph.add(task)

        if priority:
            pass  # each layer's update waits for its own chunks (next iteration, above)
        elif pattern.delayed_update:
            back = [t for c in prev_comm for t in from_spare(_bucket_of_task(graph, c), n, [c])]
            graph.add(_Task("compute", "update (previous step)", "update", n, total_update, back))
        elif fsdp:  # each bucket's update on its shards, once its reduce-scatter is done
            prev_updates = [shard_update(k) for k in range(len(buckets)) if k in reduce_of_bucket]
        elif pattern.parameters:
            for k in range(len(buckets)):
                upd = shard_update(k)
                kind = pattern.parameters
                prev_gather[k] = graph.add(
                    _Task("comm", f"{kind} b{k}", kind, n, network.time(kind, bucket_bytes[k]), to_spare(k, n, [upd]))
                )
        else:
            if copy or host.copy_s_per_byte:  # the update reads the unpacked gradients
                by_bucket = reduce_of_bucket or {_bucket_of_task(graph, c): c for c in comm}
                comm = [
                    t
                    for k, c in sorted(by_bucket.items(), reverse=True)
                    for t in copy_task("unpack", k, n, from_spare(k, n, [c]))
                ]
            graph.add(_Task("compute", "update", "update", n, total_update, comm + second_order_tail))
        prev_comm, prev_chunks = comm, chunks
    return graph


def _gather(graph: _Graph, network: NetworkProfile, layer: Layer, name: str, n: int, deps: list[int]) -> int:
    """FSDP's all-gather of one layer's parameters (their whole size on every worker)."""
    return graph.add(_Task("comm", name, "all_gather", n, network.time("all_gather", layer.bytes), deps, layer.bytes))


def _bucket_of_task(graph: _Graph, idx: int) -> int:
    """The bucket index in a gradient collective's name (``all_reduce b3`` -> 3)."""
    return int(graph.tasks[idx].name.rsplit(" b", 1)[1])


def _factor_collective(
    graph: _Graph, network: NetworkProfile, pattern: CommPattern, layer: Layer, n: int, deps: list[int]
) -> int:
    """One layer's factor reduction on the comm stream (K-FAC's statistics)."""
    kind = pattern.factors
    if kind is None:
        raise JaxschedRuntimeError("a factor collective for a pattern without factors")
    return graph.add(
        _Task("comm", f"{kind} factors {layer.name}", f"factor {kind}", n, network.time(kind, layer.factor_bytes), deps)
    )


def _inversions(
    graph: _Graph, network: NetworkProfile, pattern: CommPattern, lay: Sequence[Layer], n: int, factor_comm: list[int]
) -> list[int]:
    """The factor inversions (the busiest worker's share under the pattern's placement) and
    the all-gather that shares them; returns what the update must wait for."""
    from jaxsched.sim._kfac_placement import plan_placement

    dims = [d for layer in lay for d in layer.factor_dims]
    times = [t for layer in lay for t in layer.inverse_s]
    if not dims:
        return factor_comm
    owners = plan_placement(
        dims,
        network.workers,
        pattern.inverse_placement or "naive",
        [i for i, layer in enumerate(lay) for _ in layer.factor_dims],
    )
    busiest = max(worker_loads_seconds(times, owners, network.workers))
    inv = graph.add(_Task("compute", "invert factors", "inverse", n, busiest, list(factor_comm)))
    if owners is None or network.workers == 1:
        return [inv]
    nbytes = sum(d * d for d in dims) * 4
    return [graph.add(_Task("comm", "all_gather inverses", "all_gather", n, network.time("all_gather", nbytes), [inv]))]


def worker_loads_seconds(times: Sequence[float], owners: Sequence[int] | None, workers: int) -> list[float]:
    """Seconds of inversion per worker (``owners`` None: every worker inverts everything).

    The slowest worker's load is what a distributed K-FAC inversion costs the step.

    Args:
      times: each inversion's seconds.
      owners: the worker that computes each one (None: all of them, replicated).
      workers: how many workers.

    Returns:
      Seconds per worker.

    Example:
      >>> from jaxsched import sim
      >>> sim.worker_loads_seconds([1.0, 2.0, 3.0], [0, 1, 0], 2), sim.worker_loads_seconds([1.0, 2.0], None, 2)
      ([4.0, 2.0], [3.0, 3.0])
    """
    if owners is None:
        return [sum(times)] * workers
    load: list[float] = [0] * workers
    for t, w in zip(times, owners, strict=True):
        load[w] += t
    return load


def _execute(
    graph: _Graph, priority: bool, merge_cost: Any = None, credit_bytes: Any = 0, comm_slowdown: Any = 1
) -> tuple[list[Any], list[Any], list[tuple[list[int], Any, Any]]]:
    """Run the task graph; returns per-task start/end and the comm ops as executed.

    With ``comm_slowdown`` s > 1, the running compute task progresses at 1/s of its speed
    while a collective runs: its end is recomputed whenever the comm stream starts or stops."""
    tasks = graph.tasks
    count = len(tasks)
    start: list[Any] = [None] * count
    end: list[Any] = [None] * count
    waiting = [len(t.deps) for t in tasks]
    dependents: list[list[int]] = [[] for _ in range(count)]
    for idx, task in enumerate(tasks):
        for dep in task.deps:
            dependents[dep].append(idx)
    ready: list[tuple] = []  # comm tasks whose deps are done
    events: list[tuple] = []  # (time, seq, [task ids])
    comm_ops: list[tuple[list[int], Any, Any]] = []
    now: Any = 0
    seq = 0
    pointer = 0
    order = graph.compute_order
    compute_free = comm_free = True
    finished = 0
    slow = comm_slowdown != 1
    running: list[Any] = []  # [task, work left at `since`, since, rate, event seq]
    stale: set[int] = set()  # seqs of compute end events superseded by a rate change

    def rate() -> Any:
        return 1 if comm_free else 1 / comm_slowdown

    def rerate() -> None:
        nonlocal seq
        if not running:
            return
        idx, left, since, old_rate, old_seq = running
        left = left - (now - since) * old_rate
        new_rate = rate()
        if new_rate == old_rate:
            running[1], running[2] = left, now
            return
        stale.add(old_seq)
        end[idx] = now + left / new_rate
        running[:] = [idx, left, now, new_rate, seq]
        heapq.heappush(events, (end[idx], seq, [idx]))
        seq += 1

    def make_ready(idx: int) -> None:
        key = tasks[idx].priority if priority else (now,)
        heapq.heappush(ready, (key, idx))

    for idx, task in enumerate(tasks):
        if task.stream == "comm" and not task.deps:
            make_ready(idx)
    while finished < count:
        if compute_free and pointer < len(order) and waiting[order[pointer]] == 0:
            idx = order[pointer]
            pointer += 1
            start[idx], end[idx] = now, now + tasks[idx].duration
            if slow:
                end[idx] = now + tasks[idx].duration / rate()
                running[:] = [idx, tasks[idx].duration, now, rate(), seq]
            heapq.heappush(events, (end[idx], seq, [idx]))
            seq += 1
            compute_free = False
        if comm_free and ready:
            _, idx = heapq.heappop(ready)
            group, duration = [idx], tasks[idx].duration
            if merge_cost is not None:  # ByteScheduler credit: send ready chunks together
                nbytes = tasks[idx].nbytes
                while ready and nbytes + tasks[ready[0][1]].nbytes <= credit_bytes:
                    _, other = heapq.heappop(ready)
                    group.append(other)
                    nbytes += tasks[other].nbytes
                duration = merge_cost(nbytes)
            for member in group:
                start[member], end[member] = now, now + duration
            comm_ops.append((group, now, now + duration))
            heapq.heappush(events, (now + duration, seq, group))
            seq += 1
            comm_free = False
            if slow:
                rerate()
        if not events:
            raise JaxschedRuntimeError("simulator deadlock: a task waits on something never scheduled")
        while events and events[0][1] in stale:
            heapq.heappop(events)
        now = events[0][0]
        comm_was_busy = not comm_free
        while events and events[0][0] == now:
            _, event_seq, group = heapq.heappop(events)
            if event_seq in stale:
                continue
            if tasks[group[0]].stream == "compute":
                compute_free = True
                running.clear()
            else:
                comm_free = True
            for idx in group:
                finished += 1
                for child in dependents[idx]:
                    waiting[child] -= 1
                    if waiting[child] == 0 and tasks[child].stream == "comm":
                        make_ready(child)
        if slow and comm_was_busy and comm_free:
            rerate()
    return start, end, comm_ops


def simulate(
    layers: LayerProfile,
    network: NetworkProfile,
    strategy: str | CommPattern,
    buckets: Sequence[Sequence[int]] | None = None,
    *,
    iterations: int = 8,
    compression: Compression | None = None,
    partition_bytes: int = 4 * MB,
    credit_bytes: int | None = None,
    shared_stream: bool = False,
    keep_spans: bool = True,
    host: HostCosts | None = None,
) -> SimResult:
    """Simulate ``iterations`` iterations of ``strategy`` and report the steady state.

    ``buckets`` (forward order) defaults to `default_buckets`; ``bytescheduler``
    ignores them and instead splits every layer's gradient into ``partition_bytes``
    chunks, sent by priority (earlier layers first, preempting at chunk boundaries),
    merging ready chunks up to ``credit_bytes`` (default: one partition) per collective.
    ``shared_stream=True`` runs every collective inline on the compute stream, in program
    order: how XLA:CPU executes them (no overlap at all; docs/architecture.md).
    ``host`` adds the host engine's own costs (`HostCosts`: stage dispatch, copies
    to the spare device, compute slowed while bytes move).

    Args:
      layers: the model's layers (`jaxsched.LayerProfile`).
      network: the α-β network (`jaxsched.NetworkProfile`).
      strategy: a strategy name (`SIMULATED`) or a `jaxsched.sim._costmodel.CommPattern`.
      buckets: layer indices per bucket, forward order (None: `default_buckets`).
      iterations: iterations simulated (>= 3); the second half is measured.
      compression: sparsification of each bucket (`Compression`; None: dense).
      partition_bytes: ``bytescheduler``'s chunk size.
      credit_bytes: ``bytescheduler``'s merge limit per collective (None: one partition).
      shared_stream: run collectives inline on the compute stream (XLA:CPU).
      keep_spans: keep every task's `Span` (False: faster, for planners).
      host: the host engine's costs (`HostCosts`; None: none).

    Returns:
      The `SimResult` of the steady state.

    Raises:
      SimulationError: an unknown or unsimulated strategy (``auto``, DiLoCo), bad buckets,
        too few iterations, or compression where the pattern has none.

    Example:
      >>> import jaxsched
      >>> layers = jaxsched.LayerProfile([jaxsched.Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(4)])
      >>> net = jaxsched.network_preset("10gbe", 8)
      >>> wfbp = jaxsched.simulate(layers, net, "wfbp")
      >>> serial = jaxsched.simulate(layers, net, "wfbp", shared_stream=True)
      >>> wfbp.iteration_s < serial.iteration_s  # overlap is what a second stream buys
      True
    """
    if (
        not isinstance(strategy, CommPattern)
        and strategy in comm_pattern_names()
        and comm_pattern(strategy).periodic_sync
    ):
        raise SimulationError(
            f"{strategy!r} synchronizes every few steps; simulate it with "
            "jaxsched.sim._diloco.simulate_diloco (simulate --strategies "
            f"{strategy} --inner-steps H)"
        )
    if strategy == "auto":
        raise SimulationError(
            "'auto' runs one of the exact strategies, chosen per step; simulate each of them "
            "(allreduce, wfbp, dear) and compare"
        )
    if not isinstance(strategy, CommPattern) and strategy not in SIMULATED:
        raise SimulationError(f"unknown strategy {strategy!r}; choose one of {', '.join(SIMULATED)}")
    if iterations < 3:
        raise SimulationError(f"iterations={iterations} must be >= 3 (one warm-up, two to measure)")
    priority = strategy == BYTESCHEDULER
    if compression is not None and (priority or not comm_pattern(strategy).compressible):
        modelled = [n for n in comm_pattern_names() if comm_pattern(n).compressible]
        raise SimulationError(f"compression is modelled for {', '.join(modelled)}, not {strategy!r}")
    num = len(layers)
    if priority:
        buckets = [[i] for i in range(num)]
    buckets = check_buckets(buckets if buckets is not None else default_buckets(strategy, num), num)
    if partition_bytes <= 0:
        raise SimulationError(f"partition_bytes={partition_bytes} must be > 0")
    credit = partition_bytes if credit_bytes is None else credit_bytes
    graph = _build(layers, network, strategy, buckets, iterations, compression, partition_bytes, shared_stream, host)
    merge = (lambda b: network.time("all_reduce", b)) if priority else None
    start, end, comm_ops = _execute(
        graph, priority=priority, merge_cost=merge, credit_bytes=credit, comm_slowdown=host.comm_slowdown if host else 1
    )
    tasks = graph.tasks
    first_of_iter: dict[int, Any] = {}
    for idx in graph.compute_order:
        first_of_iter.setdefault(tasks[idx].iteration, start[idx])
    warm, last = iterations // 2, iterations - 1
    window = last - warm
    period = (first_of_iter[last] - first_of_iter[warm]) / window
    compute_busy = sum(tasks[i].duration for i in graph.compute_order if tasks[i].iteration == warm)
    comm_busy = (
        sum(op_end - op_start for group, op_start, op_end in comm_ops if warm <= tasks[group[0]].iteration < last)
        / window
    )
    # A stream's busy time per iteration is a hard floor of the steady period; it guards a
    # finite window against a backlog that is still growing (approx, when comm-bound).
    iteration = max(period, compute_busy, comm_busy)
    bound, compute_min, comm_min = lower_bound(layers, network, compression)
    t0, t1 = first_of_iter[warm], first_of_iter[warm + 1]
    gaps, cursor = [], t0
    for idx in graph.compute_order:
        if t0 <= start[idx] < t1:
            if start[idx] > cursor:
                gaps.append((cursor - t0, start[idx] - t0))
            cursor = max(cursor, end[idx])
    spans = []
    if keep_spans:
        spans = [
            Span("compute", tasks[i].name, tasks[i].kind, tasks[i].iteration, start[i], end[i])
            for i in graph.compute_order
        ]
        for group, op_start, op_end in comm_ops:
            head = tasks[group[0]]
            name = head.name if len(group) == 1 else f"{head.name} +{len(group) - 1} chunks"
            spans.append(Span("comm", name, head.kind, head.iteration, op_start, op_end))
    options: dict[str, Any] = {"iterations": iterations, "shared_stream": shared_stream}
    if priority:
        options.update(partition_bytes=partition_bytes, credit_bytes=credit)
    if compression is not None:
        options.update(compression=compression.kind, density=compression.density)
    if host is not None and host != HostCosts():
        options.update(host=dataclasses.asdict(host))
    return SimResult(
        strategy,
        buckets,
        iteration,
        compute_busy,
        comm_busy,
        iteration - compute_busy,
        iteration - comm_busy,
        bound,
        compute_min,
        comm_min,
        gaps,
        spans,
        options,
    )
