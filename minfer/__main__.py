"""``python -m minfer``: the ``minfer`` command without the installed entry point."""
import sys

from minfer.cli import main

sys.exit(main())
