"""``jaxsched`` command line: ``train``, ``demo``, ``simulate`` and ``profile``.

Examples:
    jaxsched train --config configs/mlp_digits.toml --strategies allreduce,dear
    jaxsched demo
    jaxsched simulate --model resnet50 --workers 64 --network 10gbe --device v100
    jaxsched profile --model mlp --optimizer adam --out layers.json --network-out net.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

DEMO_CONFIG = Path(__file__).parent / "configs" / "demo.toml"


def request_cpu_devices(n: int) -> None:
    """Ask for ``n`` virtual CPU devices; must run before JAX creates its CPU client."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # backend already initialised; devices_for() reports a shortfall clearly


def _run_training(config_path: str, strategies: list[str] | None, log: str | None,
                  progress: bool) -> int:
    from jaxsched import config as config_lib

    cfg = config_lib.load(config_path)
    request_cpu_devices(cfg.train.devices)
    from jaxsched import trainer

    results = []
    for strategy in strategies or cfg.train.strategies:
        results.append(trainer.train(cfg, strategy, progress=progress, log_path=log))
    print(f"\n{cfg.model.name} on {cfg.data.name}, {cfg.train.devices} devices, "
          f"{cfg.train.steps} steps, api={cfg.train.api} (steps/s measured in this run)")
    print(trainer.summary_table(results))
    if len(results) > 1:
        worst = max(max(abs(a - b) for a, b in zip(r.losses, results[0].losses)) for r in results[1:])
        verdict = "agree" if worst <= 1e-4 * max(1.0, max(map(abs, results[0].losses))) else "DIFFER"
        print(f"losses of every strategy {verdict} with {results[0].strategy} at every step "
              f"(largest gap {worst:.1e}); on CPU, collectives run synchronously, so steps/s here "
              "shows overhead, not overlap")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxsched", description="Scheduled gradient communication for data-parallel JAX training.")
    sub = parser.add_subparsers(dest="command", required=True)

    train_p = sub.add_parser("train", help="train a config with the baseline or scheduled step")
    train_p.add_argument("--config", required=True, help="TOML file, e.g. configs/mlp_digits.toml")
    train_p.add_argument("--strategies", help="comma-separated, overrides train.strategies")
    train_p.add_argument("--log", help="append per-step metrics as JSON lines to this file")
    train_p.add_argument("--no-progress", action="store_true")

    demo_p = sub.add_parser("demo", help="the main job on 8 virtual CPU devices")
    demo_p.add_argument("--log", default="runs/demo.jsonl")
    demo_p.add_argument("--no-progress", action="store_true")

    from jaxsched.sim import cli as sim_cli  # simulate, profile
    sim_cli.add_parser(sub)
    args = parser.parse_args(argv)
    from jaxsched.config import ConfigError

    try:
        if args.command == "train":
            strategies = args.strategies.split(",") if args.strategies else None
            return _run_training(args.config, strategies, args.log, not args.no_progress)
        if args.command == "demo":
            Path(args.log).parent.mkdir(parents=True, exist_ok=True)
            Path(args.log).unlink(missing_ok=True)
            code = _run_training(str(DEMO_CONFIG), None, args.log, not args.no_progress)
            print(f"per-step metrics: {args.log}")
            return code
        if args.command in ("simulate", "profile"):
            return sim_cli.run(args)
    except ConfigError as err:
        print(f"jaxsched: error: {err}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
