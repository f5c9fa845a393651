"""``jaxsched cluster``, ``launch``, ``bench``: emulated hosts, one process per host, and
measured overlap on them (see :mod:`jaxsched.tools.cluster`, :mod:`jaxsched.tools.launch`,
:mod:`jaxsched.tools.bench`)."""
from __future__ import annotations

import argparse

from jaxsched.tools.cli.options import add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    from jaxsched.tools import bench
    from jaxsched.tools import cluster
    from jaxsched.tools import launch

    parser = add_command(subparsers, "cluster", "bring an emulated multi-host network up or down "
                         "(network namespaces + tc; needs root)")
    cluster.add_arguments(parser)
    parser.set_defaults(run=cluster.main)
    parser = add_command(subparsers, "launch", "run a command as one process per (emulated) host "
                         "with jax.distributed set up: jaxsched launch --hosts 2 -- python train.py")
    launch.add_arguments(parser)
    parser.set_defaults(run=launch.main)
    parser = add_command(subparsers, "bench", "measure overlap on an emulated cluster: every "
                         "strategy against the plain step, compute-only and comm-only, interleaved")
    bench.add_arguments(parser)
    parser.set_defaults(run=lambda args: bench.run(args))
