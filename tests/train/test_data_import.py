"""`captioner data import`: own images and captions (CSV/TSV, JSON Lines, a folder with sidecar
.txt files) into a Karpathy-format dataset.json, and every refusal in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from captioner.cli.main import main as captioner_main
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
    assert data["tokenizer"] == "chars2" and "chars2" in said  # chosen from the captions
    merged = next(im for im in data["images"] if len(im["sentences"]) == 3)
    assert merged["sentences"][2]["tokens"] == list("桌子上的猫")
    assert dataset_tokenizer(out) == "chars2"


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
    assert said.splitlines()[-2] == f"wrote {out / 'dataset.json'}"  # not the image left out, named last


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
    assert "13 images of 17 cannot be used" in text
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


# ------------------------------------------------------------- what users have at hand

from captioner.train.own import SourceError, read_source, split_sizes  # noqa: E402


def csv_source(tmp_path: Path, rows: list[str], name: str = "c.csv", encoding: str = "utf-8") -> Path:
    path = tmp_path / name
    path.write_bytes(("\n".join(rows) + "\n").encode(encoding))
    return path


def test_a_latin1_csv_is_refused_naming_its_encoding_and_an_iconv_that_converts_it_whole(tmp_path, capsys):
    import shutil
    import subprocess

    photo_folder(tmp_path, n=4)
    rows = ["image,caption"] + [f"pics/p{i}.png,un café près de la fenêtre numéro {i}" for i in range(4)]
    source = csv_source(tmp_path, rows, encoding="latin-1")
    assert data_main(["import", str(source), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = one_line_error(capsys)
    assert "not UTF-8" in err and "GB18030" not in err
    command = err[err.index("iconv -f "):].split(";")[0].split(" or ")[0].strip()
    assert command.split()[2] == "CP1252" and "--encoding cp1252" in err
    assert "'pics/p0.png,un café près de la fenêtre numéro 0'" in err  # the line as it reads in that encoding
    # The hint is right: iconv converts the whole file, and the result imports with its accents.
    if shutil.which("iconv"):
        converted = tmp_path / "c-utf8.csv"
        with open(converted, "wb") as out:
            subprocess.run(command.split()[:5] + [str(source)], stdout=out, check=True)
        assert converted.read_text(encoding="utf-8").count("café") == 4
    # Or read as it is, with --encoding.
    assert data_main(["import", str(source), "--out", str(tmp_path / "out"), "--encoding", "latin-1",
                      "--quiet"]) == 0
    assert read_dataset(tmp_path / "out")["images"][0]["sentences"][0]["raw"].startswith("un café")


def test_a_polish_cp1250_csv_is_named_cp1250_not_the_western_code_page(tmp_path):
    rows = ["image,caption"] + [f"pics/p{i}.png,źrebię na łące przy żółtym ogrodzeniu, ślimak {i}" for i in range(4)]
    with pytest.raises(SourceError) as refused:
        read_source(csv_source(tmp_path, rows, encoding="cp1250"))
    message = str(refused.value)
    assert "it looks like cp1250" in message and "iconv -f CP1250 -t UTF-8" in message
    assert "źrebię na łące" in message and "--encoding cp1250" in message


def test_an_encoding_given_is_used_or_refused_in_one_line(tmp_path):
    source = csv_source(tmp_path, ["image,caption", "p.png,un café"], encoding="cp1252")
    assert read_source(source, encoding="cp1252").images[0].captions == ["un café"]
    with pytest.raises(SourceError, match="unknown encoding 'latin-9x'"):
        read_source(source, encoding="latin-9x")
    with pytest.raises(SourceError, match=r"is not utf-16-le \(byte 0x.. on line 2\)"):
        read_source(csv_source(tmp_path, ["image,caption", "p.png,ab"], name="odd.csv"), encoding="utf-16-le")


def test_excel_csv_utf8_with_a_byte_order_mark_reads_its_header(tmp_path):
    photo_folder(tmp_path, n=3)
    source = csv_source(tmp_path, ["image,caption"] + [f"pics/p{i}.png,a cup {i}" for i in range(3)],
                        encoding="utf-8-sig")
    got = read_source(source)
    assert got.columns == ("image", "caption") and got.captions == 3


def test_a_utf16_file_with_its_byte_order_mark_is_read(tmp_path):
    photo_folder(tmp_path, n=2)
    source = csv_source(tmp_path, ["image\tcaption"] + [f"pics/p{i}.png\tune tasse {i}" for i in range(2)],
                        name="c.tsv", encoding="utf-16")
    assert read_source(source).captions == 2


def test_a_stray_quote_that_swallows_the_next_rows_is_refused_naming_its_line(tmp_path, capsys):
    photo_folder(tmp_path, n=3)
    rows = ["image,caption", "pics/p0.png,a red square", 'pics/p1.png,"a cat with green eyes',
            "pics/p2.png,Black and white photo of a camera"]
    source = csv_source(tmp_path, rows)
    assert data_main(["import", str(source), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = one_line_error(capsys)
    assert "line 3" in err and "quote" in err and "pics/p2.png" in err
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_a_stray_quote_is_found_whichever_column_the_image_is_in(tmp_path):
    photo_folder(tmp_path, n=3)
    rows = ["caption;image", "a red square;pics/p0.png", '"a cat with green eyes;pics/p1.png', "a camera;pics/p2.png"]
    with pytest.raises(SourceError, match="line 3.*not closed before line 4"):
        read_source(csv_source(tmp_path, rows))


def test_a_quoted_caption_with_a_line_break_that_is_no_row_is_one_caption(tmp_path):
    photo_folder(tmp_path, n=2)
    rows = ["image,caption", 'pics/p0.png,"a cat\non a mat, sleeping\nnext to photo.jpg"', "pics/p1.png,a dog"]
    got = read_source(csv_source(tmp_path, rows))
    assert [im.captions for im in got.images] == [["a cat on a mat, sleeping next to photo.jpg"], ["a dog"]]


def test_json_lines_split_at_newlines_only_not_at_unicode_line_separators(tmp_path):
    photo_folder(tmp_path, n=2)
    lines = [json.dumps({"image": f"pics/p{i}.png", "caption": f"a cat\u2028on a mat {i}"}, ensure_ascii=False)
             for i in range(2)]
    source = tmp_path / "m.jsonl"
    source.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    got = read_source(source)
    assert got.captions == 2 and got.images[0].captions == ["a cat on a mat 0"]


def test_the_same_image_and_caption_twice_is_one_reference(tmp_path, capsys):
    photo_folder(tmp_path, n=3)
    rows = ["image,caption"] + [f"pics/p{i}.png,a cup {i}" for i in range(3)] + ["pics/p0.png,a  cup 0",
                                                                                  "pics/p0.png,another cup"]
    got = read_source(csv_source(tmp_path, rows))
    assert got.images[0].captions == ["a cup 0", "another cup"] and got.duplicates == 1
    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert "1 repeated caption dropped" in capsys.readouterr().out


def test_one_image_spelt_two_ways_is_one_image(tmp_path):
    photo_folder(tmp_path, n=3)
    rows = ["image,caption", "pics/p0.png,a cup", "sub/../pics/p0.png,a mug", "./pics/p1.png,a bowl",
            "pics/p2.png,a plate"]
    got = read_source(csv_source(tmp_path, rows))
    assert len(got.images) == 3 and got.images[0].captions == ["a cup", "a mug"]


def test_a_blank_line_inside_a_csv_is_skipped(tmp_path):
    photo_folder(tmp_path, n=3)
    rows = ["image,caption", "pics/p0.png,a cup", "", " , ", "pics/p1.png,a mug", "pics/p2.png,a bowl"]
    assert read_source(csv_source(tmp_path, rows)).captions == 3


def test_left_out_images_are_named_up_to_ten_then_counted(tmp_path, capsys):
    folder = tmp_path / "shots"
    paths = photo_folder(folder, n=16, sub="a")
    for p in paths[:3]:
        p.with_suffix(".txt").write_text("a small dog\n", encoding="utf-8")
    paths[3].with_suffix(".txt").write_text("...\n", encoding="utf-8")  # only an empty caption
    assert data_main(["import", str(folder), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "12 images without a caption file left out" in said
    named = [line for line in said.splitlines() if line.strip().startswith(str(folder / "a" / "p"))
             or line.strip().startswith("a/p")]
    assert len(named) == 10 + 1  # ten without a caption file, the one with only an empty caption
    assert "and 2 more" in said
    assert "1 image with only empty captions left out" in said and f"{Path('a') / 'p3.png'}" in said


def test_unreadable_images_left_out_are_named_with_normalised_paths(tmp_path, capsys):
    photo_folder(tmp_path, n=4)
    rows = ["image,caption"] + [f"pics/p{i}.png,a cup {i}" for i in range(4)] + ["sub/../pics/gone.png,a mug"]
    source = csv_source(tmp_path, rows)
    assert data_main(["import", str(source), "--out", str(tmp_path / "out"), "--quiet", "--skip-unreadable"]) == 0
    said = capsys.readouterr().out
    assert "1 unreadable image left out" in said
    assert str(tmp_path / "pics" / "gone.png") in said and ".." not in said


@pytest.mark.parametrize("n, train, val, test", [(2, 1, 1, 0), (3, 2, 1, 0), (4, 3, 1, 0), (5, 3, 1, 1),
                                                 (10, 8, 1, 1), (30, 24, 3, 3)])
def test_default_splits_validate_on_one_image_at_least_and_test_only_beside_three_training(n, train, val, test):
    assert split_sizes(n, None, None) == (val, test) and n - val - test == train


def test_one_image_cannot_be_split(tmp_path):
    with pytest.raises(SourceError, match="at least 2 images"):
        split_sizes(1, None, None)


def test_shares_round_to_the_nearest_count_and_a_positive_share_is_one_image_at_least():
    assert split_sizes(10, 0.27, 0.05) == (3, 1)
    assert split_sizes(10, 0.05, 0) == (1, 0)
    assert split_sizes(20, 0.25, 0.1) == (5, 2)


def test_a_split_that_leaves_nothing_to_train_on_is_refused():
    assert split_sizes(4, 2, 1) == (2, 1)
    with pytest.raises(SourceError, match="train"):
        split_sizes(4, 2, 2)
    with pytest.raises(SourceError, match="validat"):
        split_sizes(10, 0, 1)


def test_two_images_import_with_one_to_validate_on(tmp_path, capsys):
    photo_folder(tmp_path, n=2)
    source = csv_source(tmp_path, ["image,caption", "pics/p0.png,a cup", "pics/p1.png,a mug"])
    assert data_main(["import", str(source), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    assert sorted(im["split"] for im in read_dataset(tmp_path / "out")["images"]) == ["train", "val"]


def test_the_json_lines_key_error_lists_every_accepted_name_plainly(tmp_path, capsys):
    (tmp_path / "m.jsonl").write_text('{"image": "a.png", "label": "x"}\n', encoding="utf-8")
    assert data_main(["import", str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    for name in ("caption", "text", "sentence", "description", "captions", "texts", "sentences", "descriptions"):
        assert f" {name}," in err or f" {name};" in err or f" {name} " in err, name
    assert "((" not in err and "(" not in err.split("looked for")[1].split(";")[0]


def test_a_plural_key_such_as_descriptions_holds_a_list_of_captions(tmp_path):
    photo_folder(tmp_path, n=1)
    (tmp_path / "m.jsonl").write_text(json.dumps({"image": "pics/p0.png", "descriptions": ["a cup", "a mug"]}) + "\n",
                                      encoding="utf-8")
    got = read_source(tmp_path / "m.jsonl")
    assert got.columns == ("image", "descriptions") and got.images[0].captions == ["a cup", "a mug"]


def test_the_data_set_is_named_after_the_output_folder_unless_named(tmp_path):
    photo_folder(tmp_path, n=3)
    source = csv_source(tmp_path, ["image,caption"] + [f"pics/p{i}.png,a cup {i}" for i in range(3)],
                        name="captions.csv")
    assert data_main(["import", str(source), "--out", str(tmp_path / "kitchen"), "--quiet"]) == 0
    assert read_dataset(tmp_path / "kitchen")["dataset"] == "kitchen"
    assert data_main(["import", str(source), "--out", str(tmp_path / "kitchen"), "--name", "Cups and mugs",
                      "--overwrite", "--quiet"]) == 0
    assert read_dataset(tmp_path / "kitchen")["dataset"] == "Cups and mugs"


def test_avif_images_are_found_in_folders(tmp_path):
    from PIL import features

    from captioner.cli.batch import discover

    if not features.check("avif"):
        pytest.skip("this Pillow has no AVIF codec")
    folder = tmp_path / "shots"
    photo_folder(folder, n=2, sub="a")
    Image.new("RGB", (24, 16), (10, 120, 200)).save(folder / "a" / "kite.avif")
    for name in ("p0", "p1", "kite"):
        (folder / "a" / f"{name}.txt").write_text(f"a {name} in the sky\n", encoding="utf-8")
    assert str(folder / "a" / "kite.avif") in discover([str(folder)]).images
    got = read_source(folder)
    assert (folder / "a" / "kite.avif") in [im.path for im in got.images]


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
def test_the_line_quoted_from_a_refused_file_is_whole_when_it_is_the_last_without_a_line_break(tmp_path):
    """The failing byte on the last line, which no line break ends: the line is quoted to its
    last character, as any other line is."""
    rows = ["image,caption"] + [f"pics/p{i}.png,a cup on a table {i}" for i in range(3)]
    rows.append("pics/p3.png,un café près de la fenêtre numéro 3")
    source = tmp_path / "last.csv"
    source.write_bytes("\n".join(rows).encode("latin-1"))  # no line break after the last row
    with pytest.raises(SourceError) as refused:
        read_source(source)
    message = str(refused.value)
    assert "on line 5" in message and "fen" in message
    assert "numéro 3'" in message, message  # the line's last character, then the closing quote


def test_a_share_too_small_for_one_image_still_gives_one():
    """A positive share that rounds to no image (1% of 10) is one image: validation and test
    asked for are never left empty."""
    assert split_sizes(10, 0.01, 0.01) == (1, 1)
    assert split_sizes(100, 0.004, None) == (1, 10)


def test_sentence_ids_count_from_zero_across_the_images(tmp_path, capsys):
    """Karpathy's numbering: sentid 0, 1, 2, ... over every sentence of the file, in image order,
    each image listing its own."""
    photo_folder(tmp_path, n=3)
    rows = ["image,caption", "pics/p0.png,a cup", "pics/p0.png,a mug", "pics/p1.png,a jar", "pics/p2.png,a pot"]
    assert data_main(["import", str(csv_source(tmp_path, rows)), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    images = read_dataset(tmp_path / "out")["images"]
    sentences = [s for im in images for s in im["sentences"]]
    assert [s["sentid"] for s in sentences] == [0, 1, 2, 3]
    assert all(im["sentids"] == [s["sentid"] for s in im["sentences"]] for im in images)
    assert [im["imgid"] for im in images] == [0, 1, 2]


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_sidecar_text_file_s_final_line_break_is_no_empty_caption(tmp_path, ending):
    """A .txt written by any editor ends with a line break: that is the end of its last caption,
    not an empty one; a blank line between captions still counts as one."""
    from captioner.train.own import read_source

    folder = tmp_path / "pics"
    images = photo_folder(tmp_path)
    for i, image in enumerate(images):
        body = "a red circle" + ending if i else "a red circle\n\na blue square" + ending
        image.with_suffix(".txt").write_bytes(body.encode())
    source = read_source(folder)
    assert source.empty_captions == 1  # the blank line of the first file, nothing else
    assert source.captions == len(images) + 1


def test_paths_written_relative_to_the_current_folder_are_recognised_and_the_fix_named(tmp_path, capsys,
                                                                                      monkeypatch):
    # The commonest own-data mistake: the captions file in own/, its paths written from the folder
    # above it (where the user stood), not from the file's own folder.
    photo_folder(tmp_path, n=3, sub="photos")
    (tmp_path / "own").mkdir()
    rows = ["image,caption"] + [f"photos/p{i}.png,caption {i}" for i in range(3)]
    (tmp_path / "own" / "captions.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert data_main(["import", "own/captions.csv", "--out", "data", "--quiet"]) == 1
    text = capsys.readouterr().out
    assert "3 images of 3 cannot be used" in text
    hint = [line for line in text.splitlines() if "current folder" in line]
    assert len(hint) == 1, text
    assert "all 3 missing images exist relative to the current folder" in hint[0]
    assert "relative to the file's own folder (own)" in hint[0] and "../photos/p0.png" in hint[0]

    # One not found anywhere: no such hint.
    rows = ["image,caption", "elsewhere/x.png,a caption"]
    (tmp_path / "own" / "other.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert data_main(["import", "own/other.csv", "--out", "data", "--quiet"]) == 1
    assert "current folder" not in capsys.readouterr().out


def test_one_unusable_image_is_said_in_the_singular(tmp_path, capsys):
    photo_folder(tmp_path, n=3)
    rows = ["image,caption"] + [f"pics/p{i}.png,caption {i}" for i in range(3)] + ["pics/gone.png,caption"]
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    assert data_main(["import", str(tmp_path / "c.csv"), "--out", str(tmp_path / "out"), "--quiet"]) == 1
    text = capsys.readouterr().out
    assert "1 image of 4 cannot be used:" in text
