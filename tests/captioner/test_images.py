"""Image loading: every awkward file becomes RGB or a clear error."""

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.data.images import ImageLoadError, Preprocess, load_image
from captioner.io.checkpoint import Checkpoint
from tests.badfiles import exif_rotated_jpeg, make_bad_folder
from tests.tiny import tiny_captioner

ERRORS = {
    "zero.jpg": "empty file",
    "truncated.jpg": "truncated",
    "text.jpg": "not an image",
    "page.jpg": "not an image",
    "bomb.png": "decompression bomb",
    "dangling.jpg": "cannot read",
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return root, make_bad_folder(root)


def test_each_case_loads_as_rgb_or_fails_clearly(bad):
    root, expect = bad
    for rel, ok in expect.items():
        if ok:
            im = load_image(root / rel)
            assert im.mode == "RGB", rel
            assert im.width >= 1 and im.height >= 1
        else:
            with pytest.raises(ImageLoadError, match=ERRORS[rel]):
                load_image(root / rel)


def test_exif_orientation_is_applied():
    im = load_image(exif_rotated_jpeg())
    assert im.size == (40, 20)  # stored 20x40, shown rotated
    right = np.asarray(im)[10, 35]  # the red square ends up on the right after a 90 degree turn
    assert right[0] > 200 and right[2] < 60


def test_sixteen_bit_keeps_its_range(bad):
    root, _ = bad
    arr = np.asarray(load_image(root / "sixteen.png"))
    assert arr.max() > 200 and arr.min() < 10  # scaled to 8 bits, not clipped to white


def test_transparency_goes_over_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    import io
    buf = io.BytesIO()
    rgba.save(buf, "PNG")
    assert np.asarray(load_image(buf.getvalue()))[0, 0].tolist() == [255, 255, 255]


def test_animated_gif_uses_the_first_frame(bad):
    root, _ = bad
    first = np.asarray(load_image(root / "animated.gif"))
    with Image.open(root / "animated.gif") as im:
        assert im.n_frames == 3
        ref = np.asarray(im.convert("RGB"))
    assert np.array_equal(first, ref)


def test_pixel_limit_is_configurable(bad):
    root, _ = bad
    with pytest.raises(ImageLoadError, match="over the limit"):
        load_image(root / "large.jpg", max_pixels=1_000_000)


def test_preprocess_resizes_the_whole_image_without_crop():
    im = Image.new("RGB", (100, 50), "black")
    im.paste(Image.new("RGB", (10, 50), "white"), (90, 0))  # a white stripe at the right edge
    x = Preprocess(size=(16, 16), mean=(0, 0, 0), std=(1, 1, 1))(im)
    assert x.shape == (3, 16, 16)
    assert x[:, :, -1].mean() > 0.8  # the right edge survived: nothing was cropped
    assert x[:, :, :8].max() < 0.05
    assert isinstance(x, torch.Tensor)


def test_jpeg_decoded_at_reduced_scale_keeps_the_target_size(tmp_path):
    im = Image.new("RGB", (1600, 1200), "red")
    path = tmp_path / "big.jpg"
    im.save(path, quality=90)
    small = load_image(path, at_least=224)
    assert small.size == (400, 300)  # 1/4 scale: the largest reduction that keeps both sides >= 224
    assert load_image(path).size == (1600, 1200)
    png = tmp_path / "big.png"
    im.save(png)
    assert load_image(png, at_least=224).size == (1600, 1200)  # only JPEG has reduced decoding


def _photo(photos, name="COCO_val2014_000000000074.jpg"):
    return photos / "coco" / "val2014" / name


def test_crop_preprocess_is_torchvisions_imagenet_recipe(photos):
    # Resize the shorter side to 256, centre-crop 224, normalise: VGG19_Weights.transforms().
    import torchvision.models as tvm

    image = load_image(_photo(photos, "COCO_val2014_000000000133.jpg"))  # 320x240, grayscale
    ours = Preprocess(size=(224, 224), resize=256)(image)
    theirs = tvm.VGG19_Weights.DEFAULT.transforms()(image)
    assert ours.shape == theirs.shape == (3, 224, 224)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_crop_box_is_the_region_the_model_sees():
    pre = Preprocess(size=(224, 224), resize=256)
    # 400x200: shorter side 200 -> 256 (scale 1.28), long side 512; crop 224 from the middle.
    assert pre.crop_box((400, 200)) == pytest.approx((112.5, 12.5, 287.5, 187.5))
    assert Preprocess(size=(224, 224)).crop_box((400, 200)) == (0, 0, 400, 200)  # squash: all of it
    im = Image.new("RGB", (400, 200))
    assert pre.seen(im).size == (175, 175)
    assert Preprocess(size=(224, 224)).seen(im) is im


@pytest.mark.parametrize("pre", [Preprocess(size=(64, 64)), Preprocess(size=(64, 64), resize=73)],
                         ids=["squash", "crop"])
def test_training_evaluate_caption_and_app_see_the_same_pixels(photos, pre):
    # A 320 px JPEG that a 64 px input may decode at reduced scale: every path must decode
    # it the same way, or one checkpoint gives two captions for one image.
    from captioner.cli.batch import _ImageFiles
    from captioner.data.coco import ImageDataset, ImageRecord
    from captioner.data.images import DEFAULT_MAX_PIXELS

    path = _photo(photos)
    from_dataset = ImageDataset([ImageRecord(74, path, ["x"])], pre)[0][0]  # training and evaluate
    from_batch = pre.normalize(_ImageFiles([str(path)], pre, DEFAULT_MAX_PIXELS)[0].pixels)  # captioner caption
    assert torch.equal(from_dataset, from_batch)
    from_upload = pre(pre.load(path.read_bytes()))  # the app: uploaded bytes
    assert torch.equal(from_dataset, from_upload)


def test_preprocess_round_trips_and_reads_older_checkpoints():
    pre = Preprocess(size=(224, 224), resize=256)
    assert Preprocess.from_dict(pre.to_dict()) == pre
    # Older files (saved before crop existed) are upgraded where every upgrade is: Checkpoint.from_dict.
    old = tiny_captioner().checkpoint().to_dict()
    old["preprocess"] = {"size": [128, 128], "mean": [0.5] * 3, "std": [0.25] * 3}
    assert Checkpoint.from_dict(old).preprocess == Preprocess(size=(128, 128), mean=(0.5,) * 3, std=(0.25,) * 3,
                                                              resize=0)


@pytest.mark.parametrize("pre", [Preprocess(size=(40, 56)), Preprocess(size=(40, 56), resize=61)],
                         ids=["squash", "crop"])
def test_pixels_then_normalize_is_the_plain_float_preprocessing(photos, pre):
    """The batch loader hands over 8-bit pixels and normalises them where the model runs: the
    result must be bit for bit the float recipe (x / 255 - mean) / std on the resized image."""
    image = pre.load(_photo(photos))
    h, w = pre.size
    if pre.resize:
        resized = pre._center_crop(image.resize(pre._resized(image.size), Image.Resampling.BILINEAR))
    else:
        resized = image.resize((w, h), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
    plain = (x - torch.tensor(pre.mean).view(3, 1, 1)) / torch.tensor(pre.std).view(3, 1, 1)
    pixels = pre.pixels(image)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, h, w)
    assert torch.equal(pre.normalize(pixels), plain)
    assert torch.equal(pre(image), plain)
    batch = torch.stack([pixels, pixels.flip(-1)])  # a batch normalises row by row alike
    assert torch.equal(pre.normalize(batch)[1], pre.normalize(pixels.flip(-1)))


# ----------------------------------------------------------------- AVIF, HEIC

from PIL import features  # noqa: E402

from captioner.data import images  # noqa: E402
from captioner.data.images import is_image_path  # noqa: E402

HEIC_HEAD = b"\x00\x00\x00\x1cftypheic\x00\x00\x00\x00mif1heicmiaf" + b"\x00" * 64


def test_avif_heic_and_heif_are_image_files():
    assert all(is_image_path(f"photo{ext}") for ext in (".avif", ".AVIF", ".heic", ".HEIC", ".heif"))
    assert not is_image_path("notes.txt")


@pytest.mark.skipif(not features.check("avif"), reason="this Pillow has no AVIF codec")
def test_an_avif_file_is_read(tmp_path):
    Image.new("RGB", (24, 16), (10, 120, 200)).save(tmp_path / "kite.avif")
    assert load_image(tmp_path / "kite.avif").size == (24, 16)


def without_heif_reader(monkeypatch):
    """Pillow as it is before pillow-heif registers (the test session may have registered it)."""
    monkeypatch.setattr(Image, "ID", [i for i in Image.ID if i != "HEIF"])
    monkeypatch.setattr(Image, "OPEN", {k: v for k, v in Image.OPEN.items() if k != "HEIF"})


def test_heic_without_pillow_heif_names_the_extra_to_install(tmp_path, monkeypatch):
    without_heif_reader(monkeypatch)
    monkeypatch.setattr(images, "_heif_opener", lambda: False)
    (tmp_path / "IMG_0001.HEIC").write_bytes(HEIC_HEAD)
    for source in (tmp_path / "IMG_0001.HEIC", HEIC_HEAD):
        with pytest.raises(ImageLoadError, match=r"HEIC.*pillow-heif.*captioner\[heic\]"):
            load_image(source)
    # Any other unknown file keeps the plain reason.
    (tmp_path / "x.jpg").write_bytes(b"\x00\x00\x00\x1cftypisom" + b"\x00" * 64)
    with pytest.raises(ImageLoadError, match="^not an image file Pillow can read$"):
        load_image(tmp_path / "x.jpg")


def test_heic_is_read_once_pillow_heif_is_installed(tmp_path, monkeypatch):
    pillow_heif = pytest.importorskip("pillow_heif")
    heic = pillow_heif.from_pillow(Image.new("RGB", (24, 16), (200, 30, 30)))
    heic.save(tmp_path / "IMG_0002.heic")
    without_heif_reader(monkeypatch)  # as in a fresh process: pillow-heif installed, not yet registered
    images._heif_opener.cache_clear()
    im = load_image(tmp_path / "IMG_0002.heic")
    assert im.size == (24, 16) and abs(im.getpixel((12, 8))[0] - 200) < 12
    assert load_image((tmp_path / "IMG_0002.heic").read_bytes()).size == (24, 16)
