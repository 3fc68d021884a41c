"""``python -m embcache.cli``: the ``embcache`` command."""

import sys

from embcache.cli import main

sys.exit(main())
