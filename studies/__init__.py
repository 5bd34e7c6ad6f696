"""Research studies, each a package with its subcommands, results and tests: attention (the
attention comparison, `python -m studies.attention`)."""
