"""``python -m cute_fp4``: the CLI."""

import sys

from cute_fp4.cli import main

sys.exit(main())
