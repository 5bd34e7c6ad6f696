"""`captioner caption`: one JSON line per image, bad files reported, exit codes, resume."""

import json

import pytest
import torch

from captioner.cli.batch import image_loader
from captioner.cli.main import main
from captioner.data.images import Preprocess, load_image
from tests.badfiles import SKIPPED_IN_BAD_FOLDER, make_bad_folder
from tests.builders import read_jsonl
from tests.tiny import tiny_captioner, tiny_image


def test_folder_with_good_and_broken_files(tmp_path, weights, capsys):
    root = tmp_path / "imgs"
    expect = make_bad_folder(root)
    out = tmp_path / "out.jsonl"
    code = main(["caption", str(root), "--weights", weights, "--out", str(out), "--max-len", "6",
                 "--batch-size", "4", "--workers", "0"])
    assert code == 1  # some failed
    lines = read_jsonl(out)
    by_image = {rec["image"][len(str(root)) + 1:]: rec for rec in lines}
    assert len(lines) == len(by_image) == len(expect)  # exactly one line per image, none twice
    assert set(by_image) == set(expect)
    for rel, ok in expect.items():
        rec = by_image[rel]
        if ok:
            assert isinstance(rec["caption"], str) and rec["words"] and "error" not in rec
            assert rec["caption"] == " ".join(rec["words"])
            assert isinstance(rec["score"], float)
        else:
            assert rec["error"] and "caption" not in rec
    summary = capsys.readouterr().err
    assert f"skipped {SKIPPED_IN_BAD_FOLDER}" in summary
    assert f"failed {sum(not ok for ok in expect.values())}" in summary


def test_all_good_exits_zero_and_writes_attention(tmp_path, weights, capsys):
    paths = []
    for i in range(3):
        p = tmp_path / f"img{i}.png"
        tiny_image(i).save(p)
        paths.append(str(p))
    code = main(["caption", *paths, "--weights", weights, "--with-attention", "--max-len", "5",
                 "--attention-dir", str(tmp_path / "att")])
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["image"] for x in lines] == paths
    for rec in lines:
        t = len(rec["words"])
        assert len(rec["alphas"]) == t and len(rec["betas"]) == t
        assert all(len(row) == 2 and len(row[0]) == 2 for row in rec["alphas"])  # 32 px -> 2x2 grid
        assert abs(sum(sum(r) for r in rec["alphas"][0]) - 1) < 1e-3
    assert len(list((tmp_path / "att").glob("*.png"))) == 3


def test_resume_skips_done_images_and_redoes_a_torn_line(tmp_path, weights):
    paths = []
    for i in range(5):
        p = tmp_path / f"img{i}.png"
        tiny_image(i).save(p)
        paths.append(str(p))
    out = tmp_path / "out.jsonl"
    assert main(["caption", *paths[:3], "--weights", weights, "--out", str(out), "--quiet"]) == 0
    full = out.read_text()
    out.write_text(full[: full.rindex("\n", 0, len(full) - 1) + 1] + '{"image": "' + paths[2][:5])  # torn last line
    assert main(["caption", *paths, "--weights", weights, "--out", str(out), "--quiet"]) == 0
    lines = read_jsonl(out)
    assert sorted(x["image"] for x in lines) == sorted(paths)  # every image exactly once


def test_usage_errors_exit_two(tmp_path, weights, capsys):
    assert main(["caption", str(tmp_path / "nope.jpg"), "--weights", weights]) == 2
    assert "no such file" in capsys.readouterr().err
    p = tmp_path / "a.png"
    tiny_image().save(p)
    assert main(["caption", str(p), "--weights", str(tmp_path / "missing.pt")]) == 2
    with pytest.raises(SystemExit) as e:
        main(["caption", str(p), "--beam-size", "0"])
    assert e.value.code == 2


