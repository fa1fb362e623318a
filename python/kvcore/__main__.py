"""``python -m kvcore``: the ``kvcore`` command line."""

from kvcore.cli import main

raise SystemExit(main())
