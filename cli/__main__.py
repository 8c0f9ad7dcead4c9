"""``python -m streamrl.cli``: the ``streamrl`` command without its console script."""

import sys

from streamrl.cli import main

sys.exit(main())
