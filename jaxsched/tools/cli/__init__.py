"""``jaxsched`` command line: ``train``, ``demo``, ``verify``, ``simulate``, ``profile``,
``cluster``, ``launch``, ``bench`` and ``inspect``.

Examples:
    jaxsched train --config configs/mlp_digits.toml --strategies allreduce,dear
    jaxsched demo
    jaxsched verify --config configs/cnn_digits.toml
    sudo jaxsched bench --hosts 2 --bandwidth 1gbit --strategies allreduce,wfbp,dear
    jaxsched simulate --model resnet50 --workers 64 --network 10gbe --device v100
    jaxsched profile --model mlp --optimizer adam --out layers.json --network-out net.json
    jaxsched inspect --config configs/tiny_lm.toml --target h100:1x2x4 --png out.png

Each module in `COMMAND_MODULES` has ``register(subparsers)``, which adds its
subcommands and sets ``run=`` on each; a new subcommand is one more module in that list.
Every option is checked while the command line is parsed, before any work starts.
"""

from __future__ import annotations

from jaxsched import _deprecations

import argparse
import importlib
import sys
from typing import Sequence

from jaxsched.tools.cli._options import CommandError, request_cpu_devices

COMMAND_MODULES = (
    "jaxsched.tools.cli._train",
    "jaxsched.tools.cli._verify",
    "jaxsched.tools.cli._simulate",
    "jaxsched.tools.cli._cluster",
    "jaxsched.tools.cli._inspection",
)

__all__ = ["COMMAND_MODULES", "CommandError", "build_parser", "main", "request_cpu_devices"]


def build_parser() -> argparse.ArgumentParser:
    """The whole command line, every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="jaxsched", description="Scheduled gradient communication for data-parallel JAX training."
    )
    parser.add_argument("--version", action="version", version=_version())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _version() -> str:
    """``jaxsched X (jax Y, jaxlib Z)``, without importing JAX."""
    from importlib import metadata

    from jaxsched._version import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"jaxsched {__version__} (jax {installed('jax')}, jaxlib {installed('jaxlib')})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; returns the exit status (2 for bad input, with one clear line)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage and the error (or --help)
        return int(exit_.code or 0)
    from jaxsched.demo.config import ConfigError
    from jaxsched.sim._costmodel import ProfileError
    from jaxsched.sim import SimulationError

    try:
        return args.run(args)
    except (CommandError, ConfigError, ProfileError, SimulationError) as err:
        print(f"jaxsched {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
