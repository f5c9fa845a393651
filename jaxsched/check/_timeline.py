"""Compiled reports drawn as timelines of XLA's estimated schedule (`plot`).

Overlapping collective windows go to separate rows (`_streams`):

>>> from jaxsched.check._compiled_report import CollectiveWindow
>>> w = lambda a, b: CollectiveWindow("c", "all-reduce", 0, (), True, 0, 0.0, a, b, 0.0)
>>> _streams([w(0, 10), w(5, 15), w(10, 20)])
[0, 1, 0]
"""

from __future__ import annotations

from typing import Sequence

from jaxsched.check._compiled_report import ESTIMATE_FROM_INSTRUCTIONS, ESTIMATOR, CollectiveWindow, CompiledReport
from jaxsched.check._table import _us

__all__ = ["plot"]

_KIND_COLORS = {
    "all-reduce": "tab:blue",
    "reduce-scatter": "tab:orange",
    "all-gather": "tab:green",
    "all-to-all": "tab:purple",
    "collective-permute": "tab:brown",
    "send": "tab:pink",
    "recv": "tab:olive",
    "ragged-all-to-all": "tab:cyan",
}


def _bounds(w: CollectiveWindow) -> tuple[float, float]:
    """A timed window's start and end, seconds (only timed windows are drawn)."""
    return (w.start_s or 0.0, w.end_s or 0.0)


def _bar(w: CollectiveWindow) -> tuple[float, float]:
    """``(start, width)`` in microseconds, at least a sliver wide."""
    start, end = _bounds(w)
    return start * 1e6, max((end - start) * 1e6, 1e-3)


def _timed(r: CompiledReport) -> list[CollectiveWindow]:
    return [c for c in r.collectives if c.start_s is not None and c.end_s is not None]


def _streams(windows: list[CollectiveWindow]) -> list[int]:
    """Greedy row assignment so that overlapping windows go to separate rows."""
    ends: list[float] = []
    rows = [0] * len(windows)
    for k in sorted(range(len(windows)), key=lambda k: _bounds(windows[k])[0]):
        start, end = _bounds(windows[k])
        for r, e in enumerate(ends):
            if e <= start:
                rows[k], ends[r] = r, end
                break
        else:
            rows[k] = len(ends)
            ends.append(end)
    return rows


def plot(reports: Sequence[CompiledReport], path: str) -> str:
    """A PNG timeline per report (XLA's estimate): compute row, one row per collective
    stream (async windows start..done as bars colored by kind), sync collectives hatched.

    Uses matplotlib's ``Figure`` directly (no pyplot), so the caller's backend is untouched.

    Args:
      reports: one panel each, top to bottom; a report without a schedule gets a note.
      path: where the PNG goes.

    Returns:
      ``path``.

    Example:
      >>> import os, tempfile
      >>> from jaxsched import check
      >>> r = check.CompiledReport("x", "h100", "gpu", 3e-6, 1e-6, (), (("dot", 0.0, 3e-6),))
      >>> path = check.plot([r], os.path.join(tempfile.mkdtemp(), "timeline.png"))
      >>> os.path.getsize(path) > 0
      True
    """
    from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    from matplotlib.patches import Patch

    reports = list(reports)
    heights = []
    for r in reports:
        timed = _timed(r)
        heights.append(2 + len(set(_streams([c for c in timed if c.is_async]))) if timed else 2)
    fig = Figure(figsize=(12, sum(0.5 * h + 1.2 for h in heights) or 2))
    axes = fig.subplots(max(len(reports), 1), 1, squeeze=False)
    kinds: set[str] = set()
    for ax, r in zip(axes[:, 0], reports):
        timed = _timed(r)
        ax.set_title(
            f"{r.label} [{r.target or r.platform}]  step {_us(r.step_s)} us, exposed comm {_us(r.exposed_comm_s)} us",
            fontsize=9,
        )
        if not r.compute and not timed:
            ax.text(
                0.5,
                0.5,
                f"no schedule estimate ({len(r.collectives)} collectives, {r.num_async} async)"
                + ("; step from XLA's instruction costs" if r.estimate_source == ESTIMATE_FROM_INSTRUCTIONS else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_yticks([])
            ax.set_xticks([])
            continue
        ax.broken_barh([(s * 1e6, max((e - s) * 1e6, 1e-3)) for _, s, e in r.compute], (0, 0.8), color="0.55")
        labels = ["compute"]
        async_w = [c for c in timed if c.is_async]
        rows = _streams(async_w)
        for c, row in zip(async_w, rows):
            kinds.add(c.kind)
            ax.broken_barh(
                [_bar(c)],
                (row + 1, 0.8),
                facecolor=_KIND_COLORS.get(c.kind, "tab:gray"),
                alpha=0.8,
                edgecolor="white",
                linewidth=0.8,
            )
        n_rows = (max(rows) + 1) if rows else 0
        labels += [f"comm {k}" for k in range(n_rows)]
        sync_w = [c for c in timed if not c.is_async]
        if sync_w:
            y = n_rows + 1
            for c in sync_w:
                kinds.add(c.kind)
                ax.broken_barh(
                    [_bar(c)],
                    (y, 0.8),
                    facecolor="white",
                    edgecolor=_KIND_COLORS.get(c.kind, "tab:gray"),
                    hatch="xx",
                )
            labels.append("sync")
        ax.set_yticks([k + 0.4 for k in range(len(labels))], labels, fontsize=8)
        ax.set_xlabel("time (us, XLA estimate)")
    handles = [Patch(color=_KIND_COLORS.get(k, "tab:gray"), label=k) for k in sorted(kinds)]
    handles.append(Patch(facecolor="white", edgecolor="k", hatch="xx", label="synchronous"))
    fig.legend(handles=handles, loc="lower right", fontsize=8, ncol=len(handles))
    fig.suptitle(ESTIMATOR, fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    return path