def test_worker_batches_cross_as_one_tensor_in_path_order(tmp_path):
    """A worker sends each batch's good images stacked into one tensor, with the bad ones'
    reasons beside it; every path comes back once, in order, whatever a file holds."""
    paths = []
    for i in range(5):
        p = tmp_path / f"img{i}.png"
        if i in (1, 4):
            p.write_bytes(b"<html>not an image</html>")
        else:
            tiny_image(i).save(p)
        paths.append(str(p))
    prep = Preprocess(size=(16, 16))
    batches = list(image_loader(paths, prep, batch_size=3, workers=1))
    assert [b.indices for b in batches] == [[0, 1, 2], [3, 4]]
    assert [b.loaded for b in batches] == [[0, 2], [3]]
    assert set(batches[0].errors) == {1} and set(batches[1].errors) == {4}
    assert "not an image" in batches[0].errors[1]
    assert batches[0].pixels.shape == (2, 3, 16, 16)
    assert batches[0].pixels.dtype == torch.uint8  # a quarter of float pixels' bytes between processes
    for b in batches:  # the stacked rows are those images' pixels, normalised to exactly what training sees
        for row, index in enumerate(b.loaded):
            assert torch.equal(prep.normalize(b.pixels[row]), prep(load_image(paths[index])))
    only_bad = list(image_loader([paths[1]], prep, batch_size=3, workers=0))
    assert only_bad[0].pixels is None and only_bad[0].loaded == []


def test_a_batch_of_8_bit_pixels_captions_as_its_normalised_tensor():
    """caption_batch takes the loader's 8-bit pixels and normalises them on the model's device:
    the same captions, scores and maps as the float tensor training's preprocessing gives."""
    cap = tiny_captioner(seed=3)
    images = [tiny_image(seed=i) for i in range(3)]
    pixels = torch.stack([cap.preprocess.pixels(im) for im in images])
    floats = torch.stack([cap.preprocess(im) for im in images])
    for a, b in zip(cap.caption_batch(pixels), cap.caption_batch(floats)):
        assert a.words == b.words and a.score == b.score and torch.equal(a.alphas, b.alphas)


def test_max_pixels_raises_the_limit_above_pillows_own(tmp_path, weights, monkeypatch, capsys):
    """Pillow refuses images over twice its own limit before ours is asked: a raised
    --max-pixels must let them through (here Pillow's limit is lowered to make that small)."""
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000)
    tiny_image(0, size=(60, 50)).save(tmp_path / "huge.png")  # 3,000 pixels: over twice Pillow's limit
    out = tmp_path / "out.jsonl"
    code = main(["caption", str(tmp_path / "huge.png"), "--weights", weights, "--out", str(out), "--max-len", "4",
                 "--max-pixels", "5000", "--attention-dir", str(tmp_path / "maps"), "--quiet"])
    assert code == 0, read_jsonl(out)
    (record,) = read_jsonl(out)
    assert record["words"] and "error" not in record
    assert (tmp_path / "maps").is_dir() and record["attention_png"]  # the figure reads it under the same limit


def test_an_image_over_the_limit_names_the_option_that_raises_it(tmp_path, weights, capsys):
    tiny_image(0, size=(40, 30)).save(tmp_path / "big.png")
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(tmp_path / "big.png"), "--weights", weights, "--out", str(out),
                 "--max-pixels", "1000", "--quiet"]) == 1
    (record,) = read_jsonl(out)
    assert "1,200 pixels" in record["error"] and "1,000" in record["error"]
    assert "--max-pixels" in record["error"]


def test_attention_in_the_json_is_written_as_rounded(tmp_path, weights):
    """Rounded to 4 decimals as the help says, in the file too: 0.0012, not 0.0012000000569969416."""
    import re

    tiny_image(0).save(tmp_path / "a.png")
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(tmp_path / "a.png"), "--weights", weights, "--out", str(out), "--with-attention",
                 "--max-len", "5", "--quiet"]) == 0
    (record,) = read_jsonl(out)
    numbers = [x for row in record["alphas"] for line in row for x in line] + record["betas"] + [record["score"]]
    assert numbers and all(x == round(x, 4) for x in numbers)
    assert not re.search(r"\d\.\d{5,}", out.read_text())


