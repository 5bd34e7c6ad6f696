"""studies.attention.heads: each head's map and their mean scored on the same words."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from captioner.data.coco import load_split
from captioner.data.shapes import generate_dataset
from captioner.evaluation.grounding import load_shape_objects, pointing_game
from studies.attention import cli
from studies.attention import heads as hp
from studies.attention.forced import forced_maps
from tests.tiny import tiny_captioner


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shapes")
    generate_dataset(folder, {"test": 7}, seed=5, image_size=48)
    return folder


def _pointing(folder: Path, maps_of) -> tuple[int, float, int]:
    """Hits, mass and words of the pointing game on maps_of(i) for each test image i."""
    records = load_split(folder, "test")
    objects = load_shape_objects(folder / "instances_test.json")
    hits = mass = words = 0
    for i, (w, maps) in enumerate(maps_of(records)):
        img = objects[records[i].image_id]
        recs = pointing_game(w, maps, img.objects, img.size)
        hits, mass, words = hits + sum(r.hit for r in recs), mass + sum(r.mass for r in recs), words + len(recs)
    return hits, mass, words


def test_each_head_and_the_mean_are_scored_on_the_same_words(shapes):
    cap = tiny_captioner(seed=3, heads=2)
    r = hp.head_pointing(cap, shapes, images=7, batch_size=3)
    assert len(r.hits) == len(r.mass) == 3 and r.words > 0
    from captioner.data.coco import ImageDataset
    from captioner.data.vocab import tokenize

    def maps_one_by_one(recs, head=None):
        """Each image alone, apart from the batched code under test: the mean map (head None)
        or one head's."""
        out = []
        for rec in recs:
            words = tokenize(rec.captions[0])
            x = ImageDataset([rec], cap.preprocess)[0][0][None]
            ids = torch.tensor([cap.vocab.encode(words)])
            with torch.inference_mode():
                o = cap.model(x, ids, torch.tensor([ids.shape[1]]))
            a = o.alphas[0] if head is None else o.alphas_heads[0, :, head]
            out.append((words, a.unflatten(1, cap.model.encode(x).grid).double().numpy()))
        return out

    # The mean map: as the attention comparison scores it (forced_maps), and image by image.
    with torch.inference_mode():
        hits, mass, words = _pointing(shapes, lambda recs: forced_maps(cap, recs))
    assert (r.hits[0], r.words) == (hits, words) and r.mass[0] == pytest.approx(mass)
    hits0, mass0, words0 = _pointing(shapes, maps_one_by_one)
    assert (r.hits[0], r.words) == (hits0, words0) and r.mass[0] == pytest.approx(mass0)
    # Head 2 on its own: its maps differ from the mean's, and are scored apart.
    head_maps = lambda recs: maps_one_by_one(recs, head=1)  # noqa: E731
    hits2, mass2, _ = _pointing(shapes, head_maps)
    assert r.hits[2] == hits2 and r.mass[2] == pytest.approx(mass2)
    assert r.mass[0] == pytest.approx((r.mass[1] + r.mass[2]) / 2)  # mass is linear in the map: the mean's is the mean
    assert max(r.hits[1:]) <= r.best_head_hits <= sum(r.hits[1:])
    assert [name for name, _, _ in r.rows()] == ["mean of heads", "head 1", "head 2"]


def test_a_single_head_model_is_its_own_mean(shapes, capsys):
    cap = tiny_captioner(seed=3)
    r = hp.head_pointing(cap, shapes, images=7)
    assert len(r.hits) == 2 and r.hits[0] == r.hits[1] == r.best_head_hits
    assert np.isclose(r.mass[0], r.mass[1])
    with pytest.raises(SystemExit) as e:
        cli.main(["heads", "x.pt", "--data", str(shapes.parent / "nowhere")])
    assert e.value.code == 2 and "instances_test.json" in capsys.readouterr().err
