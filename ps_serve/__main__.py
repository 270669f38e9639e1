"""``python -m ps_serve``: the ps-serve command (ps_serve/cli.py)."""

import sys

from ps_serve.cli import main

sys.exit(main())
