"""Each strategy compiled per target with the options the ``xla`` engine chooses, against
the plain step with XLA's defaults and with those same options.

Nothing runs on an accelerator: every step is compiled for compile-only devices
(jaxsched.tools.aot) and read with jaxsched.check._inspection. Every time is XLA's estimate
for the compiled program (its latency-hiding schedule, or, where XLA:TPU writes none, its
instruction costs: the ``source`` of each row), NOT a measurement; every ratio is to a
baseline compiled in the same run, and sets two estimates of one kind against each other:
against a plain step estimated from instruction costs, the scheduled program is estimated
from its instruction costs too (``by_instruction_costs``).

Cases: an MLP of 8 layers of 1024 (ReLU; sgd with momentum, 512 rows per
device) on ``h100:1x2x4`` and ``v5p:2x2x2``; the zoo Transformer (12 blocks of 1024, 218M
parameters) on ``h100:1x8x8``.

    .venv-aot/bin/python benchmarks/per_target_schedules.py            # all cases (about 20 min)
    .venv-aot/bin/python benchmarks/per_target_schedules.py --cases mlp@h100:1x2x4

Writes benchmarks/results/per_target_schedules.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULTS = Path(__file__).parent / "results"
JSON_PATH = RESULTS / "per_target_schedules.json"
CASES = ("mlp@h100:1x2x4", "mlp@v5p:2x2x2", "transformer@h100:1x8x8")
STRATEGIES = ("wfbp", "dear", "approx", "auto")


def model_spec(name: str):
    from jaxsched.demo.config import OptimizerConfig
    from jaxsched.tools.aot._experiment import ZOO, ModelSpec

    if name == "mlp":
        momentum = OptimizerConfig(name="momentum", learning_rate=0.1)
        return ModelSpec("mlp", (1024,), 10, {"hidden": (1024,) * 8}, 512, momentum)
    return ZOO[name]


def _row(report, baseline=None, options_baseline=None, by_costs=None) -> dict:
    """One program's estimates and its ratios to each baseline, each pair estimated alike:
    against a baseline estimated from XLA's instruction costs (no schedule), ``by_costs``
    (the same program estimated from instruction costs) where there is one."""
    ratio = lambda a, b: None if a is None or b in (None, 0) else round(a / b, 3)
    row = {
        "step_us": None if report.step_s is None else round(report.step_s * 1e6, 1),
        "exposed_us": None if report.exposed_comm_s is None else round(report.exposed_comm_s * 1e6, 1),
        "source": report.estimate_source,
        "async": f"{report.num_async}/{len(report.collectives)}",
        "kinds": sorted({w.kind for w in report.collectives}),
    }
    if by_costs is not None:
        row["by_instruction_costs"] = {
            "step_us": round(by_costs.step_s * 1e6, 1),
            "exposed_us": None if by_costs.exposed_comm_s is None else round(by_costs.exposed_comm_s * 1e6, 1),
        }
    for label, base in (("vs_plain_defaults", baseline), ("vs_plain_same_options", options_baseline)):
        if base is not None:
            alike = report
            if base.estimate_source != report.estimate_source and by_costs is not None:
                alike = by_costs if base.estimate_source == by_costs.estimate_source else report
            row[label] = {
                "step": ratio(alike.step_s, base.step_s),
                "exposed": ratio(alike.exposed_comm_s, base.exposed_comm_s),
                "source": alike.estimate_source,
            }
    return row


def run_case(case: str, strategies=STRATEGIES) -> dict:
    import jax

    import jaxsched
    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.tools.aot._experiment import abstract_experiment

    model, target = case.split("@")
    started = time.perf_counter()
    exp = abstract_experiment(model_spec(model), target=target)
    args = (exp.params, exp.opt_state, exp.batch)
    plain = inspect_lib.inspect_jitted(exp.step, args, exp.mesh, label="plain, XLA defaults")
    rows, options, same, same_by_costs = {}, None, None, None
    for name in strategies:
        print(f"  {case}: {name}", file=sys.stderr, flush=True)
        sched = jaxsched.schedule(exp.step, strategy=name)
        # with the baseline, so that a program is also estimated as the plain step is
        inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch)
        if same is None and name != "auto":
            options = sched.program.compiler_options
            same, same_by_costs = inspect_lib.inspect_lowered_by_costs_too(
                jax.jit(exp.step).trace(*args).lower(),
                exp.mesh,
                label="plain, the engine's options",
                target=inspect_lib.describe_mesh(exp.mesh),
                compiler_options=options,
            )
        rows[name] = _row(inspection.report, plain, same, inspection.report_by_instruction_costs)
        rows[name]["options"] = inspect_lib.format_options(inspection.report.compiler_options or {})
        if name == "auto":
            choice = sched.strategy.last_choice
            rows[name]["chosen"] = choice.chosen
            rows[name]["candidates_us"] = {
                k: None if v is None else round(v * 1e6, 1) for k, v in choice.estimated_s.items()
            }
    return {
        "model": model,
        "target": target,
        "plain_defaults": _row(plain),
        "plain_same_options": _row(same, plain, by_costs=same_by_costs),
        "engine_options": inspect_lib.format_options(options or {}),
        "strategies": rows,
        "wall_s": round(time.perf_counter() - started, 1),
        "note": "XLA's estimates for programs compiled on this machine, not measurements",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="model@target")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    results = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    for case in args.cases:
        results[case] = run_case(case, tuple(args.strategies))
        JSON_PATH.write_text(json.dumps(results, indent=1))
        entry = results[case]
        base = entry["plain_defaults"]
        print(f"{case}: plain {base['step_us']} us, exposed {base['exposed_us']} us ({base['source']})")
        for name, row in entry["strategies"].items():
            print(f"  {name}: {row['step_us']} / {row['exposed_us']} us; {row.get('vs_plain_defaults')}")
    print(f"wrote {JSON_PATH}")


if __name__ == "__main__":
    main()
