"""The model card (README.md) of an exported model folder: the Hugging Face Hub's metadata
as YAML front matter, then what the model is, what it was trained on, the figures its
checkpoint recorded with the command that measures them again, and how to use it.

The YAML is written by hand, every string as a JSON string (which YAML reads as a
double-quoted scalar), so the card needs no YAML package to write and any YAML parser reads it.
"""

from __future__ import annotations

import json
import re

from captioner.io import folder as fmt


def recorded_figures(meta: dict) -> list[tuple[str, str, float]]:
    """(metric, split, value) of the figures a checkpoint recorded: training writes
    ``val_<metric>`` into the checkpoint it keeps for its best validation figure, and with a
    ``min:A,B`` metric each of A and B too. The expression's own entry is in the list; the Hub's
    metadata leaves it out (``hub_figures``)."""
    out = []
    for key, value in meta.items():
        if key.startswith("val_") and key != "val_images" and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            out.append((key.removeprefix("val_"), "val", float(value)))
    return out


def hub_figures(figures: list[tuple[str, str, float]]) -> list[tuple[str, str, float]]:
    """The figures that are metrics (a name), not a validation expression such as ``min:A,B``."""
    return [f for f in figures if ":" not in f[0] and "," not in f[0]]


def figure_name(metric: str) -> str:
    """A metric as the card's table says it: ``min:a_b,c`` is "the lower of a b and c"."""
    if not metric.startswith("min:"):
        return metric
    parts = [p.replace("_", " ") for p in metric.removeprefix("min:").split(",")]
    return "the lower of " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _q(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def front_matter(config: dict, *, license: str, name: str) -> str:
    model = config["model"]
    data = config.get("training_data") or "unknown"
    # own data is named after a folder (or --name): no data set the Hub knows, so none is listed
    dataset = None if data.endswith("(own data)") or data == "unknown" else _slug(data.split(" (")[0])
    figures = hub_figures(recorded_figures(config.get("meta") or {}))
    tags = ["image-captioning", "show-attend-and-tell", "visual-attention", f"{model['attention']}-attention",
            "safetensors"] + (["onnx"] if config.get("onnx") else [])
    lines = ["---", "pipeline_tag: image-to-text", "library_name: captioner", "tags:"]
    lines += [f"  - {_q(t)}" for t in tags]
    lines += ["language:", f"  - {_q(config.get('language') or 'en')}", f"license: {_q(license)}"]
    if dataset is not None:
        lines += ["datasets:", f"  - {_q(dataset)}"]
    if figures:
        lines.append("metrics:")
        lines += [f"  - {_q(m)}" for m in dict.fromkeys(m for m, _, _ in figures)]
    lines += ["model-index:", f"  - name: {_q(name)}", "    results:"]
    if figures:
        lines += ["      - task:", "          type: image-to-text", "          name: Image captioning",
                  "        dataset:", f"          name: {_q(data)}", f"          type: {_q(dataset or _slug(data))}",
                  f"          split: {_q(figures[0][1])}", "        metrics:"]
        for metric, _, value in figures:
            lines += [f"          - type: {_q(metric)}", f"            name: {_q(metric.replace('_', ' '))}",
                      f"            value: {value!r}"]
    else:
        lines[-1] = "    results: []"
    lines.append("---")
    return "\n".join(lines) + "\n"


# Below this many validation images a card says its figures rest on too few to mean much.
FEW_VALIDATION_IMAGES = 100


def _validation_size(n) -> str:
    if not isinstance(n, int) or isinstance(n, bool):
        return ""  # a checkpoint saved before training recorded it
    said = f", on {n:,} validation image{'s' if n != 1 else ''}"
    return said + (": too few for the figures to say much" if n < FEW_VALIDATION_IMAGES else "")


def _encoder_weights(kind: str) -> str:
    if kind == "random":
        return "trained from random values (no pretrained weights): expect little of it on photographs"
    return kind


def model_card(config: dict, *, name: str) -> str:
    """The card of the folder ``name`` whose config.json is ``config`` (its license and source in it)."""
    license, source = config.get("license") or "unknown", config.get("source")
    model = config["model"]
    meta = config.get("meta") or {}
    figures = recorded_figures(meta)
    data = config.get("training_data") or "data it does not name"
    h, w = config["preprocess"]["size"]
    parts = [front_matter(config, license=license, name=name), f"# {name}", ""]
    if config.get("notice"):
        parts += [f"**Note: {config['notice']}.**", ""]
    parts += [
        f"An image captioning model with visual attention after Show, Attend and Tell (Xu et al. 2015), "
        f"made with captioner {config['captioner_version']}"
        + (f" from `{source}`" if source else "") + ".",
        "",
        f"- **Attention**: {model['attention']} ({model['score']} score, {model['normalizer']}, "
        f"{model['heads']} head{'s' if model['heads'] != 1 else ''})" if "heads" in model else
        f"- **Attention**: {model['attention']} ({model['score']} score, {model['normalizer']})",
        f"- **Encoder**: `{model['encoder']}`, {model['annotation_dim']}-dimensional annotations on a "
        f"{config['grid'][0]}x{config['grid'][1]} grid, images {w}x{h} px",
        f"- **Decoder**: LSTM, hidden size {model['hidden_dim']}, embedding {model['embed_dim']}, "
        f"vocabulary {model['vocab_size']} tokens (tokenizer `{config['tokenizer']}`), captions of at most "
        f"{config['max_caption_len']} tokens",
        f"- **Trained on**: {data}",
        *([f"- **Encoder weights**: {_encoder_weights(meta['encoder_weights'])}"] if meta.get("encoder_weights")
          else []),
        f"- **Familiarity record**: {'yes' if config.get('familiarity') else 'no'} (every caption says how like "
        "the training images its image is)",
        "",
        "## Figures", "",
    ]
    if figures:
        parts += ["| metric | split | value |", "|---|---|---|"]
        parts += [f"| {figure_name(m)} | {s} | {v:.4g} |" for m, s, v in figures]
        parts += ["", "Recorded by training on its validation split"
                  + _validation_size(meta.get("val_images")) + "; measured again with:", "",
                  "```", f"captioner evaluate --weights {name} --data DATA_FOLDER --split val", "```", ""]
    else:
        parts += ["The checkpoint recorded no figures. Measure them with:", "",
                  "```", f"captioner evaluate --weights {name} --data DATA_FOLDER --split test", "```", ""]
    parts += ["## Use", "",
              "captioner is not on the package index: install it from its clone's folder "
              "(`pip install PATH/TO/captioner`). Then, from the folder that holds "
              f"`{name}/` (a path is taken before a bundled model's name):", "", "```",
              f"captioner caption --weights {name} photo.jpg", "```", ""]
    if config.get("onnx"):
        parts += ["Without torch (onnxruntime, numpy and pillow only; captioner's docs/export.md):", "", "```",
                  "pip install onnxruntime numpy pillow && pip install --no-deps PATH/TO/captioner",
                  f"python -m captioner.onnx {name} photo.jpg --beam-size 3", "```", ""]
    parts += ["## Files", "",
              f"- `{fmt.CONFIG}`: architecture, preprocessing, tokenizer, length limit, captioner version",
              f"- `{fmt.WEIGHTS}`: the weights; `{fmt.VOCAB}`: the vocabulary"]
    if config.get("familiarity"):
        parts.append(f"- `{fmt.FAMILIARITY}`: the training images' feature record (familiarity)")
    if config.get("onnx"):
        q = config["onnx"].get("int8")
        int8 = "" if not q else " with weights stored in int8 and fp16, computed in fp32" \
            if q.get("form") == "weights" else \
            " quantised to int8 (the encoder calibrated on images, the step dynamically)"
        parts.append(f"- `{fmt.ENCODER_ONNX}`, `{fmt.STEP_ONNX}`: the encoder and one decoder step{int8} "
                     f"(ONNX opset {config['onnx']['opset']}); the beam search runs outside the graph")
        beside = fmt.weight_files(config)
        if beside:
            parts.append(f"- {', '.join(f'`{name}`' for name in beside)}: the graphs' weights, which each graph "
                         "reads from beside it")
    return "\n".join(parts) + "\n"
