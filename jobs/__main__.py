"""``python -m mimo_fx.jobs``: the main job (see :mod:`mimo_fx.jobs.e2e`)."""

import sys

from .e2e import main

if __name__ == "__main__":
    sys.exit(main())
