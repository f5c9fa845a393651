"""What XLA:TPU's schedule charges for one cross-slice (DCN) all-reduce, by size.

On a pod of several slices XLA:TPU hands a gradient's cross-slice sum to the megascale
runtime as a host send and receive. This compiles, for ``v5p:2x2x2`` with 2 slices, a
``psum`` over the slices of one buffer of each size beside an independent matmul, and
records the send's and the receive's windows in XLA's schedule. Nothing runs on a TPU:
every time is XLA's latency-hiding scheduler estimate, NOT a measurement.

It also compiles several independent sums at once: XLA's schedule charges each send its
own window as if the sends shared no bandwidth (14 sums of 1.5 MiB in 5 ms, one of 21 MiB
in 33 ms), so splitting a transfer lowers the estimate and not the bytes on the network.

Why it matters: a data-parallel step must send its last gradient (the first layer's, which
backward computes last) across slices after its backward, so the step exposes at least
the send's window less whatever compute can still follow it. The FSDP section of
docs/accelerators.md reads the unrolled Transformer's exposed communication against it.

    .venv-aot/bin/python benchmarks/tpu_dcn_latency.py     # about a minute

Writes benchmarks/results/tpu_dcn_latency.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULT = Path(__file__).parent / "results" / "tpu_dcn_latency.json"
TARGET = "v5p:2x2x2:slices=2"
SIZES = (4 << 10, 512 << 10, 1536 << 10, 4 << 20, 16 << 20)  # bytes per device
# (independent psums, bytes per device each): 21 MiB as one sum or as 14 sums of 1.5 MiB
CONCURRENT = ((1, 21 << 20), (4, 1536 << 10), (14, 1536 << 10))


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxsched.tools.aot as aot
    from jaxsched.check import _inspection as inspect_lib
    from jaxsched.core._progress import progress
    from jaxsched.runtime.engine._xla import TPU_OPTIONS

    name, topology, slices = aot.parse_target(TARGET)
    mesh = Mesh(np.array(aot.devices(name, topology, slices=slices)).reshape(slices, -1), ("data", "chips"))
    spec = P(("data", "chips"))
    rows = []
    for size in progress(list(SIZES), f"compiling for {TARGET}"):
        count = mesh.devices.size * size // (4 * 128)
        buffer = jax.ShapeDtypeStruct((count, 128), jnp.float32, sharding=NamedSharding(mesh, spec))
        other = jax.ShapeDtypeStruct((16 * 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, spec))

        def body(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
            return jax.lax.psum(x, "data"), y @ y.T @ y

        step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False))
        started = time.perf_counter()
        compiled, schedule = inspect_lib.compile_with_schedule(step.trace(buffer, other).lower(), TPU_OPTIONS)
        report = inspect_lib.report(compiled, schedule, mesh, label=f"{size} bytes")
        windows = {w.kind: (w.end_s - w.start_s) for w in report.collectives if w.start_s is not None}
        rows.append(
            {
                "bytes_per_device": size,
                "send_window_s": windows.get("send"),
                "recv_window_s": windows.get("recv"),
                "step_s": report.step_s,
                "compile_s": round(time.perf_counter() - started, 1),
            }
        )
        print(
            f"{size / 2**20:8.3f} MiB: send {1e3 * (windows.get('send') or 0):.2f} ms, "
            f"receive {1e3 * (windows.get('recv') or 0):.2f} ms (XLA's estimates)",
            flush=True,
        )
    concurrent = []
    for n, size in progress(list(CONCURRENT), "independent sums at once"):
        count = mesh.devices.size * size // (4 * 128)
        buffers = [jax.ShapeDtypeStruct((count, 128), jnp.float32, sharding=NamedSharding(mesh, spec))] * n
        other = jax.ShapeDtypeStruct((16 * 1024, 1024), jnp.float32, sharding=NamedSharding(mesh, spec))

        def sums(xs: list[jax.Array], y: jax.Array) -> tuple[list[jax.Array], jax.Array]:
            return [jax.lax.psum(x, "data") for x in xs], y @ y.T @ y

        step = jax.jit(
            jax.shard_map(sums, mesh=mesh, in_specs=([spec] * n, spec), out_specs=([spec] * n, spec), check_vma=False)
        )
        compiled, schedule = inspect_lib.compile_with_schedule(step.trace(buffers, other).lower(), TPU_OPTIONS)
        report = inspect_lib.report(compiled, schedule, mesh, label=f"{n} x {size} bytes")
        sends = [w for w in report.collectives if w.kind == "send" and w.start_s is not None]
        concurrent.append(
            {
                "sums": n,
                "bytes_per_device_each": size,
                "sends": len(sends),
                "longest_send_window_s": max(w.end_s - w.start_s for w in sends),
                "step_s": report.step_s,
            }
        )
        print(
            f"{n:3d} x {size / 2**20:6.3f} MiB at once: step {1e3 * report.step_s:.2f} ms (XLA's estimate)", flush=True
        )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(
        json.dumps(
            {
                "what": "XLA:TPU's schedule estimate (NOT measured) of a cross-slice psum's send and receive",
                "target": TARGET,
                "command": "benchmarks/tpu_dcn_latency.py",
                "date": time.strftime("%Y-%m-%d"),
                "machine": {"python": sys.version.split()[0], "jax": jax.__version__},
                "compiler_options": TPU_OPTIONS,
                "rows": rows,
                "concurrent": concurrent,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
