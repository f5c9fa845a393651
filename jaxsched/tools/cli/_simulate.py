"""``jaxsched simulate`` and ``jaxsched profile``: the simulator and profilers from the shell.

Examples:
    jaxsched simulate --model resnet50 --workers 64 --network 10gbe --device v100 \\
        --strategies allreduce,wfbp,mgwfbp,bytescheduler,dear,approx --planner optimal
    jaxsched simulate --model gpt2 --workers 64 --network nvlink4+400gbib --per-node 8 --device h100
    jaxsched simulate --profile layers.json --network-profile net.json --json out.json
    jaxsched simulate --model gpt2 --workers 16 --network nvlink4+10gbe --per-node 8 --device h100 \\
        --strategies wfbp,diloco --inner-steps 10 --fragments 4 --overlap-steps 1 --outer-bits 4
    jaxsched profile --model mlp --out layers.json --network-out net.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from jaxsched._errors import JaxschedValueError
from jaxsched.tools.cli._options import (
    CommandError,
    add_command,
    existing_file,
    fraction,
    name_list,
    output_path,
    positive_float,
    positive_int,
    prepare_output,
    request_cpu_devices,
)
from jaxsched.sim._costmodel import (
    DEVICE_PRESETS,
    LINK_PRESETS,
    LayerProfile,
    NetworkProfile,
    device_preset,
    network_preset,
    topk_selection_s_per_byte,
)
from jaxsched.sim import COMPRESSIONS, SIMULATED, Compression, SimResult, lower_bound, simulate
from jaxsched.sim._core import MB

if TYPE_CHECKING:
    from jaxsched.sim._diloco import DiLoCoSimResult

__all__ = [
    "check_strategy",
    "DEFAULT_PLANNER",
    "DEFAULT_STRATEGIES",
    "DEFAULT_WORKERS",
    "network_name",
    "OPTIMIZERS",
    "PLANNERS",
    "PROFILE_MODELS",
    "register",
    "run_profile",
    "run_simulate",
]

DEFAULT_WORKERS = 8
DEFAULT_STRATEGIES = "allreduce,wfbp,mgwfbp,bytescheduler,dear,approx"
# Planner each strategy uses unless --planner overrides it (allreduce is the fixed reference:
# one bucket; bytescheduler partitions tensors itself).
DEFAULT_PLANNER = {
    "wfbp": "per_layer",
    "mgwfbp": "mgwfbp",
    "dear": "threshold",
    "approx": "threshold",
    "fsdp": "per_layer",  # gathers per layer; each layer's reduce-scatter as its backward ends
}
PLANNERS = ("per_layer", "threshold", "mgwfbp", "prophet", "optimal")
PROFILE_MODELS = ("mlp", "cnn", "transformer")
OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")


def _periodic(name: str) -> bool:
    """Whether ``name`` is a strategy that synchronizes every few steps (DiLoCo), which
    `jaxsched.sim._diloco` models instead of the per-step simulator."""
    from jaxsched.sim._costmodel import comm_pattern, comm_pattern_names

    return name in comm_pattern_names() and comm_pattern(name).periodic_sync


def check_strategy(name: str) -> None:
    """``name`` is a simulated strategy, optionally with ``+topk`` or ``+gtopk``."""
    base, _, comp = name.partition("+")
    if _periodic(base):
        if comp:
            raise JaxschedValueError(f"{name!r}: compress {base}'s outer gradients with --outer-bits")
        return
    if base == "auto":
        raise JaxschedValueError("'auto' runs one of allreduce, wfbp and dear, chosen per step: simulate those")
    if base not in SIMULATED:
        raise JaxschedValueError(f"{base!r} is unknown; choose from {', '.join(SIMULATED)}")
    if comp and comp not in COMPRESSIONS:
        raise JaxschedValueError(f"compression {comp!r} in {name!r} is unknown; use +{' or +'.join(COMPRESSIONS)}")


def _levels(network: NetworkProfile) -> str:
    levels = network.meta.get("levels")
    if not levels:
        return ""
    return f" ({levels['nodes']} nodes x {levels['per_node']} devices, {network.meta.get('algorithm')})"


def network_name(text: str) -> str:
    """A link preset, or two joined by ``+`` (fast within a node, slow between nodes)."""
    parts = text.split("+")
    unknown = [p for p in parts if p not in LINK_PRESETS]
    if unknown or len(parts) > 2:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use one of {', '.join(sorted(LINK_PRESETS))}, or 'fast+slow' (e.g. nvlink4+400gbib, ici+dcn)"
        )
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``simulate`` and ``profile``."""
    from jaxsched.sim._zoo_profiles import ZOO_MODELS

    sim = add_command(
        subparsers,
        "simulate",
        "simulate strategies on a model and cluster (figures are simulated, not measured)",
        __doc__.split("\n\n", 1)[1],
    )
    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=ZOO_MODELS, help="a published model's roofline profile")
    src.add_argument("--profile", type=existing_file, help="layer profile JSON (from `jaxsched profile` or your own)")
    sim.add_argument("--workers", type=positive_int, default=DEFAULT_WORKERS, help="data-parallel workers")
    sim.add_argument(
        "--network",
        type=network_name,
        default="10gbe",
        help=f"link preset ({', '.join(sorted(LINK_PRESETS))}) or a two-level "
        "'fast+slow' pair of them, e.g. nvlink4+400gbib (then --per-node)",
    )
    sim.add_argument("--per-node", type=positive_int, help="devices per node on a two-level --network (default 8)")
    sim.add_argument(
        "--flat",
        action="store_true",
        help="on a two-level --network, one flat ring over all devices instead of the hierarchical all-reduce",
    )
    sim.add_argument(
        "--network-profile", type=existing_file, help="network profile JSON; overrides --network/--workers"
    )
    sim.add_argument("--device", choices=sorted(DEVICE_PRESETS), default="v100", help="device roofline for --model")
    sim.add_argument("--batch", type=positive_int, help="per-device batch for --model (default: per model)")
    sim.add_argument(
        "--seq-len", type=positive_int, help="sequence length for a transformer --model (default: per model)"
    )
    sim.add_argument("--efficiency", type=fraction, default=0.5, help="fraction of device peak sustained")
    sim.add_argument(
        "--strategies",
        type=name_list(lambda: SIMULATED, check_strategy),
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated from {', '.join(SIMULATED)}, or diloco (with --inner-steps); add +topk or "
        "+gtopk for compression, e.g. wfbp+gtopk",
    )
    sim.add_argument(
        "--strategy", dest="strategies", help=argparse.SUPPRESS, type=name_list(lambda: SIMULATED, check_strategy)
    )  # one name reads better
    sim.add_argument(
        "--planner",
        choices=PLANNERS,
        help="bucket planner for every strategy (default: "
        + ", ".join(f"{k}: {v}" for k, v in DEFAULT_PLANNER.items())
        + ")",
    )
    sim.add_argument("--threshold-mb", type=positive_float, default=25.0, help="bucket size for the threshold planner")
    sim.add_argument("--partition-mb", type=positive_float, help="ByteScheduler partition (default: tuned)")
    sim.add_argument("--credit-mb", type=positive_float, help="ByteScheduler credit (default: tuned)")
    sim.add_argument("--density", type=fraction, default=0.001, help="top-k density for +topk/+gtopk")
    sim.add_argument("--iterations", type=positive_int, default=8, help="iterations simulated")
    sim.add_argument(
        "--inner-steps",
        type=positive_int,
        default=50,
        help="diloco: inner steps H between synchronizations of a fragment",
    )
    sim.add_argument("--fragments", type=positive_int, default=1, help="diloco: fragments (streaming)")
    sim.add_argument(
        "--overlap-steps", type=int, default=0, help="diloco: inner steps a fragment's outer all-reduce is in flight"
    )
    sim.add_argument(
        "--outer-bits",
        type=int,
        choices=(4, 8, 32),
        default=32,
        help="diloco: bits per outer-gradient element sent (32: float32)",
    )
    sim.add_argument(
        "--shared-stream",
        action="store_true",
        help="collectives run inline on the compute stream (XLA:CPU): no overlap",
    )
    sim.add_argument("--json", type=output_path, help="write the results here")
    sim.add_argument("--trace", type=output_path, help="write a Chrome-trace JSON timeline here (open in Perfetto)")
    sim.add_argument("--png", type=output_path, help="write a Gantt chart PNG here")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    sim.set_defaults(run=run_simulate)

    prof = add_command(
        subparsers, "profile", "measure a zoo model's layers and this mesh's collectives, and write profile JSON files"
    )
    prof.add_argument("--model", choices=PROFILE_MODELS, required=True, help="zoo model to measure")
    prof.add_argument("--batch", type=positive_int, default=64, help="batch per device")
    prof.add_argument("--devices", type=positive_int, default=8, help="virtual CPU devices for the mesh")
    prof.add_argument("--out", type=output_path, default="layers.json", help="layer profile JSON")
    prof.add_argument("--network-out", type=output_path, default="network.json", help="network profile JSON")
    prof.add_argument("--repeats", type=positive_int, default=5, help="timed runs per median")
    prof.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="none", help="also measure each layer's optimizer update (update_s)"
    )
    prof.add_argument("--learning-rate", type=positive_float, default=1e-3, help="for --optimizer")
    prof.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    prof.set_defaults(run=run_profile)


