"""``jaxsched cluster``, ``launch``, ``bench``: emulated hosts, one process per host, and
measured overlap on them (see `jaxsched.tools.cluster`, `jaxsched.tools.launch`,
`jaxsched.tools.bench`). This module only parses; the work is in those modules.

``python -m jaxsched.tools.cli._bench --worker ...`` is the entry point of one benchmark process.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from jaxsched.tools import bench
from jaxsched.tools import cluster as cluster_lib
from jaxsched.tools import launch as launch_lib
from jaxsched.tools.cli._options import add_command, name_list, output_dir, output_path, positive_float, positive_int

__all__ = [
    "add_bench_arguments",
    "add_cluster_arguments",
    "add_launch_arguments",
    "register",
    "run_bench",
    "run_cluster",
    "run_launch",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, "cluster", "bring an emulated multi-host network up or down (network namespaces + tc; needs root)"
    )
    add_cluster_arguments(parser)
    parser.set_defaults(run=run_cluster)
    parser = add_command(
        subparsers,
        "launch",
        "run a command as one process per (emulated) host "
        "with jax.distributed set up: jaxsched launch --hosts 2 -- python train.py",
    )
    add_launch_arguments(parser)
    parser.set_defaults(run=run_launch)
    parser = add_command(
        subparsers,
        "bench",
        "measure overlap on an emulated cluster: every "
        "strategy against the plain step, compute-only and comm-only, interleaved",
    )
    add_bench_arguments(parser)
    parser.set_defaults(run=bench.run)


# -- cluster ------------------------------------------------------------------------------------
def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``up``/``down``/``status`` to ``parser`` (the ``jaxsched cluster`` subcommand)."""
    sub = parser.add_subparsers(dest="cluster_command", required=True, metavar="{up,set,down,status}")
    up = sub.add_parser("up", help="create an emulated cluster (root)")
    up.add_argument("--hosts", type=int, required=True, help="number of hosts (>= 2)")
    up.add_argument(
        "--bandwidth",
        default="1gbit",
        help="rate of every link, each way: e.g. 1gbit, 500mbit; 'none' for unshaped (default 1gbit)",
    )
    up.add_argument(
        "--subnet", default=cluster_lib.DEFAULT_SUBNET, help=f"private /24 (default {cluster_lib.DEFAULT_SUBNET})"
    )
    set_ = sub.add_parser("set", help="change the links of a running cluster (root); jobs keep running")
    set_.add_argument(
        "--bandwidth", required=True, help="new rate of every link, each way: e.g. 100mbit; 'none' for unshaped"
    )
    set_.add_argument(
        "--delay", default=None, help="added one-way delay per link end, e.g. 5ms (needs the netem qdisc)"
    )
    down = sub.add_parser("down", help="remove the emulated cluster and anything a crashed run left")
    status = sub.add_parser("status", help="show the emulated cluster, if one is up")
    for p in (up, set_, down, status):
        p.add_argument(
            "--prefix",
            default=cluster_lib.DEFAULT_PREFIX,
            help=f"namespace name prefix (default {cluster_lib.DEFAULT_PREFIX})",
        )


def run_cluster(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run ``jaxsched cluster ...``; returns the exit status (0 ok, 1 failed, 2 bad input)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="jaxsched cluster", description="An emulated multi-host cluster (root).")
        add_cluster_arguments(parser)
        args = parser.parse_args(args)
    try:
        if args.cluster_command == "up":
            cluster = cluster_lib.Cluster.up(args.hosts, args.bandwidth, prefix=args.prefix, subnet=args.subnet)
            print(cluster.describe())
            print(
                "take it down with: jaxsched cluster down"
                + ("" if args.prefix == cluster_lib.DEFAULT_PREFIX else f" --prefix {args.prefix}")
            )
            return 0
        if args.cluster_command == "set":
            cluster_lib.require_privileges()
            cluster = cluster_lib.set_links(args.prefix, args.bandwidth, args.delay)
            print(
                f"cluster {cluster.prefix!r}: links now {cluster_lib.format_bandwidth(cluster.bandwidth)} each way"
                + (f", {args.delay} added delay" if cluster_lib.parse_delay(args.delay) else "")
            )
            return 0
        if args.cluster_command == "down":
            cluster_lib.require_privileges()
            removed = cluster_lib.teardown(args.prefix)
            print(f"removed {', '.join(removed)}" if removed else f"no cluster with prefix {args.prefix!r} was up")
            return 0
        if args.cluster_command == "status":
            if not cluster_lib.list_namespaces(args.prefix):
                print(f"no cluster with prefix {args.prefix!r} is up")
                return 1
            print(cluster_lib.Cluster.attach(args.prefix).describe())
            return 0
    except ValueError as err:
        print(f"jaxsched cluster: error: {err}", file=sys.stderr)
        return 2
    except cluster_lib.ClusterError as err:
        print(f"jaxsched cluster: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jaxsched cluster: interrupted; nothing left behind", file=sys.stderr)
        return 130
    raise AssertionError(args.cluster_command)


