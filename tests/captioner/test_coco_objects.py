"""CHAIR and attention grounding on COCO's instance annotations, from `captioner evaluate`:
for a model's captions and for a captions file, on the photo fixture in COCO's layout with
instances files the tests write (tiny.write_coco_instances)."""

import json

import numpy as np
import pytest
import torch

import captioner.evaluation.evaluate as evaluation
from captioner.cli.main import main
from captioner.data.coco import CocoInstance, ImageInstances, instance_files, load_instances, load_split
from captioner.evaluation.coco_grounding import coco_pointing, summarize_coco_grounding
from captioner.search.decoding import CaptionResult
from tests.builders import coco_config
from tests.tiny import tiny_captioner, write_coco_instances

# Image 136 (320 x 320, a photo of grass; its references name no object) holds a dog, whose
# mask is the box's top-left quarter, and a person given by its box alone; image 139 (a
# brick wall) has no instances. On a 4 x 4 grid each cell is 80 px.
DOG = ("dog", [0.0, 0.0, 160.0, 160.0], [[0, 0, 80, 0, 80, 80, 0, 80]])
PERSON = ("person", [160.0, 160.0, 160.0, 160.0], None)
OBJECTS = {136: [DOG, PERSON]}


def _maps(*cells):
    """(len(cells), 4, 4) maps, one per word: {(row, col): mass} each (empty: uniform)."""
    maps = torch.full((len(cells), 4, 4), 1 / 16)
    for t, spots in enumerate(cells):
        if spots:
            maps[t] = 0
            for cell, mass in spots.items():
                maps[t][cell] = mass
    return maps


# "dog": strongest at (1, 1), in the dog's box but off its mask: a miss, 0.3 on the mask
# (cell (0, 0)). "man": strongest at (2, 3), inside the person's box: a hit, mass 0.7.
# "cat" names nothing in the image: hallucinated, not scored for grounding.
WORDS_136 = ["a", "dog", "and", "a", "man", "near", "a", "cat"]
MAPS_136 = _maps({}, {(1, 1): 0.5, (0, 0): 0.3, (3, 0): 0.2}, {}, {}, {(2, 3): 0.7, (0, 3): 0.3}, {}, {}, {})
WORDS_139 = ["a", "brick", "wall"]


@pytest.fixture
def coco(photos):
    """The photo fixture's COCO folder with instances files; split "test" of its Karpathy
    file holds images 136 and 139."""
    root = photos / "coco"
    write_coco_instances(root, OBJECTS)
    return root


# ------------------------------------------------------------------------- units


def _image(*objects, size=(320, 320)):
    return ImageInstances(1, size[0], size[1], tuple(CocoInstance(n, tuple(b), p) for n, b, p in objects))


def test_pointing_uses_the_mask_where_given_and_the_box_where_not():
    dog, man = coco_pointing(WORDS_136, MAPS_136, _image(DOG, PERSON))
    assert (dog.word, dog.kind, dog.step, dog.hit) == ("dog", "dog", 1, False)
    assert dog.hit_touch  # the box alone would have it
    assert dog.mass == pytest.approx(0.3) and dog.chance == pytest.approx(1 / 16)
    assert (man.kind, man.hit, man.chance) == ("person", True, 4 / 16)
    assert man.mass == pytest.approx(0.7)
    boxes_only = coco_pointing(WORDS_136, MAPS_136, _image(DOG[:2] + (None,), PERSON))
    assert boxes_only[0].hit and boxes_only[0].mass == pytest.approx(0.8) and boxes_only[0].chance == 4 / 16


def test_every_instance_of_the_category_counts_and_a_phrase_is_scored_at_its_last_word():
    two_dogs = _image(("dog", [0, 0, 80, 80], None), ("dog", [240, 240, 80, 80], None),
                      ("hot dog", [0, 240, 80, 80], None))
    words = ["two", "dogs", "and", "a", "hot", "dog"]
    maps = _maps({}, {(3, 3): 0.6, (0, 0): 0.4}, {}, {}, {(3, 0): 1.0}, {(0, 0): 1.0})
    dogs, hot_dog = coco_pointing(words, maps, two_dogs)
    assert (dogs.kind, dogs.hit, dogs.chance) == ("dog", True, 2 / 16) and dogs.mass == pytest.approx(1.0)
    assert (hot_dog.kind, hot_dog.step, hot_dog.hit) == ("hot dog", 5, False)  # step 5's map looks at a dog
    assert hot_dog.word == "hot dog"
    assert dogs.chance_touch == 2 / 16  # one 80 px cell touches each dog's box


