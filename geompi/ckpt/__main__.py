"""``python -m geompi.ckpt``: see geompi.ckpt.cli."""

import sys

from geompi.ckpt.cli import main

sys.exit(main())
