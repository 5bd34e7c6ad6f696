"""How good the captions are: the caption metrics, CHAIR and attention grounding.

- ``metrics``, ``cider``: BLEU, METEOR, ROUGE-L and CIDEr as the official toolkit computes them;
- ``chair``: hallucinated objects (CHAIR);
- ``grounding``, ``coco_grounding``: where the maps point, on shapes and on COCO's boxes;
- ``evaluate``: a model over a split, all of the above in one report.
"""
