"""``engine="auto"`` (the default): the host engine where XLA cannot overlap, else xla.

The host engine is chosen for multi-process CPU meshes with one mesh device per process
and a spare local CPU device in each (see `jaxsched.runtime.engine._host`); every other mesh
(GPU, TPU, one process) gets the xla engine, with ``compiler_options``.

Example:
    >>> AutoEngine(compiler_options={}).name
    'auto'
"""

from __future__ import annotations

from typing import Any

from jaxsched.runtime.engine._base import Engine, EngineCosts, PerDeviceProgram, register_engine
from jaxsched.runtime.engine._host import HostEngine, host_engine_applies
from jaxsched.runtime.engine._xla import XlaEngine

__all__ = ["AutoEngine"]


class AutoEngine(Engine):
    """Picks an engine per program from its mesh."""

    name = "auto"

    def __init__(self, compiler_options: dict[str, Any] | None = None):
        self.xla = XlaEngine(compiler_options)

    def resolve(self, program: PerDeviceProgram) -> Engine:
        if program.manual_axes is None and host_engine_applies(program.mesh):
            return HostEngine()
        return self.xla

    def collective_form(self, mesh, op: str) -> str:
        return (HostEngine() if host_engine_applies(mesh) else self.xla).collective_form(mesh, op)

    def costs(self, mesh) -> EngineCosts:
        return (HostEngine() if host_engine_applies(mesh) else self.xla).costs(mesh)

    def compile(self, program: PerDeviceProgram):
        return self.resolve(program).compile(program)


register_engine("auto", AutoEngine)
