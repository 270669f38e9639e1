"""``python -m ps_tools.launch``: the same as the ``ps-launch`` command."""

import sys

from ps_tools.launch.cli import main

sys.exit(main())
