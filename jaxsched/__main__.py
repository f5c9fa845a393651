import sys

from jaxsched.tools.cli import main

sys.exit(main())
