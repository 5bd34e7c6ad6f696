"""A folder captioned with `captioner caption --format txt | metadata`, corrected by hand, then
read back by `captioner data import` into a data set to train on."""

from __future__ import annotations

import json

from captioner.cli.main import main as captioner_main
from captioner.train.data_cli import main as data_main
from tests.builders import one_line, read_jsonl
from tests.train.test_data_import import photo_folder, read_dataset


def _caption(folder, weights, *extra):
    assert captioner_main(["caption", str(folder), "--weights", weights, "--max-len", "5", "--workers", "0",
                           "--quiet", *extra]) == 0


def _by_name(out) -> dict[str, list[str]]:
    """Each image's captions in dataset.json, by file name."""
    return {im["filename"]: [s["raw"] for s in im["sentences"]] for im in read_dataset(out)["images"]}


def test_a_folder_captioned_as_txt_and_corrected_by_hand_imports_with_the_correction(tmp_path, weights, capsys):
    paths = photo_folder(tmp_path / "shots", n=4, sub="a")
    _caption(tmp_path / "shots", weights, "--format", "txt")
    captions = {p.name: p.with_suffix(".txt").read_text(encoding="utf-8").strip() for p in paths}
    paths[2].with_suffix(".txt").write_text("a green square corrected by hand\n", encoding="utf-8")
    out = tmp_path / "data"
    assert data_main(["import", str(tmp_path / "shots"), "--out", str(out), "--quiet"]) == 0
    assert "as folder" in capsys.readouterr().out
    got = _by_name(out)
    assert got["p2.png"] == ["a green square corrected by hand"]
    assert {name: got[name] for name in ("p0.png", "p1.png", "p3.png")} == \
        {name: [captions[name]] for name in ("p0.png", "p1.png", "p3.png")}


def test_a_folder_captioned_as_metadata_and_corrected_by_hand_imports_with_the_correction(tmp_path, weights,
                                                                                         capsys):
    photo_folder(tmp_path / "shots", n=4, sub="a")
    _caption(tmp_path / "shots", weights, "--format", "metadata")
    metadata = tmp_path / "shots" / "metadata.jsonl"
    lines = read_jsonl(metadata)
    assert [r["file_name"] for r in lines] == [f"a/p{i}.png" for i in range(4)]
    lines[1]["text"] = "two red circles, corrected"
    metadata.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    out = tmp_path / "data"
    # The folder itself (its metadata.jsonl found there), or the metadata.jsonl file: the same data set.
    for source, where in ((tmp_path / "shots", out), (metadata, tmp_path / "data2")):
        assert data_main(["import", str(source), "--out", str(where), "--quiet"]) == 0
        got = _by_name(where)
        assert got["p1.png"] == ["two red circles, corrected"]
        assert got["p0.png"] == [lines[0]["text"]] and len(got) == 4
    assert "as metadata" in capsys.readouterr().out


def test_an_image_the_metadata_leaves_out_is_named(tmp_path, weights, capsys):
    paths = photo_folder(tmp_path / "shots", n=4, sub="a")
    _caption(tmp_path / "shots", weights, "--format", "metadata")
    photo_folder(tmp_path / "shots", n=5, sub="a")  # p4.png, after the captions were written
    assert data_main(["import", str(tmp_path / "shots"), "--out", str(tmp_path / "data"), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "1 image without a line in metadata.jsonl left out" in said and "p4.png" in said
    assert len(read_dataset(tmp_path / "data")["images"]) == len(paths)


def test_a_folder_with_both_forms_asks_which_to_read(tmp_path, weights, capsys):
    photo_folder(tmp_path / "shots", n=4, sub="a")
    _caption(tmp_path / "shots", weights, "--format", "metadata")
    _caption(tmp_path / "shots", weights, "--format", "txt")
    (tmp_path / "shots" / "a" / "p0.txt").write_text("from the txt\n", encoding="utf-8")
    assert data_main(["import", str(tmp_path / "shots"), "--out", str(tmp_path / "data"), "--quiet"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "--format metadata" in line and "--format folder" in line
    for fmt, expected in (("folder", "from the txt"), ("metadata", None)):
        out = tmp_path / f"data-{fmt}"
        assert data_main(["import", str(tmp_path / "shots"), "--format", fmt, "--out", str(out), "--quiet"]) == 0
        got = _by_name(out)["p0.png"]
        assert got == [expected] if expected else got != ["from the txt"]


def test_metadata_format_wants_a_folder_that_holds_one(tmp_path, capsys):
    photo_folder(tmp_path / "shots", n=2, sub="a")
    assert data_main(["import", str(tmp_path / "shots"), "--format", "metadata", "--out", str(tmp_path / "d")]) == 2
    assert "metadata.jsonl" in one_line(capsys.readouterr().err)
