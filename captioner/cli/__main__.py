"""``python -m captioner.cli``: the ``captioner`` command, as torchrun runs it."""

import sys

from captioner.cli.main import main

sys.exit(main())
