"""Where the collectives sit in a compiled (scheduled) XLA program, by XLA's own estimate.

A strategy that reorders gradient communication only helps if the compiler keeps the order
and overlaps the communication with compute. This module reads what XLA actually produced:
the scheduled HLO of a compiled program (``compiled.as_text()``; the ENTRY computation's
instruction order is the schedule) and, when the backend writes one, the latency-hiding
scheduler's own estimate (``xla_dump_latency_hiding_schedule``: start/end cycles of every
instruction, total and "wasted" cycles). It reports each collective's kind, size, mesh axes,
whether it is asynchronous, and the compute scheduled inside its start..done window.

Nothing here runs on an accelerator: it works on programs compiled for compile-only GPU or
TPU devices, and every time it reports is XLA's estimate, not a measurement.

How asynchrony shows up in the compiled HLO:

- GPU: ``all-reduce-start``/``all-reduce-done`` (likewise all-gather, reduce-scatter,
  all-to-all, collective-permute), or ``async-start``/``async-done`` wrapping a collective.
  A pair whose backend_config says ``"is_sync":true`` runs synchronously.
- TPU: an *async collective fusion*: a ``fusion`` named ``async-collective-start*`` whose
  computation ends in ``custom-call(... custom_call_target="AsyncCollectiveStart")``, compute
  fusions calling ``async_collective_fusion.*`` (the collective's continuation fused with
  convolutions), and a ``fusion`` ending in ``AsyncCollectiveDone``. TPU schedules *before*
  it forms these fusions, so its schedule names the pairs ``all-reduce-start.N`` etc.; they
  are matched to the fused pairs by kind and order.
- A bare collective (``all-reduce(``) in ENTRY is synchronous (CPU always; TPU by default).

A hand-written program, with no schedule estimate:

>>> TEXT = '''
... HloModule m, is_scheduled=true
...
... %add (a: f32[], b: f32[]) -> f32[] {
...   %a = f32[] parameter(0)
...   %b = f32[] parameter(1)
...   ROOT %s = f32[] add(%a, %b)
... }
...
... ENTRY %main (p: f32[256,256], q: f32[256,256]) -> f32[256,256] {
...   %p = f32[256,256]{1,0} parameter(0)
...   %q = f32[256,256]{1,0} parameter(1)
...   %ars = f32[256,256]{1,0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
...   %d = f32[256,256]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
...   %ard = f32[256,256]{1,0} all-reduce-done(%ars)
...   ROOT %r = f32[256,256]{1,0} add(%ard, %d)
... }
... '''
>>> r = report(TEXT, None, None, label="x")
>>> w = r.collectives[0]
>>> (w.kind, w.bytes, w.is_async, w.compute_ops, w.compute_flops, w.start_s)
('all-reduce', 262144, True, 1, 33554432.0, None)
>>> (r.num_async, r.num_sync, r.step_s)
(1, 0, None)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from jax.sharding import Mesh

from jaxsched.check._hlo_text import _replica_groups
from jaxsched.check._compiled_report import (
    ESTIMATE_FROM_INSTRUCTIONS,
    ESTIMATE_FROM_SCHEDULE,
    ESTIMATOR,
    CollectiveWindow,
    CompiledReport,
    LoopCost,
)
from jaxsched.check._hlo_text import MeshLike
from jaxsched.check._compiling import CompilerOption, compile_with_schedule
from jaxsched.check._estimate import estimate_from_instruction_costs
from jaxsched.check._report import report
from jaxsched.check._table import format_options, format_table
from jaxsched.check._timeline import _streams, plot
from jaxsched.core._axes import num_slices

if TYPE_CHECKING:
    from jax.stages import Lowered

__all__ = [
    "CollectiveWindow",
    "CompiledReport",
    "ESTIMATOR",
    "Inspection",
    "LoopCost",
    "PLAIN_LABEL",
    "ESTIMATE_FROM_INSTRUCTIONS",
    "ESTIMATE_FROM_SCHEDULE",
    "compile_with_schedule",
    "describe_mesh",
    "estimate_from_instruction_costs",
    "format_options",
    "format_table",
    "inspect_lowered",
    "inspect_lowered_by_costs_too",
    "inspect_jitted",
    "plot",
    "ratios",
    "report",
]

# Read by the tests of the HLO reader and of the timeline's rows.
_PRIVATE_REEXPORTS = (_replica_groups, _streams)


def inspect_lowered(
    lowered: Lowered,
    mesh: MeshLike | None,
    *,
    label: str,
    target: str = "",
    compiler_options: Mapping[str, CompilerOption] | None = None,
    estimate: bool = True,
) -> CompiledReport:
    """Compile ``lowered`` with ``compiler_options`` (None: XLA's defaults; options that
    ``jax.jit(..., compiler_options=...)`` put in ``lowered`` apply too, so passing the same
    again changes nothing) and report it, the options recorded in the report; with
    ``estimate``, where XLA writes no schedule, estimate its step from XLA's instruction
    costs (`estimate_from_instruction_costs`).

    Args:
      lowered: the program, from ``jax.jit(f).trace(*args).lower()``.
      mesh: the mesh it runs on (maps replica groups to axis names; None: no axes).
      label: the report's name.
      target: what it was compiled for (`describe_mesh`).
      compiler_options: XLA options for this compile (None: XLA's defaults).
      estimate: estimate the step from XLA's instruction costs where XLA wrote no schedule.

    Returns:
      The `CompiledReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched import check
      >>> lowered = jax.jit(jnp.sin).trace(jnp.ones(4)).lower()
      >>> check.inspect_lowered(lowered, None, label="sin").collectives
      ()
    """
    return _compiled_reports(lowered, mesh, label, target, compiler_options, estimate, costs_too=False)[0]


def inspect_lowered_by_costs_too(
    lowered: Lowered,
    mesh: MeshLike | None,
    *,
    label: str,
    target: str = "",
    compiler_options: Mapping[str, CompilerOption] | None = None,
) -> tuple[CompiledReport, CompiledReport | None]:
    """`inspect_lowered`'s report, and the same program estimated from XLA's instruction
    costs where its report comes from a schedule: the estimate of a baseline for which XLA
    wrote no schedule (one TPU slice with XLA's defaults), so that the two compare alike.

    Args:
      lowered: the program, from ``jax.jit(f).trace(*args).lower()``.
      mesh: the mesh it runs on.
      label: the report's name (the second's: with ``", by instruction costs"``).
      target: what it was compiled for (`describe_mesh`).
      compiler_options: XLA options for this compile (None: XLA's defaults).

    Returns:
      ``(report, by_costs)``: ``by_costs`` None where the report has no schedule estimate
      or the program carries no instruction costs (XLA:GPU and XLA:CPU write none).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched import check
      >>> lowered = jax.jit(jnp.sin).trace(jnp.ones(4)).lower()
      >>> rep, by_costs = check.inspect_lowered_by_costs_too(lowered, None, label="sin")
      >>> by_costs is None      # XLA:CPU costs no instruction
      True
    """
    return _compiled_reports(lowered, mesh, label, target, compiler_options, True, costs_too=True)


def _compiled_reports(
    lowered: Lowered,
    mesh: MeshLike | None,
    label: str,
    target: str,
    compiler_options: Mapping[str, CompilerOption] | None,
    estimate: bool,
    *,
    costs_too: bool,
) -> tuple[CompiledReport, CompiledReport | None]:
    """One compile: its report, and with ``costs_too`` its instruction-cost estimate."""
    compiled, schedule = compile_with_schedule(lowered, compiler_options)
    rep = report(compiled, schedule, mesh, label=label, target=target, compiler_options=compiler_options)
    if estimate and rep.step_s is None and rep.platform != "cpu":
        rep = estimate_from_instruction_costs(rep, compiled, mesh)
    by_costs = None
    if costs_too and rep.step_s is not None and rep.estimate_source != ESTIMATE_FROM_INSTRUCTIONS:
        unscheduled = dataclasses.replace(rep, label=f"{label}, by instruction costs", step_s=None)
        estimated = estimate_from_instruction_costs(unscheduled, compiled, mesh)
        by_costs = estimated if estimated.step_s is not None else None
    return rep, by_costs


PLAIN_LABEL = "plain (XLA defaults)"


def describe_mesh(mesh: Mesh) -> str:
    """``"gpu: 8 x NVIDIA H100 80GB HBM3 over 2 hosts"``: what a program was compiled for.

    Args:
      mesh: a mesh of real or compile-only devices.

    Returns:
      Platform, device count and kind, and hosts and slices where more than one.

    Example:
      >>> import jax
      >>> from jaxsched import check
      >>> check.describe_mesh(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]))
      'cpu: 2 x cpu'
    """
    devices = list(mesh.devices.flat)
    first = devices[0]
    hosts = len({d.process_index for d in devices})
    slices = num_slices(devices)
    where = f" over {hosts} hosts" if hosts > 1 else ""
    where += f", {slices} slices" if slices > 1 else ""
    return f"{first.platform}: {len(devices)} x {getattr(first, 'device_kind', first.platform)}{where}"


def inspect_jitted(
    fn: Callable[..., Any],
    args: Sequence[Any],
    mesh: Mesh,
    *,
    label: str = PLAIN_LABEL,
    compiler_options: Mapping[str, CompilerOption] | None = None,
    estimate: bool = True,
) -> CompiledReport:
    """Compile ``fn`` (jitted or not) on ``args`` (arrays or ``jax.ShapeDtypeStruct`` with
    shardings) with only ``compiler_options`` (default: XLA's own defaults) and report it.
    This is how a user's step is judged as XLA compiles it alone. Where XLA writes no
    schedule (XLA:TPU on one slice with its defaults), ``estimate`` adds an estimate from
    XLA's instruction costs (`estimate_from_instruction_costs`).

    Args:
      fn: the step; jitted or not (``jax.jit`` is applied where it has no ``trace``).
      args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` with shardings (nothing is
        allocated, so compile-only devices work).
      mesh: the mesh the shardings use.
      label: the report's name.
      compiler_options: XLA options for this compile (None: XLA's defaults).
      estimate: estimate the step from XLA's instruction costs where XLA wrote no schedule.

    Returns:
      The `CompiledReport`, ``target`` from `describe_mesh`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jaxsched import check
      >>> mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
      >>> x = jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))
      >>> r = check.inspect_jitted(lambda x: x.sum(0), [x], mesh)
      >>> r.label, r.num_sync, r.no_estimate_reason
      ('plain (XLA defaults)', 1, 'XLA:CPU runs collectives inline and writes no schedule estimate')
    """
    import jax

    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    return inspect_lowered(
        jitted.trace(*args).lower(),
        mesh,
        label=label,
        target=describe_mesh(mesh),
        compiler_options=compiler_options,
        estimate=estimate,
    )


def ratios(report: CompiledReport, base: CompiledReport | None) -> dict[str, float | None]:
    """``report``'s estimated step and exposed communication over ``base``'s.

    Args:
      report: the program judged (a scheduled step).
      base: what it is compared with (the plain step; None: no ratios).

    Returns:
      ``{"step": ..., "exposed_comm": ...}``, each None where either report has no
      estimate (or the base's is 0).

    Example:
      >>> from jaxsched import check
      >>> base = check.CompiledReport("plain", "", "gpu", 4e-6, 2e-6, (), ())
      >>> r = check.CompiledReport("dear", "", "gpu", 3e-6, 1e-6, (), ())
      >>> check.ratios(r, base)
      {'step': 0.75, 'exposed_comm': 0.5}
    """

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {
        "step": ratio(report.step_s, None if base is None else base.step_s),
        "exposed_comm": ratio(report.exposed_comm_s, None if base is None else base.exposed_comm_s),
    }


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What ``Scheduled.inspect`` returns.

    Attributes:
      report: the scheduled step as compiled (the engine's per-target options, in
        ``report.compiler_options``).
      baseline: the user's step unchanged, compiled with XLA's default options (None when
        not asked for). Where XLA writes no schedule for it (XLA:TPU on one slice), its
        estimate comes from XLA's instruction costs (``baseline.estimate_source``).
      report_by_instruction_costs: the scheduled step estimated from XLA's instruction
        costs too, where the baseline's estimate comes from them and the scheduled
        step's from a schedule: `ratios` then compare these two, so that no ratio sets
        one estimator against another (the table shows all three).

    Example:
      >>> from jaxsched import check
      >>> base = check.CompiledReport("plain", "", "gpu", 4e-6, 2e-6, (), ())
      >>> ins = check.Inspection(check.CompiledReport("dear", "", "gpu", 3e-6, 1e-6, (), ()), base)
      >>> ins.ratios()["step"], ins.to_json()["ratio_to_baseline"]["exposed_comm"]
      (0.75, 0.5)
    """

    report: CompiledReport
    baseline: CompiledReport | None = None
    report_by_instruction_costs: CompiledReport | None = None

    @property
    def compared(self) -> CompiledReport:
        """The scheduled step's report that `ratios` compare with the baseline: its
        instruction-cost estimate where the baseline's comes from instruction costs."""
        base = self.baseline
        if (
            base is not None
            and base.estimate_source == ESTIMATE_FROM_INSTRUCTIONS
            and self.report.estimate_source != ESTIMATE_FROM_INSTRUCTIONS
            and self.report_by_instruction_costs is not None
        ):
            return self.report_by_instruction_costs
        return self.report

    def ratios(self) -> dict[str, float | None]:
        """Estimated step and exposed communication as ratios to the baseline's, each
        program estimated the same way (`compared`).

        Returns:
          ``{"step": ..., "exposed_comm": ...}`` (`ratios`); None values without a baseline.

        Example:
          >>> from jaxsched import check
          >>> check.Inspection(check.CompiledReport("x", "", "cpu", None, None, (), ())).ratios()
          {'step': None, 'exposed_comm': None}
        """
        return ratios(self.compared, self.baseline)

    def table(self) -> str:
        """The baseline (when there is one) and the scheduled step, ratios to the baseline.

        Returns:
          `format_table` of the two (also what ``str(inspection)`` gives).

        Example:
          >>> from jaxsched import check
          >>> ins = check.Inspection(check.CompiledReport("dear", "h100", "gpu", 3e-6, 1e-6, (), ()))
          >>> "dear [h100, gpu]: step 3.0 us" in ins.table()
          True
        """
        shown = [self.report] if self.baseline is None else [self.baseline, self.report]
        if self.compared is not self.report:
            shown.append(self.compared)
        return format_table(shown, baseline=self.baseline)

    def plot(self, path: str) -> str:
        """`plot` of the baseline (when there is one) and the scheduled step.

        Args:
          path: where the PNG goes.

        Returns:
          ``path``.

        Example:
          >>> import os, tempfile
          >>> from jaxsched import check
          >>> ins = check.Inspection(check.CompiledReport("x", "", "gpu", 3e-6, 1e-6, (), ()))
          >>> os.path.exists(ins.plot(os.path.join(tempfile.mkdtemp(), "t.png")))
          True
        """
        return plot([r for r in (self.baseline, self.report) if r is not None], path)

    def to_json(self) -> dict[str, Any]:
        return {
            "report": self.report.to_json(),
            "baseline": None if self.baseline is None else self.baseline.to_json(),
            "report_by_instruction_costs": (
                None if self.report_by_instruction_costs is None else self.report_by_instruction_costs.to_json()
            ),
            "ratio_to_baseline": self.ratios(),
        }

    def __str__(self) -> str:
        return self.table()
