"""``jaxsched verify``: the plain and the scheduled step side by side on a config's own step and
data, judged against a rounding baseline (see `jaxsched.check._verify`).

Examples:
    jaxsched verify --config configs/cnn_digits.toml --steps 200
    jaxsched verify --config configs/mlp_digits.toml --strategies dear --rtol 1e-6

Exit status 1 when a strategy leaves the tolerance, so it can gate CI.
"""

from __future__ import annotations

import argparse

from jaxsched.tools.cli._options import add_command, positive_float, positive_int, request_cpu_devices

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    from jaxsched.tools.cli._train import _strategy_names
    from jaxsched.tools.cli._options import name_list

    parser = add_command(
        subparsers,
        "verify",
        "compare scheduled and plain steps on a config's own data against a rounding baseline",
        __doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--config", required=True, help="TOML file, e.g. configs/cnn_digits.toml")
    parser.add_argument(
        "--strategies",
        type=name_list(_strategy_names),
        help="comma-separated (default: the config's, without allreduce)",
    )
    parser.add_argument("--steps", type=positive_int, help="steps to compare (default: the config's)")
    parser.add_argument("--rtol", type=positive_float, default=1e-5, help="relative tolerance floor")
    parser.add_argument(
        "--precision",
        choices=("float64", "float32"),
        default="float64",
        help="what every run is compared in (float64: rounding cannot pass for a defect)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jaxsched.demo import config as config_lib

    cfg = config_lib.load(args.config)
    request_cpu_devices(cfg.train.devices)
    from jaxsched.demo import trainer

    reports = trainer.verify_config(
        cfg, args.strategies, args.steps, args.rtol, args.precision, progress=not args.no_progress
    )
    for report in reports:
        print(report)
    return 0 if all(r.ok for r in reports) else 1
