"""Resuming `captioner caption --out FILE`: the same image however its folder is spelled,
attention asked for on a later run, failed files retried."""

import os

from captioner.cli.main import main
from tests.builders import read_jsonl
from tests.tiny import tiny_image


def _folder(root, n=3):
    root.mkdir()
    for i in range(n):
        tiny_image(i).save(root / f"img{i}.png")
    return root


def _run(args, weights, capsys):
    capsys.readouterr()
    code = main(["caption", *args, "--weights", weights, "--max-len", "5", "--workers", "0"])
    return code, capsys.readouterr().err


def test_another_spelling_of_the_same_folder_resumes(tmp_path, weights, capsys, monkeypatch):
    folder = _folder(tmp_path / "photos")
    out = tmp_path / "out.jsonl"
    monkeypatch.chdir(tmp_path)
    assert _run(["photos", "--out", "out.jsonl"], weights, capsys)[0] == 0
    first = read_jsonl(out)
    assert [r["image"] for r in first] == [os.path.join("photos", f"img{i}.png") for i in range(3)]

    # The absolute path, the folder through a symlink, and "." from inside it: nothing to do.
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    for cwd, spelling, out_arg in [(tmp_path, str(folder), str(out)), (tmp_path, "link/", "out.jsonl"),
                                   (folder, ".", "../out.jsonl"), (folder, "./img1.png", str(out))]:
        monkeypatch.chdir(cwd)
        code, err = _run([spelling, "--out", out_arg], weights, capsys)
        assert code == 0
        assert "captioned 0" in err
        assert read_jsonl(out) == first, spelling  # no line appended, none changed

    # A new image in the folder is the only one captioned, and keeps the path as given.
    tiny_image(9).save(folder / "img9.png")
    code, err = _run([".", "--out", "../out.jsonl"], weights, capsys)
    assert code == 0 and "captioned 1" in err
    assert read_jsonl(out)[-1]["image"] == os.path.join(".", "img9.png")
    assert len(read_jsonl(out)) == 4


def test_attention_asked_for_on_an_earlier_run_captions_again_with_it(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    out = tmp_path / "out.jsonl"
    assert _run([str(folder), "--out", str(out)], weights, capsys)[0] == 0
    assert all("alphas" not in r for r in read_jsonl(out))

    code, err = _run([str(folder), "--out", str(out), "--with-attention", "--attention-dir",
                      str(tmp_path / "att")], weights, capsys)
    assert code == 0
    assert "captioned 3" in err
    lines = read_jsonl(out)
    assert len(lines) == 3  # the new lines replace the old ones, one line per image
    for rec in lines:
        assert len(rec["alphas"]) == len(rec["words"]) and len(rec["betas"]) == len(rec["words"])
        assert os.path.isfile(rec["attention_png"])
    assert len(list((tmp_path / "att").glob("*.png"))) == 3

    # Asked again: now they are done.
    code, err = _run([str(folder), "--out", str(out), "--with-attention"], weights, capsys)
    assert code == 0 and "captioned 0" in err and read_jsonl(out) == lines


def test_a_failed_file_is_retried_and_its_new_line_replaces_the_error(tmp_path, weights, capsys):
    folder = _folder(tmp_path / "photos")
    bad = folder / "img1.png"
    bad.write_bytes(b"not an image at all")
    out = tmp_path / "out.jsonl"
    code, err = _run([str(folder), "--out", str(out)], weights, capsys)
    assert code == 1 and "failed 1" in err
    assert "error" in next(r for r in read_jsonl(out) if r["image"] == str(bad))

    # Still broken: tried again, still an error, exit 1, still one line for it.
    code, err = _run([str(folder), "--out", str(out)], weights, capsys)
    assert code == 1 and "failed 1" in err and "retried 1" in err
    assert [r["image"] for r in read_jsonl(out)].count(str(bad)) == 1

    tiny_image(1).save(bad)  # the file is mended
    code, err = _run([str(folder), "--out", str(out)], weights, capsys)
    assert code == 0, err
    assert "captioned 1" in err and "retried 1" in err and "failed 0" in err
    lines = read_jsonl(out)
    assert sorted(r["image"] for r in lines) == sorted(str(folder / f"img{i}.png") for i in range(3))
    assert all("error" not in r and r["words"] for r in lines)


def test_a_later_error_never_replaces_a_caption(tmp_path, weights, capsys):
    """Captioned once; then the file became unreadable and attention is asked for: the run
    tries it again and fails, and the file keeps its caption rather than the error."""
    folder = _folder(tmp_path / "photos")
    out = tmp_path / "out.jsonl"
    assert _run([str(folder), "--out", str(out)], weights, capsys)[0] == 0
    before = {r["image"]: r for r in read_jsonl(out)}
    bad = folder / "img1.png"
    bad.write_bytes(b"no longer an image")

    code, err = _run([str(folder), "--out", str(out), "--with-attention"], weights, capsys)
    assert code == 1 and "failed 1" in err
    lines = read_jsonl(out)
    assert len(lines) == 3 and all("error" not in r for r in lines)
    kept = next(r for r in lines if r["image"] == str(bad))
    assert kept == before[str(bad)]  # the earlier caption, as it was
    assert all("alphas" in r for r in lines if r["image"] != str(bad))


def test_compact_keeps_the_caption_whichever_order_the_lines_came_in(tmp_path):
    import json

    from captioner.cli.batch import compact

    out = tmp_path / "out.jsonl"
    caption = {"image": "a.png", "resolved": str(tmp_path / "a.png"), "caption": "a red circle", "words": ["a"]}
    error = {"image": "a.png", "resolved": str(tmp_path / "a.png"), "error": "unreadable"}
    for order in ([caption, error], [error, caption], [error, caption, error]):
        out.write_text("".join(json.dumps(r) + "\n" for r in order))
        compact(out)
        assert [json.loads(x) for x in out.read_text().splitlines()] == [caption]


def test_the_resume_plan_takes_each_image_once_and_counts_what_it_retries(tmp_path):
    """batch.plan_resume: the bookkeeping `captioner caption` does before it captions."""
    import json

    from captioner.cli.batch import plan_resume, read_resume

    images = [tmp_path / f"{n}.png" for n in ("a", "b", "c", "d")]
    for p in images:
        p.write_bytes(b"")
    out = tmp_path / "out.jsonl"
    out.write_text("\n".join(json.dumps(r) for r in (
        {"image": str(images[0]), "caption": "x", "words": ["x"], "score": 0.0, "alphas": [[1.0]]},
        {"image": str(images[1]), "error": "broken"},
        {"image": str(images[2]), "caption": "y", "words": ["y"], "score": 0.0},
    )) + "\n")
    named = [str(p) for p in images] + [str(images[3]), str(tmp_path / "." / "d.png")]  # d named thrice
    plan = plan_resume(named, read_resume(out, with_attention=True))
    assert plan.todo == [str(images[1]), str(images[2]), str(images[3])]
    assert (plan.already, plan.retried, plan.again) == (1, 1, 1)
    fresh = plan_resume(named, None)
    assert fresh.todo == [str(p) for p in images] and (fresh.already, fresh.retried, fresh.again) == (0, 0, 0)
