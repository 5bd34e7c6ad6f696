"""Files of a model: checkpoints, exported folders, model cards, the bundled demos, and loading.

- ``checkpoint``: the one typed reader of a checkpoint (``Checkpoint.from_dict``), loaded safely;
- ``tensorfile``, ``folder``: safetensors files and the exported folder's layout;
- ``export``: a checkpoint to an exported folder (and ONNX graphs); ``card``: its model card;
- ``bundled``: the demo models that ship inside the package;
- ``loading``: which file a name means, the model rebuilt from it, what it says about itself.
"""
