"""``python -m kvmeta`` is the ``kvmeta`` command."""

import sys

from kvmeta.cli import main

sys.exit(main())
