"""train/startup.py at its edges, each case one that a one-character change of a rule there
would get wrong: a checkpoint with another vocabulary of the same size, a grounding metric
with a Karpathy split file, a split left with no readable image, hidden files beside
generated shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.distributed import DistContext
from captioner.model import CaptionModel
from captioner.train.config import DataConfig, load_config
from captioner.train.startup import (StartupError, _init_from, check_new_run, check_shapes_folder,
                                     readable_splits)
from captioner.vocab import Vocabulary
from tests.tiny import tiny_captioner, tiny_config, tiny_vocab


def test_init_from_refuses_another_vocabulary_of_the_same_size(tmp_path):
    """``data.max_vocab`` makes equal sizes likely: the words themselves must match, else the
    embeddings of one word would start another's."""
    source = tmp_path / "source.pt"
    tiny_captioner(seed=1).save(source)
    words = tiny_vocab().words
    model = CaptionModel(tiny_config())

    _init_from(model, Vocabulary(list(words)), str(source))  # the same words: the weights are copied
    src = torch.load(source, weights_only=True)["state_dict"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in src.items())

    specials = [w for w in words if w.startswith("<")]
    shuffled = specials + list(reversed([w for w in words if not w.startswith("<")]))
    renamed = words[:-1] + ["zebra"]
    for other in (shuffled, renamed):
        assert len(other) == len(words) and other != words
        fresh = CaptionModel(tiny_config())
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        with pytest.raises(StartupError, match="has a different vocabulary"):
            _init_from(fresh, Vocabulary(other), str(source))
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())  # nothing copied


def _grounding_config(data: Path, *sets: str):
    return load_config(None, [f"data.dir={data}", "val.metric=object_accuracy", *sets])


def test_a_grounding_metric_needs_objects_and_no_karpathy_split_file(tmp_path):
    data = tmp_path / "shapes"
    data.mkdir()
    (data / "captions_val.json").write_text("{}")
    with pytest.raises(StartupError, match="object_accuracy needs the objects of each image"):
        check_new_run(_grounding_config(data))  # captions without objects
    (data / "instances_val.json").write_text("{}")
    check_new_run(_grounding_config(data))  # shapes data: objects beside the captions
    with pytest.raises(StartupError, match="without a Karpathy split file"):
        check_new_run(_grounding_config(data, "data.karpathy=dataset_coco.json"))
    check_new_run(_grounding_config(data, "data.karpathy=dataset_coco.json", "val.metric=CIDEr"))

    # Shapes the run generates have objects; a folder whose captions are there already has none.
    fresh = tmp_path / "to-generate"
    check_new_run(_grounding_config(fresh, "data.generate_shapes=true"))
    fresh.mkdir()
    (fresh / "captions_train.json").write_text("{}")
    with pytest.raises(StartupError, match="needs the objects"):
        check_new_run(_grounding_config(fresh, "data.generate_shapes=true"))


def _damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:30])  # a PNG cut short


@pytest.mark.parametrize("split", ["val", "train"])
def test_a_split_left_without_readable_images_is_refused_even_when_skipping_unreadable(tiny_coco, split):
    from tests.builders import tiny_train_config

    cfg = tiny_train_config(tiny_coco, **{"data.skip_unreadable": True})
    for path in (tiny_coco / "images").glob(f"{split}_*.png"):
        _damage(path)
    with pytest.raises(StartupError, match=f"no readable images left in split '{split}'"):
        readable_splits(cfg, DistContext(), progress=False)


def test_skipping_unreadable_images_keeps_the_others_and_counts_those_left_out(tiny_coco):
    from tests.builders import tiny_train_config

    _damage(tiny_coco / "images" / "val_201.png")
    _damage(tiny_coco / "images" / "train_103.png")
    with pytest.raises(StartupError, match=r"2 images cannot be read: .*train_103\.png.*val_201\.png"):
        readable_splits(tiny_train_config(tiny_coco), DistContext(), progress=False)
    cfg = tiny_train_config(tiny_coco, **{"data.skip_unreadable": True})
    _, readable, left_out = readable_splits(cfg, DistContext(), progress=False)
    assert left_out == {"train": 1, "val": 1}
    assert [r.path.name for r in readable["val"]] == ["val_202.png"]
    assert len(readable["train"]) == 5 and "train_103.png" not in {r.path.name for r in readable["train"]}


def test_hidden_files_beside_generated_shapes_are_not_taken_for_other_files(tmp_path):
    """A .DS_Store (macOS) or ._ file in the data folder or among its images does not stop
    shapes being generated there; a visible file does."""
    folder = tmp_path / "shapes"
    (folder / "images" / "train").mkdir(parents=True)
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "images" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "images" / "train" / "._train_000000.png").write_bytes(b"")
    (folder / "images" / "train" / "train_000000.png").write_bytes(b"")
    check_shapes_folder(DataConfig(dir=str(folder), generate_shapes=True))

    for stray in (folder / "notes.txt", folder / "images" / "train" / "holiday.png"):
        stray.write_text("mine")
        with pytest.raises(StartupError, match=f"such as {stray}"):
            check_shapes_folder(DataConfig(dir=str(folder), generate_shapes=True))
        stray.unlink()
    (folder / "notes.txt").write_text("mine")  # ignored when shapes are not generated
    check_shapes_folder(DataConfig(dir=str(folder), generate_shapes=False))
