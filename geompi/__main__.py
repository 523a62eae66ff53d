"""``python -m geompi``: the ``geompi`` command (see :mod:`geompi.cli`)."""

import sys

from geompi.cli import main

sys.exit(main())
