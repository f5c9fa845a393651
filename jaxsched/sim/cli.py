"""``jaxsched simulate`` and ``jaxsched profile``: the simulator and profilers from the shell.

Examples:
    jaxsched simulate --model resnet50 --workers 64 --network 10gbe --device v100 \\
        --strategies allreduce,wfbp,mgwfbp,bytescheduler,dear,approx --planner optimal
    jaxsched simulate --profile layers.json --network-profile net.json --json out.json
    jaxsched profile --model mlp --out layers.json --network-out net.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jaxsched.costmodel import (DEVICE_PRESETS, LINK_PRESETS, LayerProfile, NetworkProfile,
                                ProfileError, device_preset, network_preset)
from jaxsched.sim.core import (COMPRESSIONS, MB, STRATEGIES, Compression, SimResult,
                               SimulationError, lower_bound, simulate)

DEFAULT_WORKERS = 8
DEFAULT_STRATEGIES = "allreduce,wfbp,mgwfbp,bytescheduler,dear,approx"
# Planner each strategy uses unless --planner overrides it (allreduce is the fixed reference:
# one bucket; bytescheduler partitions tensors itself).
DEFAULT_PLANNER = {"wfbp": "per_layer", "mgwfbp": "mgwfbp", "dear": "threshold", "approx": "threshold"}
# Selection for top-k is a few elementwise passes over the gradient (see FACTS.md, top-k on CPU).
SELECTION_PASSES = 3


def add_parser(subparsers: Any) -> None:
    """Register the ``simulate`` and ``profile`` subcommands."""
    from jaxsched.zoo_profiles import ZOO_MODELS

    sim = subparsers.add_parser("simulate", help="simulate strategies on a model and cluster "
                                "(figures are simulated, not measured)")
    src = sim.add_mutually_exclusive_group()
    src.add_argument("--model", choices=ZOO_MODELS, default="resnet50")
    src.add_argument("--profile", help="layer profile JSON (from `jaxsched profile` or your own)")
    sim.add_argument("--workers", type=int, default=DEFAULT_WORKERS)
    sim.add_argument("--network", choices=sorted(LINK_PRESETS), default="10gbe")
    sim.add_argument("--network-profile", help="network profile JSON; overrides --network/--workers")
    sim.add_argument("--device", choices=sorted(DEVICE_PRESETS), default="v100")
    sim.add_argument("--batch", type=int, help="per-device batch for --model (default per model)")
    sim.add_argument("--seq-len", type=int, help="sequence length for transformer --model")
    sim.add_argument("--efficiency", type=float, default=0.5, help="fraction of device peak sustained")
    sim.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                     help=f"comma-separated from {', '.join(STRATEGIES)}; add +topk or +gtopk "
                          f"for compression, e.g. wfbp+gtopk")
    sim.add_argument("--planner", choices=("per_layer", "threshold", "mgwfbp", "prophet", "optimal"))
    sim.add_argument("--threshold-mb", type=float, default=25.0)
    sim.add_argument("--partition-mb", type=float, help="ByteScheduler partition (default: tuned)")
    sim.add_argument("--credit-mb", type=float, help="ByteScheduler credit (default: tuned)")
    sim.add_argument("--density", type=float, default=0.001, help="top-k density for +topk/+gtopk")
    sim.add_argument("--iterations", type=int, default=8)
    sim.add_argument("--shared-stream", action="store_true",
                     help="collectives run inline on the compute stream (XLA:CPU): no overlap")
    sim.add_argument("--json", help="write the results here")
    sim.add_argument("--trace", help="write a Chrome-trace JSON timeline here (open in Perfetto)")
    sim.add_argument("--png", help="write a Gantt chart PNG here")
    sim.add_argument("--no-progress", action="store_true")

    prof = subparsers.add_parser("profile", help="measure a zoo model's layers and this mesh's "
                                 "collectives, and write profile JSON files")
    prof.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="mlp")
    prof.add_argument("--batch", type=int, default=64)
    prof.add_argument("--devices", type=int, default=8, help="virtual CPU devices for the mesh")
    prof.add_argument("--out", default="layers.json")
    prof.add_argument("--network-out", default="network.json")
    prof.add_argument("--repeats", type=int, default=5)
    prof.add_argument("--optimizer", choices=("none", "sgd", "momentum", "adam", "adamw"),
                      default="none", help="also measure each layer's optimizer update (update_s)")
    prof.add_argument("--learning-rate", type=float, default=1e-3)
    prof.add_argument("--no-progress", action="store_true")


def _parse_strategies(text: str) -> list[tuple[str, str, str | None]]:
    parsed = []
    for name in filter(None, (s.strip() for s in text.split(","))):
        base, _, comp = name.partition("+")
        if base not in STRATEGIES:
            raise SimulationError(f"--strategies: {base!r} is unknown; choose from {', '.join(STRATEGIES)}")
        if comp and comp not in COMPRESSIONS:
            raise SimulationError(f"--strategies: compression {comp!r} in {name!r} is unknown; "
                                  f"use +{' or +'.join(COMPRESSIONS)}")
        parsed.append((name, base, comp or None))
    if not parsed:
        raise SimulationError("--strategies is empty")
    return parsed


def _inputs(args: argparse.Namespace) -> tuple[LayerProfile, NetworkProfile, str]:
    if args.profile:
        layers = LayerProfile.load(args.profile)
        label = args.profile
    else:
        from jaxsched.zoo_profiles import zoo_profile

        layers = zoo_profile(args.model, args.device, args.batch, args.seq_len, args.efficiency)
        label = f"{args.model} (batch {layers.meta['batch']}, {args.device} roofline)"
    if args.network_profile:
        network = NetworkProfile.load(args.network_profile)
        if args.workers != network.workers and args.workers != DEFAULT_WORKERS:
            print(f"note: {args.network_profile} was measured on {network.workers} workers; "
                  f"--workers {args.workers} is ignored", file=sys.stderr)
    else:
        network = network_preset(args.network, args.workers)
    return layers, network, label


def _bytescheduler(layers: LayerProfile, network: NetworkProfile, args: argparse.Namespace,
                   progress: bool) -> SimResult:
    """ByteScheduler auto-tunes partition and credit; we grid-search them in the simulator."""
    if args.partition_mb is not None:
        partitions = [int(args.partition_mb * MB)]
    else:
        partitions = [MB << e for e in range(7)]
    credits = [1, 2, 4] if args.credit_mb is None else [None]
    grid = [(p, int(args.credit_mb * MB) if c is None else p * c) for p in partitions for c in credits]
    if progress:
        from tqdm import tqdm
        grid = tqdm(grid, desc="bytescheduler tuning", leave=False)
    best = None
    for partition, credit in grid:
        result = simulate(layers, network, "bytescheduler", iterations=args.iterations,
                          partition_bytes=partition, credit_bytes=credit,
                          shared_stream=args.shared_stream, keep_spans=False)
        if best is None or result.iteration_s < best[0]:
            best = (result.iteration_s, partition, credit)
    return simulate(layers, network, "bytescheduler", iterations=args.iterations,
                    partition_bytes=best[1], credit_bytes=best[2], shared_stream=args.shared_stream)


def run_simulate(args: argparse.Namespace) -> int:
    from jaxsched.plan import plan_buckets

    layers, network, label = _inputs(args)
    progress = not args.no_progress
    strategies = _parse_strategies(args.strategies)
    selection = SELECTION_PASSES / device_preset(args.device).memory_bytes_per_s
    results: dict[str, SimResult] = {}
    planners: dict[str, str] = {}
    for name, base, comp in strategies:
        compression = Compression(comp, args.density, selection) if comp else None
        if base == "bytescheduler":
            results[name] = _bytescheduler(layers, network, args, progress)
            planners[name] = "bytescheduler"
            continue
        if base == "allreduce":
            planner, buckets = "one bucket", [list(range(len(layers)))]
        else:
            planner = args.planner or DEFAULT_PLANNER[base]
            buckets = plan_buckets(layers, network, planner, base,
                                   threshold_bytes=int(args.threshold_mb * MB),
                                   compression=compression, progress=progress)
        planners[name] = planner
        results[name] = simulate(layers, network, base, buckets, iterations=args.iterations,
                                 compression=compression, shared_stream=args.shared_stream)
    bound, compute_min, comm_min = lower_bound(layers, network)
    reference = results.get("allreduce")
    print(f"{label}: {len(layers)} layers, {layers.total_params / 1e6:.2f}M params, "
          f"{network.workers} workers, {network.meta.get('preset', args.network_profile)} "
          f"-- SIMULATED")
    print(f"compute {compute_min * 1e3:.1f} ms, one all-reduce of all gradients "
          f"{comm_min * 1e3:.1f} ms, bound max(compute, comm) {bound * 1e3:.1f} ms")
    header = f"{'strategy':<20} {'planner':<12} {'buckets':>7} {'iter ms':>10} {'speedup':>8} {'% of bound':>10}"
    print(header)
    print("-" * len(header))
    for name, result in results.items():
        speedup = f"{reference.iteration_s / result.iteration_s:.2f}x" if reference else "-"
        print(f"{name:<20} {planners[name]:<12} {len(result.buckets):>7} "
              f"{result.iteration_s * 1e3:>10.2f} {speedup:>8} "
              f"{100 * result.bound_s / result.iteration_s:>9.1f}%")
    if args.json:
        payload = {"simulated": True, "profile": label, "workers": network.workers,
                   "bound_s": float(bound), "compute_s": float(compute_min), "comm_s": float(comm_min),
                   "strategies": {name: {**r.summary(), "planner": planners[name]}
                                  for name, r in results.items()}}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.trace:
        from jaxsched.sim.timeline import save_chrome_trace
        save_chrome_trace(list(results.values()), args.trace)
    if args.png:
        from jaxsched.sim.timeline import save_gantt_png
        save_gantt_png(list(results.values()), args.png)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from jaxsched.cli import request_cpu_devices

    request_cpu_devices(args.devices)
    from jaxsched import profile

    optimizer = None
    if args.optimizer != "none":
        from jaxsched.config import OptimizerConfig
        from jaxsched.steps import make_optimizer

        optimizer = make_optimizer(OptimizerConfig(args.optimizer, args.learning_rate))
    layers = profile.profile_zoo_model(args.model, batch=args.batch, repeats=args.repeats,
                                       optimizer=optimizer)
    layers.save(args.out)
    network, fit = profile.profile_network(repeats=args.repeats, progress=not args.no_progress)
    network.save(args.network_out)
    print(f"{args.model}: {len(layers)} layers, forward {layers.forward_s * 1e3:.2f} ms, "
          f"backward {layers.backward_s * 1e3:.2f} ms, update {layers.update_s * 1e3:.2f} ms "
          f"(measured medians) -> {args.out}")
    for name, cost in network.collectives.items():
        print(f"{name:<15} alpha {cost.alpha_s * 1e6:9.1f} us  beta {cost.beta_s_per_byte * 1e9:8.3f} "
              f"ns/B  fit error {100 * fit[name]:.1f}% (max relative)")
    print(f"{network.workers} workers -> {args.network_out}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch ``simulate``/``profile``; input errors print one clear line and return 2."""
    try:
        if args.command == "profile":
            return run_profile(args)
        return run_simulate(args)
    except (ProfileError, SimulationError, ValueError) as err:
        print(f"jaxsched {args.command}: error: {err}", file=sys.stderr)
        return 2
