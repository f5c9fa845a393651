"""What an inspection reports: a compiled program's collectives and XLA's estimate of its step.

Plain data, read back from JSON as written (``CompiledReport.to_json`` / ``from_json``):

>>> w = CollectiveWindow("ar", "all-reduce", 1024, ("data",), True, 2, 1e6, 0.0, 2e-6, 1e-6)
>>> r = CompiledReport("x", "", "gpu", 3e-6, 1e-6, (w,), ())
>>> CompiledReport.from_json(r.to_json()) == r, r.num_async, r.no_estimate_reason
(True, 1, None)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

__all__ = [
    "CollectiveWindow",
    "CompiledReport",
    "ESTIMATE_FROM_INSTRUCTIONS",
    "ESTIMATE_FROM_SCHEDULE",
    "ESTIMATOR",
    "LoopCost",
]

ESTIMATOR = "XLA latency-hiding scheduler estimate for the compiled program (not measured on hardware)"

#: ``CompiledReport.estimate_source`` of a report timed by XLA's latency-hiding schedule.
ESTIMATE_FROM_SCHEDULE = "schedule"
#: ``CompiledReport.estimate_source`` of a report XLA wrote no schedule for, timed from
#: XLA's cost of each instruction (`estimate_from_instruction_costs`).
ESTIMATE_FROM_INSTRUCTIONS = "instruction costs"


@dataclasses.dataclass(frozen=True)
class CollectiveWindow:
    """One collective of the compiled program, and what XLA scheduled inside its window.

    ``start_s``/``end_s``/``compute_s`` come from XLA's schedule estimate (None without one).
    For a collective the final program runs synchronously, ``compute_ops``, ``compute_flops``
    and ``compute_s`` are 0; on TPU its ``start_s``..``end_s`` can still be the window the
    scheduler had planned before a later pass made it synchronous.

    Attributes:
      name: the collective's HLO instruction (its start op for an asynchronous one).
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ...
      bytes: what it moves per device (its result).
      mesh_axes: the mesh axes its replica groups span (``()`` without a mesh).
      is_async: whether the final program runs it asynchronously.
      compute_ops: compute instructions in its start..done window, in program order.
      compute_flops: their flops, by XLA's cost analysis.
      start_s: its start in XLA's schedule estimate (None without one).
      end_s: its end in the estimate.
      compute_s: the compute time the estimate puts inside its window.

    Example:
      >>> from jaxsched import check
      >>> w = check.CollectiveWindow("ar", "all-reduce", 1024, ("data",), True, 2, 1e6, 0.0, 2e-6, 1e-6)
      >>> w.end_s - w.start_s > w.compute_s  # part of its 2 us is not hidden
      True
    """

    name: str
    kind: str
    bytes: int
    mesh_axes: tuple[str, ...]
    is_async: bool
    compute_ops: int
    compute_flops: float
    start_s: float | None
    end_s: float | None
    compute_s: float | None


class LoopCost(NamedTuple):
    """A while loop of the compiled program (a ``lax.scan`` over layers), all iterations.

    Attributes:
      name: the loop's HLO instruction.
      trips: its trip count (iterations XLA peeled or unrolled are not among them).
      seconds: XLA's estimate of all its iterations.
      exposed_s: communication in them that no compute hides.
      peak_gathered_bytes: the most all-gathered bytes alive at once within one iteration
        (a double-buffered layer stack: the next layer's weights, while the current layer's
        arrive through the loop's carry).

    Example:
      >>> from jaxsched import check
      >>> loop = check.LoopCost("while.1", trips=12, seconds=1.2e-3, exposed_s=1e-4)
      >>> round(loop.seconds / loop.trips * 1e6)  # us per layer
      100
    """

    name: str
    trips: int
    seconds: float
    exposed_s: float
    peak_gathered_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CompiledReport:
    """A compiled program's collectives and XLA's estimate of its step and exposed comm.

    Both headline figures come from the start and end times the latency-hiding scheduler
    gave every instruction (its own cost model): ``step_s`` is the schedule's length (the
    last instruction's end), ``exposed_comm_s`` the time in it during which a collective
    is in flight and no compute runs, counting the whole window of a collective that the
    final program runs synchronously. XLA:TPU schedules before it forms its async
    collective fusions and runs a collective it could not fuse synchronously, where the
    schedule had planned compute beside it: such a collective adds its own time (XLA's,
    compiled alone) to both figures instead of its planned window.

    A while loop (a ``lax.scan`` over layers) is one instruction in the entry's schedule;
    XLA schedules its body on its own, and the body runs its trip count times: ``step_s`` and
    ``exposed_comm_s`` count every iteration, and ``loops`` lists each loop
    (`LoopCost`). ``peak_gathered_bytes`` is the
    most all-gathered data alive at once in the schedule (each gather from its start to its
    last reader): FSDP's gathered parameters, what a bound on prefetching keeps small.
    ``peak_memory_bytes`` is XLA's memory analysis per device (arguments + outputs +
    temporaries - aliased), None where the backend has none.

    XLA also writes summary statistics, kept as ``xla_total_s`` (``total_cycles``) and
    ``xla_wasted_s`` (``total_wasted_cycles``). They come from a separate pass and disagree
    with the schedule's own times, in both directions (a 126M-parameter MLP on H100:
    total 3061 us for a schedule 4164 us long, and 5572 us for one 4032 us long; on TPU
    the wasted cycles barely move between programs), so they are reported, not used.

    ``estimate_source`` says where ``step_s`` and ``exposed_comm_s`` come from:
    ``"schedule"`` (`ESTIMATE_FROM_SCHEDULE`, the above), ``"instruction costs"``
    (`ESTIMATE_FROM_INSTRUCTIONS`: XLA wrote no schedule, as XLA:TPU does not for a
    single slice with its default options, and the step is XLA's cost of each instruction
    added up; see `estimate_from_instruction_costs`), or None (no estimate:
    `no_estimate_reason` says why). ``compiler_options`` are the XLA options the
    program was compiled with (``{}``: XLA's defaults), as passed to the compiler.

    Attributes:
      label: the report's name.
      target: what the program was compiled for (`describe_mesh`).
      platform: ``"gpu"``, ``"tpu"`` or ``"cpu"``.
      step_s: the estimated step, seconds (None: no estimate).
      exposed_comm_s: the estimated communication no compute hides, seconds.
      collectives: every collective (`CollectiveWindow`), in program order.
      compute: ``(name, start_s, end_s)`` of each compute instruction in the schedule.
      estimator: what the times are (`ESTIMATOR`).
      xla_total_s: XLA's ``total_cycles``, as seconds (reported, not used).
      xla_wasted_s: XLA's ``total_wasted_cycles``, as seconds (reported, not used).
      loops: the while loops (`LoopCost`).
      peak_gathered_bytes: the most all-gathered bytes alive at once.
      peak_memory_bytes: XLA's peak memory per device (None where the backend has none).
      estimate_source: where the step comes from (see above).
      compiler_options: the XLA options it was compiled with.
      made_sync_s: of ``step_s`` and ``exposed_comm_s``, the own time of the collectives the
        final program runs synchronously where the schedule had planned compute beside
        them (every loop iteration counted; see above).

    Example:
      A report is plain data: build one from JSON (what ``jaxsched inspect --json`` writes)
      to compare programs without compiling them again.

      >>> from jaxsched import check
      >>> r = check.CompiledReport("x", "h100", "gpu", 3e-6, 1e-6, (), ())
      >>> check.CompiledReport.from_json(r.to_json()) == r, r.estimate_source
      (True, None)
    """

    label: str
    target: str
    platform: str
    step_s: float | None
    exposed_comm_s: float | None
    collectives: tuple[CollectiveWindow, ...]
    compute: tuple[tuple[str, float, float], ...]
    estimator: str = ESTIMATOR
    xla_total_s: float | None = None
    xla_wasted_s: float | None = None
    loops: tuple[LoopCost, ...] = ()
    peak_gathered_bytes: int | None = None
    peak_memory_bytes: int | None = None
    estimate_source: str | None = None
    compiler_options: dict[str, str | bool | int | float] = dataclasses.field(default_factory=dict)
    made_sync_s: float = 0.0

    @property
    def num_async(self) -> int:
        return sum(1 for c in self.collectives if c.is_async)

    @property
    def no_estimate_reason(self) -> str | None:
        """Why the report has no estimated step (None when it has one)."""
        if self.step_s is not None:
            return None
        read = "the collectives listed are read from the compiled HLO"
        if self.platform == "cpu":
            return "XLA:CPU runs collectives inline and writes no schedule estimate"
        if self.num_async == 0:
            return (
                "XLA compiled every collective of this program synchronously and wrote no "
                "schedule estimate for it (XLA:TPU writes one only for a program with "
                "asynchronous collectives; on GPU its latency-hiding scheduler did not run "
                f"for this target); {read}"
            )
        return f"XLA wrote no schedule estimate for this program on this target; {read}"

    @property
    def num_sync(self) -> int:
        return sum(1 for c in self.collectives if not c.is_async)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["collectives"] = [dict(dataclasses.asdict(c), mesh_axes=list(c.mesh_axes)) for c in self.collectives]
        d["compute"] = [list(c) for c in self.compute]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CompiledReport:
        d = dict(d)
        d["collectives"] = tuple(CollectiveWindow(**dict(c, mesh_axes=tuple(c["mesh_axes"]))) for c in d["collectives"])
        d["compute"] = tuple((str(n), float(s), float(e)) for n, s, e in d["compute"])
        d["loops"] = tuple(LoopCost(*loop) for loop in d.get("loops", ()))
        return cls(**d)
