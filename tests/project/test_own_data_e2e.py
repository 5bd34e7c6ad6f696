"""Own photographs with Chinese captions, end to end on a CPU in seconds: import a JSON Lines
file, check, train a few steps with train/configs/own-soft.toml, caption, evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from captioner.cli.main import main as captioner_main
from captioner.inference import Captioner

CONFIG = Path(__file__).parents[2] / "train" / "configs" / "own-soft.toml"
PHRASES = ["一只猫坐在桌子上", "桌子上有一只猫", "一个男人在街上骑自行车", "街上的男人和自行车", "一盘食物放在桌子上",
           "桌子上的一盘食物", "两只狗在草地上跑", "草地上有两只狗"]
# A photograph's config for a CPU test: the encoder from scratch and tiny, no feature cache.
TINY = ["model.encoder=small", "model.encoder_pretrained=false", "model.image_size=32", "model.embed_dim=16",
        "model.hidden_dim=32", "model.attention_dim=16", "model.dropout=0", "data.feature_cache=false",
        "data.workers=0", "data.min_count=1", "optim.max_steps=40", "optim.batch_size=8", "optim.lr=0.01",
        "optim.threads=1", "optim.save_every=40", "val.limit=2", "val.max_len=12", "val.beam_size=1",
        "val.patience=0", "val.every_epochs=10"]


def chinese_jsonl(photos: Path) -> Path:
    images = sorted((photos / "coco").rglob("*.jpg"))
    lines = [json.dumps({"file_name": str(p.relative_to(photos)),
                         "captions": [PHRASES[(2 * i) % len(PHRASES)] + "。", PHRASES[(2 * i + 1) % len(PHRASES)]]},
                        ensure_ascii=False) for i, p in enumerate(images)]
    source = photos / "metadata.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return source


def overrides(data: Path) -> list[str]:
    return [a for kv in [f"data.dir={data}", *TINY] for a in ("--set", kv)]


@pytest.mark.slow  # end to end: import, train, caption, evaluate
def test_chinese_photos_import_train_caption_evaluate(tmp_path, photos, capsys):
    data = tmp_path / "zh"
    assert captioner_main(["data", "import", str(chinese_jsonl(photos)), "--out", str(data), "--val", "2",
                           "--test", "2", "--quiet"]) == 0
    assert "tokenizer: chars" in capsys.readouterr().out

    assert captioner_main(["data", "check", "--config", str(CONFIG), *overrides(data), "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "train: 8 images, 16 captions" in said and "characters (tokenizer chars" in said

    run = tmp_path / "run"
    assert captioner_main(["train", "--config", str(CONFIG), *overrides(data), "--run-dir", str(run),
                           "--quiet"]) == 0
    capsys.readouterr()
    raw = torch.load(run / "best.pt", weights_only=True)
    assert raw["tokenizer"] == "chars2"
    assert {"猫", "狗", "桌"} <= set(raw["vocab"]) and "一只猫坐在桌子上" not in raw["vocab"]
    # Resuming keeps the checkpoint's tokenizer and vocabulary.
    assert captioner_main(["train", "--resume", str(run), "--set", "optim.max_steps=44", "--quiet"]) == 0
    resumed = torch.load(run / "last.pt", weights_only=True)
    assert resumed["tokenizer"] == "chars2" and resumed["vocab"] == raw["vocab"]
    assert resumed["meta"]["step"] == 44

    # Caption: the JSON line is readable UTF-8 and the caption has no spaces between characters.
    out = tmp_path / "captions.jsonl"
    image = next((photos / "coco" / "train2014").glob("*.jpg"))
    assert captioner_main(["caption", str(image), "--weights", str(run / "best.pt"), "--beam-size", "1",
                           "--max-len", "12", "--out", str(out), "--quiet"]) == 0
    line = out.read_text(encoding="utf-8").splitlines()[0]
    record = json.loads(line)
    assert record["words"], "the trained model says nothing"
    assert record["caption"] == "".join(record["words"]) and " " not in record["caption"]
    assert record["caption"] in line  # not \u-escaped
    assert set(record["caption"]) <= set(raw["vocab"])

    # Evaluate: BLEU and CIDEr on characters; METEOR left out, saying why.
    assert captioner_main(["evaluate", "--data", str(data), "--split", "test", "--weights", str(run / "best.pt"),
                           "--beam-size", "1", "--max-len", "12", "--out", str(tmp_path / "eval.json")]) == 0
    table = capsys.readouterr().out
    assert "BLEU-4" in table and "CIDEr" in table and "English only" in table and "characters" in table
    report = json.loads((tmp_path / "eval.json").read_text(encoding="utf-8"))
    assert report["tokenizer"] == "chars2" and "METEOR" not in report["metrics"]
    assert report["metrics"]["BLEU-1"] > 0  # characters the references share, not whole captions as one word
    results = (tmp_path / "eval.results.json").read_text(encoding="utf-8")
    assert "\\u" not in results and any("\u4e00" <= c <= "\u9fff" for c in results)  # readable UTF-8
    assert Captioner.load(run / "best.pt").training_data == "zh (own data)"  # named after --out
