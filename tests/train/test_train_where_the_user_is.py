"""Own data, found where the user is: a shipped config by its name from any folder, missing own
data pointing to `captioner data import`, and a trained model named by its run and its data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from captioner.cli.main import main as captioner_main
from captioner.inference import Captioner
from captioner.io.loading import checkpoint_name
from captioner.train.config import BUNDLED_CONFIGS, bundled_configs, find_config, load_config
from captioner.train.loop import train
from tests.builders import one_line, read_jsonl, tiny_train_config

REPO_CONFIGS = Path(__file__).parents[2] / "train" / "configs"


def test_the_shipped_configs_are_the_repository_s():
    assert bundled_configs() == sorted(p.stem for p in REPO_CONFIGS.glob("*.toml"))
    assert "own-soft" in bundled_configs() and "shapes-soft" in bundled_configs()


@pytest.mark.parametrize("given", ["own-soft", "own-soft.toml", "train/configs/own-soft.toml"])
def test_a_shipped_config_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    assert find_config(given) == BUNDLED_CONFIGS / "own-soft.toml"
    assert load_config(given).name == "own-soft"


def test_a_file_of_that_name_in_the_folder_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "own-soft.toml").write_text('name = "mine"\n')
    assert find_config("own-soft.toml") == Path("own-soft.toml")
    assert load_config("own-soft.toml").name == "mine"
    assert load_config("own-soft").name == "own-soft"  # a bare name: no such file here, the shipped one


def test_the_repository_s_path_still_works_from_its_root():
    assert load_config(REPO_CONFIGS / "own-soft.toml").name == "own-soft"


@pytest.mark.parametrize("given", ["own-sof", "elsewhere/own-soft.toml", "train/configs"])
def test_a_missing_config_is_one_line_listing_the_shipped_names(tmp_path, monkeypatch, capsys, given):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train" / "configs").mkdir(parents=True)
    assert captioner_main(["train", "--config", given]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"no config file {given};" in line and "own-soft, shapes-hard" in line and "coco-vgg19-soft" in line
    assert ("did you mean own-soft?" in line) == (given != "train/configs")


def test_train_and_data_check_take_a_shipped_config_by_name(tiny_coco, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    sets = [f"data.dir={tiny_coco}", "data.karpathy=", "data.workers=0", "model.encoder=small",
            "model.encoder_pretrained=false", "model.image_size=32", "data.feature_cache=false",
            "optim.max_steps=1", "val.every_epochs=0", "val.max_len=3", "val.beam_size=1"]
    args = [a for s in sets for a in ("--set", s)]
    assert captioner_main(["data", "check", "--config", "own-soft", *args, "--quiet"]) == 0
    assert captioner_main(["train", "--config", "own-soft", *args, "--run-dir", "run", "--quiet"]) == 0
    assert "stopped at optim.max_steps = 1" in capsys.readouterr().err


def test_data_check_of_missing_own_data_points_to_data_import(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert captioner_main(["data", "check", "--config", "own-soft", "--set", "data.dir=myphotos"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "no data set in myphotos: myphotos/dataset.json not found" in line
    assert "captioner data import SOURCE --out myphotos" in line
    assert "karpathy" not in line.lower() and "cocodataset" not in line


def test_train_of_missing_own_data_points_to_data_import(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert captioner_main(["train", "--config", "own-soft", "--set", "model.encoder_pretrained=false"]) == 2
    line = one_line(capsys.readouterr().err)
    assert "captioner data import SOURCE --out data/own" in line and "karpathy" not in line.lower()


@pytest.mark.parametrize("folder,hint", [("myphotos", "captioner data import SOURCE --out myphotos"),
                                         ("data/coco", "cocodataset.org"),
                                         ("data/flickr8k", "caption_datasets.zip")])
def test_evaluate_on_a_folder_without_data_says_where_its_data_comes_from(tmp_path, monkeypatch, capsys, weights,
                                                                        folder, hint):
    monkeypatch.chdir(tmp_path)
    (tmp_path / folder).mkdir(parents=True)
    assert captioner_main(["evaluate", "--data", folder, "--weights", weights]) == 2
    line = one_line(capsys.readouterr().err)
    assert f"no split 'test' in {folder}" in line and hint in line
    assert ("cocodataset" in line) == (folder == "data/coco")


def test_a_trained_checkpoint_is_named_by_its_run(tiny_coco, tmp_path):
    """best.pt of runs/my-photos is "my-photos/best.pt" in every JSON line and overlay title, and
    stays so where it is copied; a file of another name keeps its own."""
    run = tmp_path / "runs" / "my-photos"
    train(tiny_train_config(tiny_coco, **{"optim.max_steps": 2, "val.every_epochs": 0}), run, progress=False)
    image = tmp_path / "a.png"
    Image.new("RGB", (40, 30), (200, 30, 30)).save(image)
    out = tmp_path / "caps.jsonl"
    assert captioner_main(["caption", str(image), "--weights", str(run / "best.pt"), "--out", str(out),
                           "--attention-dir", str(tmp_path / "maps"), "--max-len", "3", "--quiet"]) == 0
    (record,) = read_jsonl(out)
    assert record["model"] == "my-photos/best.pt"
    assert Image.open(record["attention_png"]).text["Model"] == "my-photos/best.pt"

    elsewhere = tmp_path / "models"
    elsewhere.mkdir()
    shutil.copy(run / "last.pt", elsewhere / "last.pt")
    shutil.copy(run / "best.pt", elsewhere / "cats.pt")
    assert Captioner.load(elsewhere / "last.pt").name == "my-photos/last.pt"
    assert Captioner.load(elsewhere / "cats.pt").name == "cats.pt"


def test_a_run_file_without_its_run_recorded_is_named_by_its_folder(tmp_path):
    assert checkpoint_name(tmp_path / "runs" / "old-run" / "best.pt", {}) == "old-run/best.pt"
    assert checkpoint_name(tmp_path / "runs" / "old-run" / "best.pt", {"run": "mine"}) == "mine/best.pt"
    assert checkpoint_name(tmp_path / "weights" / "soft.pt", {"run": "mine"}) == "soft.pt"


def _csv(tmp_path: Path, n: int = 6) -> Path:
    rows = ["image,caption"]
    for i in range(n):
        Image.new("RGB", (24, 16), (40 * i, 200 - 30 * i, 90)).save(tmp_path / f"p{i}.png")
        rows += [f"p{i}.png,a coloured square number {i}", f"p{i}.png,a square of colour {i}"]
    path = tmp_path / "captions.csv"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("name,shown", [("sample photographs", "sample photographs (own data)"),
                                        (None, "my-photos (own data)")])
def test_the_model_card_names_the_data_set_it_was_trained_on(tmp_path, name, shown):
    """The name `data import --name` gives the data set is what the card says it was trained
    on; a dataset.json naming none gives its folder's name, never a file's."""
    data = tmp_path / "my-photos"
    assert captioner_main(["data", "import", str(_csv(tmp_path)), "--out", str(data), "--val", "1", "--test", "1",
                           "--quiet", *(["--name", name] if name else [])]) == 0
    if name is None:
        dataset = json.loads((data / "dataset.json").read_text(encoding="utf-8"))
        dataset.pop("dataset", None)
        (data / "dataset.json").write_text(json.dumps(dataset), encoding="utf-8")
    run = tmp_path / "run"
    train(tiny_train_config(data, **{"data.karpathy": "dataset.json", "optim.max_steps": 1,
                                     "val.every_epochs": 0}), run, progress=False)
    assert Captioner.load(run / "best.pt").training_data == shown
