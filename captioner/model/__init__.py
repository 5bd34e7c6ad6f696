"""The model of Show, Attend and Tell, and what it knows about its training images.

- ``encoders``: the CNN cut before pooling, giving the annotation vectors a_1..a_L;
- ``attention``: the attention family (scores, normalisers, soft, hard and local modes);
- ``multihead``, ``grid``: several heads, and self-attention over the feature grid;
- ``decoder``: the LSTM decoder with the beta gate and the deep output layer (``CaptionModel``);
- ``familiarity``: how like the training images a new image is;
- ``kernels``: the fast forms, each beside its plain form, behind one switch.
"""
