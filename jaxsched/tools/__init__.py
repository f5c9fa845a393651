"""Command-line tools: benchmarks, the emulated cluster, the launcher, ahead-of-time
compilation for accelerators, and the ``jaxsched`` CLI (the only place that parses arguments).
"""

from jaxsched import _deprecations

__all__: list[str] = []


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
