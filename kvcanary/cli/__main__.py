"""``python -m kvcanary.cli``: the ``kvcanary`` command."""

import sys

from kvcanary.cli import main

sys.exit(main())
