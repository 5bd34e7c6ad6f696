"""The torch-free runtime: an exported model's ONNX graphs, with the search in numpy.

    python -m captioner.onnx MODEL_FOLDER IMAGES...

- ``runtime``: the command and ``OnnxCaptioner``;
- ``search``: the beam search in numpy, held equal to the torch search by the tests.

Nothing here imports torch.
"""

from captioner.onnx.runtime import OnnxCaptioner, main

__all__ = ["OnnxCaptioner", "main"]
