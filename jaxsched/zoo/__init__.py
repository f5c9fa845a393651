"""Small models and data sets that ship with the package.

They serve the demo, the profiler and the benchmarks; user code never needs them.
"""

__all__: list[str] = []
