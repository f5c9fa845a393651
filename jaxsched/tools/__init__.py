"""Command-line tools: benchmarks, the emulated cluster, the launcher, ahead-of-time
compilation for accelerators, and the ``jaxsched`` CLI (the only place that parses arguments).
"""

__all__: list[str] = []
