"""Compiled reports as a text table: XLA's estimated step and exposed communication, per collective.

>>> from jaxsched.check._compiled_report import CompiledReport
>>> r = CompiledReport("x", "h100", "gpu", 2e-6, 1e-6, (), (), estimate_source="schedule")
>>> print(format_table([r]).splitlines()[2])
x [h100, gpu]: step 2.0 us, exposed comm 1.0 us (XLA estimate); async 0/0 collectives
>>> format_options({"b": 1, "a": True})
'a=True, b=1'
"""

from __future__ import annotations

from typing import Sequence

from jaxsched.check._compiled_report import (
    ESTIMATE_FROM_INSTRUCTIONS,
    ESTIMATE_FROM_SCHEDULE,
    ESTIMATOR,
    CompiledReport,
)

__all__ = ["format_options", "format_table"]


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def _ratio(x: float | None, base: float | None, mixed: bool = False) -> str:
    if x is None or base is None or base == 0:
        return ""
    return f" ({x / base:.2f}x{' against an estimate from instruction costs' if mixed else ''})"


#: How each ``estimate_source`` is named in a report's summary.
_SOURCE_TEXT = {
    ESTIMATE_FROM_SCHEDULE: "XLA estimate",
    ESTIMATE_FROM_INSTRUCTIONS: "estimated from XLA's instruction costs: no schedule, nothing overlapped",
    None: "no estimate",
}


def format_options(options: dict) -> str:
    """``"XLA defaults"``, or ``"name=value, ..."`` in name order (stable across runs, for diffs).

    Args:
      options: XLA compiler options, as a report keeps them.

    Returns:
      One line of text.

    Example:
      >>> from jaxsched import check
      >>> check.format_options({}), check.format_options({"b": 1, "a": True})
      ('XLA defaults', 'a=True, b=1')
    """
    if not options:
        return "XLA defaults"
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items()))


def format_table(reports: Sequence[CompiledReport], baseline: CompiledReport | None = None) -> str:
    """A text table of the reports; times are XLA's estimate, ratios are to ``baseline``.

    Args:
      reports: the reports, one block each, in this order.
      baseline: the report the ratios are to (None: no ratios).

    Returns:
      The table: a header explaining the times, then per report its summary line and one
      row per collective.

    Example:
      >>> from jaxsched import check
      >>> base = check.CompiledReport("plain", "h100", "gpu", 4e-6, 2e-6, (), (), estimate_source="schedule")
      >>> r = check.CompiledReport("dear", "h100", "gpu", 3e-6, 1e-6, (), (), estimate_source="schedule")
      >>> print(check.format_table([base, r], baseline=base).splitlines()[-3])
      dear [h100, gpu]: step 3.0 us (0.75x), exposed comm 1.0 us (0.50x) (XLA estimate); async 0/0 collectives
    """
    lines = [
        f"Times: {ESTIMATOR}. step = the length of XLA's estimated schedule; exposed comm = "
        "the time in it with a collective in flight and no compute running; XLA's own "
        "summary statistics (total / wasted cycles) in brackets."
    ]
    if any(r.estimate_source == ESTIMATE_FROM_INSTRUCTIONS for r in reports):
        lines.append(
            "Where XLA wrote no schedule, step = XLA's cost of each instruction added up, and every "
            "collective's cost (XLA's latency estimate for it alone) counted as exposed, less "
            "the compute in the window of an asynchronous one."
        )
    for r in reports:
        b_step = baseline.step_s if baseline is not None else None
        b_exp = baseline.exposed_comm_s if baseline is not None else None
        mixed = (
            baseline is not None
            and baseline is not r
            and ESTIMATE_FROM_INSTRUCTIONS in (r.estimate_source, baseline.estimate_source)
            and r.estimate_source != baseline.estimate_source
        )
        lines.append("")
        lines.append(
            f"{r.label} [{r.target or '?'}, {r.platform}]: step {_us(r.step_s)} us"
            f"{_ratio(r.step_s, b_step, mixed)}, exposed comm {_us(r.exposed_comm_s)} us"
            f"{_ratio(r.exposed_comm_s, b_exp, mixed)} ({_SOURCE_TEXT.get(r.estimate_source, r.estimate_source)}); "
            f"async {r.num_async}/{len(r.collectives)} collectives"
            + (
                f" [XLA statistics: total {_us(r.xla_total_s)} us, wasted {_us(r.xla_wasted_s)} us]"
                if r.xla_total_s is not None
                else ""
            )
        )
        if r.no_estimate_reason:
            lines.append(f"  no estimate: {r.no_estimate_reason}")
        if r.made_sync_s:
            lines.append(
                f"  of which {_us(r.made_sync_s)} us: collectives XLA scheduled beside compute but runs "
                "synchronously (XLA:TPU fused no compute with them), each at its own time"
            )
        lines.append(f"  compiler options: {format_options(r.compiler_options)}")
        memory = [
            f"{what} {value / 1e6:.1f} MB"
            for what, value in (("peak memory", r.peak_memory_bytes), ("peak gathered", r.peak_gathered_bytes))
            if value
        ]
        if memory:
            lines.append("  per device: " + ", ".join(memory))
        for loop in r.loops:
            lines.append(
                f"  loop {loop.name}: {loop.trips} iterations, {_us(loop.seconds)} us, exposed comm "
                f"{_us(loop.exposed_s)} us, gathered per iteration {loop.peak_gathered_bytes / 1e6:.1f} MB"
            )
        if not r.collectives:
            lines.append("  (no collectives)")
            continue
        lines.append(
            f"  {'kind':<20}{'MB':>9}  {'axes':<12}{'async':<6}{'ops':>5}{'GFLOP':>9}"
            f"{'compute us':>12}{'window us':>11}  name"
        )
        for c in r.collectives:
            window = None if c.start_s is None or c.end_s is None else c.end_s - c.start_s
            lines.append(
                f"  {c.kind:<20}{c.bytes / 1e6:>9.3f}  {','.join(c.mesh_axes) or '-':<12}"
                f"{'yes' if c.is_async else 'no':<6}{c.compute_ops:>5}"
                f"{c.compute_flops / 1e9:>9.3f}{_us(c.compute_s):>12}{_us(window):>11}  {c.name}"
            )
    return "\n".join(lines)
