"""Engines run scheduled per-device programs: ``xla`` (one jitted program; GPU/TPU overlap
through XLA's scheduler). New engines plug in with :func:`register_engine`."""
from jaxsched.engine.base import Engine, PerDeviceProgram, engine_names, make_engine, register_engine
from jaxsched.engine.xla import GPU_OPTIONS, XlaEngine, compiler_options_for

__all__ = ["Engine", "GPU_OPTIONS", "PerDeviceProgram", "XlaEngine", "compiler_options_for",
           "engine_names", "make_engine", "register_engine"]
