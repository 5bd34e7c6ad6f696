"""What a model names wrong (studies/attention/naming.py): each caption that does not name
exactly the image's objects is told by one kind of error."""

from __future__ import annotations

import pytest

from captioner.evaluation.grounding import ShapeObject
from studies.attention import cli, naming, scoring
from tests.tiny import tiny_captioner

RED_CIRCLE = ShapeObject("circle", "red", "small", (10.0, 10.0, 20.0, 20.0))
BLUE_SQUARE = ShapeObject("square", "blue", "small", (70.0, 80.0, 20.0, 20.0))
YELLOW_CROSS = ShapeObject("cross", "yellow", "large", (90.0, 14.0, 30.0, 30.0))
OBJECTS = [RED_CIRCLE, BLUE_SQUARE, YELLOW_CROSS]


def kind(caption: str, objects=OBJECTS) -> str | None:
    return naming.kind(caption.split(), objects)


def test_a_caption_naming_every_object_right_has_no_error_kind():
    assert kind("a red circle a blue square and a yellow cross") is None
    assert kind("a large yellow cross to the right of a small red circle", [RED_CIRCLE, YELLOW_CROSS]) is None


def test_a_shape_said_again_in_place_of_another_is_a_repeated_shape():
    # The cross is called a square: the square is in the image once, said twice.
    assert kind("a red circle a blue square and a yellow square") == "repeated shape"
    # Called a star, a shape the image lacks: another kind.
    assert kind("a red circle a blue square and a yellow star") == "other shape"


def test_wrong_colours_wrong_counts_and_wrong_pairs_are_told_apart():
    assert kind("a red circle a blue square and a white cross") == "colour"
    assert kind("a red circle and a blue square") == "count"
    assert kind("a blue circle a red square and a yellow cross") == "pairing"  # each multiset right
    assert kind("a red circle a blue square and a white star") == "colour and shape"


def test_the_subcommand_prints_a_row_per_checkpoint(tmp_path, capsys, shapes_test_sets):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=3).save(weights)
    shapes_test_sets([7001], 3, tmp_path / "tests")
    assert cli.main(["naming", str(weights), str(weights), "--data", str(tmp_path / "tests" / "shapes-test7001-3"),
                     "--images", "3", "--beam-size", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {weights} |")]
    assert len(rows) == 2 and rows[0] == rows[1]  # the same model twice: the same counts
    assert len(rows[0].split("|")) == 3 + len(naming.KINDS) + 2


def test_the_row_counts_every_test_set_given(tmp_path, capsys, monkeypatch, shapes_test_sets):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=3).save(weights)
    sets = shapes_test_sets([7001, 7002], 3, tmp_path / "tests")  # 2 images of each are counted
    found = {sets["test7001"]: [None, "repeated shape"], sets["test7002"]: ["repeated shape", "count"]}
    monkeypatch.setattr(naming, "kinds_of", lambda cap, folder, *a: found[folder])
    assert cli.main(["naming", str(weights), "--data", str(sets["test7001"]), "--data", str(sets["test7002"]),
                     "--images", "2"]) == 0
    row, = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {weights} |")]
    assert [c.strip() for c in row.strip("|").split("|")[1:]] == ["4", "3", "1", "2", "0", "0", "0", "0"]


def test_a_folder_that_is_not_a_test_set_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["naming", str(tmp_path / "x.pt"), "--data", str(tmp_path)])
    assert e.value.code == 2 and "has no instances_test.json" in capsys.readouterr().err


def test_the_decoded_test_images_pair_each_first_images_caption_with_its_objects(tmp_path, shapes_test_sets):
    """scoring.decoded_test_images, which naming and relation count over: the first N images
    only, each caption the comparison's decoding of that image, beside that image's objects."""
    from captioner.data.coco import load_split
    from captioner.evaluation.evaluate import decode_records
    from captioner.evaluation.grounding import load_shape_objects
    from captioner.inference import DecodeOptions

    cap = tiny_captioner(seed=3)
    folder = shapes_test_sets([7001], 3, tmp_path / "tests")["test7001"]
    got = scoring.decoded_test_images(cap, folder, 2, beam_size=2)
    records = load_split(folder, "test")[:2]
    assert len(load_split(folder, "test")) == 3  # one image more than asked for
    objects = load_shape_objects(folder / "instances_test.json")
    decoded = decode_records(cap, records, DecodeOptions(beam_size=2, max_len=scoring.MAX_LEN))
    assert got == [(res.words, objects[rec.image_id].objects) for rec, res in zip(records, decoded)]
    assert len({repr(objs) for _, objs in got}) == 2  # two images' objects, not one image's
