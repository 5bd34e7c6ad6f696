"""A captioned image as two pieces of plain HTML: the word picker with the picked word's map over
the image, and the grid of every word's map. No script and no rerun: the picker is a group of
radio inputs, and CSS (``:checked ~``) shows the picked word's layer, so picking a word costs the
server nothing and the browser one repaint; the pictures (app/pictures.py) travel inside the
HTML (data URIs), so a result costs no request either. Each picture travels once: it is a custom
property of the page's root (``--name: url("data:...")``), defined by one element and drawn by
the others as a background (the upload's preview defines the photo; the picker, the layers).

Layers are keyed by (word, head); head None is the map a word's step used (the heads' mean
when a model has several heads). With several heads a second radio group picks the head (the
mean first), and CSS shows the layer of the picked word and head, in the big view and the grid.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from app.pictures import Key, Picture
from captioner.overlay import TINT


def photo_var(picture: Picture) -> str:
    """The custom property that holds the upload's preview on the page (picture_defs): the page
    defines it with the preview, and a result shown on the same JPEG draws it from there."""
    return f"img-{picture.digest[:16]}"


def picture_defs(pictures: dict[str, str]) -> str:
    """CSS naming each picture (name -> data URI) once for the whole page: ``var(--name)``
    draws it anywhere, so the picker, the big view and the grid share one copy."""
    return ":root {" + "".join(f' --{name}: url("{uri}");' for name, uri in pictures.items()) + " }"


def layer_var(prefix: str, t: int, head: "int | None") -> str:
    """The custom property holding word t's layer of ``head`` in the result ``prefix``."""
    return f"{prefix}-l{t}{_hc(head)}"


def _layer(prefix: str, t: int, head: "int | None", classes: str) -> str:
    """An element drawing word t's layer of ``head`` (defined once by the picker), for the big view or a panel."""
    return f'<div class="layer {classes}" style="background-image: var(--{layer_var(prefix, t, head)})"></div>'


def word_labels(words: list[str]) -> list[str]:
    """Labels the reader tells apart: "a", "star", "a (2)"."""
    seen: dict[str, int] = {}
    labels = []
    for w in words:
        seen[w] = seen.get(w, 0) + 1
        labels.append(w if seen[w] == 1 else f"{w} ({seen[w]})")
    return labels


def words_of(words: list[str], betas: torch.Tensor) -> list["Word"]:
    labels, n = word_labels(words), len(words)
    return [Word(labels[t], f"“{w}”: word {t + 1} of {n}, β = {float(b):.2f}", f"{w} · β {float(b):.2f}")
            for t, (w, b) in enumerate(zip(words, betas))]


@dataclass(frozen=True)
class Word:
    label: str  # as the picker shows it ("a (2)" for a second "a")
    note: str  # under the big view: "“a”: word 1 of 9, β = 0.52"
    panel: str  # under the grid's panel: "a · β 0.52"


def _picked(prefix: str, t: int) -> str:
    return f"#{prefix}-w{t}:checked"


def _head_ids(heads: int) -> list["int | None"]:
    """The head choices of a result: None (the mean map) alone, or None and 0 .. heads - 1."""
    return [None] if heads <= 1 else [None, *range(heads)]


def _hc(head: "int | None") -> str:
    """CSS name of a head choice."""
    return "hm" if head is None else f"h{head}"


def picker_html(prefix: str, words: list[Word], photo: str, layers: dict[Key, str], aspect: float,
                heads: int = 1, photo_uri: str | None = None) -> str:
    """The word picker and the picked word's map over the photo. ``photo``: the name of the custom
    property holding the photo, defined here when ``photo_uri`` (a data URI) is given, else by another
    element of the page (the upload's preview); ``layers``: data URIs, each defined here once as
    ``layer_var(prefix, t, head)`` for the grid to draw too; ``aspect``: the photo's width / height;
    ``heads`` > 1: a head picker too, and ``layers`` holds (t, j) for every head j besides (t, None),
    the mean."""
    p = prefix
    pictures = {layer_var(p, t, c): uri for (t, c), uri in layers.items()}
    if photo_uri is not None:
        pictures[photo] = photo_uri
    choices = _head_ids(heads)
    note_rules = ",\n".join(f"{_picked(p, t)} ~ .notes .n{t}" for t in range(len(words)))
    if len(choices) == 1:
        layer_rules = ",\n".join(f"{_picked(p, t)} ~ .big .l{t}" for t in range(len(words)))
    else:  # the word's input, then the head's, then the view: both must be checked
        layer_rules = ",\n".join(f"{_picked(p, t)} ~ #{p}-{_hc(c)}:checked ~ .big .l{t}.{_hc(c)}"
                                  for t in range(len(words)) for c in choices)
    shown = f"{layer_rules},\n{note_rules}"
    marks = _label_marks([f"{p}-w{t}" for t in range(len(words))], ".words")
    if len(choices) > 1:
        marks += "\n" + _label_marks([f"{p}-{_hc(c)}" for c in choices], ".heads")
    style = f"""<style>
.{p} input {{ position: absolute; opacity: 0; pointer-events: none; }}
.{p} .words {{ display: flex; flex-wrap: wrap; gap: 0.4rem; align-items: center; margin: 0.5rem 0 0.8rem; }}
.{p} .words label {{ border: 1px solid rgba(128, 128, 128, 0.5); border-radius: 1rem; padding: 0.15rem 0.7rem;
  cursor: pointer; user-select: none; }}
{picture_defs(pictures)}
.{p} .big {{ position: relative; max-width: 560px; aspect-ratio: {aspect:.5f};
  background: var(--{photo}) center / 100% 100% no-repeat; }}
.{p} .big .layer {{ position: absolute; inset: 0; background: center / 100% 100% no-repeat; }}
.{p} .big .layer, .{p} .notes p {{ display: none; }}
.{p} .notes p {{ font-size: 0.875rem; opacity: 0.7; margin: 0.3rem 0 0; }}
{shown} {{ display: block; }}
{marks}
</style>"""
    inputs = "".join(f'<input type="radio" name="{p}-word" id="{p}-w{t}" value="{t}"{" checked" if t == 0 else ""}>'
                     for t in range(len(words)))
    labels = "".join(f'<label for="{p}-w{t}">{html.escape(w.label)}</label>' for t, w in enumerate(words))
    head_row = ""
    if len(choices) > 1:
        inputs += "".join(f'<input type="radio" name="{p}-head" id="{p}-{_hc(c)}" value="{_hc(c)}"'
                          f'{" checked" if c is None else ""}>' for c in choices)
        head_row = ('<div class="words heads"><span>Head</span>'
                    + "".join(f'<label for="{p}-{_hc(c)}">{"mean" if c is None else c + 1}</label>' for c in choices)
                    + "</div>")
    big = "".join(_layer(p, t, c, f"l{t} {_hc(c)}") for t in range(len(words)) for c in choices)
    notes = "".join(f'<p class="n{t}">{html.escape(w.note)}</p>' for t, w in enumerate(words))
    return (f'{style}<div class="{p}">{inputs}<div class="words"><span>Word</span>{labels}</div>{head_row}'
            f'<div class="big" role="img" aria-label="the image">{big}</div>'
            f'<div class="notes">{notes}</div></div>')


