"""The page's markup: the upload's preview, and a captioned image as one element.

The rules are static, in page.css beside this file, read once and sent as the page's
stylesheet (``STYLE``). What is made here carries only what belongs to one image: its pictures
and its aspect as CSS custom properties, its words, and which input each part belongs to.

A captioned image is plain HTML, no script, and picking a word makes no rerun: the picker is a
group of radio inputs, one per (word, head choice), each in a ``.word`` with everything that
shows that pair (the word's pill, the head row, the big view with its map over the photo, the
note, the word's panel in the grid), and page.css shows what is in the ``.word`` whose input is
checked. So picking a word costs the server nothing and the browser one repaint; a grid panel
is a label of its word's input, so clicking it picks that word. With several heads there is
one ``.head-group`` of words per head choice (the heads' mean first); a head's pill checks the
same word's input in that head's group, so the word stays picked.

Each picture travels once: a picture is a custom property, defined once and drawn by name.
The upload's preview defines the photo for the whole page (``--img-<digest>``); a result drawn
on another picture (a model that crops) defines its own photo; the result's element defines
its map layers, which its big view and its panels draw.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import torch

from captioner.app.pictures import Key, Picture
from captioner.overlay import TINT

STYLE = (f"<style>:root {{ --captioner-tint: rgb{TINT}; }}\n"
         f"{(Path(__file__).parent / 'page.css').read_text(encoding='utf-8')}</style>")
# The gradient maps (captioner.explain), as the page names how each is made.
GRADIENT_MAPS = {"gradcam": "Grad-CAM on the encoder's last feature map",
                 "gradinput": "gradient × input on the annotation vectors"}
# Shown while the model writes: page.css reveals it after half a second, so a quick caption (most are)
# never flashes it, and the server starts no timer for it (st.spinner starts a thread per caption).
WRITING = '<p class="captioner-writing">Writing a caption…</p>'


@dataclass(frozen=True)
class Word:
    label: str  # as the picker shows it ("a (2)" for a second "a")
    note: str  # under the big view: "“a”: word 1 of 9, β = 0.52"
    panel: str  # under the grid's panel: "a · β 0.52"


def word_probs_html(words: list[str], probs: tuple[float, ...]) -> str:
    """The caption's words, each shaded by how doubtful the model was of it (page.css: the lower
    its probability --p, the stronger the shade) with its probability in a tooltip."""
    spans = [f'<span class="word-prob" style="--p: {p:.3f}" title="p = {p:.4g} given the words before it">'
             f"{html.escape(w)}</span>" for w, p in zip(words, probs)]
    return f'<p class="captioner-probs">{" ".join(spans)}</p>'


def word_labels(words: list[str]) -> list[str]:
    """Labels the reader tells apart: "a", "star", "a (2)"."""
    seen: dict[str, int] = {}
    labels = []
    for w in words:
        seen[w] = seen.get(w, 0) + 1
        labels.append(w if seen[w] == 1 else f"{w} ({seen[w]})")
    return labels


def words_of(words: list[str], betas: torch.Tensor) -> list[Word]:
    labels, n = word_labels(words), len(words)
    return [Word(labels[t], f"“{w}”: word {t + 1} of {n}, β = {float(b):.2f}", f"{w} · β {float(b):.2f}")
            for t, (w, b) in enumerate(zip(words, betas))]


def photo_var(picture: Picture) -> str:
    """The custom property that holds the upload's preview on the page: the preview defines it,
    and a result drawn on the same JPEG draws it from there."""
    return f"img-{picture.digest[:16]}"


def preview_html(picture: Picture, name: str) -> str:
    """The upload as the page shows it, inside the page (no media file, no request), and the
    page's definition of its photo."""
    photo = photo_var(picture)
    return (f"<style>:root {{ --{photo}: url({picture.preview_uri}); }}</style>"
            f'<figure class="captioner-preview" style="--photo: var(--{photo}); '
            f'--aspect: {picture.width} / {picture.height}">'
            f'<div class="photo" role="img" aria-label="the image"></div>'
            f"<figcaption>{html.escape(name)} ({picture.width}×{picture.height})</figcaption></figure>")


