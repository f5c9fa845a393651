"""Which XLA:TPU options move the cross-slice (DCN) transfers of a step's gradient sum earlier.

On a two-slice v5p pod XLA:TPU sends every gradient's DCN share only after the last ICI
phase of the step (docs/accelerators.md, "What the compilers do"). This compiles the
plain step of a 6 x 2048 MLP (4096 rows per device) for ``v5p:2x2x2`` with 2 slices under
jaxsched's TPU options plus, one at a time, each option that might change that, and
records XLA's estimates, when the ICI phases finish and when the weight matrices' DCN
shares start to move. Nothing runs on a TPU: every time is XLA's latency-hiding scheduler estimate for
the compiled program, NOT a measurement.

    .venv/bin/python benchmarks/tpu_dcn_options.py     # about 3 minutes

Writes benchmarks/results/tpu_dcn_options.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

RESULT = Path(__file__).parent / "results" / "tpu_dcn_options.json"
TARGET = "v5p:2x2x2:slices=2"
LARGE = 1_000_000  # bytes: a weight matrix's DCN share, not a bias's

#: Each candidate, added to jaxsched's TPU options (jaxsched.runtime.engine._xla.TPU_OPTIONS).
CANDIDATES: dict[str, dict] = {
    "jaxsched's TPU options": {},
    "data-parallel all-reduce opt": {
        "xla_tpu_enable_data_parallel_all_reduce_opt": True,
        "xla_tpu_data_parallel_opt_different_sized_ops": True,
    },
    "4 concurrent async all-reduces": {"xla_max_concurrent_async_all_reduces": 4},
    "8 concurrent send/recv": {"xla_max_concurrent_send_recv": 8},
    "DCN combiner off": {"xla_tpu_dcn_all_reduce_combiner_threshold_bytes": 0},
    "DCN overlap limit 8": {"xla_tpu_dcn_overlap_limit": 8},
    "overlap compute with collectives (TC)": {"xla_tpu_overlap_compute_collective_tc": True},
    "async collective permute": {"xla_enable_async_collective_permute": True},
    "prefer async all-gather": {"xla_tpu_prefer_async_allgather_to_allreduce": True},
    "DCN all-reduce dual pipelining": {"xla_tpu_data_parallel_dcn_ar_dual_pipelining": True},
    "multi-recv DCN sinking": {"xla_tpu_enable_multi_recv_for_dcn_all_reduce_sinking": True},
    "send/recv aggregation off": {"xla_tpu_enable_send_recv_aggregation": False},
    # the TPUs sum the cross-slice shares, the hosts only move them (a compiled-planner
    # variant on multi-slice meshes: jaxsched.pipeline._compiled_planner.DEVICE_DCN_REDUCTION)
    "device DCN reduction": {"xla_tpu_use_megascale_host_reduction": False},
}


def main() -> int:
    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.tools.aot._experiment import ModelSpec, abstract_experiment
    from jaxsched.runtime.engine._xla import TPU_OPTIONS
    from jaxsched.core._progress import progress

    spec = ModelSpec("mlp", (1024,), 1000, {"hidden": (2048,) * 6}, batch_per_device=4096)
    exp = abstract_experiment(spec, target=TARGET)
    rows = {}
    names = progress(list(CANDIDATES), f"compiling for {TARGET}")
    for name in names:
        names.set_postfix(options=name)
        started = time.perf_counter()
        report = inspect_lib.inspect_jitted(
            exp.step,
            (exp.params, exp.opt_state, exp.batch),
            exp.mesh,
            label=name,
            compiler_options={**TPU_OPTIONS, **CANDIDATES[name]},
        )
        ici = [c for c in report.collectives if c.kind == "all-reduce"]
        sends = [c for c in report.collectives if c.kind == "send"]
        rows[name] = {
            "options": CANDIDATES[name],
            "step_s": report.step_s,
            "exposed_comm_s": report.exposed_comm_s,
            "last_ici_phase_done_s": max((c.end_s for c in ici), default=None),
            "first_send_s": min((c.start_s for c in sends), default=None),
            "first_ici_phase_done_s": min((c.end_s for c in ici), default=None),
            # the tensors' shares (a scalar's or a bias's share is a few bytes)
            "large_sends_start_s": [
                min((c.start_s for c in sends if c.bytes >= LARGE), default=None),
                max((c.start_s for c in sends if c.bytes >= LARGE), default=None),
            ],
            "sends": len(sends),
            "compile_s": round(time.perf_counter() - started, 1),
        }
        ms = lambda t: "-" if t is None else f"{t * 1e3:5.2f}"
        print(
            f"{name:40s} step {ms(report.step_s)} ms  exposed {ms(report.exposed_comm_s)} ms"
            f"  ICI phases done {ms(rows[name]['first_ici_phase_done_s'])} to "
            f"{ms(rows[name]['last_ici_phase_done_s'])} ms, large sends start "
            f"{ms(rows[name]['large_sends_start_s'][0])} to "
            f"{ms(rows[name]['large_sends_start_s'][1])} ms",
            file=sys.stderr,
        )
    RESULT.parent.mkdir(exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "target": TARGET,
                "model": exp.description,
                "estimator": (
                    "XLA latency-hiding scheduler estimate for the compiled program (not measured on hardware)"
                ),
                "date": time.strftime("%Y-%m-%d"),
                "candidates": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
