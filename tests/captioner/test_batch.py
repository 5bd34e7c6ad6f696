"""captioner/cli/batch.py's bookkeeping at its edges: what an output file already holds (read_resume)
and what a run then does and counts (plan_resume), where one image has several lines or
failed in a run that this one does not repeat."""

from __future__ import annotations

import json

from captioner.cli.batch import Resume, plan_resume, read_resume, resume_key


def _write(out, *records) -> None:
    out.write_text("".join(json.dumps(r) + "\n" for r in records))


def _caption(path, **extra) -> dict:
    return {"image": str(path), "caption": "x", "words": ["x"], "score": 0.0, **extra}


def test_an_image_with_a_caption_and_an_error_line_is_not_failed(tmp_path):
    """A retry that failed again after an earlier caption (compact keeps the caption): the
    image is captioned, not failed; asked for again with attention, it is captioned again
    without counting as a retry."""
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    out = tmp_path / "out.jsonl"
    _write(out, _caption(a), {"image": str(a), "error": "broken"}, {"image": str(b), "error": "broken"},
           _caption(b))
    key_a, key_b = resume_key(str(a)), resume_key(str(b))
    assert read_resume(out) == Resume(done={key_a, key_b}, failed=set(), lacking=set())
    assert read_resume(out, with_attention=True) == Resume(done=set(), failed=set(), lacking={key_a, key_b})

    plan = plan_resume([str(a), str(b)], read_resume(out, with_attention=True))
    assert plan.todo == [str(a), str(b)]
    assert (plan.already, plan.retried, plan.again) == (0, 0, 2)


def test_only_the_failures_named_again_count_as_retried(tmp_path):
    """An image that failed in an earlier run over another folder is not tried by this one."""
    here, elsewhere = tmp_path / "here.png", tmp_path / "other" / "there.png"
    out = tmp_path / "out.jsonl"
    _write(out, {"image": str(here), "error": "broken"}, {"image": str(elsewhere), "error": "broken"})
    resume = read_resume(out)
    assert resume.failed == {resume_key(str(here)), resume_key(str(elsewhere))}

    plan = plan_resume([str(here), str(tmp_path / "new.png")], resume)
    assert plan.todo == [str(here), str(tmp_path / "new.png")]
    assert (plan.already, plan.retried, plan.again) == (0, 1, 0)
    assert plan_resume([str(tmp_path / "new.png")], resume).retried == 0


def test_the_lines_resume_matches_on_and_those_it_passes_over(tmp_path):
    """The resume key written in the line ("resolved") wins over the path as written; lines
    that are not image records, and a torn last line, are passed over (the torn one cut off)."""
    a = tmp_path / "a.png"
    moved = tmp_path / "moved.png"
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(_caption("elsewhere/a.png", resolved=resume_key(str(a)))) + "\n"
                   + '{"note": "not an image"}\n' + "[1, 2]\n" + "not json\n"
                   + json.dumps(_caption(moved))[:20])
    assert read_resume(out).done == {resume_key(str(a))}
    assert out.read_text().endswith("not json\n")  # the torn line is gone from the file
    assert plan_resume([str(a), str(moved)], read_resume(out)).todo == [str(moved)]


def test_discover_walks_folders_sorted_once_each_and_names_every_missing_path(tmp_path):
    import os

    import pytest

    from captioner.cli.batch import discover

    root = tmp_path / "photos"
    (root / "b").mkdir(parents=True)
    (root / "a").mkdir()
    for rel in ("b/2.PNG", "b/1.jpg", "a/z.jpeg", "top.png", "notes.txt", "a/.hidden.txt"):
        (root / rel).write_bytes(b"")
    (root / "a" / "loop").symlink_to(root, target_is_directory=True)  # a link back up: entered once only
    (tmp_path / "named.dat").write_bytes(b"")
    found = discover([str(root), str(tmp_path / "named.dat")])
    assert found.images == [os.path.join(str(root), "top.png"), *(os.path.join(str(root), p) for p in (
        "a/z.jpeg", "b/1.jpg", "b/2.PNG")), str(tmp_path / "named.dat")]  # a file named is tried whatever it is
    assert found.skipped == 2
    with pytest.raises(FileNotFoundError, match=r"^no such file or folder: .*gone1, .*gone2$"):
        discover([str(root), str(tmp_path / "gone1"), str(tmp_path / "gone2")])


