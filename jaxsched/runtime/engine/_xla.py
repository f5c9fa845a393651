"""The ``xla`` engine: the scheduled program as one jitted shard_map.

Overlap on GPU and TPU comes from XLA's latency-hiding scheduler, which moves async
collective starts early and dones late around independent compute. What each compiler
does by default would undo a schedule (measured on compiled programs, docs/accelerators.md),
so the options below go to this one function only (never through ``XLA_FLAGS``):

* GPU: ``xla_gpu_enable_latency_hiding_scheduler`` on, and the all-reduce, reduce-scatter
  and all-gather combiners capped at the plan's bucket size
  (``*_combine_threshold_bytes = PerDeviceProgram.bucket_bytes``, 25 MiB by default).
  XLA's defaults would re-merge our buckets into one collective at the end of backward,
  the serialization buckets avoid; with the combiners off (0) every tensor of a bucket is
  its own collective, and on a multi-host mesh their latencies add up (a 9.5M-parameter
  CNN on 64 H100s: estimated 4.4x the plain step, against 0.81x with the cap;
  docs/accelerators.md). Two collectives in flight
  (``xla_gpu_experimental_parallel_collective_overlap_limit``), so that an all-gather
  need not wait for a reduce-scatter.
* TPU: by default XLA:TPU combines every all-reduce into one *synchronous* all-reduce
  after backward. The async collective fusion (``xla_tpu_enable_async_collective_fusion``
  and its ``fuse_*`` options), async all-reduce/all-gather, and the cross-replica-sum
  combiner threshold at 0 make each collective an async pair with compute in its window.

XLA:CPU runs collectives synchronously inside a program (docs/benchmarks.md), so CPU gets
no options.

Example:
    >>> XlaEngine(compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True}).name
    'xla'
    >>> compiler_options_for("cuda", bucket_bytes=2**20)["xla_gpu_all_reduce_combine_threshold_bytes"]
    1048576
    >>> compiler_options_for("cpu")
    {}
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from jaxsched._errors import JaxschedTypeError
from jaxsched.core import _axes as axes
from jaxsched.runtime.engine._base import (
    Engine,
    PerDeviceProgram,
    platform_family,
    register_engine,
    signature_guarded,
)

__all__ = [
    "collective_form_for",
    "COLLECTIVE_FORMS",
    "compiler_options_for",
    "GPU_FSDP_MEMORY_OPTIONS",
    "GPU_FSDP_OPTIONS",
    "GPU_OPTIONS",
    "TPU_OPTIONS",
    "XlaEngine",
]

#: GPU options for every program. XLA:GPU runs one collective at a time by default, so a
#: bucket's all-gather waits behind the previous bucket's reduce-scatter; with two in flight
#: an 8x1024 MLP on h100:1x2x4 (XLA's estimates) exposed 120 us of communication under
#: ``wfbp`` instead of 162, and 173 under ``dear`` instead of 212 (the plain step: 193).
GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_reduce_combine_threshold_bytes": 0,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
    "xla_gpu_all_gather_combine_threshold_bytes": 0,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


#: GPU options for every program that gathers parameter blocks (FSDP). XLA's collective
#: pipeliner moves a loop iteration's reduce-scatter into the next iteration, which keeps a
#: whole layer's unreduced gradient alive beside the next layer's gathered weights: on a
#: scanned 6-layer Transformer (h100:1x2x4, XLA's estimates) it hid 0.08 ms more of a 3.6 ms
#: step for 22 MB more per device, twice the layer that double-buffering the gathers already
#: adds; without it the step stays within the plain step's memory plus that one layer.
GPU_FSDP_MEMORY_OPTIONS: dict[str, Any] = {"xla_gpu_enable_pipelined_reduce_scatter": False}

#: GPU options for a program that gathers parameter blocks (FSDP) across four hosts or more,
#: measured on an 8-layer FSDP Transformer (XLA's estimates, benchmarks/fsdp_compiled.py): on
#: 64 H100s gathers combined up to 64 MiB and reduce-scatters up to 32 MiB (about a layer)
#: cut the estimated step from 19.2 to 18.3 ms; on 8 H100s over 2 hosts they raised it from
#: 11.3 to 12.3 ms.
GPU_FSDP_OPTIONS: dict[str, Any] = {
    "xla_gpu_all_gather_combine_threshold_bytes": 1 << 26,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 25,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}

#: TPU options for every program: XLA:TPU runs a collective async only inside an async
#: collective fusion with compute. Its scheduler often plans a gradient's all-reduce beside
#: the elementwise update of another layer, which by default is no fusion partner (only a
#: matmul is): with ``fuse_kloop_fusions`` every weight all-reduce of an 8x1024 MLP on
#: v5p:2x2x2 runs async (XLA's estimates: ``wfbp`` 610 us a step, 820 without it; ``approx``
#: 582 and 792; without it 1 and 2 of the 8 run async).
#: ``xla_max_concurrent_async_all_gathers=4`` is left out: on a scanned FSDP Transformer (two
#: v5p slices) it left three of a layer's four
#: prefetched gathers synchronous in every iteration (``wfbp`` 44.3 ms a step, 42.7 without).
TPU_OPTIONS: dict[str, Any] = {
    "xla_tpu_enable_async_collective_fusion": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": True,
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": True,
    "xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter": True,
    "xla_tpu_enable_async_collective_fusion_multiple_steps": True,
    "xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions": True,
    "xla_enable_async_all_reduce": True,
    "xla_enable_async_all_gather": True,
    "xla_jf_crs_combiner_threshold_in_bytes": 0,
}


def compiler_options_for(
    platform: str, bucket_bytes: int = 0, axis_size: int = 1, gathers_parameters: bool = False, hosts: int = 1
) -> dict[str, Any]:
    """Per-function XLA options for ``platform`` (``cpu``, ``gpu``/``cuda``/``rocm``, ``tpu``).

    On GPU the combiners may merge collectives up to a bucket of ``bucket_bytes`` (0: not
    at all). XLA sizes a collective by its result, so a reduce-scatter over ``axis_size``
    devices counts ``bucket_bytes / axis_size``. A program that gathers parameter blocks
    (FSDP, ``gathers_parameters``) keeps the pipelined reduce-scatter off
    (`GPU_FSDP_MEMORY_OPTIONS`); across ``hosts`` >= 4 it also sends a
    layer's gathers and reduce-scatters as a few large collectives
    (`GPU_FSDP_OPTIONS`): each collective then costs a start-up of hundreds of
    microseconds, which dozens per layer add up to, while on one or two hosts combining
    only keeps more gathered weights alive."""
    if platform_family(platform) == "gpu":
        bucket_bytes = int(bucket_bytes)
        options = {
            **GPU_OPTIONS,
            "xla_gpu_all_reduce_combine_threshold_bytes": bucket_bytes,
            "xla_gpu_all_gather_combine_threshold_bytes": bucket_bytes,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": bucket_bytes // max(1, axis_size),
        }
        if gathers_parameters:
            options.update(GPU_FSDP_MEMORY_OPTIONS)
            if hosts >= 4:
                options.update(GPU_FSDP_OPTIONS)
        return options
    if platform == "tpu":
        return dict(TPU_OPTIONS)
    return {}


#: How buckets travel per platform and collective (see `Engine.collective_form`).
#: Measured on compiled programs (docs/accelerators.md, benchmarks/compiled_overlap.py).
COLLECTIVE_FORMS: dict[str, dict[str, str]] = {
    "tpu": {"all_reduce": "per_tensor", "reduce_scatter": "per_tensor", "all_gather": "per_tensor"},
    "gpu": {"all_reduce": "mixed", "reduce_scatter": "mixed", "all_gather": "per_tensor"},
}


#: XLA:CPU's pass that sums 16-bit float all-reduces in float32 aborts the process ("Invalid
#: binary instruction opcode copy", jax 0.10.2) on the all-reduce JAX lowers for a ``psum``
#: in a ``shard_map`` manual over some mesh axes only: its reducer holds a sharding
#: constraint. A program that leaves model axes to XLA and sums a bfloat16 gradient is one;
#: without the pass XLA:CPU sums those in their own type, a float rounding apart.
CPU_PARTIAL_SHARD_MAP_BROKEN_PASS = "all-reduce-promotion"


def _disable_pass(options: dict[str, Any], name: str) -> None:
    """Add ``name`` to the passes ``options`` disable (``xla_disable_hlo_passes``)."""
    passes = [p for p in str(options.get("xla_disable_hlo_passes", "")).split(",") if p]
    if name not in passes:
        options["xla_disable_hlo_passes"] = ",".join([*passes, name])


def collective_form_for(platform: str, op: str) -> str:
    return COLLECTIVE_FORMS.get(platform_family(platform), {}).get(op, "mixed")


class XlaEngine(Engine):
    """One ``jax.jit(shard_map(body))`` per program, compiled with per-function options.

    Args:
      compiler_options: XLA options for this program only; ``None`` picks the platform's
        set (`compiler_options_for`), or none for a program that asks for XLA's
        defaults (``PerDeviceProgram.compiler_defaults``); ``{}`` passes none.
    """

    name = "xla"

    @property
    def checks_signatures(self) -> bool:  # type: ignore[override]
        """True: `compile` jits a `signature_guarded` body (a subclass's own `compile` may not)."""
        return type(self).compile is XlaEngine.compile

    def __init__(self, compiler_options: dict[str, Any] | None = None):
        if compiler_options is not None and not isinstance(compiler_options, dict):
            raise JaxschedTypeError(
                f"compiler_options must be a dict of XLA option names to values, got {type(compiler_options).__name__}"
            )
        self.compiler_options = compiler_options

    def collective_form(self, mesh, op: str) -> str:
        return collective_form_for(mesh.devices.flat[0].platform, op)

    def options_for(self, program: PerDeviceProgram) -> dict[str, Any]:
        """The XLA options `compile` passes for ``program`` (``{}``: XLA's defaults)."""
        platform = program.mesh.devices.flat[0].platform
        if self.compiler_options is not None:
            options = self.compiler_options
        elif program.compiler_defaults:
            options = {}
        else:
            options = compiler_options_for(
                platform,
                program.bucket_bytes,
                axes.axis_size(program.mesh, program.axis_name),
                program.gathers_parameters,
                len({getattr(d, "process_index", 0) for d in program.mesh.devices.flat}),
            )
        if self.compiler_options is None:
            options = {**options, **program.compiler_overrides}
        options = dict(options)
        if platform == "cpu" and program.manual_axes is not None:
            _disable_pass(options, CPU_PARTIAL_SHARD_MAP_BROKEN_PASS)
        return options

    def compile(self, program: PerDeviceProgram) -> Callable[..., tuple]:
        options = self.options_for(program)
        donated = tuple(range(program.donated_inputs))
        if program.global_body is not None:

            def whole(*args):
                return tuple(program.global_body(*args))

            sharding = lambda spec: NamedSharding(program.mesh, spec)
            return jax.jit(
                signature_guarded(whole, program.batch_inputs),
                in_shardings=tuple(map(sharding, program.in_specs)),
                # the aux where XLA's propagation puts it, as in the step as written
                out_shardings=tuple(map(sharding, program.state_out_specs)) + program.aux_out_shardings(),
                donate_argnums=donated,
                compiler_options=options or None,
            )
        return jax.jit(
            signature_guarded(program.mapped(), program.batch_inputs),
            out_shardings=program.out_shardings(),
            donate_argnums=donated,
            compiler_options=options or None,
        )


register_engine("xla", XlaEngine)
