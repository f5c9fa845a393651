"""``jaxsched bench``: measured overlap on an emulated multi-host cluster.

Brings up ``hosts`` network namespaces joined by links shaped to ``bandwidth``
(`jaxsched.tools.cluster`), starts one process per host (`jaxsched.tools.launch`), each with
two CPU devices and pinned to one core, and measures in the same session, interleaved
step by step:

* ``plain``: the user's step (pmean after backward, one jitted program);
* ``compute``: the same step without the gradient reduction;
* ``comm``: the gradient reduction alone (one psum of a gradient-sized buffer), and
  ``comm_tree``: the psum of a gradient-shaped tree, leaf by leaf, as the plain step's
  ``pmean`` does it (on gloo the small leaves add start-up costs);
* ``ceiling``: the compute-only step and the comm-only psum (on the spare devices) as raw
  programs dispatched together: what the machine gives when both run at once. On hosts
  whose one core also runs gloo and the network stack this is well above the bound, and
  no schedule can beat it;
* every strategy through ``jaxsched.schedule(..., engine="host")``.

It first calibrates the per-process batch so that compute-only time is close to
comm-only time (otherwise one side dominates and overlap cannot show; these machines'
speed moves by 2x from day to day). For each strategy it reports the median step, the
speedup over the plain step, the ratio to the bound ``max(compute, comm)`` and to the
ceiling, and the overlap efficiency ``(T_plain - T_s) / (T_plain - bound)``; then one step per strategy
with stage timestamps (a Gantt PNG) beside the simulator's prediction for the same
measured costs.

Example (needs root for the namespaces; a few minutes)::

    jaxsched bench --hosts 2 --bandwidth 1gbit --strategies allreduce,wfbp,dear --steps 20 --json out.json
    python benchmarks/overlap.py --hosts 2 --bandwidth 1gbit

Example (the arithmetic of the report):
    >>> round(overlap_efficiency(plain=1.0, step=0.7, bound=0.5), 6)
    0.6
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from jaxsched.sim import _intervals as intervals
from jaxsched.tools._bench_worker import COMPRESSORS, parse_compression, worker
from jaxsched.tools._calibration import Calibration, calibrate_batch

__all__ = [
    "bench_figure",
    "calibrate_batch",
    "Calibration",
    "calibration_text",
    "CEILING_TARGETS",
    "chart_path",
    "COMPRESSORS",
    "format_report",
    "host_costs_of",
    "miss_reason",
    "missed_target",
    "overlap_efficiency",
    "parse_compression",
    "plot",
    "RESULTS_DIR",
    "run",
    "simulated",
    "speedups_withheld",
    "summarize",
    "time_breakdown",
    "worker",
]

WIDTH, DEPTH = 2048, 2  # the issue's set-up; --depth 8 --width 1024 sends the same bytes
RESULTS_DIR = Path("benchmarks/results")


def overlap_efficiency(plain: float, step: float, bound: float) -> float:
    """How much of the time that overlap could save a strategy saves: 1 at the bound.

    Args:
      plain: the plain step's median, seconds.
      step: the strategy's median step, seconds.
      bound: ``max(compute, comm)``, seconds.

    Returns:
      ``(plain - step) / (plain - bound)``; 0 when the plain step is at the bound already.

    Example:
      >>> from jaxsched.tools import bench
      >>> round(bench.overlap_efficiency(plain=1.0, step=0.75, bound=0.5), 6), bench.overlap_efficiency(0.5, 0.5, 0.5)
      (0.5, 0.0)
    """
    return (plain - step) / (plain - bound) if plain > bound else 0.0


# -- the driver --------------------------------------------------------------------------------
def speedups_withheld(calibration: dict[str, Any] | None) -> str | None:
    """Why speed-ups must not be reported, or None.

    A speed-up over the plain step only says something about overlap when compute and
    comm are about equal; when the calibration did not get them there, one side dominates
    and every strategy looks like the plain step (or better only by noise).

    Args:
      calibration: the run's calibration record (None: not recorded).

    Returns:
      The reason, or None when speed-ups may be reported.

    Example:
      >>> from jaxsched.tools import bench
      >>> bench.speedups_withheld({"converged": True}) is None
      True
      >>> print(bench.speedups_withheld({"converged": False, "achieved_ratio": 3.0, "batch": 64,
      ...                                "tolerance": 0.25, "reason": "batch limit"}))
      calibration did not converge: compute/comm = 3.00 at batch 64, outside 1 +- 25% (batch limit); ...
    """
    if not calibration or calibration.get("explicit_batch") or calibration.get("converged"):
        return None
    return (
        f"calibration did not converge: compute/comm = {calibration['achieved_ratio']:.2f} "
        f"at batch {calibration['batch']}, outside 1 +- {calibration['tolerance']:.0%} "
        f"({calibration.get('reason')}); pass --batch to measure anyway"
    )


def summarize(raw: dict[str, Any], strategies: Sequence[str], bandwidth: str) -> dict[str, Any]:
    """The report: compute, comm, bound, and per strategy step, speedup, efficiency."""
    med = raw["median_s"]
    compute_s, comm_s, plain_s = med["compute"], med["comm"], med["plain"]
    bound = max(compute_s, comm_s)
    ceiling = med.get("ceiling")
    result: dict[str, Any] = {
        "compute_s": compute_s,
        "comm_s": comm_s,
        "bound_s": bound,
        "ceiling_s": ceiling,
        "comm_tree_s": med.get("comm_tree"),
        "plain_s": plain_s,
        "bandwidth": bandwidth,
        "processes": raw["processes"],
        "batch_per_process": raw["batch_per_process"],
        "steps": raw["steps"],
        "layers": raw.get("layers", {}),
        "calibration": raw.get("calibration"),
        "host_costs": raw.get("host_costs"),
        "strategies": {},
    }
    withheld = speedups_withheld(raw.get("calibration"))
    result["speedups_withheld"] = withheld
    # the machine drifts between the calibration probes and the measured steps: say by how much
    result["measured_ratio"] = compute_s / comm_s if comm_s else None
    for name in strategies:
        if name in raw.get("missing", []):
            result["strategies"][name] = {"missing": True}
            continue
        step = med[name]
        result["strategies"][name] = {
            "step_s": step,
            "speedup": None if withheld else plain_s / step,
            "ratio_to_bound": step / bound,
            "ratio_to_ceiling": step / ceiling if ceiling else None,
            "overlap_efficiency": None if withheld else overlap_efficiency(plain_s, step, bound),
            "max_loss_gap_to_plain": max(abs(a - b) for a, b in zip(raw["losses"][name], raw["losses"]["plain"])),
        }
        spans = raw.get("timelines", {}).get(name)
        if spans:
            result["strategies"][name]["breakdown"] = time_breakdown(spans)
    for name, row in result["strategies"].items():
        missed = None if row.get("missing") else missed_target(name, row, result["strategies"])
        if missed:
            row["missed_target"] = missed
            if row.get("breakdown"):
                row["missed_because"] = miss_reason(row["breakdown"], compute_s)
    return result


#: What each strategy should reach on this machine, as a multiple of the ceiling.
CEILING_TARGETS = {"approx": 1.10, "wfbp": 1.25}


def time_breakdown(spans: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Where one measured step's time went: compute alone, communication alone (exposed),
    both at once (overlapped), and neither (dispatch, waiting), from its stage spans.

    Args:
      spans: the step's stages, each with ``kind`` (``"compute"`` or ``"comm"``),
        ``started`` and ``done`` (seconds).

    Returns:
      ``step_s``, ``compute_alone_s``, ``comm_alone_s``, ``overlapped_s`` and ``idle_s``.

    Example:
        >>> spans = [dict(kind="compute", started=0.0, done=0.3), dict(kind="comm", started=0.2, done=0.5),
        ...          dict(kind="compute", started=0.6, done=0.7)]
        >>> {k: round(v, 2) for k, v in time_breakdown(spans).items()}
        {'step_s': 0.7, 'compute_alone_s': 0.3, 'comm_alone_s': 0.2, 'overlapped_s': 0.1, 'idle_s': 0.1}
    """
    compute = intervals.union([(x["started"], x["done"]) for x in spans if x["kind"] == "compute"])
    comm = intervals.union([(x["started"], x["done"]) for x in spans if x["kind"] == "comm"])
    start = min((x["started"] for x in spans), default=0.0)
    end = max((x["done"] for x in spans), default=0.0)
    both = intervals.overlap(compute, comm)
    busy = intervals.total(compute) + intervals.total(comm) - both
    return {
        "step_s": end - start,
        "compute_alone_s": intervals.total(compute) - both,
        "comm_alone_s": intervals.total(comm) - both,
        "overlapped_s": both,
        "idle_s": max(0.0, (end - start) - busy),
    }