def _split_strategies(names: list[str]) -> list[tuple[str, str, str | None]]:
    """``wfbp+gtopk`` -> (``wfbp+gtopk``, ``wfbp``, ``gtopk``); names were checked when parsing."""
    split = []
    for name in names:
        base, _, compression = name.partition("+")
        split.append((name, base, compression or None))
    return split


def _input_errors_as_command_errors(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Profiles and presets report bad values with ValueError; show them as one line, exit 2."""

    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ValueError as err:
            raise CommandError(str(err)) from err

    return wrapped


def _inputs(args: argparse.Namespace) -> tuple[LayerProfile, NetworkProfile, str]:
    if args.profile:
        layers = LayerProfile.load(args.profile)
        label = args.profile
    else:
        from jaxsched.sim._zoo_profiles import zoo_profile

        layers = zoo_profile(args.model, args.device, args.batch, args.seq_len, args.efficiency)
        label = f"{args.model} (batch {layers.meta['batch']}, {args.device} roofline)"
    if args.network_profile:
        network = NetworkProfile.load(args.network_profile)
        if args.workers != network.workers and args.workers != DEFAULT_WORKERS:
            print(
                f"note: {args.network_profile} was measured on {network.workers} workers; "
                f"--workers {args.workers} is ignored",
                file=sys.stderr,
            )
    else:
        two_level = "+" in args.network
        if not two_level and (args.per_node or args.flat):
            raise JaxschedValueError(
                f"--per-node and --flat describe a two-level network; "
                f"--network {args.network} is one level (try nvlink4+{args.network})"
            )
        per_node = (args.per_node or 8) if two_level else None
        network = network_preset(args.network, args.workers, per_node, hierarchical=not args.flat)
    return layers, network, label


def _bytescheduler(
    layers: LayerProfile, network: NetworkProfile, args: argparse.Namespace, progress: bool
) -> SimResult:
    """ByteScheduler auto-tunes partition and credit; we grid-search them in the simulator."""
    if args.partition_mb is not None:
        partitions = [int(args.partition_mb * MB)]
    else:
        partitions = [MB << e for e in range(7)]
    credits: list[int | None] = [1, 2, 4] if args.credit_mb is None else [None]
    grid = [(p, int(args.credit_mb * MB) if c is None else p * c) for p in partitions for c in credits]
    if progress:
        from jaxsched.core._progress import progress as progress_bar

        grid = progress_bar(grid, "bytescheduler tuning", leave=False)
    best: tuple[float, int, int] | None = None  # (seconds, partition, credit)
    for partition, credit in grid:
        result = simulate(
            layers,
            network,
            "bytescheduler",
            iterations=args.iterations,
            partition_bytes=partition,
            credit_bytes=credit,
            shared_stream=args.shared_stream,
            keep_spans=False,
        )
        if best is None or result.iteration_s < best[0]:
            best = (result.iteration_s, partition, credit)
    assert best is not None  # the grid is never empty
    return simulate(
        layers,
        network,
        "bytescheduler",
        iterations=args.iterations,
        partition_bytes=best[1],
        credit_bytes=best[2],
        shared_stream=args.shared_stream,
    )


@_input_errors_as_command_errors
def run_simulate(args: argparse.Namespace) -> int:
    from jaxsched.plan import plan_buckets

    for path in (args.json, args.trace, args.png):
        prepare_output(path)
    layers, network, label = _inputs(args)
    progress = not args.no_progress
    strategies = _split_strategies(args.strategies)
    selection = topk_selection_s_per_byte(device_preset(args.device))
    results: dict[str, SimResult] = {}
    planners: dict[str, str] = {}
    periodic: dict[str, DiLoCoSimResult] = {}
    for name, base, comp in strategies:
        if _periodic(base):
            from jaxsched.sim._diloco import simulate_diloco

            periodic[name] = simulate_diloco(
                layers, network, args.inner_steps, args.fragments, args.overlap_steps, args.outer_bits
            )
            continue
        compression = Compression(comp, args.density, selection) if comp else None
        if base == "bytescheduler":
            results[name] = _bytescheduler(layers, network, args, progress)
            planners[name] = "bytescheduler"
            continue
        if base == "allreduce":
            planner, buckets = "one bucket", [list(range(len(layers)))]
        else:
            planner = args.planner or DEFAULT_PLANNER.get(base, "threshold")
            buckets = plan_buckets(
                layers,
                network,
                planner,
                base,
                threshold_bytes=int(args.threshold_mb * MB),
                compression=compression,
                progress=progress,
            )
        planners[name] = planner
        results[name] = simulate(
            layers,
            network,
            base,
            buckets,
            iterations=args.iterations,
            compression=compression,
            shared_stream=args.shared_stream,
        )
    bound, compute_min, comm_min = lower_bound(layers, network)
    reference = results.get("allreduce")
    print(
        f"{label}: {len(layers)} layers, {layers.total_params / 1e6:.2f}M params, "
        f"{network.workers} workers, {network.meta.get('preset', args.network_profile)}"
        f"{_levels(network)} -- SIMULATED"
    )
    print(
        f"compute {compute_min * 1e3:.1f} ms, one all-reduce of all gradients "
        f"{comm_min * 1e3:.1f} ms, bound max(compute, comm) {bound * 1e3:.1f} ms"
    )
    header = f"{'strategy':<20} {'planner':<12} {'buckets':>7} {'iter ms':>10} {'speedup':>8} {'% of bound':>10}"
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        speedup = f"{reference.iteration_s / result.iteration_s:.2f}x" if reference else "-"
        print(
            f"{name:<20} {planners[name]:<12} {len(result.buckets):>7} "
            f"{result.iteration_s * 1e3:>10.2f} {speedup:>8} "
            f"{100 * result.bound_s / result.iteration_s:>9.1f}%"
        )
    for name, cycle in periodic.items():
        speedup = f"{reference.iteration_s / cycle.step_s:.2f}x" if reference else "-"
        o = cycle.options
        print(
            f"{name:<20} {'H=' + str(o['inner_steps']) + ' F=' + str(o['fragments']):<12} {'-':>7} "
            f"{cycle.step_s * 1e3:>10.2f} {speedup:>8} {'-':>10}"
        )
        print(
            f"  {name}: inner step {cycle.inner_s * 1e3:.2f} ms, outer all-reduce "
            f"{cycle.outer_s * 1e3:.2f} ms per fragment over {cycle.replicas} replicas, "
            f"tau={o['overlap_steps']}, {o['outer_bits']}-bit, "
            f"{cycle.slow_bytes_per_step / MB:.2f} MiB per step over the slow links"
        )
    if args.json:
        payload = {
            "simulated": True,
            "profile": label,
            "workers": network.workers,
            "bound_s": float(bound),
            "compute_s": float(compute_min),
            "comm_s": float(comm_min),
            "strategies": {
                **{name: {**r.summary(), "planner": planners[name]} for name, r in results.items()},
                **{name: r.summary() for name, r in periodic.items()},
            },
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.trace:
        from jaxsched.sim._timeline import save_chrome_trace

        save_chrome_trace(list(results.values()), args.trace)
    if args.png:
        from jaxsched.sim._timeline import save_gantt_png

        network_name = network.meta.get("preset", args.network_profile)
        save_gantt_png(list(results.values()), args.png, title=f"{label}, {network.workers} workers, {network_name}")
    return 0


@_input_errors_as_command_errors
def run_profile(args: argparse.Namespace) -> int:
    prepare_output(args.out)
    prepare_output(args.network_out)
    request_cpu_devices(args.devices)
    from jaxsched.plan import _profiling as profile

    optimizer = None
    if args.optimizer != "none":
        from jaxsched.demo.config import OptimizerConfig
        from jaxsched.demo.steps import make_optimizer

        optimizer = make_optimizer(OptimizerConfig(args.optimizer, args.learning_rate))
    layers = profile.profile_zoo_model(args.model, batch=args.batch, repeats=args.repeats, optimizer=optimizer)
    layers.save(args.out)
    network, fit = profile.profile_network(repeats=args.repeats, progress=not args.no_progress)
    network.save(args.network_out)
    print(
        f"{args.model}: {len(layers)} layers, forward {layers.forward_s * 1e3:.2f} ms, "
        f"backward {layers.backward_s * 1e3:.2f} ms, update {layers.update_s * 1e3:.2f} ms "
        f"(measured medians) -> {args.out}"
    )
    for name, cost in network.collectives.items():
        print(
            f"{name:<15} alpha {cost.alpha_s * 1e6:9.1f} us  beta {cost.beta_s_per_byte * 1e9:8.3f} "
            f"ns/B  fit error {100 * fit[name]:.1f}% (max relative)"
        )
    print(f"{network.workers} workers -> {args.network_out}")
    return 0
