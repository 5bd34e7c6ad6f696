"""train/startup.py at its edges, each case one that a one-character change of a rule there
would get wrong: a checkpoint with another vocabulary of the same size, a grounding metric
with a Karpathy split file, a split left with no readable image, hidden files beside
generated shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from captioner.data.vocab import Vocabulary
from captioner.distributed import DistContext
from captioner.model.decoder import CaptionModel
from captioner.train.config import DataConfig, load_config
from captioner.train.datainfo import load_dataset
from captioner.train.startup import StartupError, _init_from, check_new_run, check_shapes_folder, readable_splits
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
        readable_splits(cfg, load_dataset(cfg.data), DistContext(), progress=False)


def test_skipping_unreadable_images_keeps_the_others_and_counts_those_left_out(tiny_coco):
    from tests.builders import tiny_train_config

    _damage(tiny_coco / "images" / "val_201.png")
    _damage(tiny_coco / "images" / "train_103.png")
    plain = tiny_train_config(tiny_coco)
    with pytest.raises(StartupError, match=r"2 images cannot be read: .*train_103\.png.*val_201\.png"):
        readable_splits(plain, load_dataset(plain.data), DistContext(), progress=False)
    cfg = tiny_train_config(tiny_coco, **{"data.skip_unreadable": True})
    data = load_dataset(cfg.data)
    _, readable, left_out = readable_splits(cfg, data, DistContext(), progress=False)
    assert left_out == {"train": 1, "val": 1}
    assert [r.path.name for r in readable.splits["val"]] == ["val_202.png"]
    assert len(readable.splits["train"]) == 5 and "train_103.png" not in {r.path.name for r in readable.splits["train"]}
    assert (readable.name, readable.tokenizer) == (data.name, data.tokenizer)  # the same data set, fewer images


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


def test_a_relative_checkpoint_is_found_in_the_working_folder_first_then_beside_the_config(tmp_path, monkeypatch):
    from captioner.train.startup import resolve_checkpoint

    work, configs = tmp_path / "work", tmp_path / "configs"
    work.mkdir()
    configs.mkdir()
    (configs / "start.pt").write_bytes(b"beside the config")
    monkeypatch.chdir(work)
    config = configs / "run.toml"
    assert resolve_checkpoint("model.init_from", "start.pt", config) == str(configs / "start.pt")
    (work / "start.pt").write_bytes(b"in the working folder")
    assert resolve_checkpoint("model.init_from", "start.pt", config) == str(work / "start.pt")
    assert resolve_checkpoint("model.init_from", "start.pt", None) == str(work / "start.pt")
    assert resolve_checkpoint("model.init_from", str(configs / "start.pt"), None) == str(configs / "start.pt")
    assert resolve_checkpoint("model.init_from", "", config) == ""
    assert resolve_checkpoint("model.init_from", "demo-soft", config) == "demo-soft"

    with pytest.raises(StartupError) as caught:
        resolve_checkpoint("model.encoder_from", "nope.pt", None)
    message = str(caught.value)
    assert message.startswith("model.encoder_from: no such checkpoint nope.pt (looked in ")
    assert str(work) in message and str(configs) not in message and "demo-soft" in message
    with pytest.raises(StartupError) as caught:
        resolve_checkpoint("model.init_from", str(tmp_path / "gone.pt"), config)
    assert "looked in" not in str(caught.value)  # an absolute path is looked for where it says


def test_shapes_already_generated_are_not_generated_again(tmp_path, monkeypatch):
    import captioner.data.shapes
    from captioner.train.startup import prepare_data

    made, how = [], []
    monkeypatch.setattr(captioner.data.shapes, "generate_dataset",
                        lambda out, splits, **kw: made.append(out) or how.append((splits, kw)))
    folder = tmp_path / "shapes"
    cfg = load_config(None, [f"data.dir={folder}", "data.generate_shapes=true", "data.shapes_train=40",
                             "data.shapes_val=3", "data.shapes_seed=7", "data.shapes_image_size=48"])
    prepare_data(cfg)
    assert made == [folder]
    splits, kw = how[0]
    assert splits == {"train": 40, "val": 3}
    assert (kw["seed"], kw["image_size"], kw["progress"], kw["language"]) == (7, 48, True, "en")  # a bar: minutes
    folder.mkdir()
    (folder / "captions_train.json").write_text("{}")
    prepare_data(cfg)
    prepare_data(load_config(None, [f"data.dir={tmp_path / 'mine'}"]))  # not asked for
    assert made == [folder]


def test_data_dir_naming_a_file_is_refused_before_shapes_are_generated(tmp_path):
    (tmp_path / "data").write_text("a file")
    with pytest.raises(StartupError, match="is a file, not a folder"):
        check_shapes_folder(DataConfig(dir=str(tmp_path / "data"), generate_shapes=True))


def test_the_unreadable_images_message_names_ten_and_counts_the_rest():
    from captioner.train.startup import LISTED, _unreadable_message

    def broken(n):
        return {Path(f"img{i:02d}.jpg"): "truncated" for i in range(n)}

    one = _unreadable_message(broken(1))
    assert one.startswith("1 image cannot be read: img00.jpg (truncated). Replace or remove it ")
    assert one.endswith("or train without it: --set data.skip_unreadable=true")
    ten = _unreadable_message(broken(LISTED))
    assert LISTED == 10 and "img09.jpg (truncated). Replace or remove them" in ten and "more" not in ten
    eleven = _unreadable_message(broken(11))
    assert eleven.startswith("11 images cannot be read: ") and "img09.jpg (truncated); and 1 more." in eleven
    assert "img10.jpg" not in eleven
    assert "and 1,490 more" in _unreadable_message(broken(1500))


def test_a_resumed_run_s_tokenizer_is_its_checkpoint_s_and_an_unknown_one_is_one_line(tiny_coco):
    from dataclasses import replace

    from captioner.data.vocab import DEFAULT_TOKENIZER, tokenizer_named
    from captioner.io.checkpoint import Checkpoint
    from captioner.train.startup import data_tokenizer
    from tests.builders import tiny_train_config

    data = load_dataset(tiny_train_config(tiny_coco).data)
    assert data_tokenizer(data) is tokenizer_named(DEFAULT_TOKENIZER)
    older = tiny_captioner().checkpoint().to_dict()
    del older["tokenizer"]  # a file from before checkpoints named their tokenizer
    ckpt = Checkpoint.from_dict(older)
    assert data_tokenizer(data, ckpt) is tokenizer_named(DEFAULT_TOKENIZER)
    assert data_tokenizer(data, replace(ckpt, tokenizer="chars2")) is tokenizer_named("chars2")  # the checkpoint's
    with pytest.raises(StartupError, match=f"{tiny_coco} names an unknown tokenizer 'klingon'"):
        data_tokenizer(data, replace(ckpt, tokenizer="klingon"))


def test_take_back_keeps_only_a_complete_feature_cache(tmp_path):
    from captioner.train.startup import take_back

    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "sub" / "x").write_text("x")
    (run / "config.toml").write_text("")
    (run / "features-a.json").write_text('{"complete": true}')
    (run / "features-a.f16").write_bytes(b"\0" * 8)
    (run / "features-b.json").write_text('{"complete": false}')
    (run / "features-b.f16").write_bytes(b"\0" * 8)
    (run / "features-c.json").write_text("{not json")
    take_back(run)
    assert sorted(p.name for p in run.iterdir()) == ["features-a.f16", "features-a.json"]

    (run / "features-a.json").write_text("{}")  # not complete: everything goes, the folder too
    take_back(run)
    assert not run.exists()
    take_back(run)  # gone already: nothing to do


def _saved(tmp_path, name: str, ckpt: dict) -> str:
    path = tmp_path / name
    torch.save(ckpt, path)
    return str(path)


def test_init_from_refuses_a_file_that_is_no_checkpoint_or_does_not_fit(tmp_path):
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(StartupError, match="^model.init_from: "):
        _init_from(CaptionModel(tiny_config()), tiny_vocab(), str(tmp_path / "notes.pt"))
    tiny_captioner(seed=1).save(tmp_path / "source.pt")
    with pytest.raises(StartupError, match="does not fit this model"):
        _init_from(CaptionModel(tiny_config(hidden_dim=20)), tiny_vocab(), str(tmp_path / "source.pt"))


def test_encoder_from_copies_the_encoder_only_and_refuses_another_encoder(tmp_path):
    from captioner.io.checkpoint import load_checkpoint
    from captioner.train.startup import _encoder_from

    tiny_captioner(seed=1).save(tmp_path / "source.pt")
    ckpt = load_checkpoint(tmp_path / "source.pt")
    torch.manual_seed(5)
    model = CaptionModel(tiny_config(hidden_dim=20))  # another decoder, the same encoder
    decoder = {k: v.clone() for k, v in model.decoder.state_dict().items()}
    _encoder_from(model, str(tmp_path / "source.pt"))
    theirs = {k.removeprefix("encoder."): v for k, v in ckpt.state_dict.items() if k.startswith("encoder.")}
    assert theirs and all(torch.equal(model.encoder.state_dict()[k], v) for k, v in theirs.items())
    assert all(torch.equal(model.decoder.state_dict()[k], v) for k, v in decoder.items())

    other = dict(ckpt.to_dict(), model_config={**ckpt.model_config.to_dict(), "encoder": "resnet18"})
    with pytest.raises(StartupError, match="has the encoder 'resnet18', this model 'small'"):
        _encoder_from(model, _saved(tmp_path, "other.pt", other))
    first = next(k for k in ckpt.state_dict if k.startswith("encoder."))
    short = dict(ckpt.to_dict(), state_dict={k: v for k, v in ckpt.state_dict.items() if k != first})
    with pytest.raises(StartupError, match="encoder does not fit this model"):
        _encoder_from(model, _saved(tmp_path, "short.pt", short))
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    with pytest.raises(StartupError, match="^model.encoder_from: "):
        _encoder_from(model, str(tmp_path / "notes.pt"))


def test_a_pretrained_encoder_s_weights_already_there_or_downloaded_into_an_existing_folder(tmp_path, monkeypatch):
    from captioner.model.encoders import pretrained_file
    from captioner.train.startup import _require_pretrained

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path, url = pretrained_file("resnet18")
    path.parent.mkdir(parents=True)  # the hub's folder holds other models' weights already
    fetched = []

    def download(from_url, dst, *args, **kwargs):
        fetched.append(from_url)
        Path(dst).write_bytes(b"weights")

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    _require_pretrained("resnet18")
    assert fetched == [url] and path.read_bytes() == b"weights"
    _require_pretrained("resnet18")  # there now: not fetched again
    assert fetched == [url]
    with pytest.raises(StartupError, match="the 'small' encoder has no pretrained weights"):
        _require_pretrained("small")


def test_a_new_run_starts_its_encoder_from_encoder_from(tiny_coco, tmp_path):
    """model.encoder_from with a frozen encoder: the run's encoder is the checkpoint's, whatever
    its decoder; a resumed run keeps its own."""
    from captioner.cli.main import main as captioner_main
    from captioner.io.checkpoint import load_checkpoint
    from captioner.train.config import to_toml
    from tests.builders import tiny_train_config

    tiny_captioner(seed=1, image_size=(32, 32)).save(tmp_path / "source.pt")
    source = load_checkpoint(tmp_path / "source.pt").state_dict
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 1, "val.every_epochs": 0, "model.freeze_encoder": True,
                                          "model.encoder_from": str(tmp_path / "source.pt")})
    (tmp_path / "cfg.toml").write_text(to_toml(cfg))
    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(tmp_path / "cfg.toml"), "--run-dir", str(run), "--quiet"]) == 0
    trained = load_checkpoint(run / "last.pt").state_dict
    encoder = [k for k in source if k.startswith("encoder.")]
    assert encoder and all(torch.equal(trained[k], source[k]) for k in encoder)


# --- mutation testing's survivors (docs/testing.md) -----------------------------------------
def test_pretrained_weights_are_downloaded_into_a_torch_home_that_holds_nothing_yet(tmp_path, monkeypatch):
    """A first run on a new machine: neither TORCH_HOME nor its hub/checkpoints folder exists."""
    from captioner.model.encoders import pretrained_file
    from captioner.train.startup import _require_pretrained

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "new" / "torch"))
    path, url = pretrained_file("resnet18")
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda u, dst, *a, **k: Path(dst).write_bytes(b"w"))
    _require_pretrained("resnet18")
    assert path.read_bytes() == b"w" and path.is_relative_to(tmp_path / "new" / "torch")


def test_a_run_folder_in_use_says_whether_the_run_can_be_resumed(tmp_path):
    from captioner.train.startup import check_run_folder

    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(StartupError, match=r"\(metrics.jsonl\): it cannot be resumed \(no last.pt\)"):
        check_run_folder(tmp_path, overwrite=False)
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(StartupError, match=f"continue it with --resume {tmp_path}, "):
        check_run_folder(tmp_path, overwrite=False)
    check_run_folder(tmp_path, overwrite=True)
