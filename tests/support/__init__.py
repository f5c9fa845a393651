"""Helpers shared by the tests: reference steps, equivalence checks, worker scripts."""

from pathlib import Path

#: where the worker scripts that tests start as processes live
SUPPORT_DIR = Path(__file__).resolve().parent
