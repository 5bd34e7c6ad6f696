"""captioner/batch.py's bookkeeping at its edges: what an output file already holds (read_resume)
and what a run then does and counts (plan_resume), where one image has several lines or
failed in a run that this one does not repeat."""

from __future__ import annotations

import json

from captioner.batch import Resume, plan_resume, read_resume, resume_key


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