def test_the_mask_is_read_in_the_crop_the_grid_covers_and_bus_is_a_bus():
    """The grid's 2 x 2 cells of 80 px cover the crop x 80-240, y 0-160; the dog's mask is
    x 80-160, y 0-80 of its box x 80-240, y 0-160: only cell (0, 0)'s centre is on it."""
    dog = ("dog", [80, 0, 160, 160], [[80, 0, 160, 0, 160, 80, 80, 80]])
    (rec,) = coco_pointing(["a", "dog"], torch.tensor([[[1.0, 0], [0, 0]]] * 2), _image(dog), crop=(80, 0, 240, 160))
    assert rec.hit and rec.chance == 1 / 4
    # words read with the synonym list corrected: "bus" names the bus (the reference reads "bu")
    (bus,) = coco_pointing(["a", "bus"], _maps({}, {}), _image(("bus", [0, 0, 160, 160], None)))
    assert bus.kind == "bus" and bus.chance == 4 / 16


def test_objects_only_the_references_name_and_objects_outside_the_crop_are_not_scored():
    assert coco_pointing(["a", "cat"], _maps({}, {}), _image(DOG)) == []
    (rec,) = coco_pointing(["a", "dog"], _maps({}, {}), _image(("dog", [0, 0, 40, 40], None)),
                           crop=(80, 80, 240, 240))
    assert not rec.seen
    summary = summarize_coco_grounding([[rec], coco_pointing(WORDS_136, MAPS_136, _image(DOG, PERSON))])
    assert (summary.n_words, summary.n_words_unseen) == (2, 1)
    assert summary.pointing_accuracy == 0.5 and summary.alpha_mass == pytest.approx(0.5)
    assert summary.pointing_chance == pytest.approx(5 / 32)
    assert summary.per_category["dog"].pointing_accuracy == 0 and summary.per_category["person"].n_words == 1


def test_instances_files_in_the_published_layout(coco):
    assert [p.name for p in instance_files(coco, "test")] == ["instances_train2014.json", "instances_val2014.json"]
    assert [p.name for p in instance_files(coco, "val2014")] == ["instances_val2014.json"]
    objects = load_instances(instance_files(coco, "test"), {136, 139, 9})
    assert sorted(objects) == [9, 136, 139]
    assert objects[139].instances == () and objects[136].size == (320, 320)
    mask = objects[136].mask(objects[136].instances[0])
    assert mask.shape == (320, 320) and 6000 < mask.sum() < 7000  # the 80 x 80 polygon
    assert objects[136].mask(objects[136].instances[1]) is None


# ----------------------------------------------------------------- from evaluate


def _decoded(records):
    by_id = {136: (WORDS_136, MAPS_136), 139: (WORDS_139, _maps({}, {}, {}))}
    return [CaptionResult(by_id[r.image_id][0], by_id[r.image_id][1], torch.ones(len(by_id[r.image_id][0])), -1.0)
            for r in records]


def test_evaluate_reports_chair_and_grounding_hand_computed(coco, monkeypatch, tmp_path):
    """136 names a dog and a man (both there) and a cat (not there); 139 names nothing:
    CHAIRs 1/2, CHAIRi 1/3. Grounding: the dog missed (mask), the man hit."""
    monkeypatch.setattr(evaluation, "decode_records", lambda cap, recs, *a, **k: _decoded(recs))
    report = evaluation.evaluate(tiny_captioner(), coco, "test", karpathy=coco / "dataset_coco.json",
                                 meteor=False, progress=False)
    assert report.chair.chair_s == 0.5 and report.chair.chair_i == pytest.approx(1 / 3)
    assert (report.chair.n_mentions, report.chair.n_hallucinated) == (3, 1)
    assert report.objects[136].named == ("dog", "person", "cat") and report.objects[136].hallucinated == ("cat",)
    assert report.objects[139].named == ()
    g = report.coco_grounding
    assert (g.n_words, g.pointing_accuracy) == (2, 0.5) and g.alpha_mass == pytest.approx(0.5)
    assert set(g.per_category) == {"dog", "person"}
    table = evaluation.format_table(report)
    assert "CHAIRs" in table and "0.5000" in table and "1 of 3 object mentions" in table
    assert "COCO pointing" in table and "person" in table
    evaluation.write_report(report, tmp_path / "m.json")
    results = json.loads((tmp_path / "m.results.json").read_text())
    assert results[0] == {"image_id": 136, "caption": " ".join(WORDS_136), "objects": ["dog", "person", "cat"],
                          "hallucinated": ["cat"]}
    assert json.loads((tmp_path / "m.json").read_text())["chair"]["chair_s"] == 0.5


