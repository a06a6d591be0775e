"""``python -m ds4lab.cli``: the ``ds4lab`` command."""

import sys

from . import main

sys.exit(main())
