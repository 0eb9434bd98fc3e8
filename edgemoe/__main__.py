"""``python -m edgemoe ...``: the ``edgemoe`` command, from whichever checkout this interpreter imports."""

import sys

from edgemoe.cli import main

sys.exit(main())
