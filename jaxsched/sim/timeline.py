"""Timelines of simulated iterations: Chrome-trace JSON (opens in Perfetto) and a Gantt PNG.

Why: a table says how long; a timeline says why — where the compute stream waits for
the link and where the link idles. Every figure is labelled *simulated*.

Example:
    >>> from jaxsched.costmodel import Layer, LayerProfile, network_preset
    >>> from jaxsched.sim import simulate
    >>> layers = LayerProfile([Layer("a", 1, 4000, 1e-3, 2e-3)] * 3)
    >>> trace = chrome_trace([simulate(layers, network_preset("1gbe", 4), "wfbp")])
    >>> trace["traceEvents"][0]["ph"]
    'M'
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from jaxsched.sim.core import SimResult

STREAM_TIDS = {"compute": 0, "comm": 1}
COLORS = {"forward": "#4c72b0", "backward": "#55a868", "update": "#8172b2", "compress": "#937860",
          "all_reduce": "#c44e52", "reduce_scatter": "#dd8452", "all_gather": "#da8bc3",
          "topk": "#ccb974", "gtopk": "#64b5cd"}


def chrome_trace(results: Sequence[SimResult]) -> dict[str, Any]:
    """One process per strategy, one thread per stream; times in microseconds."""
    events: list[dict[str, Any]] = []
    for pid, result in enumerate(results):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": result.strategy}})
        for stream, tid in STREAM_TIDS.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"{stream} (simulated)"}})
        for span in result.spans:
            events.append({"name": span.name, "cat": span.kind, "ph": "X", "pid": pid,
                           "tid": STREAM_TIDS[span.stream], "ts": float(span.start) * 1e6,
                           "dur": float(span.end - span.start) * 1e6,
                           "args": {"iteration": span.iteration}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"note": "simulated by jaxsched.sim; not a measurement"}}


def save_chrome_trace(results: Sequence[SimResult], path: str | Path) -> None:
    import json

    Path(path).write_text(json.dumps(chrome_trace(results)))


def save_gantt_png(results: Sequence[SimResult], path: str | Path, steady_iterations: int = 2) -> None:
    """Two rows per strategy (compute, comm) over ``steady_iterations`` steady iterations."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 1.6 + 0.9 * len(results)), layout="constrained")
    ax = fig.subplots()
    labels = []
    for row, result in enumerate(results):
        warm = int(result.options.get("iterations", 8)) // 2
        shown = [s for s in result.spans if warm <= s.iteration < warm + steady_iterations]
        if not shown:
            continue
        t0 = min(float(s.start) for s in shown if s.stream == "compute")
        for stream, offset in (("compute", 0), ("comm", 1)):
            y = 2 * row + offset
            for kind in {s.kind for s in shown if s.stream == stream}:
                bars = [((float(s.start) - t0) * 1e3, float(s.end - s.start) * 1e3)
                        for s in shown if s.stream == stream and s.kind == kind]
                ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS.get(kind, "gray"), label=kind)
            labels.append(f"{result.strategy} {stream}")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the start of a steady-state iteration (simulated)")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    fig.legend(unique.values(), unique.keys(), loc="outside lower center", fontsize="small",
               ncols=len(unique))
    ax.set_title("jaxsched simulated timeline")
    fig.savefig(path, dpi=100)
