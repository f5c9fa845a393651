"""Engines run a rewritten body. ``xla``: one jitted program (GPU/TPU overlap via XLA)."""
from jaxsched.engine.xla import compiler_options_for, compile_body

__all__ = ["compile_body", "compiler_options_for"]
