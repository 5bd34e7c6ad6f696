"""From a model's step to finished captions: greedy and the exact beam search with the N best.

- ``decoding``: the search and its typed results (``CaptionResult``);
- ``graph``: the same search as one fixed program, replayed as CUDA graphs on a GPU.
"""
