"""DiLoCo compiled for two TPU v5p slices (2x2x2 each), read with XLA's own estimate.

Nothing runs on a TPU: the zoo's step is compiled for compile-only devices
(``jaxsched.tools.aot``) on a ``("dcn", "ici")`` mesh, 2 slices of 8 chips, and every time is
XLA's latency-hiding scheduler estimate, NOT a measurement. DiLoCo compiles one program
per phase (which fragment is sent at the start, which arrives at the end); each phase is
compiled and read here, and the estimated step is their mean over an H-step cycle. For
every program: the bytes of the collectives that cross slices (``dcn``), which of them
are asynchronous, and XLA's estimate of the step and its exposed communication; beside it
``wfbp`` (jaxsched's TPU options) and the plain step as XLA compiles it by default, and each
variant's ratio to the inner step alone (the phase that neither sends nor receives).

    python benchmarks/diloco_compiled.py [--model mlp] [--inner-steps 10] [--variants "diloco F=4 tau=1 4-bit"]

Writes ``benchmarks/results/diloco_compiled.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only devices need no backend
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULTS = Path(__file__).parent / "results"
TARGET = "v5p:2x2x2:slices=2"


def crosses_slices(c) -> bool:
    """A collective over the ``dcn`` axis, or a ``send`` (XLA:TPU moves multi-slice traffic
    as send/recv pairs; a ``send``'s bytes are what leaves the slice)."""
    kind = c["kind"] if isinstance(c, dict) else c.kind
    axes = c["mesh_axes"] if isinstance(c, dict) else c.mesh_axes
    return "dcn" in axes or kind == "send"


def summarize(rep) -> dict:
    dcn = [c for c in rep.collectives if crosses_slices(c)]
    return {
        "estimated_step_s": rep.step_s,
        "exposed_comm_s": rep.exposed_comm_s,
        "dcn_bytes": int(sum(c.bytes for c in dcn)),
        "dcn_collectives": [
            {
                "kind": c.kind,
                "bytes": int(c.bytes),
                "async": bool(c.is_async),
                "mesh_axes": list(c.mesh_axes),
                "compute_ops_in_window": c.compute_ops,
                "window_s": None if c.start_s is None else c.end_s - c.start_s,
                "compute_in_window_s": c.compute_s,
            }
            for c in dcn
        ],
        "collectives": [
            {"kind": c.kind, "bytes": int(c.bytes), "async": bool(c.is_async), "mesh_axes": list(c.mesh_axes)}
            for c in rep.collectives
        ],
    }


def _quantized(bits: int) -> dict:
    from jaxsched.runtime.compress import Quantize

    return dict(fragments=4, overlap_steps=1, compression=Quantize(bits=bits))


#: What each variant passes ``jaxsched.schedule`` besides its strategy (built when compiled).
VARIANTS: dict[str, Callable[[], dict]] = {
    "allreduce": dict,
    "wfbp": dict,
    "diloco F=1 tau=0": lambda: dict(fragments=1, overlap_steps=0),
    "diloco F=4 tau=1": lambda: dict(fragments=4, overlap_steps=1),
    # Streaming DiLoCo as published: outer gradients sent in 4 bits
    "diloco F=4 tau=1 4-bit": lambda: _quantized(4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--out", default=str(RESULTS / "diloco_compiled.json"))
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated variants to compile; the others are kept from --out (default: all)",
    )
    args = parser.parse_args()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose among {list(VARIANTS)}")

    import jaxsched
    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.tools.aot._experiment import ZOO, abstract_experiment, mesh_for

    mesh = mesh_for(TARGET, ("dcn", "ici"))
    exp = abstract_experiment(ZOO[args.model], mesh=mesh)
    H = args.inner_steps
    results = {
        "what": "XLA's latency-hiding scheduler estimate for compile-only TPU devices, not a measurement",
        "target": TARGET,
        "mesh": dict(mesh.shape),
        "model": exp.description,
        "inner_steps": H,
        "command": f"python benchmarks/diloco_compiled.py --model {args.model} --inner-steps {H}",
        "variants": {},
    }
    out = Path(args.out)
    if set(chosen) != set(VARIANTS) and out.exists():
        kept = json.loads(out.read_text())
        results["variants"] = {k: v for k, v in kept.get("variants", {}).items() if k not in chosen}
        if "inner_step_alone" in kept:
            results["inner_step_alone"] = kept["inner_step_alone"]

    start = time.perf_counter()
    for name in [v for v in ("allreduce", "wfbp") if v in chosen]:
        sched = jaxsched.schedule(exp.step, strategy=name)
        rep = sched.inspect(sched.init(exp.params, exp.opt_state), exp.batch, baseline=False).report
        results["variants"][name] = summarize(rep)
        print(
            name,
            results["variants"][name]["estimated_step_s"],
            results["variants"][name]["dcn_bytes"],
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    for label in [v for v in chosen if v.startswith("diloco")]:
        sched = jaxsched.schedule(exp.step, strategy="diloco", inner_steps=H, **VARIANTS[label]())
        state = sched.init(exp.params, exp.opt_state)
        sched.lower(state, exp.batch)  # builds the program
        program = sched.program
        strategy = program.strategy
        keys = [strategy.phase_key(t) for t in range(H, 2 * H)]  # one steady cycle
        phases = {}
        for key in sorted(set(keys), key=repr):
            body = strategy.rewrite_phase(program.planned, key)
            core = program.engine.compile(dataclasses.replace(program.per_device, body=body))
            compiled, schedule = inspect_lib.compile_with_schedule(core.lower(*program.inputs(state, exp.batch)))
            phases[repr(key)] = summarize(inspect_lib.report(compiled, schedule, mesh, label=f"{label} {key}"))
            print(
                label,
                key,
                phases[repr(key)]["estimated_step_s"],
                phases[repr(key)]["dcn_bytes"],
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        per_step = [phases[repr(k)] for k in keys]
        steps = [p["estimated_step_s"] for p in per_step]
        exposed = [p["exposed_comm_s"] for p in per_step]
        results["variants"][label] = {
            "phases": phases,
            "sync_axes": list(strategy.sync_axes(program.planned)),
            "estimated_step_s": None if None in steps else sum(steps) / H,
            "exposed_comm_s": None if None in exposed else sum(exposed) / H,
            "dcn_bytes": sum(p["dcn_bytes"] for p in per_step) / H,
        }
    # the inner step alone: a phase that neither sends nor receives a fragment
    alone = results.get("inner_step_alone")
    if "diloco F=4 tau=1" in results["variants"]:
        alone = results["variants"]["diloco F=4 tau=1"]["phases"].get(repr((None, None)), alone)
    if alone is not None:
        results["inner_step_alone"] = alone
        for v in results["variants"].values():
            if v["estimated_step_s"] is not None and alone["estimated_step_s"]:
                v["vs_inner_step_alone"] = v["estimated_step_s"] / alone["estimated_step_s"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"{'variant':<20} {'est. step us':>12} {'exposed us':>10} {'dcn MB/step':>12} {'x inner step':>12}")
    rows = dict(results["variants"])
    if alone is not None:
        rows["inner step alone"] = alone
    for name, v in rows.items():
        step = "-" if v["estimated_step_s"] is None else f"{v['estimated_step_s'] * 1e6:.0f}"
        exp_ = "-" if v["exposed_comm_s"] is None else f"{v['exposed_comm_s'] * 1e6:.0f}"
        ratio = v.get("vs_inner_step_alone")
        ratio = "-" if ratio is None else f"{ratio:.2f}"
        print(f"{name:<20} {step:>12} {exp_:>10} {v['dcn_bytes'] / 1e6:>12.2f} {ratio:>12}")


if __name__ == "__main__":
    main()
