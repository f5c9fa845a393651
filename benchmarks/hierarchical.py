"""Flat against hierarchical gradient sums, data parallel over two mesh axes.

Compiles the zoo MLP (126M parameters) for a two-slice TPU v5p pod, compile-only (no TPU
here), with the step data parallel over ``("dcn", "ici")``: 2 slices x 8 chips. For each
strategy it compiles

* the plain step (``lax.pmean(grads, ("dcn", "ici"))``, XLA's own lowering);
* the strategy with the flat collective (``collective=Collective()``: one sum over both axes);
* the strategy with ``Hierarchical(fast="ici", slow="dcn")``, the two-level sum the mesh
  calls for (``jaxsched.runtime.collectives.hierarchy_from_mesh``);

and reports the bytes that cross slices (operand bytes per device per step of every
collective whose device groups span both slices, and of every ``send``: XLA:TPU lowers
the cross-slice part of a sum to point-to-point DCN transfers), which collectives are
async, and XLA's estimated step and exposed communication. Every time is XLA's latency-hiding
scheduler estimate for a compiled program, NOT a measurement.

    .venv-aot/bin/python benchmarks/hierarchical.py
    .venv-aot/bin/python benchmarks/hierarchical.py --model cnn --target v5p:2x2x2:slices=2

Writes benchmarks/results/hierarchical_aot.json. ``--update-docs`` rewrites the block
between the ``hierarchical`` markers of docs/benchmarks.md from it and from the emulated cluster's
measurement, benchmarks/results/hierarchical_cluster.json (benchmarks/hierarchical_cluster.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend

RESULTS = Path(__file__).parent / "results"
README = Path(__file__).parent.parent / "docs" / "benchmarks.md"
BEGIN, END = "<!-- hierarchical:begin -->", "<!-- hierarchical:end -->"


def docs_block(aot: dict, cluster: dict | None) -> str:
    """The README's tables: compiled for TPU (XLA's estimates), and the emulated cluster."""
    lines = [
        f"Compiled for `{aot['target']}`, mesh `{aot['mesh']}`, {aot['model']}: XLA's "
        "estimates for the compiled programs, not measured "
        f"(`.venv-aot/bin/python benchmarks/hierarchical.py --model {aot['model'].split()[0]}`). "
        "Cross-slice MB are the bytes per device per step of the collectives that span slices "
        "and of the DCN send/recv.",
        "",
        "| step | cross-slice MB | est. step ms | est. exposed comm ms |",
        "|---|---|---|---|",
    ]
    for label, row in aot["rows"].items():
        fmt = lambda v: "-" if v is None else f"{v * 1e3:.2f}"
        lines.append(
            f"| {label} | {row['cross_slice_bytes'] / 1e6:.1f} | {fmt(row['step_s'])} | {fmt(row['exposed_comm_s'])} |"
        )
    if cluster:
        lines += [
            "",
            f"Measured on the emulated cluster ({cluster['processes']} hosts x "
            f"{cluster['local_devices']} CPU devices, 1 Gbit/s links, "
            f"{cluster['gradient_bytes'] / 1e6:.1f} MB of gradients, median of "
            f"{cluster['steps']} interleaved steps, `benchmarks/hierarchical_cluster.py`). "
            "Sent MB are what each host's interface sent per step:",
            "",
            "| variant | median step ms | sent per step per host MB |",
            "|---|---|---|",
        ]
        for label, row in cluster["variants"].items():
            sent = sum(row["tx_bytes_per_step_per_host"]) / len(row["tx_bytes_per_step_per_host"])
            lines.append(f"| {label} | {row['median_step_s'] * 1e3:.1f} | {sent / 1e6:.2f} |")
    return "\n".join(lines)


def update_docs() -> None:
    aot = json.loads((RESULTS / "hierarchical_aot.json").read_text())
    path = RESULTS / "hierarchical_cluster.json"
    cluster = json.loads(path.read_text()) if path.exists() else None
    text = README.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + BEGIN + "\n" + docs_block(aot, cluster) + "\n" + END + tail)


def cross_slice_bytes(report) -> int:
    """Operand bytes per device of the collectives whose groups span the slow axis, and of
    the point-to-point sends XLA:TPU uses for the cross-slice part of a sum."""
    return sum(c.bytes for c in report.collectives if "dcn" in c.mesh_axes or c.kind == "send")


def summary(report) -> dict:
    return {
        "step_s": report.step_s,
        "exposed_comm_s": report.exposed_comm_s,
        "cross_slice_bytes": cross_slice_bytes(report),
        "collectives": [
            {"kind": c.kind, "bytes": c.bytes, "mesh_axes": list(c.mesh_axes), "async": c.is_async}
            for c in report.collectives
        ],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=("mlp", "cnn", "transformer"))
    parser.add_argument("--target", default="v5p:2x2x2:slices=2")
    parser.add_argument("--strategies", default="wfbp,dear")
    parser.add_argument("--out", type=Path, default=RESULTS / "hierarchical_aot.json")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="only rewrite the benchmarks page's block from the saved JSON results",
    )
    args = parser.parse_args(argv)
    if args.update_docs:
        update_docs()
        return 0

    import jax

    import jaxsched
    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.tools.aot._experiment import ZOO, abstract_experiment, mesh_for
    from jaxsched.runtime.collectives import Collective, hierarchy_from_mesh

    mesh = mesh_for(args.target, ("dcn", "ici"))
    exp = abstract_experiment(ZOO[args.model], mesh=mesh)
    print(f"{exp.description} on {args.target}, mesh {dict(mesh.shape)}", file=sys.stderr)
    started = time.perf_counter()
    plain = inspect_lib.inspect_jitted(exp.step, (exp.params, exp.opt_state, exp.batch), mesh)
    rows = {"plain step (XLA defaults)": summary(plain)}
    for name in args.strategies.split(","):
        for label, options in (
            ("flat", {"collective": Collective()}),
            ("hierarchical", {"collective": hierarchy_from_mesh(mesh, ("dcn", "ici"))}),
        ):
            sched = jaxsched.schedule(exp.step, strategy=name, **options)
            inspection = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=False)
            chosen = sched.program.strategy.collective
            rows[f"{name}, {label}"] = dict(
                summary(inspection.report),
                collective=repr(chosen) if type(chosen) is not Collective else "Collective()",
            )
            print(
                f"  {name} {label}: {rows[f'{name}, {label}']['cross_slice_bytes'] / 1e6:.1f} MB "
                f"cross-slice, est. step {inspection.report.step_s}",
                file=sys.stderr,
            )
    payload = {
        "what": "XLA's estimates for compiled programs (compile-only devices), not measured",
        "model": exp.description,
        "target": args.target,
        "mesh": dict(mesh.shape),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "seconds_to_compile_all": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"{'':<28}{'cross-slice MB':>15}{'est. step ms':>14}{'est. exposed ms':>17}")
    for label, row in rows.items():
        step = "-" if row["step_s"] is None else f"{row['step_s'] * 1e3:.2f}"
        exposed = "-" if row["exposed_comm_s"] is None else f"{row['exposed_comm_s'] * 1e3:.2f}"
        print(f"{label:<28}{row['cross_slice_bytes'] / 1e6:>15.1f}{step:>14}{exposed:>17}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
