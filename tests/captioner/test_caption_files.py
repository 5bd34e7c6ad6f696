"""`captioner caption --format txt | metadata`: captions written as files beside the images (a
.txt each, or Hugging Face's metadata.jsonl), what is there already kept unless --overwrite, the
run resumable, and every combination that makes no sense refused in one line."""

import json
import os

import pytest

from captioner.cli.main import main
from captioner.data.vocab import UNK
from captioner.inference import Captioner
from tests.builders import one_line, read_jsonl
from tests.tiny import tiny_image


def _folder(root, names=("a.png", "b.png", "sub/c.png")):
    for i, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        tiny_image(i).save(root / name)
    return root


def _run(args, weights, capsys):
    capsys.readouterr()
    code = main(["caption", *map(str, args), "--weights", weights, "--max-len", "5", "--workers", "0"])
    said = capsys.readouterr()
    return code, said.out, said.err


def _jsonl_captions(folder, weights, capsys):
    """Each image's caption as the JSON Lines of the same model give it, by path."""
    code, out, _ = _run([folder], weights, capsys)
    assert code == 0
    return {json.loads(line)["image"]: json.loads(line)["caption"] for line in out.splitlines()}


def test_txt_writes_a_file_beside_each_image_with_its_caption(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    expected = _jsonl_captions(folder, weights, capsys)
    code, out, err = _run([folder, "--format", "txt"], weights, capsys)
    assert code == 0 and out == ""  # nothing on stdout: the captions are in the files
    for image, caption in expected.items():
        text = os.path.splitext(image)[0] + ".txt"
        with open(text, encoding="utf-8") as f:
            assert f.read() == caption + "\n"
    assert sorted(p.name for p in folder.rglob("*.txt")) == ["a.txt", "b.txt", "c.txt"]
    assert "captioned 3, failed 0" in err and "kept 0" in err


def test_txt_under_out_mirrors_the_tree_and_leaves_the_image_folder_alone(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    expected = _jsonl_captions(folder, weights, capsys)
    out_dir = tmp_path / "captions"
    code, _, err = _run([folder, "--format", "txt", "--out", out_dir], weights, capsys)
    assert code == 0
    assert not list(folder.rglob("*.txt"))
    assert sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*.txt")) == \
        ["a.txt", "b.txt", os.path.join("sub", "c.txt")]
    assert (out_dir / "sub" / "c.txt").read_text(encoding="utf-8") == expected[str(folder / "sub" / "c.png")] + "\n"
    assert str(out_dir) in err


def test_prefix_and_suffix_go_around_each_caption(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos", names=("a.png",))
    caption = _jsonl_captions(folder, weights, capsys)[str(folder / "a.png")]
    code, _, _ = _run([folder, "--format", "txt", "--prefix", "sks, ", "--suffix", ", photo"], weights, capsys)
    assert code == 0
    assert (folder / "a.txt").read_text(encoding="utf-8") == f"sks, {caption}, photo\n"


def test_an_existing_txt_is_kept_and_named_unless_overwrite(tmp_path, weights, capsys, monkeypatch):
    folder = _folder(tmp_path / "photos")
    (folder / "b.txt").write_text("a caption corrected by hand\n", encoding="utf-8")
    code, _, err = _run([folder, "--format", "txt"], weights, capsys)
    assert code == 0
    assert (folder / "b.txt").read_text(encoding="utf-8") == "a caption corrected by hand\n"
    assert "captioned 2" in err and "kept 1" in err and str(folder / "b.txt") in err

    # The run is resumable: a second run captions nothing (every image has its .txt), and does
    # not even decode an image.
    def never(*a, **kw):
        raise AssertionError("captioned again")

    monkeypatch.setattr(Captioner, "caption_batch", never)
    code, _, err = _run([folder, "--format", "txt"], weights, capsys)
    assert code == 0 and "captioned 0" in err and "kept 3" in err
    monkeypatch.undo()

    code, _, err = _run([folder, "--format", "txt", "--overwrite"], weights, capsys)
    assert code == 0 and "captioned 3" in err and "kept 0" in err
    assert (folder / "b.txt").read_text(encoding="utf-8") != "a caption corrected by hand\n"


def test_a_run_stopped_half_way_continues_where_it_stopped(tmp_path, weights, capsys, monkeypatch):
    folder = _folder(tmp_path / "photos", names=[f"img{i}.png" for i in range(5)])
    real = Captioner.caption_batch
    calls = []

    def stopped_on_the_second_batch(self, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(Captioner, "caption_batch", stopped_on_the_second_batch)
    code, _, err = _run([folder, "--format", "txt", "--batch-size", "2"], weights, capsys)
    assert code == 130 and "the same command continues where it stopped" in err
    assert sorted(p.name for p in folder.glob("*.txt")) == ["img0.txt", "img1.txt"]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left
    monkeypatch.undo()
    code, _, err = _run([folder, "--format", "txt", "--batch-size", "2"], weights, capsys)
    assert code == 0 and "captioned 3" in err and "kept 2" in err
    assert len(list(folder.glob("*.txt"))) == 5


def test_a_file_that_cannot_be_read_gets_no_txt_and_is_named(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    (folder / "b.png").write_bytes(b"not an image at all")
    code, _, err = _run([folder, "--format", "txt", "--quiet"], weights, capsys)
    assert code == 1
    assert not (folder / "b.txt").exists() and (folder / "a.txt").exists()
    assert str(folder / "b.png") in err  # named even with --quiet: it has no other record


def test_a_caption_without_a_word_writes_no_file(tmp_path, weights, capsys, monkeypatch):
    folder = _folder(tmp_path / "photos", names=("a.png",))
    real = Captioner.caption_batch

    def unk_only(self, *a, **kw):
        results = real(self, *a, **kw)
        for r in results:
            r.words[:] = [UNK]
        return results

    monkeypatch.setattr(Captioner, "caption_batch", unk_only)
    code, _, err = _run([folder, "--format", "txt"], weights, capsys)
    assert code == 0 and not (folder / "a.txt").exists()
    assert "no word" in err and "no .txt written" in err


def test_two_images_that_would_write_one_txt_are_refused_before_any_work(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos", names=("photo.png", "photo.jpg"))
    code, _, err = _run([folder, "--format", "txt"], weights, capsys)
    assert code == 2
    line = one_line(err)
    assert "photo.jpg" in line and "photo.png" in line and "photo.txt" in line
    assert not list(folder.glob("*.txt"))


@pytest.mark.parametrize("extra, says", [
    (["--prefix", "sks, "], "--prefix"),
    (["--suffix", "x"], "--suffix"),
    (["--overwrite"], "--overwrite"),
    (["--format", "txt", "--with-attention"], "--with-attention"),
    (["--format", "txt", "--attention-heads"], "--attention-heads"),
    (["--format", "metadata", "--num-captions", "2", "--beam-size", "2"], "--num-captions"),
    (["--format", "txt", "--prefix", "two\nlines"], "line break"),
    (["--format", "metadata", "--out", "elsewhere"], "--out"),
])
def test_combinations_that_make_no_sense_are_one_line_and_exit_two(tmp_path, weights, capsys, extra, says):
    folder = _folder(tmp_path / "photos", names=("a.png",))
    code, out, err = _run([folder, *extra], weights, capsys)
    assert code == 2 and out == ""
    assert says in one_line(err)
    assert not list(folder.glob("*.txt")) and not (folder / "metadata.jsonl").exists()


def test_metadata_wants_one_folder(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    other = _folder(tmp_path / "more", names=("d.png",))
    for paths in ([folder, other], [folder / "a.png"]):
        code, _, err = _run([*paths, "--format", "metadata"], weights, capsys)
        assert code == 2 and "one folder" in one_line(err)


def test_txt_with_out_a_file_is_refused(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos", names=("a.png",))
    (tmp_path / "captions.jsonl").write_text("")
    code, _, err = _run([folder, "--format", "txt", "--out", tmp_path / "captions.jsonl"], weights, capsys)
    assert code == 2 and "folder" in one_line(err)


def test_metadata_writes_one_line_per_image_relative_to_the_folder(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    expected = _jsonl_captions(folder, weights, capsys)
    code, out, err = _run([folder, "--format", "metadata", "--prefix", "sks "], weights, capsys)
    assert code == 0 and out == ""
    lines = read_jsonl(folder / "metadata.jsonl")
    assert lines == [{"file_name": name, "text": "sks " + expected[str(folder / name)]}
                     for name in ("a.png", "b.png", "sub/c.png")]
    assert "captioned 3" in err and str(folder / "metadata.jsonl") in err


def test_metadata_keeps_its_lines_adds_new_images_and_overwrite_replaces_them(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    assert _run([folder, "--format", "metadata"], weights, capsys)[0] == 0
    lines = read_jsonl(folder / "metadata.jsonl")
    model_said = lines[1]["text"]
    lines[1]["text"] = "corrected by hand"
    # A run killed mid-write leaves a torn last line: it is cut, the image captioned again.
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:2]) + '{"file_na',
                                           encoding="utf-8")
    tiny_image(7).save(folder / "new.png")
    code, _, err = _run([folder, "--format", "metadata"], weights, capsys)
    assert code == 0 and "captioned 2" in err and "kept 2" in err and "b.png" in err
    now = read_jsonl(folder / "metadata.jsonl")
    assert [r["file_name"] for r in now] == ["a.png", "b.png", "new.png", "sub/c.png"]  # the kept first
    assert now[:2] == lines[:2] and now[1]["text"] == "corrected by hand" and now[3] == lines[2]

    code, _, err = _run([folder, "--format", "metadata", "--overwrite"], weights, capsys)
    assert code == 0 and "captioned 4" in err
    again = read_jsonl(folder / "metadata.jsonl")
    assert sorted(r["file_name"] for r in again) == ["a.png", "b.png", "new.png", "sub/c.png"]  # one line each
    assert next(r for r in again if r["file_name"] == "b.png")["text"] == model_said


def test_the_default_is_still_json_lines(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos", names=("a.png",))
    code, out, _ = _run([folder, "--format", "jsonl"], weights, capsys)
    assert code == 0 and json.loads(out)["image"] == str(folder / "a.png")
    assert not list(folder.glob("*.txt")) and not (folder / "metadata.jsonl").exists()


def test_help_explains_the_formats(capsys):
    with pytest.raises(SystemExit):
        main(["caption", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for words in ("--format", "metadata.jsonl", "--prefix", "--suffix", "--overwrite", "imagefolder"):
        assert words in text


@pytest.mark.slow  # a process of its own: about 2.5 s, most of it importing datasets
def test_hugging_face_imagefolder_reads_the_metadata_as_it_is(tmp_path, weights, capsys):
    """datasets.load_dataset("imagefolder") on the folder, offline, in a process of its own (the
    library reads HF_HOME and HF_DATASETS_OFFLINE when it is imported)."""
    import subprocess
    import sys

    folder = _folder(tmp_path / "photos", names=("a.png", "b.png", "sub/c.png", "sub/é ü.png"))
    (folder / "notes.txt").write_text("not an image")
    assert _run([folder, "--format", "metadata", "--prefix", "sks, "], weights, capsys)[0] == 0
    written = {r["file_name"]: r["text"] for r in read_jsonl(folder / "metadata.jsonl")}
    script = ("import json, sys, datasets\n"
              "ds = datasets.load_dataset('imagefolder', data_dir=sys.argv[1], split='train')\n"
              "print(json.dumps({'columns': ds.column_names, 'text': list(ds['text']), "
              "'sizes': [list(row['image'].size) for row in ds]}))\n")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read["columns"] == ["image", "text"]
    assert sorted(read["text"]) == sorted(written.values()) and len(read["text"]) == 4
    assert all(text.startswith("sks, ") for text in read["text"])
    assert read["sizes"] == [list(tiny_image(0).size)] * 4
