"""captioner: image captioning with visual attention (Show, Attend and Tell).

    from captioner import Captioner, DecodeOptions

    cap = Captioner.load()  # the bundled demo-soft model, or a checkpoint path
    image = cap.preprocess.load("photo.jpg")  # decoded as training and `captioner caption` decode it
    result = cap.caption(image, DecodeOptions(beam_size=3))
    result.caption, result.words, result.alphas  # (T, H, W): where it looked for each word

Importing the package itself is cheap: the modules load torch when they are used.
"""

__version__ = "0.1.0"

__all__ = ["Captioner", "DecodeOptions", "__version__"]


def __getattr__(name: str):
    """``Captioner`` and ``DecodeOptions`` are imported on first use, so that the torch-free runtime
    (``captioner.onnx``) can import this package without torch."""
    if name in ("Captioner", "DecodeOptions"):
        from captioner import inference

        return getattr(inference, name)
    raise AttributeError(f"module 'captioner' has no attribute {name!r}")
