"""Timelines of simulated iterations: Chrome-trace JSON (opens in Perfetto) and a Gantt PNG.

Why: a table says how long; a timeline says why — where the compute stream waits for
the link and where the link idles. Every figure is labelled *simulated*.

Example:
    >>> from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
    >>> from jaxsched.sim import simulate
    >>> layers = LayerProfile([Layer("a", 1, 4000, 1e-3, 2e-3)] * 3)
    >>> trace = chrome_trace([simulate(layers, network_preset("1gbe", 4), "wfbp")])
    >>> trace["traceEvents"][0]["ph"]
    'M'
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from jaxsched.sim._core import SimResult

__all__ = [
    "bar_label",
    "chrome_trace",
    "COLORS",
    "gantt_figure",
    "LEGEND_ORDER",
    "save_chrome_trace",
    "save_gantt_png",
    "STREAM_TIDS",
]

STREAM_TIDS = {"compute": 0, "comm": 1}
# One colour per kind of task; related kinds share a hue family (collectives warm, compute cool).
COLORS = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "update": "#8172b2",
    "compress": "#937860",
    "dispatch": "#222222",
    "pack": "#8c8c8c",
    "unpack": "#c7c7c7",
    "all_reduce": "#c44e52",
    "reduce_scatter": "#dd8452",
    "all_gather": "#da8bc3",
    "topk": "#ccb974",
    "gtopk": "#64b5cd",
}
LEGEND_ORDER = (
    "forward",
    "backward",
    "update",
    "dispatch",
    "pack",
    "unpack",
    "compress",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "topk",
    "gtopk",
)
_BUCKET = re.compile(r"\bb(\d+)\b")


def chrome_trace(results: Sequence[SimResult]) -> dict[str, Any]:
    """One process per strategy, one thread per stream; times in microseconds, the Chrome
    trace event format that Perfetto and ``chrome://tracing`` open.

    Args:
      results: simulation results, one per strategy.

    Returns:
      The trace as a JSON-ready dict (``traceEvents``: metadata and complete events).

    Example:
        >>> from jaxsched.sim import Layer, LayerProfile, network_preset, simulate
        >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 2e-3) for i in range(4)])
        >>> result = simulate(prof, network_preset("10gbe", 8), "wfbp", [[0, 1], [2, 3]])
        >>> from jaxsched.sim import chrome_trace
        >>> trace = chrome_trace([result])
        >>> trace["traceEvents"][0]["args"], sorted({e["ph"] for e in trace["traceEvents"]})
        ({'name': 'wfbp'}, ['M', 'X'])
    """
    events: list[dict[str, Any]] = []
    for pid, result in enumerate(results):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": result.strategy}})
        for stream, tid in STREAM_TIDS.items():
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"{stream} (simulated)"}}
            )
        for span in result.spans:
            events.append(
                {
                    "name": span.name,
                    "cat": span.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": STREAM_TIDS[span.stream],
                    "ts": float(span.start) * 1e6,
                    "dur": float(span.end - span.start) * 1e6,
                    "args": {"iteration": span.iteration},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"note": "simulated by jaxsched.sim; not a measurement"},
    }


def save_chrome_trace(results: Sequence[SimResult], path: str | Path) -> None:
    import json

    Path(path).write_text(json.dumps(chrome_trace(results)))


def _bucket_of(name: str) -> int | None:
    match = _BUCKET.search(name)
    return int(match.group(1)) if match else None


def _shade(color: str, bucket: int | None) -> Any:
    """Odd buckets a little darker than even ones, so neighbouring buckets stay apart."""
    from matplotlib.colors import to_rgb

    rgb = to_rgb(color)
    return tuple(c * 0.72 for c in rgb) if bucket is not None and bucket % 2 else rgb


def _merged(spans: list) -> list[tuple[float, float, str, int | None]]:
    """(start, end, kind, bucket) with back-to-back spans of the same kind and bucket joined:
    a model's 54 forward layers read as one forward bar, each bucket stays its own."""
    bars: list[tuple[float, float, str, int | None]] = []
    for span in sorted(spans, key=lambda s: float(s.start)):
        start, end, bucket = float(span.start), float(span.end), _bucket_of(span.name)
        if bars and bars[-1][2] == span.kind and bars[-1][3] == bucket and start - bars[-1][1] < 1e-12:
            bars[-1] = (bars[-1][0], end, span.kind, bucket)
        else:
            bars.append((start, end, span.kind, bucket))
    return bars


