"""What runs on devices: engines, collectives, compressors and kernels.

A strategy calls a :class:`~jaxsched.runtime.collectives.Collective` per bucket; compressors
wrap collectives; an :class:`~jaxsched.runtime.engine.Engine` runs the rewritten program,
either as one XLA program or cut into stages dispatched by the host.
"""

__all__: list[str] = []