def missed_target(name: str, row: dict[str, Any], strategies: dict[str, Any]) -> str | None:
    """Which target of `CEILING_TARGETS` (or ``dear`` no slower than ``allreduce``)
    ``name`` missed in this run, or None.

    Args:
      name: the strategy.
      row: its summarized row (``step_s``, ``ratio_to_ceiling``).
      strategies: every strategy's row, by name.

    Returns:
      What was missed, or None.

    Example:
      >>> from jaxsched.tools import bench
      >>> bench.missed_target("wfbp", {"step_s": 0.5, "ratio_to_ceiling": 1.4}, {})
      'target <= 1.25x the ceiling missed (1.40x)'
    """
    target = CEILING_TARGETS.get(name)
    if target is not None and row.get("ratio_to_ceiling") and row["ratio_to_ceiling"] > target:
        return f"target <= {target:.2f}x the ceiling missed ({row['ratio_to_ceiling']:.2f}x)"
    if name == "dear" and "allreduce" in strategies and not strategies["allreduce"].get("missing"):
        if row["step_s"] > strategies["allreduce"]["step_s"]:
            return (
                f"target: no slower than allreduce, missed "
                f"({row['step_s'] * 1e3:.0f} against {strategies['allreduce']['step_s'] * 1e3:.0f} ms)"
            )
    return None


