"""Checkpoints: plain data, safe loading, identical captions after a round trip."""

import os
import pickle

import pytest
import torch

from captioner.inference import Captioner, DecodeOptions
from captioner.io.checkpoint import CheckpointError, load_checkpoint
from tests.tiny import tiny_captioner, tiny_image


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
    ckpt = torch.load(path, weights_only=True)
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
    path.write_bytes(torch_bytes := path.read_bytes())
    path.write_bytes(torch_bytes[: len(torch_bytes) // 2])  # a checkpoint cut short
    with pytest.raises(CheckpointError, match="is damaged: it cannot be read as a checkpoint"):
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
    from captioner.data.images import Preprocess
    from captioner.model.decoder import CaptionModel
    from tests.pretrained import forbid_downloads
    from tests.tiny import tiny_config, tiny_vocab

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    asked = forbid_downloads(monkeypatch)
    torch.manual_seed(0)
    model = CaptionModel(tiny_config(encoder="resnet18", image_size=(64, 64)))
    cap = Captioner(model, tiny_vocab(), Preprocess(size=(64, 64)))
    ckpt = cap.checkpoint().to_dict()
    ckpt["model_config"]["encoder_pretrained"] = True  # as a run with encoder_pretrained = true saves it
    torch.save(ckpt, tmp_path / "model.pt")
    again = Captioner.load(tmp_path / "model.pt")
    assert asked == []
    assert again.model.config.encoder_pretrained is True  # still says how it was trained
    image = tiny_image(0, (64, 64))
    assert again.caption(image).words == cap.caption(image).words


def _image_bytes(fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    tiny_image(0).save(buf, fmt)
    return buf.getvalue()


def _zip_bytes() -> bytes:
    import io
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("notes.txt", "not weights")
    return buf.getvalue()


NOT_CHECKPOINTS = [
    ("notes.jpg", _image_bytes("JPEG"), "a JPEG image"),
    ("photo.png", _image_bytes("PNG"), "a PNG image"),
    ("config.toml", b'name = "shapes-soft"\n[data]\ndir = "data/shapes"\n', "a text file"),
    ("model.pt", b"<!doctype html><html><body>404 Not Found</body></html>", "an HTML page"),
    ("metrics.json", b'{"BLEU-4": 0.25}\n', "a JSON file"),
    ("weights.zip", _zip_bytes(), "a zip archive"),
    ("empty.pt", b"", "an empty file"),
    ("model.safetensors", (14).to_bytes(8, "little") + b'{"__meta__":1}' + bytes(8), "a safetensors file"),
    ("noise.pt", bytes(range(7, 256)) * 4, "binary data of no kind captioner knows"),
]


@pytest.mark.parametrize("name, data, kind", NOT_CHECKPOINTS, ids=[n for n, _, _ in NOT_CHECKPOINTS])
def test_a_file_that_is_not_a_checkpoint_is_named_for_what_it_is(tmp_path, name, data, kind):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"{path} is not a captioner checkpoint ({kind}"), message
    assert "captioner train" in message and "\n" not in message  # what a checkpoint is, in one line


def test_caption_with_an_image_as_weights_says_so_in_one_line(tmp_path, capsys):
    from captioner.cli.main import main

    weights = tmp_path / "notes.jpg"
    weights.write_bytes(_image_bytes("JPEG"))
    tiny_image(1).save(tmp_path / "photo.png")
    assert main(["caption", str(tmp_path / "photo.png"), "--weights", str(weights)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"captioner caption: error: {weights} is not a captioner checkpoint (a JPEG image)")
    assert "\n" not in err


def test_a_pytorch_file_of_another_program_is_told_apart(tmp_path):
    path = tmp_path / "resnet.pth"
    torch.save({"fc.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(CheckpointError, match=r"is not a captioner checkpoint \(a PyTorch file"):
        load_checkpoint(path)


def chinese_captioner() -> Captioner:
    """tiny_captioner with a character vocabulary of the same size."""
    from captioner.data.vocab import SPECIALS, Vocabulary, tokenizer_named

    cap = tiny_captioner(seed=3)
    chars = "一个红色的大圆形蓝小三角"[: len(cap.vocab) - len(SPECIALS)]
    cap.vocab = Vocabulary(list(SPECIALS) + list(chars), tokenizer_named("chars"))
    return cap


def test_the_checkpoint_records_its_tokenizer_and_captions_join_as_the_language_writes(tmp_path):
    cap = chinese_captioner()
    path = tmp_path / "zh.pt"
    cap.save(path)
    raw = torch.load(path, weights_only=True)
    assert raw["tokenizer"] == "chars"  # plain data
    again = Captioner.load(path)
    assert again.vocab.tokenizer.name == "chars"
    result = again.caption(tiny_image(0), DecodeOptions(beam_size=2, max_len=6))
    assert result.words and all(len(w) == 1 for w in result.words)
    assert result.caption == "".join(result.words)  # no spaces between characters
    assert result.to_json()["caption"] == result.caption


def test_checkpoints_without_a_tokenizer_are_ptb(tmp_path):
    for name in ("demo-soft", "demo-hard"):
        cap = Captioner.load(name)
        assert cap.vocab.tokenizer.name == "ptb"
        result = cap.caption(tiny_image(1), DecodeOptions(beam_size=1, max_len=5))
        assert result.caption == " ".join(result.words)


def test_a_checkpoint_naming_an_unknown_tokenizer_is_refused_in_one_line(tmp_path):
    ckpt = tiny_captioner().checkpoint().to_dict()
    ckpt["tokenizer"] = "mecab"
    path = tmp_path / "odd.pt"
    torch.save(ckpt, path)
    with pytest.raises(CheckpointError, match="unknown tokenizer 'mecab'"):
        Captioner.load(path)
