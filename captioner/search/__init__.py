"""From a model's step to finished captions: greedy and the exact beam search with the N best.

- ``options``: how to decode (``DecodeOptions``), each option checked once, where it is made;
- ``decoding``: the search and its typed results (``CaptionResult``);
- ``graph``: the same search as one fixed program, replayed as CUDA graphs on a GPU;
- ``results``: the search's ids turned into words and a ``CaptionResult``;
- ``record``: a caption's JSON record, built in one place (plain Python).
"""