def miss_reason(breakdown: dict[str, float], compute_s: float) -> str:
    """The measured reason a step is longer than its ceiling: how much longer its compute
    ran than the compute-only step (``compute_s``), and what was exposed or idle.

    Args:
      breakdown: the step's `time_breakdown`.
      compute_s: the compute-only step's median, seconds.

    Returns:
      One line of text.

    Example:
        >>> miss_reason({"step_s": 0.5, "compute_alone_s": 0.13, "comm_alone_s": 0.0,
        ...              "overlapped_s": 0.37, "idle_s": 0.0}, compute_s=0.25)
        'compute ran 500 ms against 250 ms alone (2.00x, slowed while bytes moved), comm exposed 0 ms, neither 0 ms'
    """
    ran = breakdown["compute_alone_s"] + breakdown["overlapped_s"]
    return (
        f"compute ran {ran * 1e3:.0f} ms against {compute_s * 1e3:.0f} ms alone "
        f"({ran / compute_s:.2f}x, slowed while bytes moved), comm exposed "
        f"{breakdown['comm_alone_s'] * 1e3:.0f} ms, neither {breakdown['idle_s'] * 1e3:.0f} ms"
    )


def host_costs_of(result: dict[str, Any]):
    """The measured host-engine terms for the simulator (`jaxsched.sim.HostCosts`):
    stage dispatch and copy cost measured by the workers, and the compute slow-down while
    bytes move derived from the measured ceiling (`jaxsched.sim.comm_slowdown_from_ceiling`).
    None when the run measured none of them (an older raw report).

    Args:
      result: the summarized report (``host_costs``, ``compute_s``, ``comm_s``, ``ceiling_s``).

    Returns:
      The `jaxsched.sim.HostCosts`, or None.

    Example:
      >>> from jaxsched.tools import bench
      >>> result = {"host_costs": {"stage_s": 1e-4, "copy_s_per_byte": 1e-9},
      ...           "compute_s": 0.3, "comm_s": 0.3, "ceiling_s": 0.33}
      >>> host = bench.host_costs_of(result)
      >>> host.stage_s, round(host.comm_slowdown, 4), bench.host_costs_of({})
      (0.0001, 1.1111, None)
    """
    from jaxsched.sim import HostCosts, comm_slowdown_from_ceiling

    measured = result.get("host_costs")
    if not measured:
        return None
    slowdown = 1.0
    if result.get("ceiling_s"):
        slowdown = comm_slowdown_from_ceiling(result["compute_s"], result["comm_s"], result["ceiling_s"])
    return HostCosts(stage_s=measured["stage_s"], copy_s_per_byte=measured["copy_s_per_byte"], comm_slowdown=slowdown)


