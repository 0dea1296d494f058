"""python -m mha.cli: the mha command (where the console script is not installed: PYTHONPATH=src)."""

from . import main

raise SystemExit(main())
