"""Every strategy compiled for GPU and TPU clusters, against the plain step as XLA compiles it.

Nothing runs on an accelerator: each step is compiled for compile-only devices
(jaxsched.tools.aot) and read with jaxsched.check._inspection. Every time is XLA's latency-hiding
scheduler estimate for the compiled program, NOT a measurement; ratios are taken against
the plain step compiled in the same run (on TPU, where XLA's defaults give no estimate,
against the plain step compiled with jaxsched's TPU options, labelled as such).

    .venv/bin/python benchmarks/compiled_overlap.py            # everything (long)
    .venv/bin/python benchmarks/compiled_overlap.py --models mlp --targets h100:1x2x4
    .venv/bin/python benchmarks/compiled_overlap.py --update-docs   # tables from the JSON

Writes benchmarks/results/compiled_overlap.json (one entry per model and target, updated in
place so a long sweep can be resumed with --resume) and a PNG of the compiled schedules per
model and target beside it. --update-docs rewrites the results block of docs/benchmarks.md from the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend

RESULTS = Path(__file__).parent / "results"
JSON_PATH = RESULTS / "compiled_overlap.json"
TARGETS = ("h100:1x2x4", "h100:1x8x8", "v5p:2x2x2:slices=2")
MODELS = ("mlp", "cnn", "transformer")
STRATEGIES = ("allreduce", "wfbp", "dear", "approx")
#: strategies also compiled with buckets="auto" (bucket size and collective form chosen by
#: XLA's estimate among jaxsched.pipeline._compiled_planner's candidates)
TUNED = ("wfbp", "dear", "approx")
BEGIN, END = "<!-- compiled_overlap:begin -->", "<!-- compiled_overlap:end -->"


def run_one(model: str, target: str, strategies, tuned) -> dict:
    import jaxsched
    from jaxsched.tools.aot._compare import compare_strategies
    from jaxsched.tools.aot._experiment import ZOO, abstract_experiment

    started = time.perf_counter()
    exp = abstract_experiment(ZOO[model], target=target)
    comparison = compare_strategies(exp, strategies, target=target, progress=True)
    reports = list(comparison.reports)
    choices = {}
    for name in tuned:
        sched = jaxsched.schedule(exp.step, strategy=name, buckets="auto")
        inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=False)
        chosen = sched.strategy.last_bucket_choice
        label = f"{name} (tuned)"
        reports.append(dataclasses.replace(inspection.report, label=label, target=target))
        choices[label] = {"chosen": chosen.labels[chosen.chosen], "estimated_step_s": chosen.as_dict()}
        print(f"  {label}: {chosen.labels[chosen.chosen]}", file=sys.stderr)
    comparison = dataclasses.replace(comparison, reports=tuple(reports))
    png = RESULTS / f"compiled_overlap_{model}_{target.replace(':', '_').replace('=', '')}.png"
    comparison.plot(str(png))
    print(comparison.table())
    entry = comparison.to_json()
    plain = comparison.reference or comparison.baseline
    entry.update(floor=communication_floor(exp, plain))
    entry.update(
        num_params=exp.num_params,
        devices=int(exp.mesh.devices.size),
        png=png.name,
        tuned_choices=choices,
        wall_s=round(time.perf_counter() - started, 1),
    )
    return entry


def communication_floor(exp, baseline) -> dict:
    """How little any exact schedule could expose, by XLA's own estimates: the gradients'
    all-reduce compiled alone (``comm_alone_s``) against the plain step's compute
    (``compute_s``: its estimated step less its exposed communication). Even a reduction
    that overlaps all of forward, backward and the update (``approx``) exposes at least
    their difference, ``floor_exposed_s``."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.runtime.engine._xla import compiler_options_for
    from jaxsched.pipeline._compiled_planner import ONE_BUCKET

    mesh, axis = exp.mesh, exp.axis
    reduce_all = jax.jit(
        jax.shard_map(
            lambda grads: jax.tree.map(lambda g: lax.psum(g, axis), grads),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
    )
    platform = mesh.devices.flat[0].platform
    # the cheapest way XLA prices the reduction: XLA's defaults, or (GPU) one combined
    # collective; XLA:TPU writes no estimate for its default synchronous all-reduce
    candidates = (
        [compiler_options_for(platform)]
        if platform == "tpu"
        else [None, compiler_options_for(platform, bucket_bytes=ONE_BUCKET)]
    )
    estimates = [
        inspect_lib.inspect_jitted(
            reduce_all, (exp.params,), mesh, label="all-reduce alone", compiler_options=options
        ).step_s
        for options in candidates
    ]
    estimates = [e for e in estimates if e is not None]
    if not estimates or baseline.step_s is None:
        return {}
    comm_alone_s = min(estimates)
    compute_s = baseline.step_s - baseline.exposed_comm_s
    floor = max(0.0, comm_alone_s - compute_s)
    return {
        "comm_alone_s": comm_alone_s,
        "compute_s": compute_s,
        "floor_exposed_s": floor,
        "floor_ratio": floor / baseline.exposed_comm_s if baseline.exposed_comm_s else None,
    }


def _floor_of(model: str, target: str, entry: dict) -> dict:
    """The floor of an entry already in the JSON, from its reference report's estimates."""
    from types import SimpleNamespace

    from jaxsched.tools.aot._experiment import ZOO, abstract_experiment

    print(f"== floor of {model} @ {target}", file=sys.stderr)
    plain = entry.get("reference_report") or entry["baseline"]
    return communication_floor(
        abstract_experiment(ZOO[model], target=target),
        SimpleNamespace(step_s=plain["step_s"], exposed_comm_s=plain["exposed_comm_s"]),
    )


def _without_timelines(entry: dict) -> dict:
    """The compute timeline of every report is drawn in the PNG; the JSON keeps the rest."""

    def strip(report):
        return {k: v for k, v in report.items() if k != "compute"} if isinstance(report, dict) else report

    entry = dict(entry, baseline=strip(entry["baseline"]), reference_report=strip(entry.get("reference_report")))
    entry["strategies"] = {name: strip(r) for name, r in entry["strategies"].items()}
    return entry


def _fmt(x):
    return "-" if x is None else f"{x:.2f}x"


def markdown(results: dict) -> str:
    lines = [
        f"All figures: {next(iter(results.values()))['estimator'] if results else ''}; "
        "ratios to the plain step compiled in the same run (`.venv/bin/python "
        "benchmarks/compiled_overlap.py`, jax 0.10.2, libtpu 0.0.42.1, CUDA plugin 0.10.2).",
        "",
    ]
    for key, entry in results.items():
        model, target = key.split(" @ ")
        lines.append(
            f"**{entry['model']} on `{target}`** ({entry['devices']} devices; ratios to {entry['reference']}):"
        )
        lines.append("")
        lines.append("| strategy | est. step | x plain | est. exposed comm | x plain | async collectives |")
        lines.append("|---|---|---|---|---|---|")
        base = entry.get("reference_report") or entry["baseline"]
        rows = [(entry["baseline"]["label"], entry["baseline"], None)]
        if entry.get("reference_report"):
            rows.append((base["label"], base, {"step": 1.0, "exposed_comm": 1.0}))
        rows += [(name, r, r["ratio_to_reference"]) for name, r in entry["strategies"].items()]
        for name, r, ratio in rows:
            step = "-" if r["step_s"] is None else f"{r['step_s'] * 1e6:.0f} us"
            exposed = "-" if r["exposed_comm_s"] is None else f"{r['exposed_comm_s'] * 1e6:.0f} us"
            ratio = ratio or ({"step": 1.0, "exposed_comm": 1.0} if r is base else {})
            n_async = sum(1 for c in r["collectives"] if c["is_async"])
            lines.append(
                f"| {name} | {step} | {_fmt(ratio.get('step'))} | {exposed} | "
                f"{_fmt(ratio.get('exposed_comm'))} | {n_async}/{len(r['collectives'])} |"
            )
        floor = entry.get("floor") or {}
        if floor:
            lines.append(
                f"\nFloor: the gradients' all-reduce compiled alone is estimated at "
                f"{floor['comm_alone_s'] * 1e6:.0f} us and the plain step's compute at "
                f"{floor['compute_s'] * 1e6:.0f} us, so no exact schedule exposes less than "
                f"{floor['floor_exposed_s'] * 1e6:.0f} us ({_fmt(floor['floor_ratio'])} plain)."
            )
        if entry.get("tuned_choices"):
            chosen = "; ".join(
                f"{v['chosen'].replace(', buckets=None', ', 25 MB buckets')}" for v in entry["tuned_choices"].values()
            )
            lines.append(f'\nTuned = `buckets="auto"`, which chose {chosen}.')
        lines.append("")
    return "\n".join(lines)


def compact_markdown(results: dict) -> str:
    """One row per model and target: estimated step / exposed communication, each as a
    ratio to the plain step, per strategy (tuned where it ran)."""
    names = ("wfbp", "dear", "approx")
    lines = [
        "XLA's estimates for the compiled programs, not measurements: estimated step / "
        "estimated exposed communication, each as a ratio to the plain step compiled with "
        'XLA\'s defaults in the same run (`buckets="auto"` where it ran, else the '
        "strategy's defaults; full tables and the chosen variants in "
        "[docs/accelerators.md](docs/accelerators.md)).",
        "",
        "The floor is the least exposed communication any exact schedule can reach by the "
        "same estimates: the gradients' all-reduce compiled alone, less the plain step's "
        "compute.",
        "",
        "| model | target | plain step (est.) | " + " | ".join(f"`{n}`" for n in names) + " | exposed-comm floor |",
        "|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for key, entry in results.items():
        model, target = key.split(" @ ")
        base = entry.get("reference_report") or entry["baseline"]
        cells = []
        for n in names:
            r = entry["strategies"].get(f"{n} (tuned)") or entry["strategies"].get(n)
            ratio = r["ratio_to_reference"] if r else {}
            cells.append(f"{_fmt(ratio.get('step'))} / {_fmt(ratio.get('exposed_comm'))}" if r else "-")
        step = "-" if base["step_s"] is None else f"{base['step_s'] * 1e3:.1f} ms"
        floor = (entry.get("floor") or {}).get("floor_ratio")
        lines.append(
            f"| {entry['model'].split(',')[0]} | `{target}` | {step} | " + " | ".join(cells) + f" | {_fmt(floor)} |"
        )
    return "\n".join(lines)


def update_docs(results: dict) -> None:
    blocks = {Path("docs/benchmarks.md"): markdown(results)}
    for path, text in blocks.items():
        block = f"{BEGIN}\n{text}\n{END}"
        text = path.read_text()
        if BEGIN not in text:
            print(f"{path}: no {BEGIN} block; not changed", file=sys.stderr)
            continue
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        path.write_text(head + block + tail)
        print(f"updated {path}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument(
        "--tuned", default=",".join(TUNED), help="strategies also run with buckets='auto' ('' for none)"
    )
    parser.add_argument("--resume", action="store_true", help="skip model/target pairs already in the JSON")
    parser.add_argument(
        "--floors-only", action="store_true", help="only add the exposed-communication floor to entries that lack it"
    )
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="only rewrite the docs' results block (and the JSON, without timelines)",
    )
    args = parser.parse_args()
    results = json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}
    results = {key: _without_timelines(entry) for key, entry in results.items()}
    if args.update_docs:
        JSON_PATH.write_text(json.dumps(results, separators=(",", ":")))
        update_docs(results)
        return 0
    import jax

    jax.config.update("jax_platforms", "cpu")
    for target in args.targets.split(","):
        for model in args.models.split(","):
            key = f"{model} @ {target}"
            if args.floors_only:
                if key in results and not results[key].get("floor"):
                    results[key]["floor"] = _floor_of(model, target, results[key])
                    JSON_PATH.write_text(json.dumps(results, separators=(",", ":")))
                continue
            if args.resume and key in results:
                continue
            print(f"== {key}", file=sys.stderr)
            results[key] = _without_timelines(
                run_one(model, target, args.strategies.split(","), [t for t in args.tuned.split(",") if t])
            )
            RESULTS.mkdir(exist_ok=True)
            JSON_PATH.write_text(json.dumps(results, separators=(",", ":")))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
