"""Entry point of one ``jaxsched bench`` process: ``python -m jaxsched.tools.cli._bench``."""

from __future__ import annotations

import sys

from jaxsched.tools.cli._cluster import run_bench

__all__ = ["run_bench"]

if __name__ == "__main__":
    sys.exit(run_bench())
