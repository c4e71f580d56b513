"""``python -m server.cli``: the ``shardserve`` command without an installed entry point."""

import sys

from server.cli.serve import main

sys.exit(main())
