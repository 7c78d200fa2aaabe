"""``python -m autoshard.cli``: the ``autoshard`` console script (``torchrun -m autoshard.cli profile``)."""

import sys

from . import main

if __name__ == "__main__":      # not when imported (the doctest walk imports every module)
    sys.exit(main())