def bar_label(kind: str, bucket: int | None, fraction: float) -> str | None:
    """What a bar is, as long as the bar is wide (``fraction`` of the time axis) enough to
    hold it: ``"all-reduce bucket 3"``, ``"bucket 3"``, ``"b3"``; ``"backward"``; None if
    nothing fits.

    Args:
      kind: the span's kind (``"all_reduce"``, ``"forward"``, ...).
      bucket: the bucket a collective moves, or None for compute.
      fraction: the bar's width as a fraction of the time axis.

    Returns:
      The longest label that fits, or None.

    Example:
        >>> from jaxsched.sim import bar_label
        >>> bar_label("all_reduce", 3, 0.2), bar_label("all_reduce", 3, 0.03), bar_label("forward", None, 0.1)
        ('all-reduce bucket 3', 'b3', 'forward')
    """
    kind_text = kind.replace("_", "-")
    options = [f"{kind_text} bucket {bucket}", f"bucket {bucket}", f"b{bucket}"] if bucket is not None else [kind_text]
    for text in options:
        if fraction >= 0.0075 * (len(text) + 1):  # about a character per 0.75% of the axis
            return text
    return None


def save_gantt_png(
    results: Sequence[SimResult], path: str | Path, steady_iterations: int = 2, title: str | None = None
) -> None:
    """Write `gantt_figure` as a PNG.

    Args:
      results: simulation results, one per strategy.
      path: the file to write.
      steady_iterations: how many steady-state iterations to draw.
      title: what was simulated, drawn above the chart.

    Example:
        >>> import pathlib, tempfile
        >>> from jaxsched.sim import Layer, LayerProfile, network_preset, simulate
        >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 2e-3) for i in range(4)])
        >>> result = simulate(prof, network_preset("10gbe", 8), "wfbp", [[0, 1], [2, 3]])
        >>> from jaxsched.sim import save_gantt_png
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     save_gantt_png([result], pathlib.Path(tmp, "gantt.png"))
        ...     pathlib.Path(tmp, "gantt.png").read_bytes()[1:4]
        b'PNG'
    """
    gantt_figure(results, steady_iterations, title).savefig(path, dpi=110)