def test_evaluate_without_instances_files_reports_no_chair(photos, monkeypatch):
    coco = photos / "coco"
    monkeypatch.setattr(evaluation, "decode_records", lambda cap, recs, *a, **k: _decoded(recs))
    report = evaluation.evaluate(tiny_captioner(), coco, "test", karpathy=coco / "dataset_coco.json",
                                 meteor=False, progress=False)
    assert report.chair is None and report.coco_grounding is None
    assert "CHAIR" not in evaluation.format_table(report)


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_coco_results_file_is_scored_without_a_model(coco, tmp_path, capsys):
    captions = tmp_path / "results.json"
    captions.write_text(json.dumps([{"image_id": 136, "caption": "Two dogs and a teddy bear."},
                                    {"image_id": 139, "caption": "A man near a brick wall"},
                                    {"image_id": 9, "caption": "An astronaut."}]))
    code, out, err = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--karpathy",
                           str(coco / "dataset_coco.json"), "--split", "test", "--no-meteor",
                           "--out", str(tmp_path / "e" / "m.json")], capsys)
    assert code == 0, err
    # 136: dog (there), teddy bear (not); 139: person (not there): CHAIRs 2/2, CHAIRi 2/3
    assert "CHAIRs" in out and "1.0000" in out and "2 of 3 object mentions" in out
    assert "BLEU-4" in out and "CIDEr" in out
    assert "not computed: the captions carry no maps" in out
    (note,) = [line for line in err.splitlines() if "not in split" in line]
    assert "1 caption" in note and "e.g. 9" in note
    results = json.loads((tmp_path / "e" / "m.results.json").read_text())
    assert [r["hallucinated"] for r in results] == [["teddy bear"], ["person"]]


def test_captions_file_lines_with_their_maps_are_grounded_like_the_models(coco, tmp_path, capsys, monkeypatch):
    records = load_split(coco, "test", coco / "dataset_coco.json")
    lines = [{"image": str(r.path), **res.to_json(with_attention=True)} for r, res in zip(records, _decoded(records))]
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--karpathy",
                           str(coco / "dataset_coco.json"), "--split", "test", "--no-meteor"], capsys)
    assert code == 0, err
    assert "not in split" not in err
    pointing = next(line for line in out.splitlines() if line.startswith("COCO pointing (object words)"))
    assert "0.5000" in pointing and "2 words" in pointing
    assert "0.3333  (1 of 3 object mentions)" in out


