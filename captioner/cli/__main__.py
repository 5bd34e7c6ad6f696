"""``python -m captioner.cli``: the ``captioner`` command, as torchrun runs it."""

from captioner.cli.main import run

run()
