"""Image loading: every awkward file becomes RGB or a clear error."""

import numpy as np
import pytest
import torch
from PIL import Image

from badfiles import exif_rotated_jpeg, make_bad_folder
from captioner.images import ImageLoadError, Preprocess, load_image

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
