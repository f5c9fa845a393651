"""What runs on devices: engines, collectives, compressors and kernels.

A strategy calls a `Collective` per bucket; compressors
wrap collectives; an `Engine` runs the rewritten program,
either as one XLA program or cut into stages dispatched by the host.
"""

__all__: list[str] = []
