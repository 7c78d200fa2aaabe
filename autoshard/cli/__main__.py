"""``python -m autoshard.cli``: the ``autoshard`` console script (``torchrun -m autoshard.cli profile``)."""

import sys

from . import main

sys.exit(main())
