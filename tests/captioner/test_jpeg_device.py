"""JPEG decoding on the model's device (``captioner caption --decode-on-device``) is held to the
CPU path: the same files load or fail, with the same reasons; the pixels within a level or two
of 255; the demo's captions of JPEG shapes pictures unchanged. On a CPU the device's decoder is
torchvision's libjpeg-turbo one, the same call that runs nvJPEG on a GPU."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from captioner.cli.batch import image_loader
from captioner.cli.main import main
from captioner.data.images import Preprocess
from captioner.data.jpeg_device import decode_resize, plain_jpeg
from tests.badfiles import exif_rotated_jpeg, make_bad_folder
from tests.builders import read_jsonl

CMYK_OR_ROTATED = ("cmyk.jpg", "rotated.jpg")


def _jpeg(path, im: Image.Image, **kw) -> str:
    buf = io.BytesIO()
    im.save(buf, "JPEG", **kw)
    path.write_bytes(buf.getvalue())
    return str(path)


def test_only_upright_rgb_or_grey_jpegs_within_the_limit_are_left_to_the_device(tmp_path):
    rgb = Image.radial_gradient("L").convert("RGB").resize((40, 30))
    assert plain_jpeg(_jpeg(tmp_path / "rgb.jpg", rgb), 10_000) is not None
    assert plain_jpeg(_jpeg(tmp_path / "grey.jpg", rgb.convert("L")), 10_000) is not None
    data = plain_jpeg(tmp_path / "rgb.jpg", 10_000)
    assert data.dtype == torch.uint8 and bytes(data.numpy()) == (tmp_path / "rgb.jpg").read_bytes()
    assert plain_jpeg(_jpeg(tmp_path / "cmyk.jpg", rgb.convert("CMYK")), 10_000) is None
    (tmp_path / "rotated.jpg").write_bytes(exif_rotated_jpeg())
    assert plain_jpeg(tmp_path / "rotated.jpg", 10_000) is None  # the CPU path turns it upright
    assert plain_jpeg(tmp_path / "rgb.jpg", 1_000) is None  # over the limit: the CPU path says so
    rgb.save(tmp_path / "png.jpg", "PNG")
    assert plain_jpeg(tmp_path / "png.jpg", 10_000) is None
    (tmp_path / "text.jpg").write_text("not an image")
    assert plain_jpeg(tmp_path / "text.jpg", 10_000) is None


@pytest.mark.parametrize("pre,mean_limit,image_limit,max_limit", [
    # The demo's size: the CPU path decodes a 320 px photo at half scale (Preprocess.load), the
    # device at full scale, which shows on fine detail.
    (Preprocess(size=(128, 128)), 1.5, 4.0, None),
    (Preprocess(size=(224, 224), resize=256), 0.25, 0.25, 1),  # the paper's: full scale on both paths
], ids=["squash-128", "crop-224"])
def test_device_pixels_are_within_levels_of_the_cpu_path(photos, pre, mean_limit, image_limit, max_limit):
    paths = sorted(photos.rglob("*.jpg"))
    raw = [plain_jpeg(p, 10**8) for p in paths]
    assert all(r is not None for r in raw) and len(raw) >= 10
    device = decode_resize(raw, pre, "cpu")
    means = []
    for p, pixels in zip(paths, device):
        cpu = pre.pixels(pre.load(p))
        assert pixels.dtype == torch.uint8 and pixels.shape == cpu.shape == (3, *pre.size)
        diff = (pixels.int() - cpu.int()).abs().float()
        assert diff.mean() <= image_limit, (p.name, diff.mean())
        assert max_limit is None or diff.max() <= max_limit, (p.name, diff.max())
        means.append(float(diff.mean()))
    assert sum(means) / len(means) <= mean_limit, means


def test_a_batch_with_a_file_the_decoder_refuses_loses_only_that_file(tmp_path):
    pre = Preprocess(size=(32, 32))
    good = [_jpeg(tmp_path / f"g{i}.jpg", Image.effect_noise((160, 120), 40 + 20 * i).convert("RGB"))
            for i in range(3)]
    whole = (tmp_path / "g0.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(whole[: len(whole) // 2])  # a header, half its data
    paths = [good[0], str(tmp_path / "cut.jpg"), good[1], good[2]]
    (batch,) = image_loader(paths, pre, batch_size=4, workers=0, raw_jpegs=True)
    assert set(batch.raw) == {0, 1, 2, 3} and batch.pixels is None  # the workers only read the bytes
    done = batch.decoded_on(torch.device("cpu"), paths, pre)
    assert done.loaded == [0, 2, 3] and set(done.errors) == {1} and "truncated" in done.errors[1]
    for row, i in enumerate(done.loaded):
        assert torch.equal(done.pixels[row], decode_resize([plain_jpeg(paths[i], 10**6)], pre, "cpu")[0])


def _decoded_on_the_device(monkeypatch) -> list[int]:
    """How many JPEGs each call of the device's decoder took: the flag must reach it."""
    from captioner.cli import batch

    calls: list[int] = []
    real = batch.decode_resize
    monkeypatch.setattr(batch, "decode_resize", lambda raw, *a, **kw: calls.append(len(raw)) or real(raw, *a, **kw))
    return calls


