"""``python -m softtrust`` is the ``softtrust`` command."""

import sys

from softtrust.cli import main

sys.exit(main())
