"""`captioner data import`: own images and captions (CSV/TSV, JSON Lines, a folder with sidecar
.txt files) into a Karpathy-format dataset.json, and every refusal in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from captioner.cli import main as captioner_main
from captioner.data.coco import dataset_tokenizer, load_split
from captioner.train.data_cli import main as data_main
from tests.builders import one_line

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (200, 30, 200), (30, 200, 200)]


def photo_folder(root: Path, n: int = 6, sub: str = "pics") -> list[Path]:
    """n small PNGs under root/sub, named p0.png .. p{n-1}.png."""
    (root / sub).mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = root / sub / f"p{i}.png"
        Image.new("RGB", (24, 16), COLOURS[i % len(COLOURS)]).save(path)
        paths.append(path)
    return paths


def read_dataset(out: Path) -> dict:
    return json.loads((out / "dataset.json").read_text(encoding="utf-8"))


def test_a_csv_with_several_rows_per_image_becomes_a_karpathy_split(tmp_path, capsys):
    photo_folder(tmp_path)
    rows = ["image,caption"] + [f"pics/p{i}.png,\"a red thing, number {i}\"" for i in range(6)]
    rows += [f"pics/p{i}.png,another caption {i}" for i in range(6)] + ["pics/p0.png,   ", "pics/p1.png,"]
    (tmp_path / "captions.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert data_main(["import", str(tmp_path / "captions.csv"), "--out", str(out), "--val", "1", "--test", "2",
                      "--quiet"]) == 0
    said = capsys.readouterr().out
    data = read_dataset(out)
    assert data["tokenizer"] == "ptb"  # English captions: the COCO toolkit's tokens
    assert [im["split"] for im in data["images"]].count("val") == 1
    assert [im["split"] for im in data["images"]].count("test") == 2
    assert all(len(im["sentences"]) == 2 for im in data["images"])  # rows of one image merged
    assert "2 empty captions dropped" in said and "6 images" in said and "12 captions" in said
    assert "captioner train --config" in said and f"data.dir={out}" in said
    # The loaders find the file on their own: "as on COCO".
    train = load_split(out, "train")
    assert len(train) == 3 and all(r.path.is_file() for r in train)
    assert dataset_tokenizer(out) == "ptb"
    # Images stay where they are: nothing copied.
    assert not any(p.suffix == ".png" for p in out.rglob("*"))


def test_a_tsv_with_its_own_column_names(tmp_path, capsys):
    photo_folder(tmp_path)
    lines = ["id\tbild\tbeschreibung"] + [f"{i}\tpics/p{i}.png\tEin Hund läuft über die Straße {i}." for i in range(6)]
    (tmp_path / "data.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert data_main(["import", str(tmp_path / "data.tsv"), "--out", str(out), "--image-column", "bild",
                      "--caption-column", "beschreibung", "--tokenizer", "whitespace", "--quiet"]) == 0
    data = read_dataset(out)
    assert data["tokenizer"] == "whitespace"
    first = data["images"][0]["sentences"][0]
    assert first["raw"].startswith("Ein Hund läuft über die Straße")
    assert first["tokens"][:3] == ["ein", "hund", "läuft"]
    assert "läuft" in (out / "dataset.json").read_text(encoding="utf-8")  # readable UTF-8, not \\u escapes


def test_json_lines_with_absolute_paths_and_caption_lists_in_chinese(tmp_path, capsys):
    paths = photo_folder(tmp_path / "elsewhere")
    lines = [json.dumps({"file_name": str(p), "captions": [f"一只红色的猫{i}", "一张照片。"]}, ensure_ascii=False)
             for i, p in enumerate(paths)]
    lines.append(json.dumps({"image": str(paths[0]), "text": "桌子上的猫"}, ensure_ascii=False))
    source = tmp_path / "meta" / "metadata.jsonl"
    source.parent.mkdir()
    source.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    out = tmp_path / "out"
    assert data_main(["import", str(source), "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr().out
    data = read_dataset(out)
    assert data["tokenizer"] == "chars" and "chars" in said  # chosen from the captions
    merged = next(im for im in data["images"] if len(im["sentences"]) == 3)
    assert merged["sentences"][2]["tokens"] == list("桌子上的猫")
    assert dataset_tokenizer(out) == "chars"


def test_a_folder_of_images_with_sidecar_text_files(tmp_path, capsys):
    paths = photo_folder(tmp_path / "shots", sub="a")
    for i, p in enumerate(paths[:5]):
        p.with_suffix(".txt").write_text(f"a small dog {i}\n\na dog on grass\n", encoding="utf-8")
    out = tmp_path / "out"
    assert data_main(["import", str(tmp_path / "shots"), "--out", str(out), "--quiet"]) == 0
    said = capsys.readouterr().out
    data = read_dataset(out)
    assert len(data["images"]) == 5 and all(len(im["sentences"]) == 2 for im in data["images"])
    assert "1 image without a caption file left out" in said


def test_the_split_is_a_seeded_draw(tmp_path):
    photo_folder(tmp_path, n=6)
    rows = ["filename,text"] + [f"pics/p{i}.png,caption {i}" for i in range(6)]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")

    def draw(seed: int, name: str) -> list[str]:
        assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(tmp_path / name), "--seed", str(seed),
                          "--val", "2", "--test", "2", "--quiet"]) == 0
        return [im["split"] for im in sorted(read_dataset(tmp_path / name)["images"], key=lambda im: im["filename"])]

    first = draw(0, "a")
    assert draw(0, "b") == first
    assert any(draw(s, f"s{s}") != first for s in range(1, 6))


def one_line_error(capsys) -> str:
    return one_line(capsys.readouterr().err)


def test_a_source_that_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "c.csv").write_bytes("image,caption\np0.png,un café\n".encode("latin-1"))
    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(tmp_path / "out")]) == 2
    assert "not UTF-8" in one_line_error(capsys)
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_no_caption_column_names_the_columns_seen(tmp_path, capsys):
    (tmp_path / "c.csv").write_text("image,label\np0.png,cat\n", encoding="utf-8")
    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert "no caption column" in err and "image, label" in err and "--caption-column" in err


def test_a_json_lines_file_with_a_bad_line_is_refused_with_its_number(tmp_path, capsys):
    (tmp_path / "m.jsonl").write_text('{"image": "a.png", "caption": "x"}\n{oops\n', encoding="utf-8")
    assert data_main(["import", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "out")]) == 2
    assert "line 2" in one_line_error(capsys)


def test_missing_and_undecodable_images_are_named_and_stop_unless_skipped(tmp_path, capsys):
    photo_folder(tmp_path, n=4)
    (tmp_path / "pics" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    rows = ["image,caption"] + [f"pics/p{i}.png,caption {i}" for i in range(4)]
    rows += [f"pics/gone{i}.png,caption" for i in range(12)] + ["pics/broken.png,a broken one"]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(out), "--quiet"]) == 1
    said = capsys.readouterr()
    text = said.out + said.err
    assert "13 of 17 images cannot be used" in text
    assert sum("gone" in line or "broken" in line for line in text.splitlines()) == 10  # up to ten named
    assert "--skip-unreadable" in text
    assert not (out / "dataset.json").exists()

    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(out), "--quiet", "--val", "1", "--test", "1",
                      "--skip-unreadable"]) == 0
    assert "13 unreadable images left out" in capsys.readouterr().out
    assert len(read_dataset(out)["images"]) == 4


def test_import_is_a_captioner_data_subcommand_with_help(capsys):
    with pytest.raises(SystemExit) as stop:
        captioner_main(["data", "import", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for expected in ("CSV", "JSON Lines", ".txt", "--tokenizer", "--seed", "--val", "dataset.json", "Exit"):
        assert expected in text, expected


def test_captions_neither_english_nor_chinese_are_split_at_spaces_by_default(tmp_path, capsys):
    photo_folder(tmp_path, n=3)
    rows = ["path,text"] + [f"pics/p{i}.png,Собака бежит по траве {i}." for i in range(3)]
    (tmp_path / "ru.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert data_main(["import", str(tmp_path / "ru.csv"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    data = read_dataset(tmp_path / "out")
    assert data["tokenizer"] == "whitespace"
    assert data["images"][0]["sentences"][0]["tokens"][:2] == ["собака", "бежит"]
