"""Measured overlap on an emulated 2-host cluster: see ``jaxsched.tools.bench`` (same options).

.venv/bin/python benchmarks/overlap.py --hosts 2 --bandwidth 1gbit --steps 20
"""

import sys

from jaxsched.tools.cli._cluster import run_bench as main

if __name__ == "__main__":
    sys.exit(main())
