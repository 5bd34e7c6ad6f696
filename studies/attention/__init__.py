"""The attention comparison: the attention family trained on shapes and scored so that a
table can rank its variants (docs/attention-comparison.md). Run it as
`python -m studies.attention SUBCOMMAND` from the repository root.

    plan      rows and recipes (rows.toml), what each (row, seed) trains
    runner    the trainings: a pool of jobs, resumed where they stopped
    scoring   the test sets and the per-image statistics of one model
    store     the results, one record per (row, seed) in one file per table
    stats     figures, bootstrap and Welch intervals, rank correlations
    table     the table from the results
    timing    training steps/s
    transfer  finished trainings packed on one machine, unpacked on another
    forced    teacher-forced maps: each image's first reference caption fed to the model
    goal      does every seed of a recipe reach the demo's floors
    heads     each head's pointing (multi-head models)
    widths    the half-widths of a learned local window
    misses    where the maps of words that miss their object look
    naming    what a model names wrong, one kind of error per caption
    relations why a model states a spatial relation wrong
    cli       the subcommands

Its results (small, meant to be committed) are in results/; its tests in tests/studies/.
"""
