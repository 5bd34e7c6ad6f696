"""`python -m studies.attention SUBCOMMAND`: the attention comparison (cli.py)."""

import sys

from .cli import main

sys.exit(main())
