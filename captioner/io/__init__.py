"""Files of a model: checkpoints, exported folders, model cards, the bundled demos, a caption's record.

- ``checkpoint``: the one typed reader of a checkpoint (``Checkpoint.from_dict``), loaded safely;
- ``tensorfile``, ``folder``: safetensors files and the exported folder's layout;
- ``export``: a checkpoint to an exported folder (and ONNX graphs); ``card``: its model card;
- ``bundled``: the demo models that ship inside the package;
- ``record``: a caption's JSON record, built in one place (plain Python).
"""
