"""``python -m fleetward.cli``: the same as the ``fleetward`` command (how fleetward starts its own
router, controller and agent processes)."""

import sys

from fleetward.cli.main import main

sys.exit(main())