def simulated(result: dict[str, Any], strategies: Sequence[str]):
    """The simulator's prediction for the measured costs (labelled SIMULATED), with the
    host engine's measured terms (`host_costs_of`)."""
    from jaxsched.sim._costmodel import CollectiveCost, Layer, LayerProfile, NetworkProfile
    from jaxsched.sim import simulate

    host = host_costs_of(result)

    width = result.get("layers", {}).get("width", WIDTH)
    depth = result.get("layers", {}).get("depth", DEPTH)
    per_layer = result["compute_s"] / depth
    nbytes = (width * width + width) * 4
    layers = LayerProfile(
        [Layer(f"layer{i}", width * width + width, nbytes, per_layer / 3, 2 * per_layer / 3) for i in range(depth)],
        {"source": "measured compute-only step split 1:2 forward:backward"},
    )
    beta = result["comm_s"] / (depth * nbytes)
    # reduce-scatter and all-gather: half each of the measured pair when bench timed it
    # (on gloo the pair costs more than one all-reduce), else half an all-reduce each
    pair_s = (result.get("host_costs") or {}).get("reduce_scatter_all_gather_s")
    half = (pair_s / 2 / (depth * nbytes)) if pair_s else beta * 0.5
    costs = {
        "all_reduce": CollectiveCost(0.0, beta),
        "reduce_scatter": CollectiveCost(0.0, half),
        "all_gather": CollectiveCost(0.0, half),
    }
    network = NetworkProfile(
        result["processes"],
        costs,
        {"source": "measured comm-only psum" + (" and reduce-scatter + all-gather" if pair_s else "")},
    )
    sims = {}
    for name in strategies:
        if result["strategies"].get(name, {}).get("missing"):
            continue
        try:
            if "+" in name:
                continue  # compressed variants are measured, not simulated here
            # one bucket per layer, allreduce included: the plain step's pmean reduces the
            # gradient tree leaf by leaf and the host engine runs each psum as its own
            # stage, so each leaf's copies to and from the spare device overlap the other
            # leaves' psums (one bucket would price one serial copy of every gradient)
            sims[name] = simulate(layers, network, name, [[i] for i in range(depth)], host=host)
        except Exception:  # a strategy the simulator does not model
            continue
    return sims


def chart_path(folder: Path, result: dict[str, Any], strategies: Sequence[str]) -> Path:
    """``bench_<depth>x<width>_<strategies>.png``: one chart per model and strategy set, so a
    run on one model does not overwrite another's chart.

    Args:
      folder: where the charts go.
      result: the summarized report (its ``layers``).
      strategies: the strategies charted.

    Returns:
      The chart's path.

    Example:
        >>> from pathlib import Path
        >>> from jaxsched.tools import bench
        >>> bench.chart_path(Path("out"), {"layers": {"depth": 8, "width": 1024}}, ["wfbp", "dear+topk:0.01"]).name
        'bench_8x1024_wfbp-dear+topk0.01.png'
    """
    layers = result.get("layers", {})
    names = "-".join(re.sub(r"[^A-Za-z0-9_.+]", "", n) for n in strategies)
    return folder / f"bench_{layers.get('depth', DEPTH)}x{layers.get('width', WIDTH)}_{names}.png"