def _label_marks(ids: list[str], row: str) -> str:
    """CSS marking the label of the checked input (and of the focused one) among radio inputs
    ``ids`` whose labels sit in the row ``row`` (".words", ".heads")."""
    picked = ",\n".join(f"#{i}:checked ~ {row} label[for={i}]" for i in ids)
    focused = ",\n".join(f"#{i}:focus-visible ~ {row} label[for={i}]" for i in ids)
    return (f"{picked} {{ background: rgb{TINT}; border-color: rgb{TINT}; color: black; }}\n"
            f"{focused} {{ outline: 2px solid rgb{TINT}; outline-offset: 2px; }}")


def grid_html(prefix: str, words: list[Word], photo: str, aspect: float, grid: tuple[int, int],
              heads: int = 1) -> str:
    """Every word's map on the photo, small; a panel is a label of the picker's input: clicking it
    picks that word. The pictures are the picker's (``photo``: the name of the photo's custom
    property; the layers: ``layer_var``), so the page carries each once and the browser decodes it
    once; ``grid``: the maps' (H, W); ``heads`` > 1: the panels show the head picked in the picker."""
    p = prefix
    choices = _head_ids(heads)
    if len(choices) == 1:
        head_rules = ""
    else:
        head_rules = (f".{p}g .pic .layer {{ display: none; }}\n"
                      + ",\n".join(f"body:has(#{p}-{_hc(c)}:checked) .{p}g .pic .layer.{_hc(c)}" for c in choices)
                      + " { display: block; }")
    intro = (f"<p>The model writes the caption one word at a time. Before each word it spreads its attention "
             f"<b>α</b> over a {grid[0]}×{grid[1]} grid of image regions; the panels light up those regions "
             f"(brightest, orange: most weight) and darken the rest. <b>β</b> is the gate on what it saw: near 1 "
             f"the image mattered for that word, near 0 the word came mostly from the sentence so far (words "
             f"like <i>a</i> or <i>and</i>). Click a panel to pick its word.</p>")
    marked = ",\n".join(f"body:has({_picked(p, t)}) .{p}g .c{t} .pic" for t in range(len(words)))
    style = f"""<style>
.{p}g .grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 0.8rem; }}
.{p}g .cell {{ display: block; cursor: pointer; }}
.{p}g .pic {{ position: relative; aspect-ratio: {aspect:.5f}; background: var(--{photo}) center / 100% 100% no-repeat;
  outline-offset: 2px; }}
.{p}g .pic .layer {{ position: absolute; inset: 0; background: center / 100% 100% no-repeat; display: block; }}
.{p}g .cell span {{ display: block; font-size: 0.875rem; opacity: 0.7; text-align: center; margin-top: 0.2rem; }}
{marked} {{ outline: 3px solid rgb{TINT}; }}
{head_rules}
</style>"""
    cells = ['<div class="cell"><div class="pic"></div><span>the image</span></div>']  # first, as in the paper
    cells += [f'<label class="cell c{t}" for="{p}-w{t}"><div class="pic">'
              + "".join(_layer(p, t, c, _hc(c)) for c in choices)
              + f'</div><span>{html.escape(w.panel)}</span></label>' for t, w in enumerate(words)]
    return (f'{style}<div class="{p}g"><h3>Every word, where the model looked</h3>{intro}'
            f'<div class="grid">{"".join(cells)}</div></div>')
