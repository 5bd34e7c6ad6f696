"""Gradient maps (captioner.explain): each kind equal to its plain autograd reference, word by
word, on the attention maps' grid; nothing changes for a caption asked without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from captioner.explain import KINDS, gradient_maps
from captioner.model.encoders import Annotations
from captioner.search.options import DecodeOptions
from tests.tiny import tiny_captioner, tiny_image

MODELS = {"soft": {}, "hard": {"attention": "hard"}, "two-heads": {"heads": 2}, "grid": {"grid_layers": 1}}


def reference(cap, image, ids: list[int], kind: str) -> torch.Tensor:
    """Word by word, each from a pass of its own through the step-by-step decoder: d log p(w_t)
    / d a, then the map's formula as written (its positive part, scaled to sum to 1)."""
    tokens = cap.tokens
    with torch.no_grad():
        ann = cap.encode(cap.preprocess(image).unsqueeze(0))
    words = ids[:-1] if ids and ids[-1] == tokens.end else ids
    seq = torch.tensor([[tokens.start, *words]])
    maps = []
    for t in range(len(words)):
        a = ann.vectors.detach().clone().requires_grad_(True)
        out = cap.model.decoder.forward_stepwise(Annotations(a, ann.grid), seq[:, : t + 2], torch.tensor([t + 2]))
        logp = F.log_softmax(out.logits[0, t], -1)[words[t]]
        (g,) = torch.autograd.grad(logp, a)
        g, x = g[0], a.detach()[0]  # (L, D)
        m = (x * g).sum(1) if kind == "gradinput" else (x * g.mean(0, keepdim=True)).sum(1)
        m = m.clamp(min=0)
        m = m / m.sum() if m.sum() > 0 else torch.full_like(m, 1 / m.numel())
        maps.append(m.view(ann.grid))
    return torch.stack(maps)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_each_map_equals_its_plain_autograd_reference(model, kind):
    cap = tiny_captioner(seed=4, **MODELS[model])
    images = [tiny_image(seed=i) for i in range(3)]
    results = cap.caption_images(images, DecodeOptions(beam_size=2, max_len=6), explain=kind)
    for image, r in zip(images, results):
        maps = r.gradients[kind]
        assert maps.shape == r.alphas.shape  # one per word, on the attention maps' grid
        ids = [cap.vocab.index(w) for w in r.words] + ([cap.tokens.end] if r.end_prob is not None else [])
        torch.testing.assert_close(maps, reference(cap, image, ids, kind), atol=1e-5, rtol=1e-4)
        sums = maps.flatten(1).sum(1)
        torch.testing.assert_close(sums, torch.ones_like(sums))


def test_the_kinds_differ_and_point_where_the_gradient_is():
    cap = tiny_captioner(seed=4)
    [r] = cap.caption_images([tiny_image(seed=1)], DecodeOptions(beam_size=2), explain="gradcam")
    [s] = cap.caption_images([tiny_image(seed=1)], DecodeOptions(beam_size=2), explain="gradinput")
    assert r.words == s.words and not torch.allclose(r.gradients["gradcam"], s.gradients["gradinput"])


def test_asked_without_maps_nothing_changes():
    cap = tiny_captioner(seed=4)
    images = [tiny_image(seed=i) for i in range(3)]
    plain = cap.caption_images(images, DecodeOptions(beam_size=3))
    explained = cap.caption_images(images, DecodeOptions(beam_size=3), explain="gradinput")
    for p, e in zip(plain, explained):
        assert p.words == e.words and p.score == e.score and torch.equal(p.alphas, e.alphas)
        assert p.gradients == {} and "gradinput" not in p.to_json("x") and "gradinput" in e.to_json("x")


def test_an_unknown_kind_is_refused():
    cap = tiny_captioner(seed=4)
    with pytest.raises(ValueError, match="gradcam, gradinput"):
        gradient_maps(cap.model.decoder, cap.encode(torch.zeros(1, 3, 32, 32)), [[5]], cap.tokens, ("saliency",))


@pytest.mark.slow
def test_both_kinds_at_once_are_each_kind_alone():
    cap = tiny_captioner(seed=4)
    images = [tiny_image(seed=i) for i in range(2)]
    both = cap.caption_images(images, DecodeOptions(beam_size=2), explain=KINDS)
    for kind in KINDS:
        alone = cap.caption_images(images, DecodeOptions(beam_size=2), explain=kind)
        for b, a in zip(both, alone):
            assert set(a.gradients) == {kind} and set(b.gradients) == set(KINDS)
            torch.testing.assert_close(b.gradients[kind], a.gradients[kind])


def test_the_grounding_benchmark_scores_each_map_on_coco_boxes_on_the_same_words(photos):
    """benchmarks/explain_grounding.py --coco: attention, Grad-CAM and gradient x input scored by
    captioner evaluate's COCO grounding, on the same words; the attention's column is what
    coco_pointing gives for the captions' own maps."""
    from benchmarks.explain_grounding import MAPS, coco_columns
    from captioner.data.coco import instance_files, load_instances, load_split
    from captioner.data.vocab import Vocabulary
    from captioner.evaluation.coco_grounding import coco_pointing
    from tests.tiny import write_coco_instances

    coco = photos / "coco"
    dog, person = ("dog", [0.0, 0.0, 160.0, 160.0], None), ("person", [160.0, 160.0, 160.0, 160.0], None)
    write_coco_instances(coco, {136: [dog, person], 139: [person]})
    cap = tiny_captioner(seed=4)
    names = iter(["dog", "person", "man", "a", "near", "puppy", "woman", "the", "and", "people", "on", "grass"])
    cap.vocab = Vocabulary([w if i < 4 else next(names) for i, w in enumerate(cap.vocab.words)])
    karpathy = coco / "dataset_coco.json"
    cols = coco_columns(cap, coco, "test", karpathy, 10, 2)
    assert set(cols) == set(MAPS) and sum(cols["attention"]["pt_n"]) > 0  # words naming the boxes' categories
    assert all(cols[m]["pt_n"] == cols["attention"]["pt_n"] for m in MAPS)  # the same words for each map
    records = load_split(coco, "test", karpathy)[:10]
    objects = load_instances(instance_files(coco, "test"), {r.image_id for r in records})
    results = cap.caption_images([r.path for r in records], DecodeOptions(beam_size=2))
    want = [sum(p.hit for p in coco_pointing(res.words, res.alphas, objects[r.image_id],
                                              cap.preprocess.crop_box((objects[r.image_id].width,
                                                                       objects[r.image_id].height))) if p.seen)
            if r.image_id in objects else 0 for r, res in zip(records, results)]
    assert cols["attention"]["pt_hit"] == want