_SIM_BUCKET = re.compile(r"\bb(\d+)\b")


def _sim_label(name: str) -> str:
    """The simulator's task names with buckets spelled out: ``all_reduce b3`` -> ``all_reduce bucket 3``."""
    return _SIM_BUCKET.sub(lambda m: f"bucket {m.group(1)}", name)


def bench_figure(raw: dict[str, Any], result: dict[str, Any], sims: dict):
    """The Gantt figure: per strategy, its measured stages (one traced step, labelled with
    what each stage runs) and, only when the simulator models it, the simulated iteration."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    names = list(raw["timelines"])
    panels = [p for name in names for p in [(name, "measured")] + ([(name, "simulated")] if name in sims else [])]
    fig = Figure(figsize=(13, 1.6 + 1.4 * max(1, len(panels))))
    axes = fig.subplots(max(1, len(panels)), 1, squeeze=False)[:, 0]
    colors = {"compute": "#4C72B0", "comm": "#DD8452"}
    for ax, (name, what) in zip(axes, panels):
        if what == "measured":
            spans = raw["timelines"][name]
            end = max((s["done"] for s in spans), default=1.0)
            for row, kind in enumerate(("compute", "comm")):
                mine = [x for x in spans if x["kind"] == kind]
                for s in mine:
                    width = s["done"] - s["started"]
                    ax.barh(
                        row, width, left=s["started"], height=0.6, color=colors[kind], edgecolor="black", linewidth=0.8
                    )
                    if width > 0.05 * end:
                        ax.text(
                            s["started"] + width / 2,
                            row,
                            s["name"],
                            ha="center",
                            va="center",
                            fontsize=6.5,
                            color="white",
                            clip_on=True,
                        )
                ax.plot([s["dispatched"] for s in mine], [row - 0.4] * len(mine), "k|", markersize=6)
            row_result = result["strategies"][name]
            measured = row_result["step_s"]
            title = f"{name}: MEASURED stages of one step (ticks: dispatch; median step {measured * 1e3:.0f} ms)"
            parts = time_breakdown(spans)
            where = (
                f"this step {parts['step_s'] * 1e3:.0f} ms: compute alone "
                f"{parts['compute_alone_s'] * 1e3:.0f}, comm alone (exposed) "
                f"{parts['comm_alone_s'] * 1e3:.0f}, overlapped {parts['overlapped_s'] * 1e3:.0f}, "
                f"neither {parts['idle_s'] * 1e3:.0f} ms"
            )
            missed = missed_target(name, row_result, result["strategies"])
            if missed:
                where = f"{missed}\n{where}\nwhy: {miss_reason(parts, result['compute_s'])}"
            ax.set_title(title + "\n" + where, fontsize=8, color="firebrick" if missed else "black")
        else:
            sim = sims[name]
            steady = [s for s in sim.spans if s.iteration == sim.spans[-1].iteration - 1]
            t0 = min((float(s.start) for s in steady), default=0.0)
            end = max((float(s.end) - t0 for s in steady), default=1.0)
            for s in steady:
                row = 0 if s.stream == "compute" else 1
                width = float(s.end - s.start)
                ax.barh(
                    row,
                    width,
                    left=float(s.start) - t0,
                    height=0.6,
                    color=colors["compute" if row == 0 else "comm"],
                    edgecolor="black",
                    linewidth=0.5,
                )
                if width > 0.05 * end:
                    ax.text(
                        float(s.start) - t0 + width / 2,
                        row,
                        _sim_label(s.name),
                        ha="center",
                        va="center",
                        fontsize=6.5,
                        color="white",
                        clip_on=True,
                    )
            ax.set_title(
                f"{name}: SIMULATED for the measured costs (iteration {float(sim.iteration_s) * 1e3:.0f} ms)",
                fontsize=9,
            )
        ax.set_yticks([0, 1], ["compute", "comm"])
    axes[-1].set_xlabel("seconds")
    fig.suptitle(
        f"{_model_text(result)}, {result['processes']} hosts, {result['bandwidth']} links, "
        f"batch {result['batch_per_process']}"
        f"/process; compute {result['compute_s'] * 1e3:.0f} ms, comm {result['comm_s'] * 1e3:.0f} ms"
    )
    fig.tight_layout()
    return fig


def plot(raw: dict[str, Any], result: dict[str, Any], sims: dict, path: Path) -> None:
    """Write `bench_figure` to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    bench_figure(raw, result, sims).savefig(path, dpi=110)


