"""``python -m mha`` is the ``mha`` command."""

import sys

from .cli import main

sys.exit(main())
