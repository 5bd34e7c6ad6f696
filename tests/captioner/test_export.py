"""`captioner export`: a model as a folder (safetensors, JSON, model card) that every command
taking a checkpoint takes, with the same captions, scores and familiarity; bad folders refused
in one line."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from captioner.cli.main import main
from captioner.inference import Captioner, DecodeOptions
from captioner.io import bundled, tensorfile
from captioner.io import folder as fmt
from captioner.io.export import export
from captioner.model.familiarity import TrainingFeatures
from tests.badtensors import CORRUPTIONS
from tests.builders import one_line
from tests.tiny import tiny_captioner, tiny_image

DEMOS = [m.name for m in bundled.installed()]


@pytest.fixture(scope="module")
def shapes_images(tmp_path_factory) -> list[str]:
    from captioner.data.shapes import generate_dataset

    root = tmp_path_factory.mktemp("shapes")
    generate_dataset(root, {"test": 6}, seed=4242, progress=False)
    return sorted(str(p) for p in (root / "images").rglob("*.png"))


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("name", DEMOS)
def test_an_exported_demo_captions_as_its_checkpoint(name, shapes_images, tmp_path):
    cap = Captioner.load(name)
    export(cap, tmp_path / name)
    again = Captioner.load(tmp_path / name)
    opts = DecodeOptions(beam_size=3, max_len=cap.max_len)
    ours, theirs = cap.caption_images(shapes_images, opts), again.caption_images(shapes_images, opts)
    assert [r.caption for r in theirs] == [r.caption for r in ours]
    assert [r.score for r in theirs] == [r.score for r in ours]  # the same weights, bit for bit
    assert [r.familiarity for r in theirs] == [r.familiarity for r in ours]
    assert ours[0].familiarity is not None
    assert again.max_len == cap.max_len and again.training_data == cap.training_data
    assert again.notice() == cap.notice() and name in again.notice()  # still says it is a demo


def test_the_folder_holds_no_pickle_and_says_what_it_is(tmp_path):
    export(Captioner.load("demo-zh"), tmp_path / "zh", license="cc-by-4.0")
    names = sorted(p.name for p in (tmp_path / "zh").iterdir())
    assert names == sorted([fmt.CARD, fmt.CONFIG, fmt.FAMILIARITY, fmt.WEIGHTS, fmt.VOCAB])
    for p in (tmp_path / "zh").iterdir():
        assert p.read_bytes()[:1] != b"\x80"  # no pickle (nor torch's zip of one)
        assert not p.read_bytes().startswith(b"PK")
    config = json.loads((tmp_path / "zh" / fmt.CONFIG).read_text())
    assert config["tokenizer"] == "chars" and config["language"] == "zh" and config["max_caption_len"] == 40
    assert config["model"]["attention"] == "soft" and config["grid"] == [16, 16]
    import captioner

    assert config["preprocess"]["size"] == [128, 128] and config["captioner_version"] == captioner.__version__
    assert json.loads((tmp_path / "zh" / fmt.VOCAB).read_text())[:3] == ["<pad>", "<start>", "<end>"]
    meta = front_matter((tmp_path / "zh" / fmt.CARD).read_text())
    assert meta["pipeline_tag"] == "image-to-text" and meta["library_name"] == "captioner"
    assert meta["license"] == "cc-by-4.0" and meta["language"] == ["zh"]
    assert "image-captioning" in meta["tags"] and meta["datasets"] == ["synthetic-shapes"]


def test_the_cards_model_index_carries_metrics_never_the_validation_expression(tmp_path):
    cap = Captioner.load("demo-soft")
    [(key, value)] = [(k, v) for k, v in cap.meta.items() if k.startswith("val_")]
    assert main(["export", "demo-soft", "--out", str(tmp_path / "soft"), "--license", "mit"]) == 0
    card = (tmp_path / "soft" / fmt.CARD).read_text()
    meta = front_matter(card)
    # The demo recorded only its validation expression, min:object_accuracy,pointing_accuracy: a
    # figure for the card's table, no metric the Hub could name.
    assert key == "val_min:object_accuracy,pointing_accuracy"
    assert meta["model-index"][0]["results"] == [] and "metrics" not in meta and meta["license"] == "mit"
    assert f"| the lower of object accuracy and pointing accuracy | val | {value:.4g} |" in card
    assert "demo-soft is a demo model" in card  # the notice, in the card's text


def test_safetensors_files_are_those_of_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    arrays = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1, -2], dtype=np.int64),
              "c": np.ones((0, 4), dtype=np.float16), "d": np.array(3.5, dtype=np.float32)}  # d: a scalar
    tensorfile.write(tmp_path / "ours.safetensors", arrays, {"format": "pt"})
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert sorted(theirs) == sorted(arrays) and all(np.array_equal(theirs[k], arrays[k]) for k in arrays)
    st.save_file(arrays, str(tmp_path / "theirs.safetensors"), metadata={"x": "y"})
    back, meta = tensorfile.read(tmp_path / "theirs.safetensors")
    assert meta == {"x": "y"} and all(np.array_equal(back[k], arrays[k]) and back[k].dtype == arrays[k].dtype
                                      for k in arrays)


@pytest.fixture
def exported(tmp_path) -> Path:
    cap = tiny_captioner(seed=3)
    export(cap, tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture
def image(tmp_path) -> str:
    path = tmp_path / "img.png"
    tiny_image(1, (40, 30)).save(path)
    return str(path)


def one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("missing", [fmt.CONFIG, fmt.WEIGHTS, fmt.VOCAB])
def test_a_folder_with_a_file_missing_is_refused_in_one_line(exported, image, missing, capsys):
    (exported / missing).unlink()
    assert main(["caption", image, "--weights", str(exported)]) == 2
    line = one_error_line(capsys)
    assert missing in line if missing != fmt.CONFIG else "not an exported model" in line


def test_a_config_from_a_newer_captioner_is_refused(exported, image, capsys):
    config = json.loads((exported / fmt.CONFIG).read_text())
    (exported / fmt.CONFIG).write_text(json.dumps({**config, "version": fmt.VERSION + 1, "captioner_version": "9.0"}))
    assert main(["caption", image, "--weights", str(exported)]) == 2
    line = one_error_line(capsys)
    assert f"format version {fmt.VERSION + 1}" in line and "9.0" in line and "upgrade captioner" in line


def test_weights_of_other_shapes_than_the_config_are_refused(exported, image, capsys):
    arrays, meta = tensorfile.read(exported / fmt.WEIGHTS)
    arrays = dict(arrays)
    arrays["decoder.L_o.weight"] = np.zeros((arrays["decoder.L_o.weight"].shape[0] + 1, 12), dtype=np.float32)
    tensorfile.write(exported / fmt.WEIGHTS, arrays, meta)
    assert main(["caption", image, "--weights", str(exported)]) == 2
    line = one_error_line(capsys)
    assert "model.safetensors does not fit its config.json" in line and "decoder.L_o.weight" in line


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A tiny model with a familiarity record, exported once for the module: copy it to change it."""
    cap = tiny_captioner(seed=3)
    cap.familiarity = TrainingFeatures.fit(torch.randn(8, cap.model.encoder.dim))
    folder = tmp_path_factory.mktemp("recorded") / "model"
    export(cap, folder)
    return folder


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS)
@pytest.mark.parametrize("name", [fmt.WEIGHTS, fmt.FAMILIARITY])
def test_a_corrupt_safetensors_file_is_refused_in_one_line(recorded, name, corrupt, image, tmp_path, capsys):
    folder = Path(shutil.copytree(recorded, tmp_path / "model"))
    path = folder / name
    path.write_bytes(corrupt(path.read_bytes()))
    assert main(["caption", image, "--weights", str(folder)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("captioner caption: error: ") and str(path) in line


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS)
def test_the_reader_refuses_a_corrupt_file_with_its_own_error(corrupt, tmp_path):
    """Every corruption is a TensorFileError naming the file, whoever reads it (the torch
    loader, the torch-free runtime)."""
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    tensorfile.write(good, {"a": np.arange(12, dtype=np.float32), "b": np.ones((2, 3), dtype=np.int64)},
                     {"format": "pt"})
    bad.write_bytes(corrupt(good.read_bytes()))
    with pytest.raises(tensorfile.TensorFileError, match=re.escape(str(bad))):
        tensorfile.read(bad)


def test_the_reader_refuses_what_it_cannot_open_with_its_own_error(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(tensorfile.TensorFileError, match="model.safetensors"):
        tensorfile.read(tmp_path / "model.safetensors")


def test_a_tensor_name_with_a_line_break_is_named_on_one_line(exported, image, capsys):
    arrays, meta = tensorfile.read(exported / fmt.WEIGHTS)
    tensorfile.write(exported / fmt.WEIGHTS, {**arrays, "extra\nline": np.zeros(1, dtype=np.float32)}, meta)
    assert main(["caption", image, "--weights", str(exported)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "model.safetensors does not fit its config.json" in line and "'extra\\nline'" in line


def test_a_familiarity_record_of_other_shapes_is_refused(exported, image, capsys):
    cap = tiny_captioner(seed=3)
    record = TrainingFeatures.fit(torch.randn(8, cap.model.encoder.dim)).to_dict()
    from captioner.io.export import write_familiarity

    write_familiarity(exported, {**record, "mean": torch.zeros(cap.model.encoder.dim + 1)})
    assert main(["caption", image, "--weights", str(exported)]) == 2
    assert "familiarity.safetensors" in one_error_line(capsys)


def test_familiarity_writes_its_record_into_a_folder(exported, tiny_coco, image, capsys):
    assert Captioner.load(exported).familiarity is None
    assert main(["familiarity", str(exported), "--data", str(tiny_coco), "--quiet"]) == 0
    cap = Captioner.load(exported)
    assert cap.familiarity is not None and cap.familiarity.images == 6
    assert "yes" in (exported / fmt.CARD).read_text().split("Familiarity record")[1].splitlines()[0]
    assert main(["caption", image, "--weights", str(exported), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["familiarity"] is not None


def test_export_refuses_a_folder_of_other_files_and_a_bad_license(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["export", "demo-soft", "--out", str(tmp_path / "mine")]) == 2
    assert "notes.txt" in one_error_line(capsys)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(SystemExit) as e:
        main(["export", "demo-soft", "--out", str(tmp_path / "x"), "--license", "MIT License"])
    assert e.value.code == 2


def test_an_export_replaces_an_earlier_one_whole(tmp_path):
    export(Captioner.load("demo-soft"), tmp_path / "m")
    export(tiny_captioner(seed=2), tmp_path / "m")  # no familiarity record: the old file goes
    assert not (tmp_path / "m" / fmt.FAMILIARITY).exists()
    assert Captioner.load(tmp_path / "m").familiarity is None


def test_model_init_from_takes_a_folder(exported):
    from captioner.train.startup import _init_from, resolve_checkpoint

    assert resolve_checkpoint("model.init_from", str(exported), None) == str(exported.resolve())
    fresh = tiny_captioner(seed=9)
    _init_from(fresh.model, fresh.vocab, str(exported))
    source = Captioner.load(exported).model.state_dict()
    assert all(torch.equal(v, source[k]) for k, v in fresh.model.state_dict().items())


def test_the_app_offers_the_exported_folders_in_its_weights_folder(exported, monkeypatch):
    from captioner.app.streamlit_app import available_models

    (exported.parent / "run").mkdir()  # a folder that is no model is not offered
    monkeypatch.setenv("CAPTIONER_WEIGHTS_DIR", str(exported.parent))
    models = available_models()
    assert models["model"] == str(exported) and "run" not in models
    assert Captioner.load(models["model"]).vocab.words == tiny_captioner(seed=3).vocab.words


def test_a_downloaded_folder_named_like_a_demo_is_taken_before_the_bundled_demo(tmp_path, monkeypatch, capsys):
    # Standing where a downloader stands: the folder that holds the model's folder.
    export(tiny_captioner(seed=3), tmp_path / "demo-soft")
    monkeypatch.chdir(tmp_path)
    from captioner.io.loading import resolve_weights

    assert resolve_weights("demo-soft") == Path("demo-soft")
    tiny_image(0).save(tmp_path / "photo.png")
    assert main(["caption", "photo.png", "--weights", "demo-soft"]) == 0
    out = capsys.readouterr()
    line = json.loads(out.out.splitlines()[0])
    image = tiny_image(0)
    theirs = Captioner.load(str(tmp_path / "demo-soft")).caption(image, DecodeOptions(beam_size=3)).caption
    bundled_caption = Captioner.load(bundled.DEMOS["demo-soft"].path).caption(image, DecodeOptions(beam_size=3))
    assert line["caption"] == theirs != bundled_caption.caption  # the folder's model, not the bundled demo
    assert "the folder demo-soft" in out.err and "not the bundled demo" in out.err  # and it says so


def test_the_card_s_commands_run_from_where_a_downloader_stands(tmp_path):
    assert main(["export", "demo-soft", "--out", str(tmp_path / "soft"), "--license", "mit"]) == 0
    card = (tmp_path / "soft" / fmt.CARD).read_text()
    use = card.split("## Use", 1)[1].split("## Files", 1)[0]
    assert "pip install captioner" not in use and "--no-deps captioner" not in use  # not on the index
    assert "from the folder that holds `soft/`" in use
    assert "captioner caption --weights soft photo.jpg" in use


def test_an_own_data_card_names_metrics_not_expressions_and_says_what_the_figures_rest_on(tmp_path):
    from captioner.io.card import model_card

    export(tiny_captioner(seed=3), tmp_path / "m")
    config = json.loads((tmp_path / "m" / fmt.CONFIG).read_text())
    config["training_data"] = "mine (own data)"  # `data import` named it after its folder
    config["meta"] = {"val_min:object_accuracy,pointing_accuracy": 0.5, "val_object_accuracy": 0.75,
                      "val_pointing_accuracy": 0.5, "val_images": 2, "encoder_weights": "random"}
    card = model_card(config, name="m")
    meta = front_matter(card)
    assert meta["metrics"] == ["object_accuracy", "pointing_accuracy"]  # names, not a config expression
    types = [m["type"] for m in meta["model-index"][0]["results"][0]["metrics"]]
    assert types == ["object_accuracy", "pointing_accuracy"] and not any(":" in t for t in types)
    assert "datasets" not in meta  # a folder's name is no data set's
    assert "the lower of object accuracy and pointing accuracy | val | 0.5" in card
    assert "on 2 validation images" in card and "too few" in card
    assert "random" in card and "no pretrained weights" in card

    # A checkpoint that recorded only the expression: in the table, not as a Hub metric.
    config["meta"] = {"val_min:object_accuracy,pointing_accuracy": 0.5}
    meta = front_matter(model_card(config, name="m"))
    assert "metrics" not in meta and meta["model-index"][0]["results"] == []


# ------------------------------------------------------------------ --int8

def test_int8_needs_onnx_and_calibration_needs_int8_told_before_loading(tmp_path, capsys):
    assert main(["export", "no-such-model", "--out", str(tmp_path / "a"), "--int8"]) == 2
    assert "--int8 quantises the ONNX graphs: give --onnx too" in one_error_line(capsys)
    assert main(["export", "no-such-model", "--out", str(tmp_path / "a"), "--onnx",
                 "--calibration", str(tmp_path)]) == 2
    assert "give --onnx --int8 too" in one_error_line(capsys)
    assert not (tmp_path / "a").exists()


def test_a_model_not_trained_on_shapes_needs_calibration_images(tmp_path):
    from captioner.io.export import ExportError

    cap = tiny_captioner(seed=3)
    with pytest.raises(ExportError, match="give --calibration DIR"):
        export(cap, tmp_path / "m", onnx=True, int8="arithmetic")
    (tmp_path / "empty" / "deep").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("no image")
    with pytest.raises(ExportError, match="holds no images"):
        export(cap, tmp_path / "m", onnx=True, int8="arithmetic", calibration=tmp_path / "empty")
    with pytest.raises(ExportError, match="is not a folder"):
        export(cap, tmp_path / "m", onnx=True, int8="arithmetic", calibration=tmp_path / "empty" / "notes.txt")
    assert not (tmp_path / "m").exists()  # refused before anything was written


def test_int8_without_onnxruntime_is_refused_before_the_export(tmp_path, monkeypatch):
    import importlib.util

    from captioner.io.export import ExportError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(ExportError, match=r"needs onnxruntime.*captioner\[export,runtime\]"):
        export(tiny_captioner(seed=3), tmp_path / "m", onnx=True, int8="arithmetic", calibration=tmp_path)
    assert not (tmp_path / "m").exists()


def test_calibration_images_are_found_in_subfolders_and_spread_over_at_most_the_limit(tmp_path, monkeypatch):
    from captioner.io import quantize

    for i in range(7):
        (tmp_path / "cal" / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        tiny_image(i).save(tmp_path / "cal" / f"d{i % 2}" / f"im{i}.png")
    paths, said = quantize.calibration_images(tmp_path / "cal", False, tmp_path / "scratch")
    assert len(paths) == 7 and "cal" in said
    monkeypatch.setattr(quantize, "CALIBRATION_IMAGES", 3)
    paths, _ = quantize.calibration_images(tmp_path / "cal", False, tmp_path / "scratch")
    every = sorted((tmp_path / "cal").rglob("*.png"))
    assert paths == [every[0], every[3], every[6]]  # the first, the middle and the last, not the first three


def test_a_shapes_model_is_calibrated_on_fresh_shapes_images(tmp_path, monkeypatch):
    from captioner.io import quantize

    monkeypatch.setattr(quantize, "CALIBRATION_IMAGES", 2)
    paths, said = quantize.calibration_images(None, True, tmp_path)
    assert len(paths) == 2 and all(p.suffix == ".png" and p.is_file() for p in paths)
    assert "shapes" in said and str(quantize.SHAPES_SEED) in said


@pytest.mark.parametrize("fp32,int8,slower", [(88.0, 121.0, True), (88.0, 88.0, False), (88.0, 44.0, False)])
def test_the_timing_line_says_where_int8_is_slower_with_its_figures(fp32, int8, slower):
    from captioner.io.quantize import PartTiming

    t = PartTiming("encoder", fp32, int8, "per image")
    line = t.line()
    assert t.slower is slower and "\n" not in line
    assert f"{int8:.2f} ms per image in int8" in line and f"{fp32:.2f} ms in fp32" in line
    assert ("slower" in line and "VNNI or AMX" in line and "1.38x" in line) if slower else "faster" in line


@pytest.fixture(scope="module")
def int8_folder(tmp_path_factory, onnx_registry_once) -> tuple[Captioner, Path, str]:
    """A tiny captioner exported with --onnx --int8 through the command, calibrated on tiny images
    (the slow part, once for the module), and what the command printed."""
    root = tmp_path_factory.mktemp("int8")
    (root / "cal").mkdir()
    for i in range(6):
        tiny_image(50 + i, (40, 30)).save(root / "cal" / f"im{i}.png")
    cap = tiny_captioner(seed=5)
    export(cap, root / "fp32")  # the weights as a folder, which the command takes as CHECKPOINT
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["export", str(root / "fp32"), "--out", str(root / "int8"), "--onnx", "--int8",
                     "--calibration", str(root / "cal")]) == 0
    return cap, root / "int8", err.getvalue()


@pytest.mark.slow  # the module's ONNX export and quantisation
def test_int8_graphs_hold_int8_weights_and_say_so(int8_folder):
    import onnx

    _, folder, printed = int8_folder
    encoder, step = (onnx.load(str(folder / n)) for n in (fmt.ENCODER_ONNX, fmt.STEP_ONNX))
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in encoder.graph.node}  # static, QDQ
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in step.graph.node}  # dynamic
    int8_weights = {i.name for g in (encoder, step) for i in g.graph.initializer  # the embedding's are uint8
                    if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)}
    for weight in ("decoder.lstm.weight_ih", "decoder.lstm.weight_hh", "decoder.L_o.weight",
                   "decoder.embedding.weight", "model.encoder.trunk.1.0.weight"):
        assert any(name.startswith(weight) for name in int8_weights), weight
    config = json.loads((folder / fmt.CONFIG).read_text())
    q = config["onnx"]["int8"]
    assert "calibrated" in q["encoder"] and "6 images" in q["encoder"] and "dynamic" in q["decoder_step"]
    assert set(q["timing"]) == {"encoder", "decoder step"} and all(t["int8_ms"] > 0 for t in q["timing"].values())
    assert "decoder step quantised to int8" in (folder / fmt.CARD).read_text()
    lines = printed.splitlines()
    assert any(line.startswith("int8 graphs: ") and "x fp32's" in line for line in lines)
    same = q["same_captions"]
    assert same["images"] == 6 and same["beam_size"] == 3 and 0 <= same["share"] <= 1
    assert f"int8 gives fp32's caption for {same['share']:.0%} of 6 calibration images (beam 3)" in printed
    for part in ("encoder", "decoder step"):
        [line] = [x for x in lines if x.startswith(f"int8 {part} is ")]
        ms = q["timing"][part]
        assert ("slower" in line) == (ms["int8_ms"] > ms["fp32_ms"])


@pytest.mark.slow  # the module's ONNX export and quantisation
def test_the_share_of_same_captions_counts_the_captions_that_differ(int8_folder, tmp_path):
    """quantize.agreement captions the images through both sets of graphs: the same graphs agree
    on every image; a step that says <end> first (its bias for <end> raised) on none."""
    import onnx
    from onnx import numpy_helper

    from captioner.io import quantize
    from captioner.onnx.runtime import OnnxCaptioner

    cap, folder, _ = int8_folder
    rt = OnnxCaptioner(folder)
    inputs = [rt.preprocess.normalize_array(rt.preprocess.array(tiny_image(70 + i, (40, 30))))[None]
              for i in range(5)]
    graphs = {n: folder / n for n in (fmt.ENCODER_ONNX, fmt.STEP_ONNX)}
    loaded = quantize.load_graphs(graphs)
    assert quantize.agreement(loaded, loaded, inputs, rt.tokens, 8) == 1.0
    step = onnx.load(str(folder / fmt.STEP_ONNX))
    [bias] = [i for i in step.graph.initializer if i.name == "decoder.L_o.bias"]
    raised = numpy_helper.to_array(bias).copy()
    raised[cap.tokens.end] += 1000.0
    bias.CopyFrom(numpy_helper.from_array(raised, bias.name))
    onnx.save(step, str(tmp_path / fmt.STEP_ONNX))
    ended = {**graphs, fmt.STEP_ONNX: tmp_path / fmt.STEP_ONNX}
    assert all(c.words for c in rt.caption_arrays(np.stack([rt.preprocess.array(tiny_image(70 + i, (40, 30)))
                                                            for i in range(5)]), rt.options(max_len=8)))
    assert quantize.agreement(loaded, quantize.load_graphs(ended), inputs, rt.tokens, 8) == 0.0


@pytest.mark.slow  # the module's ONNX export and quantisation
def test_the_runtime_takes_the_int8_folder_unchanged_and_torch_its_fp32_weights(int8_folder, image, capsys):
    from captioner.onnx.runtime import OnnxCaptioner
    from captioner.onnx.runtime import main as onnx_main
    from tests.builders import torch_step

    cap, folder, _ = int8_folder
    assert onnx_main([str(folder), image, "--beam-size", "3"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["image"] == image and isinstance(line["caption"], str)
    # The quantised graphs approximate the model: near torch's numbers, and not equal to them.
    rt = OnnxCaptioner(folder)
    x = torch.stack([cap.preprocess(tiny_image(60 + i, (40, 30))) for i in range(3)])
    ann, keys, h0, c0, _ = rt.encode(x.numpy())
    with torch.no_grad():
        ours = cap.model.decoder.annotate(cap.model.encode(x)).vectors.numpy()
    assert 0 < np.abs(ann - ours).max() < 0.1 * np.abs(ours).max()
    word = np.full(3, cap.tokens.start, dtype=np.int64)
    theirs = rt.step(word, h0, c0, ann, keys)[0]
    exact = torch_step(cap.model.decoder, rt.grid)(word, h0, c0, ann, keys)[0]
    assert 0 < np.abs(theirs - exact).max() < 0.02 * np.ptp(exact)  # log p spans some 15 nats here
    again = Captioner.load(folder)  # torch reads model.safetensors, in fp32 as before
    assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(), cap.model.state_dict().values()))


# ------------------------------------------------------------------ --int8 weights

def _conv_matmul_graph(path: Path, conv: np.ndarray, matmul: np.ndarray) -> None:
    """A graph x (1, C, 3, 3) -> Conv(conv) -> Flatten -> MatMul(matmul), its weights as initializers."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["y"]),
             helper.make_node("Flatten", ["y"], ["f"]),
             helper.make_node("MatMul", ["f", "fc.weight"], ["z"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, conv.shape[1], 3, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, matmul.shape[1]])],
        [numpy_helper.from_array(conv, "conv.weight"), numpy_helper.from_array(matmul, "fc.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_the_weights_form_keeps_each_output_channel_in_its_own_scale_and_the_rest_in_fp16(tmp_path):
    """--int8 weights: convolution weights in int8 with a scale per output channel, every other
    large weight in fp16, both expanded to fp32 as the graph loads. A channel 10,000x smaller than
    its neighbour keeps its own precision (one scale for the tensor would round it to zero), and an
    all-zero channel stays zero."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from captioner.io import quantize

    rng = np.random.default_rng(0)
    conv = rng.standard_normal((3, 64, 3, 3)).astype(np.float32)
    conv[1] *= 1e-4
    conv[2] = 0
    matmul = rng.standard_normal((3, 1100)).astype(np.float32)
    _conv_matmul_graph(tmp_path / "fp32.onnx", conv, matmul)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the zero channel: no 0 / 0 on the way
        quantize.weights_only(tmp_path / "fp32.onnx", tmp_path / "small.onnx")
    small = onnx.load(str(tmp_path / "small.onnx"))
    onnx.checker.check_model(small)  # among others: each node after what it reads
    kinds = {i.name: i.data_type for i in small.graph.initializer}
    assert kinds["conv.weight.int8"] == onnx.TensorProto.INT8 and kinds["fc.weight.fp16"] == onnx.TensorProto.FLOAT16
    assert not {"conv.weight", "fc.weight"} & set(kinds)  # stored once, in the small form
    q = numpy_helper.to_array(next(i for i in small.graph.initializer if i.name == "conv.weight.int8"))
    assert np.abs(q.reshape(3, -1)).max(1).tolist() == [127, 127, 0]  # each channel spans its own range

    x = rng.standard_normal((1, 64, 3, 3)).astype(np.float32)
    run = {k: ort.InferenceSession(str(tmp_path / f"{k}.onnx"), providers=["CPUExecutionProvider"])
           for k in ("fp32", "small")}
    out = {k: s.run(None, {"x": x})[0] for k, s in run.items()}
    scale = np.abs(conv.reshape(3, -1)).max(1) / 127
    scale[2] = 1
    rounded = np.round(conv / scale[:, None, None, None]) * scale[:, None, None, None]
    y = np.einsum("cihw,ihw->c", rounded, x[0])  # the convolution (3x3 kernel over a 3x3 input)
    assert abs(y[1]) > 0 and y[2] == 0
    expected = y[None] @ matmul.astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(out["small"][0], expected[0], rtol=1e-4, atol=1e-6)
    assert np.isfinite(out["small"]).all() and not np.array_equal(out["small"], out["fp32"])
    np.testing.assert_allclose(out["fp32"], np.einsum("cihw,ihw->c", conv, x[0])[None] @ matmul, rtol=1e-4)
    assert (tmp_path / "small.onnx").stat().st_size < 0.55 * (tmp_path / "fp32.onnx").stat().st_size


def test_a_weight_that_a_convolution_shares_with_another_node_is_stored_in_fp16(tmp_path):
    """int8 rounding is for convolutions' weights alone: a tensor another node reads as well is
    stored in fp16, which keeps that node's numbers to fp16's precision."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from captioner.io import quantize

    w = np.random.default_rng(1).standard_normal((4, 16, 4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"]), helper.make_node("Add", ["x2", "w"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 4, 4]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, [4, 16, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [4, 16, 4, 4])],
        [numpy_helper.from_array(w, "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "a.onnx"))
    quantize.weights_only(tmp_path / "a.onnx", tmp_path / "b.onnx")
    assert {i.name: i.data_type for i in onnx.load(str(tmp_path / "b.onnx")).graph.initializer} == \
        {"w.fp16": TensorProto.FLOAT16}


def test_the_weights_form_leaves_small_and_non_float_initializers_as_they_are(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from captioner.io import quantize

    bias = np.arange(8, dtype=np.float32)
    table = np.arange(12, dtype=np.int64)
    def value(name, kind, n):
        return helper.make_tensor_value_info(name, kind, [n])

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"]), helper.make_node("Gather", ["table", "i"], ["z"])], "g",
        [value("x", TensorProto.FLOAT, 8), value("i", TensorProto.INT64, 1)],
        [value("y", TensorProto.FLOAT, 8), value("z", TensorProto.INT64, 1)],
        [numpy_helper.from_array(bias, "bias"), numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "a.onnx"))
    quantize.weights_only(tmp_path / "a.onnx", tmp_path / "b.onnx")
    kept = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "b.onnx")).graph.initializer}
    assert set(kept) == {"bias", "table"}
    assert np.array_equal(kept["bias"], bias) and np.array_equal(kept["table"], table)


def test_int8_takes_a_form_and_refuses_an_unknown_one(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "demo-soft", "--out", str(tmp_path / "a"), "--onnx", "--int8", "fast"])
    assert e.value.code == 2 and "invalid choice: 'fast'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.fixture(scope="module")
def weights_folder(tmp_path_factory, onnx_registry_once) -> tuple[Captioner, Path, str]:
    """A tiny captioner, not trained on shapes, exported with --onnx --int8 weights through the
    command without calibration images (the weights form needs none), and what it printed."""
    root = tmp_path_factory.mktemp("int8w")
    cap = tiny_captioner(seed=5)
    export(cap, root / "fp32", onnx=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["export", str(root / "fp32"), "--out", str(root / "w"), "--onnx", "--int8", "weights"]) == 0
    return cap, root, err.getvalue()


@pytest.mark.slow  # the module's ONNX export
def test_the_weights_form_computes_in_fp32_from_small_weights_and_says_so(weights_folder):
    import onnx

    from captioner.onnx.runtime import OnnxCaptioner

    cap, root, printed = weights_folder
    folder = root / "w"
    encoder, step = (onnx.load(str(folder / n)) for n in (fmt.ENCODER_ONNX, fmt.STEP_ONNX))
    ops = {n.op_type for g in (encoder, step) for n in g.graph.node}
    assert not ops & {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger"}
    types = {i.name: i.data_type for g in (encoder, step) for i in g.graph.initializer}
    assert types["model.encoder.trunk.1.0.weight.int8"] == onnx.TensorProto.INT8
    for weight in ("decoder.lstm.weight_ih", "decoder.lstm.weight_hh", "decoder.L_z.weight"):  # >= 1,024 values
        assert types[f"{weight}.fp16"] == onnx.TensorProto.FLOAT16 and weight not in types, weight
    assert types["decoder.L_o.weight"] == onnx.TensorProto.FLOAT  # 16 x 12 values: too few to matter
    config = json.loads((folder / fmt.CONFIG).read_text())
    q = config["onnx"]["int8"]
    assert q["form"] == "weights" and "fp32" in q["encoder"] and "fp16" in q["decoder_step"]
    assert "same_captions" not in q  # no images were given to compare on
    assert "weights stored in int8 and fp16, computed in fp32" in (folder / fmt.CARD).read_text()
    lines = printed.splitlines()
    assert any(line.startswith("int8 graphs (weights form): ") and "computed in fp32" in line for line in lines)
    assert not any("calibrated" in line or "VNNI" in line for line in lines)
    sizes = {k: fmt.graph_bytes(root / k) for k in ("fp32", "w")}
    assert sizes["w"] < 0.6 * sizes["fp32"]
    # Computed in fp32 from weights rounded to int8 (per channel) and fp16: near the fp32 graphs, not equal.
    rt = {k: OnnxCaptioner(root / k) for k in ("fp32", "w")}
    x = np.stack([rt["fp32"].preprocess.normalize_array(rt["fp32"].preprocess.array(tiny_image(60 + i, (40, 30))))
                  for i in range(3)])
    out = {k: r.encode(x) for k, r in rt.items()}
    ann32, annw = out["fp32"][0], out["w"][0]
    assert 0 < np.abs(annw - ann32).max() < 0.02 * np.abs(ann32).max()
    word = np.full(3, cap.tokens.start, dtype=np.int64)
    logp = {k: r.step(word, *out["fp32"][2:4], *out["fp32"][:2])[0] for k, r in rt.items()}
    assert 0 < np.abs(logp["w"] - logp["fp32"]).max() < 1e-3 * np.ptp(logp["fp32"])


@pytest.mark.slow  # a demo exported twice and 100 images captioned through each
def test_the_weights_form_keeps_the_demos_captions(tmp_path, onnx_registry_once):
    """The parity the weights form is for: demo-soft's captions through it are fp32's for nearly
    every fresh shapes image (99 of the first 100 of benchmarks/int8_parity.py's images; the int8
    arithmetic form: 85 to 92%, docs/results.md)."""
    from captioner.data.shapes import generate_dataset
    from captioner.io import quantize
    from captioner.onnx.runtime import OnnxCaptioner

    folders = {"fp32": export(Captioner.load("demo-soft"), tmp_path / "fp32", onnx=True).folder}
    folders["w"] = Path(shutil.copytree(folders["fp32"], tmp_path / "w"))  # the form --int8 weights writes
    for graph in (fmt.ENCODER_ONNX, fmt.STEP_ONNX):
        quantize.weights_only(folders["fp32"] / graph, folders["w"] / graph)
    generate_dataset(tmp_path / "s", {"test": 100}, seed=5858, progress=False)
    rt = {k: OnnxCaptioner(f) for k, f in folders.items()}
    pre = rt["fp32"].preprocess
    pixels = np.stack([pre.array(pre.load(p)) for p in sorted((tmp_path / "s" / "images" / "test").glob("*.png"))])
    texts = {k: [c.text for c in r.caption_arrays(pixels, r.options(beam_size=3))] for k, r in rt.items()}
    assert sum(a == b for a, b in zip(texts["fp32"], texts["w"])) >= 97


def test_the_weights_form_takes_no_calibration_images_but_uses_those_given(tmp_path):
    from captioner.io import quantize

    assert quantize.calibration_images(None, False, tmp_path, required=False) == ([], "none given")
    with pytest.raises(quantize.CalibrationError, match="give --calibration DIR"):
        quantize.calibration_images(None, False, tmp_path)
    (tmp_path / "cal").mkdir()
    tiny_image(1).save(tmp_path / "cal" / "a.png")
    paths, said = quantize.calibration_images(tmp_path / "cal", False, tmp_path, required=False)
    assert paths == [tmp_path / "cal" / "a.png"] and "cal" in said


@pytest.mark.slow  # the weights form made from the module's fp32 folder, its captions compared
def test_the_weights_form_compares_its_captions_on_the_images_given(weights_folder, tmp_path):
    from captioner.io import quantize
    from captioner.onnx.runtime import OnnxCaptioner

    cap, root, _ = weights_folder
    shutil.copytree(root / "fp32", tmp_path / "m")
    for i in range(3):
        tiny_image(80 + i, (40, 30)).save(tmp_path / f"im{i}.png")
    rt = OnnxCaptioner(root / "fp32")
    done = quantize.quantize(tmp_path / "m", rt.preprocess, sorted(tmp_path.glob("im*.png")), "from three",
                             rt.tokens, 8, form="weights")
    assert done.form == "weights" and done.images == 3 and done.compared == 3
    assert done.same_captions in (0, 1 / 3, 2 / 3, 1)
    assert f"for {done.same_captions:.0%} of 3 images (from three) (beam 3)" in done.agreement_line()
    assert done.to_config()["same_captions"] == {"share": round(done.same_captions, 4), "images": 3, "beam_size": 3}
    assert all(t.form == "weights" and t.line().startswith("weights-form ") for t in done.timings)


def test_export_refuses_an_unknown_int8_form_before_anything_is_written(tmp_path):
    from captioner.io.export import ExportError

    with pytest.raises(ExportError, match=r"--int8 fast: the form is one of arithmetic, weights"):
        export(tiny_captioner(seed=3), tmp_path / "m", onnx=True, int8="fast")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # the module's ONNX export
def test_the_graphs_keep_their_weights_in_a_file_beside_them(weights_folder, tmp_path):
    """Each graph's weights of 4 KiB or more go to ``<graph>.data`` beside it: onnxruntime
    maps that file and uses the weights where they lie, rather than holding them twice (docs/export.md).
    An export without --onnx into the folder removes them."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    from captioner.onnx.runtime import OnnxCaptioner

    cap, root, _ = weights_folder
    folder = Path(shutil.copytree(root / "fp32", tmp_path / "m"))  # exported with --onnx
    assert {fmt.ENCODER_DATA, fmt.STEP_DATA} <= {p.name for p in folder.iterdir()}
    config = json.loads((folder / fmt.CONFIG).read_text())
    assert config["onnx"]["encoder"]["data"] == fmt.ENCODER_DATA and config["onnx"]["step"]["data"] == fmt.STEP_DATA
    assert f"`{fmt.ENCODER_DATA}`, `{fmt.STEP_DATA}`: the graphs' weights" in (folder / fmt.CARD).read_text()
    four = [fmt.ENCODER_ONNX, fmt.STEP_ONNX, fmt.ENCODER_DATA, fmt.STEP_DATA]
    assert fmt.graph_bytes(folder) == sum((folder / n).stat().st_size for n in four)
    for graph, data in ((fmt.ENCODER_ONNX, fmt.ENCODER_DATA), (fmt.STEP_ONNX, fmt.STEP_DATA)):
        bare = onnx.load(str(folder / graph), load_external_data=False)
        outside = {i.name for i in bare.graph.initializer if uses_external_data(i)}
        big = {i.name for i in onnx.load(str(folder / graph)).graph.initializer
               if numpy_helper.to_array(i).nbytes >= 4096}
        assert outside == big and big  # every weight of 4 KiB or more, and only those
        assert (folder / data).stat().st_size >= 4096 * len(big)
    again = OnnxCaptioner(folder)  # reads its weights from beside the graphs
    x = np.stack([again.preprocess.normalize_array(again.preprocess.array(tiny_image(3, (40, 30))))])
    with torch.no_grad():
        ours = cap.model.decoder.annotate(cap.model.encode(torch.from_numpy(x))).vectors.numpy()
    np.testing.assert_allclose(again.encode(x)[0], ours, atol=1e-5)
    export(cap, folder)
    assert not (folder / fmt.ENCODER_DATA).exists() and not (folder / fmt.STEP_DATA).exists()
