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
from typing import Any

__all__ = ["compile_with_schedule"]


def compile_with_schedule(lowered, compiler_options: dict | None = None) -> tuple[Any, str | None]:
    """Compile ``lowered`` and return ``(compiled, schedule_text)``.

    Adds ``xla_dump_to`` (a temporary directory, removed afterwards) and
    ``xla_dump_latency_hiding_schedule`` to ``compiler_options``. ``schedule_text`` is the
    ``*.schedule.txt`` XLA wrote (GPU, and TPU with async collectives enabled), or None
    (CPU; TPU with default options). If several are written, the largest is returned.
    """
    tmp = tempfile.mkdtemp(prefix="jaxsched_schedule_")
    try:
        options = dict(compiler_options or {})
        options.update({"xla_dump_to": tmp, "xla_dump_latency_hiding_schedule": True})
        compiled = lowered.compile(compiler_options=options)
        paths = glob.glob(os.path.join(tmp, "**", "*schedule.txt"), recursive=True)
        text = None
        if paths:
            with open(max(paths, key=os.path.getsize)) as f:
                text = f.read()
        return compiled, text
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
