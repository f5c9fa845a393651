"""Compiling a lowered program with XLA's latency-hiding schedule dumped beside it.

>>> import jax, jax.numpy as jnp
>>> compiled, schedule = compile_with_schedule(jax.jit(jnp.sin).trace(jnp.ones(4)).lower())
>>> schedule is None  # XLA:CPU writes no schedule
True
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from jax.stages import Compiled, Lowered

__all__ = ["CompilerOption", "compile_with_schedule"]

#: The value of one XLA compiler option, as ``jax.jit(..., compiler_options=...)`` takes it.
CompilerOption = str | bool | int | float


def compile_with_schedule(
    lowered: Lowered, compiler_options: Mapping[str, CompilerOption] | None = None
) -> tuple[Compiled, str | None]:
    """Compile ``lowered`` and return ``(compiled, schedule_text)``.

    XLA writes its latency-hiding schedule (the start and end of every instruction) only to
    a dump directory, so this compiles with ``xla_dump_to`` (a temporary directory, removed
    afterwards) and ``xla_dump_latency_hiding_schedule`` added to ``compiler_options``.

    Args:
      lowered: the program, from ``jax.jit(f).trace(*args).lower()``.
      compiler_options: XLA options for this compile (None: XLA's defaults).

    Returns:
      ``(compiled, schedule_text)``: ``schedule_text`` is the ``*.schedule.txt`` XLA wrote
      (GPU, and TPU with async collectives enabled), or None (CPU; TPU with default
      options). If several are written, the largest.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxsched import check
      >>> lowered = jax.jit(jnp.sin).trace(jnp.ones(4)).lower()
      >>> compiled, schedule = check.compile_with_schedule(lowered)
      >>> schedule is None  # XLA:CPU writes no schedule
      True
    """
    tmp = tempfile.mkdtemp(prefix="jaxsched_schedule_")
    try:
        options: dict[str, CompilerOption] = dict(compiler_options or {})
        options.update({"xla_dump_to": tmp, "xla_dump_latency_hiding_schedule": True})
        # jax annotates the values str | bool; XLA takes its numeric options as numbers too
        compiled = lowered.compile(compiler_options=options)  # type: ignore[arg-type]
        paths = glob.glob(os.path.join(tmp, "**", "*schedule.txt"), recursive=True)
        text = None
        if paths:
            with open(max(paths, key=os.path.getsize)) as f:
                text = f.read()
        return compiled, text
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
