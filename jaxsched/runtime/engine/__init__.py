"""Engines run scheduled per-device programs: ``xla`` (one jitted program; GPU/TPU overlap
through XLA's scheduler) and ``host`` (stages dispatched over two local devices per
process; overlap on CPU clusters). New engines plug in with
[`register_engine`][jaxsched.runtime.engine.register_engine]."""

from jaxsched import _deprecations

from jaxsched.runtime.engine._base import (
    Engine,
    EngineCosts,
    PerDeviceProgram,
    engine_names,
    make_engine,
    register_engine,
)
from jaxsched.runtime.engine._xla import (
    COLLECTIVE_FORMS,
    GPU_OPTIONS,
    TPU_OPTIONS,
    XlaEngine,
    collective_form_for,
    compiler_options_for,
)
from jaxsched.runtime.engine._host import (
    HostEngine,
    HostEngineError,
    StageTiming,
    host_engine_applies,
    measure_stage_overhead,
)
from jaxsched.runtime.engine._auto import AutoEngine

# every private module's public names, explicitly
from jaxsched.runtime.engine._base import Stage, StageTimer
from jaxsched.runtime.engine._host import (
    BALLAST_ELEMENTS,
    BUCKET_MIN_BYTES,
    cut_stages,
    describe_comm_stage,
    describe_compute_stage,
    HEAVY_PRIMITIVES,
    LAYOUT_PRIMITIVES,
    spare_devices,
    StagedProgram,
)
from jaxsched.runtime.engine._xla import GPU_FSDP_MEMORY_OPTIONS, GPU_FSDP_OPTIONS

__all__ = [
    "AutoEngine",
    "BALLAST_ELEMENTS",
    "BUCKET_MIN_BYTES",
    "COLLECTIVE_FORMS",
    "Engine",
    "EngineCosts",
    "GPU_FSDP_MEMORY_OPTIONS",
    "GPU_FSDP_OPTIONS",
    "GPU_OPTIONS",
    "HEAVY_PRIMITIVES",
    "HostEngine",
    "HostEngineError",
    "LAYOUT_PRIMITIVES",
    "PerDeviceProgram",
    "Stage",
    "StageTimer",
    "StageTiming",
    "StagedProgram",
    "TPU_OPTIONS",
    "XlaEngine",
    "collective_form_for",
    "compiler_options_for",
    "cut_stages",
    "describe_comm_stage",
    "describe_compute_stage",
    "engine_names",
    "host_engine_applies",
    "make_engine",
    "measure_stage_overhead",
    "register_engine",
    "spare_devices",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
