"""The ``captioner`` command: its subcommands, shared option checks and folder captioning.

- ``main``: the parser and the subcommands (``python -m captioner.cli`` runs it, as torchrun does);
- ``common``: loading a command's model and the options' checks, with one-line errors;
- ``batch``: captioning a folder, resumable, in batches;
- ``export``: ``captioner export``.
"""
