"""What runs on devices: engines, collectives, compressors and kernels.

A strategy calls a `Collective` per bucket; compressors
wrap collectives; an `Engine` runs the rewritten program,
either as one XLA program or cut into stages dispatched by the host.
"""

from jaxsched import _deprecations

__all__: list[str] = []


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
