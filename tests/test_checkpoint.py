"""Checkpoints: plain data, safe loading, identical captions after a round trip."""

import os
import pickle

import pytest
import torch

from captioner.checkpoint import CheckpointError, load_checkpoint
from captioner.inference import Captioner, DecodeOptions
from tiny import tiny_captioner, tiny_image


def test_round_trip_gives_identical_captions(tmp_path):
    cap = tiny_captioner(seed=5)
    path = tmp_path / "model.pt"
    cap.save(path, meta={"note": "test"})
    again = Captioner.load(path)
    images = [tiny_image(i) for i in range(4)]
    opts = DecodeOptions(beam_size=3, max_len=8)
    for a, b in zip(cap.caption_images(images, opts), again.caption_images(images, opts)):
        assert a.words == b.words
        assert a.score == b.score
        assert torch.equal(a.alphas, b.alphas)
    assert again.meta["note"] == "test"
    assert again.model.config == cap.model.config
    assert again.preprocess == cap.preprocess


def test_checkpoint_is_plain_data(tmp_path):
    path = tmp_path / "model.pt"
    tiny_captioner().save(path)
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt["vocab"], list) and all(isinstance(w, str) for w in ckpt["vocab"])
    assert isinstance(ckpt["model_config"], dict)
    assert ckpt["preprocess"]["size"] == [32, 32]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = str(tmp_path / "pwned")
    path = tmp_path / "evil.pt"
    payload = {"format": "captioner-checkpoint", "payload": _Exploit(marker)}
    with open(path, "wb") as f:
        pickle.dump(payload, f, protocol=2)
    with pytest.raises(CheckpointError, match="refusing to load"):
        Captioner.load(path)
    assert not os.path.exists(marker)
    with open(path, "wb") as f:  # newer pickle protocols are refused as well
        pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointError):
        Captioner.load(path)
    assert not os.path.exists(marker)
    # The same object through torch.save is refused too.
    torch.save({"format": "captioner-checkpoint", "payload": _Exploit(marker)}, path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        load_checkpoint(path)
    assert not os.path.exists(marker)


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a captioner checkpoint"):
        load_checkpoint(path)
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")


def test_interrupted_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    cap = tiny_captioner()
    cap.save(path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        cap.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left


def test_loading_never_asks_for_pretrained_weights(tmp_path, monkeypatch):
    # A checkpoint trained from ImageNet weights holds every weight it needs: loading it
    # on a machine without them (empty TORCH_HOME, no network) must not try to fetch them.
    from pretrained import forbid_downloads

    from captioner.images import Preprocess
    from captioner.model import CaptionModel
    from tiny import tiny_config, tiny_vocab

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    asked = forbid_downloads(monkeypatch)
    torch.manual_seed(0)
    model = CaptionModel(tiny_config(encoder="resnet18", image_size=(64, 64)))
    cap = Captioner(model, tiny_vocab(), Preprocess(size=(64, 64)))
    ckpt = cap.checkpoint()
    ckpt["model_config"]["encoder_pretrained"] = True  # as a run with encoder_pretrained = true saves it
    torch.save(ckpt, tmp_path / "model.pt")
    again = Captioner.load(tmp_path / "model.pt")
    assert asked == []
    assert again.model.config.encoder_pretrained is True  # still says how it was trained
    image = tiny_image(0, (64, 64))
    assert again.caption(image).words == cap.caption(image).words