def test_the_attention_figure_is_titled_with_the_caption_and_the_model(tmp_path, weights):
    import numpy as np
    from PIL import Image

    from captioner.inference import Captioner
    from captioner.overlay import attention_figure

    tiny_image(0, size=(48, 32)).save(tmp_path / "a.png")
    out = tmp_path / "out.jsonl"
    assert main(["caption", str(tmp_path / "a.png"), "--weights", weights, "--out", str(out), "--attention-dir",
                 str(tmp_path / "maps"), "--max-len", "5", "--quiet"]) == 0
    (record,) = read_jsonl(out)
    figure = Image.open(record["attention_png"])
    assert figure.text["Title"] == record["caption"] and figure.text["Model"] == "tiny.pt"
    # Drawn too: a band above the panels, as wide as the figure, with dark text in it.
    cap = Captioner.load(weights)
    result = cap.caption(tiny_image(0, size=(48, 32)))
    untitled = attention_figure(tiny_image(0, size=(48, 32)), result)
    band = figure.height - untitled.height
    assert band > 10 and figure.width == untitled.width
    assert np.asarray(figure.convert("L"))[:band].min() < 100


def test_every_out_makes_its_missing_folders_and_says_so(tmp_path, weights, capsys):
    from captioner.cli.main import build_parser

    tiny_image(0).save(tmp_path / "a.png")
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    assert main(["caption", str(tmp_path / "a.png"), "--weights", weights, "--out", str(out), "--max-len", "4",
                 "--quiet"]) == 0
    assert len(read_jsonl(out)) == 1
    assert main(["shapes", "--out", str(tmp_path / "made" / "shapes"), "--train", "1", "--val", "0", "--test", "0",
                 "--image-size", "64"]) == 0
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("caption", "evaluate", "shapes"):
        (action,) = [a for a in sub[command]._actions if "--out" in a.option_strings]
        assert "missing folders are made" in action.help, command


def test_each_line_names_the_model_and_a_demo_s_figure_carries_its_notice(tmp_path, weights):
    from PIL import Image

    tiny_image(0, size=(48, 32)).save(tmp_path / "a.png")
    for model, name in ((weights, "tiny.pt"), ("demo-soft", "demo-soft")):
        out = tmp_path / f"{name}.jsonl"
        assert main(["caption", str(tmp_path / "a.png"), "--weights", model, "--out", str(out), "--attention-dir",
                     str(tmp_path / name), "--max-len", "5", "--quiet"]) == 0
        (record,) = read_jsonl(out)
        assert record["model"] == name
        figure = Image.open(record["attention_png"])
        if name == "demo-soft":
            assert record["training_data"] == "synthetic shapes"
            assert "synthetic shapes only" in figure.text["Warning"]
            plain = tmp_path / "plain.png"  # the same figure without the notice is shorter by its line
            from captioner.inference import Captioner
            from captioner.overlay import attention_figure

            cap = Captioner.load("demo-soft")
            seen = cap.preprocess.seen(Image.open(tmp_path / "a.png").convert("RGB"))
            attention_figure(seen, cap.caption(tmp_path / "a.png", _options(5)), model=name).save(plain)
            assert figure.height > Image.open(plain).height
        else:
            assert "training_data" not in record and "Warning" not in figure.text


def _options(max_len):
    from captioner.inference import DecodeOptions

    return DecodeOptions(beam_size=3, max_len=max_len)