def test_a_captions_file_for_no_image_of_the_split_is_one_line(coco, tmp_path, capsys):
    captions = tmp_path / "results.json"
    captions.write_text(json.dumps([{"image_id": 9, "caption": "x"}, {"image_id": 25, "caption": "y"}]))
    code, out, err = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--karpathy",
                           str(coco / "dataset_coco.json"), "--split", "test"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no caption for an image of split 'test'" in err and "2 for other images, e.g. 9" in err
    captions.write_text("not json")
    code, _, err = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--split", "val2014"], capsys)
    assert code == 2 and "not JSON Lines" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_trained_checkpoint_and_its_captions_file_give_the_same_chair(coco, tmp_path, capsys):
    """A tiny model trained on the fixture's training images, all captioned "A dog near a
    man.", says so of the validation images 74 and 133, which hold a dog but no person. 74's
    references name a doctor (a person), 133's do not: CHAIRs 1/2, CHAIRi 1/4. Captioning
    the same images with their maps and scoring that file gives the same figures."""
    split = json.loads((coco / "dataset_coco.json").read_text())
    for image in split["images"]:
        if image["split"] in ("train", "restval"):
            for sentence in image["sentences"]:
                sentence["raw"] = "A dog near a man."
    (coco / "dataset_coco.json").write_text(json.dumps(split))
    write_coco_instances(coco, {i: [DOG] + ([PERSON] if i not in (74, 133) else [])
                                for i in (9, 25, 30, 34, 36, 42, 49, 73, 74, 133, 136, 139)})
    config = coco_config(tmp_path, coco.parent)
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--set", "optim.max_steps=80",
                 "--set", "optim.lr=0.01", "--set", "val.patience=0", "--quiet"]) == 0
    weights = str(tmp_path / "run" / "last.pt")
    karpathy = ["--data", str(coco), "--karpathy", str(coco / "dataset_coco.json"), "--split", "val"]
    code, table, err = _run(["evaluate", "--weights", weights, *karpathy, "--no-meteor", "--beam-size", "1",
                             "--out", str(tmp_path / "model.json")], capsys)
    assert code == 0, err
    per_image = json.loads((tmp_path / "model.results.json").read_text())
    assert [r["caption"] for r in per_image] == ["a dog near a man"] * 2
    assert [r["hallucinated"] for r in per_image] == [[], ["person"]]
    model = json.loads((tmp_path / "model.json").read_text())
    assert model["chair"]["chair_s"] == 0.5 and model["chair"]["chair_i"] == 0.25
    assert model["coco_grounding"]["n_words"] == 2  # "dog" twice; no person to point at
    assert set(model["coco_grounding"]["per_category"]) == {"dog"}

    images = [str(coco / "val2014" / f"COCO_val2014_{i:012d}.jpg") for i in (74, 133, 73)]  # 73: not in "val"
    lines = tmp_path / "captions.jsonl"
    assert main(["caption", *images, "--weights", weights, "--beam-size", "1", "--with-attention",
                 "--out", str(lines), "--quiet"]) == 0
    capsys.readouterr()
    code, _, err = _run(["evaluate", "--captions", str(lines), "--weights", weights, *karpathy, "--no-meteor",
                         "--out", str(tmp_path / "file.json")], capsys)
    assert code == 0, err
    assert "1 caption" in err and "COCO_val2014_000000000073.jpg" in err
    from_file = json.loads((tmp_path / "file.json").read_text())
    assert from_file["chair"] == model["chair"]
    assert from_file["metrics"] == pytest.approx(model["metrics"])
    # the maps, rounded to 4 digits in the file, point the same way
    for key in ("n_words", "pointing_accuracy", "pointing_chance"):
        assert from_file["coco_grounding"][key] == pytest.approx(model["coco_grounding"][key])
    assert np.isclose(from_file["coco_grounding"]["alpha_mass"], model["coco_grounding"]["alpha_mass"], atol=1e-3)


def test_a_captions_file_s_familiarity_is_counted_from_its_lines(coco, tmp_path, capsys):
    records = load_split(coco, "test", coco / "dataset_coco.json")
    flags = [(0.004, True), (0.62, False)]
    lines = [{"image": str(r.path), "caption": "a dog near a man", "familiarity": value, "unfamiliar": flag}
             for r, (value, flag) in zip(records, flags)]
    captions = tmp_path / "captions.jsonl"
    captions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--karpathy",
                           str(coco / "dataset_coco.json"), "--split", "test", "--no-meteor"], capsys)
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if line.startswith("unfamiliar images")]
    assert "unknown" not in row and f"1 of {len(lines)}" in row and "as the file flags them" in row
    assert f"mean familiarity {(0.004 + 0.62) / 2:.3f}" in row

    # Lines without it (a model with no record wrote them): unknown, as before.
    captions.write_text("".join(json.dumps({k: v for k, v in line.items() if k not in ("familiarity", "unfamiliar")})
                                + "\n" for line in lines))
    code, out, _ = _run(["evaluate", "--captions", str(captions), "--data", str(coco), "--karpathy",
                         str(coco / "dataset_coco.json"), "--split", "test", "--no-meteor"], capsys)
    assert code == 0 and "unfamiliar images" in out and "unknown" in out
