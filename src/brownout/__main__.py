"""``python -m brownout``: the ``brownout`` command where its script is not on the PATH."""

import sys

from ._cli import main

sys.exit(main())