def run(args: Any) -> int:
    from jaxsched.tools import cluster as cluster_lib
    from jaxsched.tools import launch as launch_lib

    strategies = list(args.strategies)
    if args.compression:  # every strategy that can carry it, compressed, beside the dense ones
        parse_compression(args.compression)
        strategies += [f"{s}+{args.compression}" for s in strategies if s in ("wfbp", "dear")]
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "raw.json"
        worker = [
            sys.executable,
            "-m",
            "jaxsched.tools.cli._bench",
            "--worker",
            "--raw-out",
            str(raw_path),
            "--steps",
            str(args.steps),
            "--worker-strategies",
            ",".join(strategies),
            "--depth",
            str(args.depth),
            "--width",
            str(args.width),
        ]
        if args.batch:
            worker += ["--batch", str(args.batch)]
        worker += [
            "--calibration-start",
            str(args.calibration_start),
            "--calibration-tolerance",
            str(args.calibration_tolerance),
            "--calibration-probes",
            str(args.calibration_probes),
        ]
        if args.buckets:
            worker += ["--buckets", str(args.buckets)]
        if not args.no_pin:
            worker += ["--pin"]
        env = {
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])
        }
        if args.no_cluster:
            code = launch_lib.launch(args.hosts, worker, env=env, timeout_s=args.timeout, verbose=False)
        else:
            with cluster_lib.Cluster.up(args.hosts, args.bandwidth, prefix=args.prefix) as cluster:
                code = launch_lib.launch(
                    args.hosts, worker, cluster=cluster, env=env, timeout_s=args.timeout, verbose=False
                )
        if code != 0:
            print(f"jaxsched bench: the benchmark processes failed (exit status {code})", file=sys.stderr)
            return code
        raw = json.loads(raw_path.read_text())
    bandwidth = "unshaped loopback" if args.no_cluster else args.bandwidth
    result = summarize(raw, strategies, bandwidth)
    sims = simulated(result, strategies)
    host = host_costs_of(result)
    if host is not None:
        result["host_costs"]["comm_slowdown"] = host.comm_slowdown
    result["simulated"] = {
        n: {
            "iteration_s": float(s.iteration_s),
            "error_vs_measured": float(s.iteration_s) / result["strategies"][n]["step_s"] - 1,
        }
        for n, s in sims.items()
    }
    result["date"] = time.strftime("%Y-%m-%d %H:%M")
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    results_dir = RESULTS_DIR if args.save else Path(args.out)
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "overlap.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    png = Path(args.png) if args.png else chart_path(results_dir, result, strategies)
    plot(raw, result, sims, png)
    print(f"Gantt chart (measured stages beside the simulator): {png}")
    return 0


