"""The Gantt chart shows what a person needs to read a plan: one bar per bucket, iterations,
distinct colours per task kind, a title naming the set-up."""

from __future__ import annotations

import dataclasses

from matplotlib.colors import to_hex

from jaxsched.sim._costmodel import Layer, LayerProfile, network_preset
from jaxsched.sim import simulate
from jaxsched.sim._timeline import COLORS, gantt_figure


def _wfbp_with_four_buckets():
    layers = LayerProfile([Layer(f"l{i}", 10**6, 4 * 10**6, 1e-3, 2e-3) for i in range(8)])
    network = dataclasses.replace(network_preset("1gbe", 8), dispatch_s=1e-4, copy_s_per_byte=1e-11)
    buckets = [[0, 1], [2, 3], [4, 5], [6, 7]]
    return simulate(layers, network, "wfbp", buckets, iterations=6), network


def _bars(ax, y):
    return [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - y) < 1e-9]


def test_each_bucket_is_its_own_outlined_bar_and_neighbours_differ_in_shade():
    result, _ = _wfbp_with_four_buckets()
    fig = gantt_figure([result], steady_iterations=2, title="toy, 8 workers, 1gbe")
    ax = fig.axes[0]
    comm = sorted(_bars(ax, 1), key=lambda p: p.get_x())
    assert len(comm) == 4 * 2  # 4 buckets in each of 2 iterations, none merged
    for bar in comm:
        assert bar.get_linewidth() > 0 and to_hex(bar.get_edgecolor()) == "#ffffff"
    for left, right in zip(comm[:4], comm[1:4]):  # neighbours in one iteration
        assert to_hex(left.get_facecolor()) != to_hex(right.get_facecolor())
    labels = {t.get_text() for t in ax.texts}
    # spelled out ("all-reduce bucket 0") where the bar is wide enough, "b0" where it is not
    assert all(labels & {f"b{k}", f"bucket {k}", f"all-reduce bucket {k}"} for k in range(4)), labels
    assert {"iteration 1", "iteration 2"} <= labels


def test_title_legend_and_small_tasks_are_readable():
    result, network = _wfbp_with_four_buckets()
    fig = gantt_figure([result], title=f"toy, {network.workers} workers, 1gbe")
    ax = fig.axes[0]
    assert "toy, 8 workers, 1gbe" in ax.get_title() and "SIMULATED" in ax.get_title()
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"dispatch", "pack", "unpack", "update", "all-reduce"} <= legend
    assert len({COLORS[k] for k in ("dispatch", "pack", "unpack")}) == 3
    span = ax.get_xlim()[1]
    compute = _bars(ax, 0)
    updates = [p for p in compute if to_hex(p.get_facecolor()) == COLORS["update"]]
    assert updates and all(p.get_width() >= 0.006 * span * 0.99 for p in updates)
