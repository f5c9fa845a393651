"""FSDP Transformers compiled for GPU and TPU clusters we do not have: the scheduled step
against the plain `jax.jit` step, as XLA estimates them.

Run: ``.venv-aot/bin/python benchmarks/fsdp_compiled.py [--targets h100:1x8x8 v5p:2x2x2:slices=2]``
(needs the ``aot`` extra; about 45 minutes, 5 of them for ``h100:1x8x8``).
Writes ``benchmarks/results/fsdp_compiled.json``.

The model is `jaxsched.zoo.stacked_lm.StackedLM` (8 layers of 1024, MLP 4096,
vocabulary 8192, sequence 512, adamw), written as MaxText writes it: its layers stacked,
scanned with ``jax.checkpoint`` or unrolled, every weight ``P(None, "fsdp", None)``. On
``h100:1x8x8`` it is FSDP over the 64 GPUs; on two ``v5p:2x2x2`` slices it is HSDP, FSDP over
the 8 chips of a slice and data parallel over the slices (``"data"``). Every row is compiled
here for the target's compile-only devices; the figures are XLA's own schedule estimates
(latency-hiding scheduler), NOT measurements, each against the plain step compiled in the
same run:

* ``plain``: the user's step as XLA compiles it with its defaults;
* ``plain + MaxText flags``: the same step with the flag bundle MaxText recommends for the
  target (pipelined collectives and loop double buffering on GPU, async collective fusion on
  TPU): the peer careful users already have;
* ``wfbp``, ``dear``, ``auto``: the scheduled step with the engine's per-target options.

Per row: the estimated step, the exposed communication (collectives in flight while no compute
runs), XLA's memory analysis per device (peak = arguments + outputs + temporaries - aliased),
and the most all-gathered bytes alive at once in the schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as platform_lib
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jaxsched  # noqa: E402
import jaxsched.tools.aot as aot  # noqa: E402
from jaxsched.check import _inspection as inspection  # noqa: E402
from jaxsched.zoo import stacked_lm  # noqa: E402

#: The flag bundles MaxText's guides recommend, as per-function compiler options.
MAXTEXT_FLAGS = {
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30,
        "xla_gpu_all_gather_combine_threshold_bytes": 1 << 27,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 26,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
    },
    "tpu": {
        "xla_tpu_enable_async_collective_fusion": True,
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
        "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
        "xla_tpu_overlap_compute_collective_tc": True,
        "xla_enable_async_all_gather": True,
    },
}
ROWS_PER_DEVICE = {"gpu": 4, "tpu": 4}
STRATEGIES = ("wfbp", "dear", "auto")


def mesh_for(target: str) -> tuple[Mesh, str]:
    name, topology, slices = aot.parse_target(target)
    devices = np.array(aot.devices(name, topology, slices=slices))
    if slices > 1:
        return Mesh(devices.reshape(slices, -1), ("data", "fsdp")), "tpu"
    return Mesh(devices.reshape(-1), ("fsdp",)), "gpu" if name in aot.GPU_TARGETS else "tpu"


def memory(compiled) -> dict:
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    out = {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
    }
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def row(label: str, report, compiled, seconds: float) -> dict:
    return {
        "label": label,
        "step_us": None if report.step_s is None else report.step_s * 1e6,
        "exposed_us": None if report.exposed_comm_s is None else report.exposed_comm_s * 1e6,
        "memory": memory(compiled),
        "peak_gathered_bytes": report.peak_gathered_bytes,
        "loops": [loop._asdict() for loop in report.loops],
        "compile_s": seconds,
    }


def plain_row(step, args, mesh, label: str, options: dict | None) -> dict:
    start = time.perf_counter()
    lowered = step.trace(*args).lower()
    compiled, schedule = inspection.compile_with_schedule(lowered, options)
    report = inspection.report(compiled, schedule, mesh, label=label, target=inspection.describe_mesh(mesh))
    return row(label, report, compiled, time.perf_counter() - start)


def scheduled_row(step, args, strategy: str) -> dict:
    start = time.perf_counter()
    sched = jaxsched.schedule(step, strategy=strategy)
    state = sched.init(args[0], args[1])
    lowered = sched.lower(state, args[2])
    compiled, schedule = inspection.compile_with_schedule(lowered)
    program = sched.program
    report = inspection.report(compiled, schedule, program.planned.mesh, label=strategy)
    out = row(strategy, report, compiled, time.perf_counter() - start)
    if strategy == "auto":
        out["chose"] = getattr(program.strategy, "name", strategy)
    return out


def measure(target: str, scan: bool) -> dict:
    mesh, kind = mesh_for(target)
    config = stacked_lm.StackedLM(scan=scan, remat=True)
    tx = optax.adamw(1e-4)
    step = stacked_lm.make_step(config, tx, mesh)
    args = stacked_lm.abstract(config, mesh, tx, ROWS_PER_DEVICE[kind])
    rows = [plain_row(step, args, mesh, "plain", None)]
    rows.append(plain_row(step, args, mesh, "plain + MaxText flags", MAXTEXT_FLAGS[kind]))
    for strategy in STRATEGIES:
        rows.append(scheduled_row(step, args, strategy))
    base = rows[0]
    for r in rows:
        for key in ("step_us", "exposed_us"):
            r[key.replace("_us", "_vs_plain")] = (
                r[key] / base[key] if r[key] is not None and base[key] not in (None, 0) else None
            )
    return {
        "target": target,
        "mesh": {k: int(v) for k, v in mesh.shape.items()},
        "layers": "scanned + remat" if scan else "unrolled + remat",
        "one_layer_gathered_bytes": config.layer_bytes,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["h100:1x8x8", "v5p:2x2x2:slices=2"])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "fsdp_compiled.json")
    args = parser.parse_args()
    results = {
        "what": "FSDP/HSDP Transformer compiled for clusters we do not have: XLA's schedule estimates "
        "(NOT measured), the scheduled step against the plain jit step compiled in the same run",
        "command": "benchmarks/fsdp_compiled.py --targets " + " ".join(args.targets),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"python": platform_lib.python_version(), "jax": jax.__version__},
        "maxtext_flags": MAXTEXT_FLAGS,
        "cases": [],
    }
    cases = [(t, scan) for t in args.targets for scan in (True, False)]
    for target, scan in tqdm(cases, desc="targets"):
        results["cases"].append(measure(target, scan))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    nan = float("nan")
    for case in results["cases"]:
        print(f"{case['target']} {case['layers']} (XLA's estimates, not measured):")
        for r in case["rows"]:
            mem = r["memory"].get("peak_bytes")
            print(
                f"  {r['label']:24s} step {r['step_us'] or nan:9.0f} us ({r['step_vs_plain'] or nan:.2f}x)"
                f"  exposed {r['exposed_us'] or nan:8.0f} us ({r['exposed_vs_plain'] or nan:.2f}x)"
                f"  peak {(mem or 0) / 1e6:8.1f} MB  gathered {(r['peak_gathered_bytes'] or 0) / 1e6:6.1f} MB"
                + (f"  [chose {r['chose']}]" if "chose" in r else "")
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
