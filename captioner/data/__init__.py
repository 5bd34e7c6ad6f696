"""What goes in: images and captions.

- ``images``: decoding any picture a user hands over, and the model's preprocessing (``Preprocess``);
- ``jpeg_device``: JPEG decoding on the GPU for folder captioning;
- ``vocab``: tokenizers and the vocabulary (plain Python: the torch-free runtime uses it);
- ``coco``: COCO-format captions and instances, Karpathy splits, the image data sets;
- ``shapes``: the synthetic shapes data set, written in COCO format.
"""
