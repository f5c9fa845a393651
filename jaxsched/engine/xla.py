"""The ``xla`` engine: the scheduled program as one jitted shard_map.

Overlap on GPU comes from XLA's latency-hiding scheduler, which moves the async
collective starts early and the dones late around independent compute. Two things
would undo the schedule, so the options below are passed to this one function only
(never through ``XLA_FLAGS``):

* ``xla_gpu_enable_latency_hiding_scheduler``: turns that scheduler on;
* ``xla_gpu_{all_reduce,reduce_scatter,all_gather}_combine_threshold_bytes = 0``: XLA's
  combiners would otherwise re-merge our buckets into one collective at the end of
  backward, which is exactly the serialization the buckets exist to avoid.

On TPU the latency-hiding scheduler is on by default; XLA:CPU runs collectives
synchronously inside a program (docs/architecture.md), so CPU gets no options.

Example:
    >>> XlaEngine(compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True}).name
    'xla'
    >>> compiler_options_for("cuda") == GPU_OPTIONS
    True
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxsched.engine.base import Engine, PerDeviceProgram, register_engine

GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
}


def compiler_options_for(platform: str) -> dict[str, Any]:
    """Per-function XLA options for ``platform`` (``cpu``, ``gpu``/``cuda``/``rocm``, ``tpu``)."""
    return dict(GPU_OPTIONS) if platform in ("gpu", "cuda", "rocm") else {}


class XlaEngine(Engine):
    """One ``jax.jit(shard_map(body))`` per program, compiled with per-function options.

    Args:
      compiler_options: XLA options for this program only; ``None`` picks the platform's
        set (:func:`compiler_options_for`), ``{}`` passes none.
    """

    name = "xla"

    def __init__(self, compiler_options: dict[str, Any] | None = None):
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise TypeError(f"compiler_options must be a dict of XLA option names to values, got "
                            f"{type(compiler_options).__name__}")
        self.compiler_options = compiler_options

    def compile(self, program: PerDeviceProgram) -> Callable[..., tuple]:
        platform = program.mesh.devices.flat[0].platform
        options = (compiler_options_for(platform) if self.compiler_options is None
                   else self.compiler_options)
        return jax.jit(program.mapped(), compiler_options=options or None)


register_engine("xla", XlaEngine)
