"""``jaxsched inspect``: compile every strategy for a GPU or TPU cluster (no hardware needed)
and show what the compiler scheduled, beside the user's step as XLA compiles it alone.

Examples:
    jaxsched inspect --config configs/tiny_lm.toml --target h100:1x2x4 \
        --strategies allreduce,wfbp,dear,approx --json runs/out.json --png runs/out.png
    jaxsched inspect --model transformer --target v5p:2x2x2:slices=2 --strategies wfbp,approx

Every time printed is XLA's latency-hiding-scheduler estimate for the compiled program,
not a measurement. Needs the `aot` extra: pip install 'jaxsched[aot]'.
"""

from __future__ import annotations

import argparse
import json

from jaxsched.tools.cli._options import CommandError, add_command, existing_file, name_list, output_path, prepare_output

__all__ = ["register", "run"]


def _target(text: str) -> str:
    from jaxsched.tools.aot import GPU_TARGETS, TPU_TARGETS, parse_target

    try:
        name, _, _ = parse_target(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if name not in GPU_TARGETS + TPU_TARGETS:
        raise argparse.ArgumentTypeError(
            f"unknown target {name!r}; GPU: {', '.join(GPU_TARGETS)}; TPU: {', '.join(TPU_TARGETS)}"
        )
    return text


def _zoo_model(text: str) -> str:
    from jaxsched.tools.aot._experiment import ZOO  # imported only when the option is given

    if text not in ZOO:
        raise argparse.ArgumentTypeError(f"{text!r} is not a zoo model; choose from {', '.join(ZOO)}")
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    from jaxsched.tools.cli._train import _strategy_names

    parser = add_command(
        subparsers,
        "inspect",
        "compile strategies for a GPU/TPU cluster and report XLA's schedule (async collectives, exposed communication)",
        __doc__.split("\n\n", 1)[1],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=existing_file, help="TOML file, e.g. configs/tiny_lm.toml")
    source.add_argument(
        "--model",
        type=_zoo_model,
        help="a zoo model at a realistic size: mlp, cnn or transformer (jaxsched.tools.aot._experiment.ZOO)",
    )
    parser.add_argument(
        "--target",
        type=_target,
        default="h100:1x2x4",
        help="TARGET:TOPOLOGY[:slices=N]: h100:1x2x4 (slices x hosts x GPUs), v5p:2x2x2:slices=2",
    )
    parser.add_argument(
        "--strategies",
        type=name_list(_strategy_names),
        default="allreduce,wfbp,dear,approx",
        help="comma-separated strategies to compile",
    )
    parser.add_argument("--json", type=output_path, help="write the reports as JSON here")
    parser.add_argument("--png", type=output_path, help="draw the compiled schedules here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jaxsched.tools import aot
    from jaxsched.tools.aot import _compare as compare, _experiment as experiment

    strategies = args.strategies  # argparse applies the type to the string default too
    name, _, _ = aot.parse_target(args.target)
    platform = "gpu" if name in aot.GPU_TARGETS else "tpu"
    missing = aot.toolchain_missing(platform)
    if missing:
        raise CommandError(missing)
    try:
        if args.config:
            from jaxsched.demo import config as config_lib

            exp = experiment.from_config(config_lib.load(args.config), target=args.target)
        else:
            exp = experiment.abstract_experiment(experiment.ZOO[args.model], target=args.target)
    except aot.AotUnavailableError as err:
        raise CommandError(str(err)) from None
    comparison = compare.compare_strategies(exp, strategies, target=args.target, progress=not args.no_progress)
    print(f"{exp.description} on {args.target} ({exp.mesh.devices.size} devices)")
    print(comparison.table())
    if args.json:
        path = prepare_output(args.json)
        path.write_text(json.dumps(comparison.to_json(), indent=1))
        print(f"reports: {path}")
    if args.png:
        print(f"schedules: {comparison.plot(str(prepare_output(args.png)))}")
    return 0