def test_an_empty_folder_is_one_line_and_exit_two(tmp_path, weights, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("no pictures here")
    for folder, words in (("empty", "no image files in"), ("notes", "(1 other file)")):
        assert main(["caption", str(tmp_path / folder), "--weights", weights]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err and "captioned 0" not in err, err


@pytest.mark.parametrize("likeliest, flag", [("end", []), ("unk", ["--allow-unk"])])
def test_captions_without_a_word_are_said_on_stderr(tmp_path, capsys, likeliest, flag):
    """A model whose every caption is empty (or, with <unk> allowed, only <unk>) does not pass silently."""
    cap = tiny_captioner(seed=1)
    with torch.no_grad():  # every step's most likely word: <end>, or <unk>
        cap.model.decoder.L_o.bias.fill_(-100.0)
        cap.model.decoder.L_o.bias[getattr(cap.vocab, likeliest)] = 100.0
    cap.save(tmp_path / "m.pt")
    tiny_image(0).save(tmp_path / "a.png")
    tiny_image(1).save(tmp_path / "b.png")
    assert main(["caption", str(tmp_path / "a.png"), str(tmp_path / "b.png"), "--weights", str(tmp_path / "m.pt"),
                 "--max-len", "3", "--beam-size", "1", *flag]) == 0
    captured = capsys.readouterr()
    words = [json.loads(line)["words"] for line in captured.out.splitlines()]
    assert words == ([[]] * 2 if likeliest == "end" else [["<unk>"] * 3] * 2)
    assert "note: 2 captions with no word (empty, or only <unk>)" in captured.err


@pytest.mark.parametrize("max_len, code", [("100", 0), ("101", 2), ("100000", 2)])
def test_max_len_has_a_stated_ceiling(tmp_path, weights, capsys, max_len, code):
    tiny_image(0).save(tmp_path / "a.png")
    try:
        got = main(["caption", str(tmp_path / "a.png"), "--weights", weights, "--max-len", max_len, "--beam-size",
                    "1", "--quiet"])
    except SystemExit as e:
        got = e.code
    err = capsys.readouterr().err
    assert got == code
    if code == 2:
        assert "--max-len: at most 100 words" in err and len(err.strip().splitlines()) == 1


def test_the_python_api_takes_a_path_a_pil_image_of_any_mode_or_an_array(tmp_path):
    import numpy as np
    from PIL import Image

    from captioner.data.images import ImageTooLargeError

    cap = tiny_captioner(seed=1)
    rgb = tiny_image(0, size=(40, 30))
    rgb.save(tmp_path / "a.png")
    options = _options(4)
    want = cap.caption(rgb, options).words
    assert cap.caption(str(tmp_path / "a.png"), options).words == want
    assert cap.caption(tmp_path / "a.png", options).words == want
    assert cap.caption(np.asarray(rgb), options).words == want
    assert cap.caption(np.asarray(rgb).astype(np.float32) / 255.0, options).words == want
    assert cap.caption(rgb.convert("RGBA"), options).words == want  # opaque: the same pixels
    for mode in ("L", "LA", "P", "CMYK", "I;16", "1"):
        assert cap.caption(rgb.convert(mode), options).score <= 0  # no RuntimeError, no size mismatch
    assert cap.caption(np.asarray(rgb.convert("L")), options).score <= 0
    # The EXIF orientation is honoured, as for files: a rotated copy tagged "rotate back" reads the same.
    exif = Image.Exif()
    exif[0x0112] = 6  # 90 degrees clockwise to show
    rgb.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "r.jpg", exif=exif, quality=100)
    assert cap.caption(Image.open(tmp_path / "r.jpg"), options).words == cap.caption(tmp_path / "r.jpg",
                                                                                      options).words
    with pytest.raises(ImageTooLargeError):
        cap.caption(rgb, options, max_pixels=100)


def test_the_default_length_limit_is_the_models_own(tmp_path, capsys):
    """A model says how long its training captions were (a Chinese one counts characters, about
    twice its words); caption and evaluate decode up to that unless --max-len says otherwise."""
    import json

    from tests.tiny import tiny_captioner, tiny_image

    cap = tiny_captioner(seed=5)
    image = tmp_path / "x.png"
    tiny_image(0).save(image)
    assert len(cap.caption(tiny_image(0)).words) == 2  # this model's caption at the old default of 20
    cap.meta["max_caption_len"] = 1
    cap.save(tmp_path / "short.pt")
    assert main(["caption", str(image), "--weights", str(tmp_path / "short.pt"), "--quiet"]) == 0
    assert len(json.loads(capsys.readouterr().out)["words"]) == 1
    assert main(["caption", str(image), "--weights", str(tmp_path / "short.pt"), "--max-len", "5", "--quiet"]) == 0
    assert len(json.loads(capsys.readouterr().out)["words"]) == 2