def test_merged_parts_keep_one_line_per_image_and_the_caption_over_the_error(tmp_path):
    from captioner.cli.batch import compact, merge_parts, part_path

    out = tmp_path / "out.jsonl"
    a, b, c = (_caption(tmp_path / f"{n}.png") for n in "abc")
    _write(out, {"image": a["image"], "error": "broken"}, c)
    _write(part_path(out, 0), a, {"note": "not a record"})
    _write(part_path(out, 1), {"image": b["image"], "error": "broken"}, dict(c, caption="newer"))
    part_path(out, 1).write_text(part_path(out, 1).read_text() + '{"image": "torn')
    assert part_path(out, 1).name == "out.jsonl.part1"
    assert merge_parts(out) == 3  # a, b's error, c's newer caption: the torn line and the note are not records
    assert not list(tmp_path.glob("*.part*"))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [a, {"image": b["image"], "error": "broken"}, dict(c, caption="newer")]
    assert compact(out) == 0  # one line per image already: the file is left as it is



def test_the_loader_leaves_jpeg_bytes_to_the_device_only_when_asked(tmp_path):
    """raw_jpegs: the workers hand a plain JPEG's bytes over and decoded_on decodes them on the
    device, in the batch's order beside the images the CPU path loaded; a JPEG the device's
    decoder refuses goes through the CPU path, which says why. Without it, the CPU path only."""
    import io

    import torch
    from PIL import Image

    from captioner.cli.batch import image_loader
    from captioner.data.images import Preprocess
    from captioner.data.jpeg_device import decode_resize, plain_jpeg

    pre = Preprocess(size=(16, 16))
    buf = io.BytesIO()
    Image.effect_noise((40, 30), 60).convert("RGB").save(buf, "JPEG")
    (tmp_path / "a.jpg").write_bytes(buf.getvalue())
    (tmp_path / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    Image.new("RGB", (20, 20), "red").save(tmp_path / "b.png")
    (tmp_path / "c.png").write_text("not an image")
    paths = [str(tmp_path / n) for n in ("a.jpg", "b.png", "cut.jpg", "c.png")]

    (cpu,) = image_loader(paths, pre, batch_size=4, workers=0)
    assert cpu.raw == {} and cpu.loaded == [0, 1] and set(cpu.errors) == {2, 3} and cpu.pixels.shape[0] == 2
    assert cpu.decoded_on(torch.device("cpu"), paths, pre) is cpu  # nothing left to decode

    (raw,) = image_loader(paths, pre, batch_size=4, workers=0, raw_jpegs=True)
    assert set(raw.raw) == {0, 2} and raw.loaded == [1] and set(raw.errors) == {3}
    done = raw.decoded_on(torch.device("cpu"), paths, pre)
    assert done.indices == [0, 1, 2, 3] and done.loaded == [0, 1] and set(done.errors) == {2, 3}
    assert "truncated" in done.errors[2] and done.errors[3] == cpu.errors[3]
    assert torch.equal(done.pixels[0], decode_resize([plain_jpeg(paths[0], 10**6)], pre, "cpu")[0])
    assert torch.equal(done.pixels[1], cpu.pixels[1])


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
def test_discover_follows_a_link_to_a_folder_elsewhere(tmp_path):
    """A folder of photographs that links to another (an album on another disk): the linked
    folder's images are found under the link's path."""
    import os

    from captioner.cli.batch import discover

    elsewhere = tmp_path / "disk2" / "album"
    elsewhere.mkdir(parents=True)
    (elsewhere / "x.jpg").write_bytes(b"")
    root = tmp_path / "photos"
    root.mkdir()
    (root / "a.png").write_bytes(b"")
    (root / "album").symlink_to(elsewhere, target_is_directory=True)
    assert discover([str(root)]).images == [os.path.join(str(root), "a.png"),
                                            os.path.join(str(root), "album", "x.jpg")]


def test_caption_paths_writes_no_attention_unless_asked(tmp_path):
    """The library's default, as `captioner caption` without --with-attention: maps are large,
    and only asked for."""
    import io

    from captioner.cli.batch import caption_paths
    from captioner.inference import DecodeOptions
    from tests.tiny import tiny_captioner, tiny_image

    path = tmp_path / "a.png"
    tiny_image(0).save(path)
    cap, options = tiny_captioner(seed=1), DecodeOptions(beam_size=1, max_len=3)
    out = io.StringIO()
    caption_paths(cap, [str(path)], out, options=options, progress=False)
    assert "alphas" not in json.loads(out.getvalue())
    out = io.StringIO()
    caption_paths(cap, [str(path)], out, options=options, progress=False, with_attention=True)
    assert "alphas" in json.loads(out.getvalue())
