"""``python -m kvserve.cli``: the ``kvserve`` command."""

import sys

from kvserve.cli.entry import main

sys.exit(main())
