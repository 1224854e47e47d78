"""``python -m minfer.cli``: the ``minfer`` command (the benchmark scripts and tests start it so)."""
import sys

from minfer.cli import main

sys.exit(main())