def _model_text(result: dict[str, Any]) -> str:
    layers = result.get("layers", {})
    return f"{layers.get('depth', DEPTH)}x{layers.get('width', WIDTH)} tanh MLP"


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"{_model_text(result)}, {result['processes']} hosts, {result['bandwidth']}, "
        f"batch {result['batch_per_process']} per "
        f"process, medians of {result['steps']} interleaved steps (MEASURED)",
        f"  compute only {result['compute_s'] * 1e3:7.1f} ms   comm only {result['comm_s'] * 1e3:7.1f} ms"
        f"   bound {result['bound_s'] * 1e3:7.1f} ms   plain step {result['plain_s'] * 1e3:7.1f} ms",
        (
            f"  comm of the gradient tree leaf by leaf, as the plain step's pmean {result['comm_tree_s'] * 1e3:7.1f} ms"
            if result.get("comm_tree_s")
            else "  comm of the gradient tree: not measured"
        ),
        "  ceiling (compute and comm dispatched together as raw programs) "
        + (
            f"{result['ceiling_s'] * 1e3:7.1f} ms = {result['plain_s'] / result['ceiling_s']:.2f}x the plain step"
            if result.get("ceiling_s")
            else "not measured"
        ),
        calibration_text(result.get("calibration"), result.get("measured_ratio")),
        *([f"  SPEED-UPS WITHHELD: {result['speedups_withheld']}"] if result.get("speedups_withheld") else []),
        f"  {'strategy':<10} {'step ms':>8} {'speedup':>8} {'x bound':>8} {'x ceiling':>9} "
        f"{'overlap eff':>12} {'sim ms':>8}",
    ]
    for name, r in result["strategies"].items():
        if r.get("missing"):
            lines.append(f"  {name:<10} missing (not a registered strategy yet)")
            continue
        sim = result.get("simulated", {}).get(name, {}).get("iteration_s")
        sim_txt = f"{sim * 1e3:8.1f}" if sim is not None else f"{'-':>8}"
        ceiling = r.get("ratio_to_ceiling")
        ceiling_txt = f"{ceiling:9.2f}" if ceiling else f"{'-':>9}"
        speedup = f"{r['speedup']:8.2f}" if r.get("speedup") is not None else f"{'-':>8}"
        eff = f"{r['overlap_efficiency']:12.2f}" if r.get("overlap_efficiency") is not None else f"{'-':>12}"
        lines.append(
            f"  {name:<10} {r['step_s'] * 1e3:8.1f} {speedup} {r['ratio_to_bound']:8.2f} {ceiling_txt} {eff} {sim_txt}"
        )
    for name, r in result["strategies"].items():
        if r.get("missed_target"):
            lines.append(
                f"  {name}: {r['missed_target']}"
                + (f"; measured: {r['missed_because']}" if r.get("missed_because") else "")
            )
    return "\n".join(lines)


def calibration_text(calibration: dict[str, Any] | None, measured_ratio: float | None = None) -> str:
    """One line: how the batch was chosen and how close compute came to comm (in the probes
    and, with ``measured_ratio``, in the measured steps that followed).

    Args:
      calibration: the run's calibration record (None: not recorded).
      measured_ratio: compute/comm in the measured steps.

    Returns:
      The line, indented for the report.

    Example:
      >>> from jaxsched.tools import bench
      >>> bench.calibration_text({"explicit_batch": True, "batch": 64}), bench.calibration_text(None)
      ('  calibration: none (--batch 64 given)', '  calibration: not recorded')
    """
    if not calibration:
        return "  calibration: not recorded"
    if calibration.get("explicit_batch"):
        return f"  calibration: none (--batch {calibration['batch']} given)"
    probes = ", ".join(
        f"{p['batch']}: {p['compute_s'] * 1e3:.1f}/{p['comm_s'] * 1e3:.1f} ms" for p in calibration["probes"]
    )
    state = "converged" if calibration["converged"] else "NOT CONVERGED"
    return (
        f"  calibration {state}: compute/comm {calibration['achieved_ratio']:.2f} (target 1, "
        f"error {calibration['error']:+.1%}, tolerance {calibration['tolerance']:.0%}) after "
        f"{len(calibration['probes'])} probes (batch: compute/comm) {probes}"
        + (f"; in the measured steps compute/comm {measured_ratio:.2f}" if measured_ratio is not None else "")
    )