@pytest.mark.slow
def test_the_bad_folder_loads_and_fails_as_on_the_cpu_path(tmp_path, weights, monkeypatch):
    root = tmp_path / "imgs"
    expect = make_bad_folder(root)
    records = {}
    decoded = _decoded_on_the_device(monkeypatch)
    for flag in ([], ["--decode-on-device"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        assert main(["caption", str(root), "--weights", weights, "--out", str(out), "--max-len", "6",
                     "--batch-size", "4", "--workers", "0", "--device", "cpu", "--quiet", *flag]) == 1
        records[len(flag)] = {r["image"][len(str(root)) + 1:]: r for r in read_jsonl(out)}
        assert (sum(decoded) > 0) == bool(flag), decoded  # the device decoded JPEGs with the flag only
    cpu, device = records[0], records[1]
    assert set(device) == set(cpu) == set(expect)
    for rel, ok in expect.items():
        assert ("error" not in device[rel]) == ok, (rel, device[rel])
        assert device[rel].get("error") == cpu[rel].get("error")
    for rel in CMYK_OR_ROTATED:  # the CPU path took them: the same pixels, the same caption
        assert device[rel]["caption"] == cpu[rel]["caption"] and device[rel]["score"] == cpu[rel]["score"]


@pytest.mark.slow
def test_the_demo_captions_jpeg_shapes_pictures_as_on_the_cpu_path(tmp_path, monkeypatch):
    folder = tmp_path / "jpg"
    folder.mkdir()
    assert main(["shapes", "--out", str(tmp_path / "shapes"), "--train", "0", "--val", "0", "--test", "24",
                 "--seed", "515"]) == 0
    for p in sorted((tmp_path / "shapes" / "images" / "test").glob("*.png")):
        Image.open(p).convert("RGB").save(folder / f"{p.stem}.jpg", quality=90)
    captions = []
    decoded = _decoded_on_the_device(monkeypatch)
    for flag in ([], ["--decode-on-device"]):
        out = tmp_path / f"out{len(flag)}.jsonl"
        assert main(["caption", str(folder), "--out", str(out), "--device", "cpu", "--quiet", "--workers", "0",
                     "--batch-size", "8", *flag]) == 0
        captions.append({r["image"]: (r["caption"], round(r["score"], 4)) for r in read_jsonl(out)})
    assert sum(decoded) == 24  # every picture, with the flag, through the device's decoder
    assert len(captions[0]) == 24 and captions[0] == captions[1]


def test_without_batch_size_a_gpu_takes_larger_batches_than_a_cpu(tmp_path, weights, monkeypatch):
    import torch as t

    from captioner.cli import batch
    from captioner.cli.main import default_batch_size

    assert default_batch_size(t.device("cuda", 1)) == default_batch_size("cuda") == 64
    assert default_batch_size(t.device("cpu")) == 16
    seen = []
    real = batch.caption_paths
    monkeypatch.setattr(batch, "caption_paths", lambda *a, **kw: seen.append(kw["batch_size"]) or real(*a, **kw))
    Image.new("RGB", (20, 20), "red").save(tmp_path / "a.png")
    for extra in ([], ["--batch-size", "3"]):
        assert main(["caption", str(tmp_path / "a.png"), "--weights", weights, "--device", "cpu", "--quiet",
                     "--out", str(tmp_path / f"o{len(extra)}.jsonl"), *extra]) == 0
    assert seen == [16, 3]


def test_a_jpeg_exactly_at_the_pixel_limit_is_left_to_the_device(tmp_path):
    """The limit is the most pixels allowed, as on the CPU path (``Preprocess.load``): an image
    of exactly that many is decoded, on the device as there; one pixel fewer allowed and the
    CPU path takes it (and refuses it)."""
    path = _jpeg(tmp_path / "rgb.jpg", Image.new("RGB", (40, 30), "red"))
    assert plain_jpeg(path, 40 * 30) is not None
    assert plain_jpeg(path, 40 * 30 - 1) is None
    pre = Preprocess(size=(16, 16))
    pre.load(path, 40 * 30)  # the CPU path draws the line at the same place
    with pytest.raises(Exception, match="pixels"):
        pre.load(path, 40 * 30 - 1)


@pytest.mark.parametrize("pre", [Preprocess(size=(16, 16)), Preprocess(size=(16, 16), resize=20)],
                         ids=["squash", "crop"])
def test_resampling_sharp_edges_keeps_black_black_white_white_and_the_cpu_geometry(pre):
    """Stripes of 0 and 255 overshoot under bicubic resampling: the pixels are clamped to
    0..255, never wrapped, and land where the CPU path puts them (a wide image: the crop is
    its centre)."""
    from captioner.data.jpeg_device import resample

    stripes = torch.zeros(3, 48, 72, dtype=torch.uint8)
    stripes[:, :, 24:48] = 255
    stripes[:, 12:20, :] = 255
    device = resample(stripes, pre)
    cpu = pre.pixels(Image.fromarray(stripes.permute(1, 2, 0).numpy(), "RGB"))
    assert device.shape == cpu.shape == (3, 16, 16) and device.dtype == torch.uint8
    diff = (device.int() - cpu.int()).abs()
    assert diff.float().mean() <= 1 and diff.max() <= 10  # torch's bicubic is not Pillow's at an edge
    assert int(device.min()) == 0 and int(device.max()) == 255
    assert torch.equal(resample(torch.zeros(3, 30, 40, dtype=torch.uint8), pre), torch.zeros(3, 16, 16,
                                                                                              dtype=torch.uint8))


def test_nothing_to_decode_is_nothing_decoded():
    assert decode_resize([], Preprocess(size=(16, 16)), "cpu") == []
