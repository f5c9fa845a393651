"""Engines run scheduled per-device programs: ``xla`` (one jitted program; GPU/TPU overlap
through XLA's scheduler) and ``host`` (stages dispatched over two local devices per
process; overlap on CPU clusters). New engines plug in with
[`register_engine`][jaxsched.runtime.engine.register_engine]."""

from jaxsched.runtime.engine.base import (
    Engine,
    EngineCosts,
    PerDeviceProgram,
    engine_names,
    make_engine,
    register_engine,
)
from jaxsched.runtime.engine.xla import (
    COLLECTIVE_FORMS,
    GPU_OPTIONS,
    TPU_OPTIONS,
    XlaEngine,
    collective_form_for,
    compiler_options_for,
)
from jaxsched.runtime.engine.host import (
    HostEngine,
    HostEngineError,
    StageTiming,
    host_engine_applies,
    measure_stage_overhead,
)
from jaxsched.runtime.engine.auto import AutoEngine

__all__ = [
    "AutoEngine",
    "COLLECTIVE_FORMS",
    "collective_form_for",
    "Engine",
    "EngineCosts",
    "GPU_OPTIONS",
    "TPU_OPTIONS",
    "HostEngine",
    "HostEngineError",
    "StageTiming",
    "host_engine_applies",
    "measure_stage_overhead",
    "PerDeviceProgram",
    "XlaEngine",
    "compiler_options_for",
    "engine_names",
    "make_engine",
    "register_engine",
]