def gantt_figure(results: Sequence[SimResult], steady_iterations: int = 2, title: str | None = None) -> Any:
    """A matplotlib Figure: two rows per strategy (compute, comm) over ``steady_iterations`` steady iterations.

    Each bucket's collective is its own bar, outlined, alternately shaded and labelled
    (``all-reduce bucket 0``, shortened to ``b0`` when narrow; bucket 0 is nearest the input);
    compute bars say what they are (forward, backward, update) when they are wide enough;
    a strategy without spans gets no row; so a plan's buckets can be counted off the
    chart; dashed lines mark where each iteration's compute starts. Tasks shorter than
    0.6% of the time axis (updates, dispatch, copies) are drawn that wide so they stay
    visible. ``title`` names what was simulated (model, workers, network).

    Args:
      results: simulation results, one per strategy.
      steady_iterations: how many steady-state iterations to draw.
      title: what was simulated, drawn above the chart.

    Returns:
      A ``matplotlib.figure.Figure`` (Agg backend, no display needed).

    Example:
        >>> from jaxsched.sim import Layer, LayerProfile, network_preset, simulate
        >>> prof = LayerProfile([Layer(str(i), 1, 10**6, 1e-3, 2e-3) for i in range(4)])
        >>> result = simulate(prof, network_preset("10gbe", 8), "wfbp", [[0, 1], [2, 3]])
        >>> from jaxsched.sim import gantt_figure
        >>> type(gantt_figure([result], title="4 layers, 8 workers, 10 GbE")).__name__
        'Figure'
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = []  # (result, shown spans, t0, iteration starts)
    for result in results:
        warm = int(result.options.get("iterations", 8)) // 2
        shown = [s for s in result.spans if warm <= s.iteration < warm + steady_iterations]
        if not shown:
            continue
        compute = [s for s in shown if s.stream == "compute"] or shown
        t0 = min(float(s.start) for s in compute)
        starts = [
            min(float(s.start) for s in compute if s.iteration == it) - t0
            for it in range(warm, warm + steady_iterations)
            if any(s.iteration == it for s in compute)
        ]
        rows.append((result, shown, t0, starts))
    span_ms = max((float(s.end) - t0) * 1e3 for _, shown, t0, _ in rows for s in shown) if rows else 1.0
    min_width = 0.006 * span_ms

    fig = Figure(figsize=(13, 1.9 + 1.15 * len(rows)), layout="constrained")
    ax = fig.subplots()
    labels, kinds_seen = [], set()
    for row, (result, shown, t0, starts) in enumerate(rows):
        if row % 2:
            ax.axhspan(2 * row - 0.55, 2 * row + 1.55, color="#f2f2f2", zorder=0)
        for stream, offset in (("compute", 0), ("comm", 1)):
            y = 2 * row + offset
            for start, end, kind, bucket in _merged([s for s in shown if s.stream == stream]):
                kinds_seen.add(kind)
                left, width = (start - t0) * 1e3, max((end - start) * 1e3, min_width)
                is_comm = stream == "comm"
                ax.barh(
                    y,
                    width,
                    left=left,
                    height=0.7,
                    color=_shade(COLORS.get(kind, "gray"), bucket),
                    edgecolor="white" if is_comm else "none",
                    linewidth=1.5 if is_comm else 0,
                    zorder=2,
                )
                label = bar_label(kind, bucket, width / span_ms)
                if label:
                    ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=7, color="white", zorder=3)
            labels.append(f"{result.strategy} {stream}")
        for k, start in enumerate(starts):
            ax.plot(
                [start * 1e3] * 2,
                [2 * row - 0.6, 2 * row + 1.4],
                color="black",
                linestyle="--",
                linewidth=0.8,
                zorder=4,
            )
            ax.text(
                start * 1e3 + 0.003 * span_ms, 2 * row - 0.37, f"iteration {k + 1}", fontsize=7, va="bottom", zorder=4
            )
        buckets = len(result.buckets)
        ax.text(
            1.0,
            2 * row + 0.5,
            f" {result.iteration_s * 1e3:.1f} ms/iter\n {buckets} bucket{'s' if buckets != 1 else ''}",
            transform=ax.get_yaxis_transform(),
            fontsize=8,
            va="center",
            ha="left",
        )
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(2 * len(rows) - 0.5, -0.7)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel(
        "ms since the start of a steady-state iteration (simulated); "
        "short tasks are drawn at least 0.6% of the axis wide"
    )
    ax.grid(axis="x", color="#dddddd", linewidth=0.6, zorder=1)
    handles = [Patch(color=COLORS[k], label=k.replace("_", "-")) for k in LEGEND_ORDER if k in kinds_seen]
    handles += [Patch(color=COLORS.get(k, "gray"), label=k) for k in sorted(kinds_seen - set(LEGEND_ORDER))]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        fontsize="small",
        ncols=min(len(handles), 10),
        title="bars: task kind; collectives one bar per bucket (b0 = nearest the input), odd buckets darker",
        title_fontsize="small",
    )
    ax.set_title("Simulated timeline" + (f": {title}" if title else "") + " -- SIMULATED, not measured")
    return fig
