"""The ``xla`` engine: the rewritten body as one jitted shard_map program.

Overlap on GPU comes from XLA's latency-hiding scheduler, which moves the async
collective starts early and the dones late around independent compute. Two things
would undo the schedule, so the options below are passed to this one function only
(never through ``XLA_FLAGS``):

* ``xla_gpu_enable_latency_hiding_scheduler``: turns that scheduler on;
* ``xla_gpu_{all_reduce,reduce_scatter,all_gather}_combine_threshold_bytes = 0``: XLA's
  combiners would otherwise re-merge our buckets into one collective at the end of
  backward, which is exactly the serialization the buckets exist to avoid.

On TPU the latency-hiding scheduler is on by default; XLA:CPU runs collectives
synchronously and ignores scheduling (see FACTS.md), so CPU gets no options.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec as P

GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
}


def compiler_options_for(platform: str) -> dict[str, Any]:
    """Per-function XLA options for ``platform`` (``cpu``, ``gpu``/``cuda``/``rocm``, ``tpu``)."""
    return dict(GPU_OPTIONS) if platform in ("gpu", "cuda", "rocm") else {}


def compile_body(body: Callable, mesh: Mesh, in_specs: Sequence[P], out_specs: Sequence[P],
                 compiler_options: dict[str, Any] | None = None) -> Callable:
    """jit(shard_map(body)) taking and returning flat lists of arrays."""
    platform = mesh.devices.flat[0].platform
    options = compiler_options_for(platform) if compiler_options is None else compiler_options

    def flat_body(*args):
        return tuple(body(*args))

    mapped = jax.shard_map(flat_body, mesh=mesh, in_specs=tuple(in_specs),
                           out_specs=tuple(out_specs), check_vma=False)
    return jax.jit(mapped, compiler_options=options or None)