# -- launch -------------------------------------------------------------------------------------
def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: use 1..65535")
    return port


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``jaxsched launch``'s options to ``parser``; the command follows ``--``."""
    parser.add_argument("--hosts", type=positive_int, required=True, help="number of processes")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run each process in its host's namespace of the emulated cluster "
        "(the one that is up, else one brought up for this run; root)",
    )
    parser.add_argument(
        "--bandwidth",
        default=None,
        help="with --cluster, when the launcher brings the cluster up: rate of "
        "every link (default 1gbit; 'none' for unshaped)",
    )
    parser.add_argument("--prefix", default=None, help="with --cluster: namespace prefix (default jxs)")
    parser.add_argument("--port", type=_port, help="coordinator port (default: a free one)")
    parser.add_argument(
        "--cpu-devices", type=positive_int, help="local CPU devices per process (sets JAXSCHED_CPU_DEVICES)"
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=positive_int,
        default=launch_lib.LAUNCH_HEARTBEAT_TIMEOUT_S,
        help="seconds until jax.distributed declares a silent process dead",
    )
    parser.add_argument(
        "--grace",
        type=positive_float,
        default=launch_lib.DEFAULT_GRACE_S,
        help="seconds between SIGTERM and SIGKILL when stopping processes",
    )
    parser.add_argument("--timeout", type=positive_float, help="stop everything after this many seconds")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output with [rank]")
    parser.add_argument(
        "--verbose", action="store_true", help="keep gloo's per-peer connection lines ([Gloo] Rank N is connected ...)"
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...", help="the command each process runs")


def run_launch(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run ``jaxsched launch ...``; returns the exit status (first failing process's status)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="jaxsched launch", description="Start one JAX process per host.")
        add_launch_arguments(parser)
        args = parser.parse_args(args)
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    from jaxsched.tools import cluster as cluster_lib

    def fail(msg: str, code: int) -> int:
        print(f"jaxsched launch: error: {msg}", file=sys.stderr)
        return code

    if not command:
        return fail("no command: put it after `--`, e.g. jaxsched launch --hosts 2 -- python train.py", 2)
    if not args.cluster and (args.bandwidth is not None or args.prefix is not None):
        return fail("--bandwidth and --prefix need --cluster", 2)
    kwargs = dict(
        port=args.port,
        cpu_devices=args.cpu_devices,
        heartbeat_timeout_s=args.heartbeat_timeout,
        grace_s=args.grace,
        timeout_s=args.timeout,
        prefix_output=not args.no_prefix,
        verbose=getattr(args, "verbose", True),
    )
    try:
        if not args.cluster:
            return launch_lib.launch(args.hosts, command, **kwargs)
        prefix = args.prefix or cluster_lib.DEFAULT_PREFIX
        cluster_lib.require_privileges()
        if cluster_lib.list_namespaces(prefix):
            cluster = cluster_lib.Cluster.attach(prefix)
            if args.bandwidth is not None and cluster_lib.parse_bandwidth(args.bandwidth) != cluster.bandwidth:
                return fail(
                    f"the cluster {prefix!r} is up with links "
                    f"{cluster_lib.format_bandwidth(cluster.bandwidth)}, not "
                    f"{args.bandwidth}: take it down or leave out --bandwidth",
                    2,
                )
            print(f"jaxsched launch: using the cluster that is up: {cluster!r}", file=sys.stderr)
            return launch_lib.launch(args.hosts, command, cluster=cluster, **kwargs)
        bandwidth = "1gbit" if args.bandwidth is None else args.bandwidth
        with cluster_lib.Cluster.up(max(args.hosts, 2), bandwidth, prefix=prefix) as cluster:
            print(f"jaxsched launch: brought up {cluster!r} for this run", file=sys.stderr)
            return launch_lib.launch(args.hosts, command, cluster=cluster, **kwargs)
    except ValueError as e:
        return fail(str(e), 2)
    except (cluster_lib.ClusterError, launch_lib.LaunchError) as e:
        return fail(str(e), 1)


# -- bench --------------------------------------------------------------------------------------
def _strategy_names() -> tuple[str, ...]:
    from jaxsched.strategies import strategy_names

    return strategy_names()


def _compression_option(text: str) -> str:
    try:
        bench.parse_compression(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _hosts(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} hosts: a benchmark of communication needs at least 2")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``jaxsched bench``'s options; every value is checked while parsing, before any work."""
    parser.add_argument("--hosts", type=_hosts, default=2, help="processes, one per emulated host")
    parser.add_argument("--bandwidth", default="1gbit", help="per-link limit, e.g. 1gbit, 500mbit")
    parser.add_argument(
        "--strategies",
        type=name_list(_strategy_names),
        default="allreduce,wfbp,dear,approx",
        help="comma-separated registered strategies",
    )
    parser.add_argument("--steps", type=positive_int, default=20, help="measured steps per variant")
    parser.add_argument(
        "--compression",
        type=_compression_option,
        help="also run wfbp/dear with this compressor (topk:DENSITY, gtopk:DENSITY, powersgd:RANK, bf16), same session",
    )
    parser.add_argument("--batch", type=positive_int, help="per-process batch (default: calibrated)")
    parser.add_argument(
        "--calibration-start", type=positive_int, default=128, help="first per-process batch the calibration probes"
    )
    parser.add_argument(
        "--calibration-tolerance",
        type=positive_float,
        default=0.10,
        help="calibration succeeds when |compute/comm - 1| is at most this",
    )
    parser.add_argument(
        "--calibration-probes", type=positive_int, default=6, help="most batches the calibration measures"
    )
    parser.add_argument("--depth", type=positive_int, default=bench.DEPTH, help="layers of the tanh MLP")
    parser.add_argument("--width", type=positive_int, default=bench.WIDTH, help="width of every layer")
    parser.add_argument("--buckets", type=positive_int, help="bucket byte threshold (default: one per layer)")
    parser.add_argument(
        "--out",
        type=output_dir,
        default="runs/bench",
        help="folder for the report row (overlap.jsonl) and the Gantt chart",
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help=f"write the row and the chart into {bench.RESULTS_DIR}/ (the committed "
        "results the docs cite) instead of --out",
    )
    parser.add_argument("--json", type=output_path, help="also write the report here")
    parser.add_argument(
        "--png",
        type=output_path,
        help="Gantt chart path (default: "
        "bench_<depth>x<width>_<strategies>.png in --out, or in the results folder with --save)",
    )
    parser.add_argument("--prefix", default="jxsb", help="namespace prefix of the emulated cluster")
    parser.add_argument("--no-cluster", action="store_true", help="loopback only (no root needed)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin each process to one core")
    parser.add_argument("--timeout", type=positive_float, default=900, help="seconds for the whole run")


def run_bench(argv: Sequence[str] | None = None) -> int:
    """``jaxsched bench`` as a program (the benchmark's worker processes start here)."""
    parser = argparse.ArgumentParser(
        prog="jaxsched bench",
        description=bench.__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--raw-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker-strategies", help=argparse.SUPPRESS)  # with "+compressor" variants
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.strategies = [s for s in args.worker_strategies.split(",") if s]
        # one bucket per layer: each layer's reduction overlaps the backward of those below
        args.buckets = args.buckets or [[f"layer{i}"] for i in reversed(range(args.depth))]
        return bench.worker(args)
    return bench.run(args)
