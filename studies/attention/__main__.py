"""`python -m studies.attention SUBCOMMAND`: the attention comparison (cli.py), with the
captioner command's quick exit."""

from captioner.cli.main import run

from .cli import main

run(main)
