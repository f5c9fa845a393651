"""Checking a scheduled step: side-by-side verification and compiled-program inspection."""

from jaxsched import _deprecations

# every private module's public names, explicitly
from jaxsched.check._compiled_report import (
    CollectiveWindow,
    CompiledReport,
    ESTIMATE_FROM_INSTRUCTIONS,
    ESTIMATE_FROM_SCHEDULE,
    ESTIMATOR,
    LoopCost,
)
from jaxsched.check._compiling import CompilerOption, compile_with_schedule
from jaxsched.check._estimate import estimate_from_instruction_costs
from jaxsched.check._inspection import (
    Inspection,
    PLAIN_LABEL,
    describe_mesh,
    inspect_lowered,
    inspect_lowered_by_costs_too,
    inspect_jitted,
    ratios,
)
from jaxsched.check._report import report
from jaxsched.check._table import format_options, format_table
from jaxsched.check._timeline import plot
from jaxsched.check._verify import PRECISIONS, relative_gap, verify, VerifyReport

__all__ = [
    "CollectiveWindow",
    "CompiledReport",
    "CompilerOption",
    "ESTIMATE_FROM_INSTRUCTIONS",
    "ESTIMATE_FROM_SCHEDULE",
    "ESTIMATOR",
    "Inspection",
    "LoopCost",
    "PLAIN_LABEL",
    "PRECISIONS",
    "VerifyReport",
    "compile_with_schedule",
    "describe_mesh",
    "estimate_from_instruction_costs",
    "format_options",
    "format_table",
    "inspect_jitted",
    "inspect_lowered",
    "inspect_lowered_by_costs_too",
    "plot",
    "ratios",
    "relative_gap",
    "report",
    "verify",
]


def __getattr__(name: str) -> object:
    return _deprecations.moved_module(__name__, name)  # a module of before, now private