def _hc(head: int | None) -> str:
    """CSS name of a head choice: the mean (None) or head j."""
    return "hm" if head is None else f"h{head}"


def result_html(prefix: str, words: list[Word], layers: dict[Key, str], photo: str, aspect: float,
                grid: tuple[int, int], heads: int = 1, explain: str | None = None) -> str:
    """The word picker, the picked word's map over the photo, and the grid of every word's map:
    one element. ``prefix``: unique on the page (the inputs' name and ids); ``layers``: data URIs,
    (t, None) for every word, and with ``heads`` > 1 also (t, j) for every head j; ``photo``: a
    CSS image, ``var(--img-…)`` (the preview's definition, see ``photo_var``) or ``url(data:…)``;
    ``aspect``: the photo's width / height; ``grid``: the maps' (H, W); ``explain``: the layers are
    that kind's gradient maps, and the text says so. The custom properties are data URIs and
    numbers: nothing in them needs escaping."""
    choices = [None] if heads <= 1 else [None, *range(heads)]
    values = [f"--photo: {photo}", f"--aspect: {aspect:.5f}",
              *(f"--l{t}{_hc(c)}: url({uri})" for (t, c), uri in layers.items())]

    def pair(t: int, c: int | None) -> str:  # the id of the input that shows word t, head choice c
        return f"{prefix}-w{t}-{_hc(c)}"

    def word(t: int, c: int | None, w: Word) -> str:
        me, layer = pair(t, c), f'style="--layer: var(--l{t}{_hc(c)})"'
        head_row = "" if len(choices) == 1 else (
            '<div class="heads"><span>Head</span>'
            + "".join(f'<label class="pill{" picked" if d == c else ""}" for="{pair(t, d)}">'
                      f'{"mean" if d is None else d + 1}</label>' for d in choices)
            + "</div>")
        return (f'<div class="word"><input type="radio" name="{prefix}" id="{me}"'
                f'{" checked" if t == 0 and c is None else ""}>'
                f'<label class="pill" for="{me}">{html.escape(w.label)}</label>{head_row}'
                f'<div class="view"><div class="big" role="img" aria-label="the image" {layer}></div></div>'
                f'<p class="note">{html.escape(w.note)}</p>'
                f'<label class="cell" for="{me}"><div class="pic" {layer}></div>'
                f"<span>{html.escape(w.panel)}</span></label></div>")

    groups = "".join('<div class="head-group">' + "".join(word(t, c, w) for t, w in enumerate(words)) + "</div>"
                     for c in choices)
    if explain is None:
        heading = "Every word, where the model looked"
        intro = (f"<p>The model writes the caption one word at a time. Before each word it spreads its attention "
                 f"<b>α</b> over a {grid[0]}×{grid[1]} grid of image regions; the panels light up those regions "
                 f"(brightest, orange: most weight) and darken the rest. <b>β</b> is the gate on what it saw: near "
                 f"1 the image mattered for that word, near 0 the word came mostly from the sentence so far (words "
                 f"like <i>a</i> or <i>and</i>). Click a panel to pick its word.</p>")
    else:
        heading = "Every word, what made the model say it"
        how = GRADIENT_MAPS[explain]
        intro = (f"<p>For each word, the regions of the {grid[0]}×{grid[1]} grid whose features raised the "
                 f"word's probability, by {how} (brightest, orange: most). The attention shows where the model "
                 f"looked before a word; this shows what in the image spoke for it. Click a panel to pick its "
                 f"word.</p>")
    return (f'<div class="captioner-result" style="{"; ".join(values)}"><span class="row-name">Word</span>'
            f"{groups}<h3>{heading}</h3>{intro}"
            '<div class="cell"><div class="pic"></div><span>the image</span></div></div>')
