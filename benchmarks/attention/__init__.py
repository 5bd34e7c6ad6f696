"""The attention comparison: the attention family trained on shapes and scored so that a
table can rank its variants (docs/attention-comparison.md). Run it as
`python -m benchmarks.attention SUBCOMMAND` from the repository root.

    plan      rows and recipes (rows.toml), what each (row, seed) trains
    runner    the trainings: a pool of jobs, resumed where they stopped
    scoring   the test sets and the per-image statistics of one model
    store     the results, one record per (row, seed) in one file per table
    stats     figures, bootstrap and Welch intervals, rank correlations
    table     the table from the results
    timing    training steps/s
    transfer  finished trainings packed on one machine, unpacked on another
    heads     each head's pointing (multi-head models)
    widths    the half-widths of a learned local window
    cli       the subcommands
"""
