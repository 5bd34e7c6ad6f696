"""Caption an image and see where the model looked for every word.

Run with ``captioner app`` or ``streamlit run app/streamlit_app.py``. This page is UI only:
loading, captioning and the overlays all come from the ``captioner`` library.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import replace
from pathlib import Path

import streamlit as st
from streamlit.runtime.uploaded_file_manager import DeletedFile

from captioner import inference
from captioner.app import page
from captioner.app.pictures import Picture
from captioner.app.serving import (
    Shown,
    app_device,
    app_precision,
    caption_gate,
    caption_image,
    figure_png,
    forget_upload,
    logged_run,
    pixel_limit,
    result_json,
    results_cache,
    settle_heap,
)
from captioner.data.images import ImageLoadError, ImageTooLargeError
from captioner.inference import Captioner, DecodeOptions
from captioner.io import bundled
from captioner.io.checkpoint import CheckpointError
from captioner.io.folder import is_model_folder
from captioner.model.attention import HARD_INFERENCE
from captioner.search.decoding import CaptionResult

EXAMPLES_DIR = Path(__file__).parent / "examples"
# A local file: an emoji or material icon here would make the browser fetch it from a public CDN.
PAGE_ICON = Path(__file__).parent / "icon.png"
UPLOAD_TYPES = ["jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"]
MOST_CHARS = 300  # the character budget slider's end: alt text asks for 125 to 150 characters


class Html:
    """HTML for st.html, taken as it is. A plain string is dedented and stripped first, a scan of
    every character that costs more than the rest of the element for a result's pictures."""

    __slots__ = ("body",)

    def __init__(self, body: str):
        self.body = body

    def _repr_html_(self) -> str:
        return self.body


STYLE = Html(page.STYLE)


# The toggle above the result: what the word maps show (captioner.explain's kinds, or None: the attention).
MAPS = {"attention": None, "gradcam": "gradcam", "gradinput": "gradinput"}
MAP_NAMES = {"attention": "Where it looked (attention)", "gradcam": "What made it say it (Grad-CAM)",
             "gradinput": "What made it say it (gradient × input)"}


def available_models() -> dict[str, str]:
    """Label -> weights for Captioner.load: the installed bundled models, then *.pt in the weights folder,
    then the model folders `captioner export` wrote there."""
    models = {m.name: m.name for m in bundled.installed()}
    folder = Path(os.environ.get("CAPTIONER_WEIGHTS_DIR", "weights"))
    if folder.is_dir():
        found = sorted(folder.glob("*.pt")) + sorted(p for p in folder.iterdir() if is_model_folder(p))
        for path in found:
            models[path.name if path.name not in models else str(path)] = str(path)
    return models


def own_limit(weights: str) -> int:
    """The longest caption a model was trained on (Captioner.max_len), the default length
    limit; the usual default where it cannot be loaded (the page says why, further on)."""
    try:
        path = inference.resolve_weights(weights)
        return load_captioner(str(path), path.stat().st_mtime).max_len
    except (CheckpointError, OSError):
        return DecodeOptions.max_len


def length_unit(weights: str) -> str:
    """What a model's caption length counts: "characters" for a Chinese or Japanese model
    (its tokens are characters), else "words"."""
    try:
        path = inference.resolve_weights(weights)
        unit = load_captioner(str(path), path.stat().st_mtime).vocab.tokenizer.unit
    except (CheckpointError, OSError):
        return "words"
    return "characters" if unit == "characters" else "words"


@st.cache_resource(show_spinner="Loading the model…", max_entries=4)
def load_captioner(weights: str, modified: float) -> Captioner:
    # `modified` only joins the cache key, so that a checkpoint rewritten in place is loaded again.
    captioner = Captioner.load(weights, device=app_device()).use_precision(app_precision())
    settle_heap()
    return captioner


def _markdown_text(text: str) -> str:
    return re.sub(r"([\\`*_{}\[\]()#+\-.!|<>~$])", r"\\\1", text)


def _clause(error: BaseException) -> str:
    """An error's message as markdown, without its closing full stop: the page's sentence goes on."""
    return _markdown_text(str(error).rstrip().rstrip("."))


def _unreadable(error: ImageLoadError) -> str:
    if isinstance(error, ImageTooLargeError):  # the visitor cannot raise it, whoever runs the app can
        return f"{_clause(error)}; the app's limit is raised with `captioner app --max-pixels N`"
    return _clause(error)


def no_model_message() -> None:
    folder = os.environ.get("CAPTIONER_WEIGHTS_DIR", "weights")
    demos = ", ".join(f"`{name}`" for name in bundled.DEMOS)
    st.warning("No captioning model is available yet.")
    st.markdown(
        f"""
The page offers the bundled demo models ({demos}) when they are installed,
and every checkpoint (`*.pt`) and exported model folder in the folder `{folder}` (set
`CAPTIONER_WEIGHTS_DIR` to use another).

To get one, train the small demo model on the synthetic shapes data (about half an hour on a CPU),
then put its best checkpoint in that folder and reload this page:

```bash
captioner train --config train/configs/shapes-soft.toml --run-dir runs/shapes-soft
mkdir -p {folder} && cp runs/shapes-soft/best.pt {folder}/shapes-soft.pt
```
""")


def sidebar(models: dict[str, str]) -> tuple[str, DecodeOptions]:
    """The settings. The length slider starts at the chosen model's longest training caption
    (own_limit); each model keeps its own slider, so a length chosen for one is not read as
    "left alone" for another."""
    with st.sidebar:
        st.header("Settings")
        label = st.selectbox("Model", list(models),
                             help="Bundled demo models, and the checkpoints (*.pt) and exported model folders "
                                  "found in the weights folder (CAPTIONER_WEIGHTS_DIR, default ./weights).")
        beam = st.slider("Beam size", 1, 10, 3,
                         help="How many candidate captions the search keeps at every step. 1 is greedy "
                              "decoding: fastest, sometimes worse.")
        limit, unit = own_limit(models[label]), length_unit(models[label])
        max_len = st.slider(f"Longest caption ({unit})", 1, max(50, limit), limit, key=f"max_len:{label}",
                            help=f"Starts at the model's own longest training caption, {limit} {unit}.")
        # A slider needs two values at least: with beam 1 there is one caption to list.
        num = st.slider("Captions to list", 1, beam, min(3, beam),
                        help="The beam's best finished captions, with their log-probabilities; the first is "
                             "the caption. Up to this many: those that had ended when the search stopped."
                        ) if beam > 1 else 1
        chars = st.slider("Most characters (0: any length)", 0, MOST_CHARS, 0, key="max_chars",
                          help="A budget for alt text (125 is the common guideline): the best caption whose "
                               "text is at most this many characters, found by the search among those that fit, "
                               "never cut.")
        st.markdown("The model follows *Show, Attend and Tell* "
                    "([Xu et al., 2015](https://arxiv.org/abs/1502.03044)): a CNN looks at the image, an LSTM "
                    "writes the caption, and an attention step picks the image regions for every word.")
    return label, DecodeOptions(beam_size=beam, max_len=max_len, num_captions=num, max_chars=chars or None)


def shapes_notice(captioner: Captioner, label: str) -> str | None:
    """What to show beside the caption of a model that knows the synthetic shapes only (the demos)."""
    if not captioner.shapes_only:
        return None
    who = f"{'Demo model: ' if captioner.bundled else ''}{_markdown_text(label)}"
    return (f"**{who} is trained on synthetic shapes only** ({bundled.SHAPES}). It describes any picture, a "
            "photograph too, as coloured shapes. For photographs, train a model on photographs "
            "(see the README) and put its checkpoint in the weights folder.")


def unfamiliar_notice(result: CaptionResult, label: str) -> str | None:
    """What to say when the image in front of the user is unlike the model's training images."""
    fam = result.familiarity
    if fam is None or not fam.unfamiliar:
        return None
    return (f"**This picture is unlike the pictures {_markdown_text(label)} was trained on** (familiarity "
            f"{fam.value:.3f}: the share of its training pictures that are at least as unusual; below "
            f"{fam.threshold:g} is unfamiliar). Its caption says more about the training pictures than about "
            "this one.")


def familiarity_text(result: CaptionResult) -> str:
    fam = result.familiarity
    return "familiarity unknown" if fam is None else f"familiarity {fam.value:.2f}"


def alternatives_list(result: CaptionResult) -> str | None:
    """The search's best captions as a numbered list, best first (with a length penalty: by the
    rank the search used, shown); None when there is one."""
    if len(result.alternatives) < 2:
        return None
    rows = [f"{i}. {_markdown_text(a.caption) or '(no words)'} · log p {a.score:.2f}"
            + ("" if a.rank is None else f" · rank {a.rank:.3f} (log p / length^penalty)")
            for i, a in enumerate(result.alternatives, 1)]
    return "The search's best captions:\n\n" + "\n".join(rows)


def model_card(captioner: Captioner) -> None:
    """The sidebar's model card: what the model was trained on, then its shape."""
    with st.sidebar.container(key="model_card"):
        st.subheader("Model card", anchor=False)
        data = captioner.training_data
        if captioner.demo is not None:
            trained = (f"{captioner.demo.training_data} only ({captioner.demo.description}): a demo model shipped "
                       "with captioner")
        elif data is None:
            trained = "not recorded in this checkpoint"
        else:
            trained = _markdown_text(data)
        st.markdown(f"**Trained on:** {trained}")
        st.caption(model_details(captioner))


def model_details(captioner: Captioner) -> str:
    cfg = captioner.model.config
    h, w = captioner.preprocess.size
    parts = [f"{cfg.attention} attention", f"{cfg.encoder} encoder", f"{w}×{h} input",
             f"{len(captioner.vocab):,} {'characters' if captioner.vocab.tokenizer.unit == 'characters' else 'words'}"]
    if "step" in captioner.meta:
        steps = captioner.meta["step"]
        parts.append(f"trained {steps:,} step{'s' if steps != 1 else ''}")
    return " · ".join(parts)


def _take_upload(upload) -> None:
    """A file the uploader holds that the page has not taken yet (its file_id is new) becomes
    the page's own: the session's "upload", shown until the next one or a picked example.

    Why here, in the run, and with one uploader for the page's life (a fixed key): an upload made
    while the last one's run is still going lands in the uploader that run draws, and Streamlit
    sends the uploader's full value with every later rerun, so whichever run comes last finds
    it. An uploader replaced after each upload (a new key) was unmounted under a file still on
    its way, and that file reached no run at all (docs/app-serving.md). The bytes are read into
    the session before anything is shown, so a run cut short by the next rerun loses nothing."""
    if upload is None or isinstance(upload, DeletedFile) or upload.file_id == st.session_state.get("upload_id"):
        return
    st.session_state["upload"] = upload.name, upload.getvalue()
    st.session_state["upload_id"] = upload.file_id
    forget_upload(upload)  # the session holds the bytes; later runs see the file as deleted, same file_id
    st.session_state["example"] = None  # no example picked, until the user picks one


def choose_image() -> tuple[str, bytes] | None:
    """The last upload, else the chosen example: (name, raw bytes). None: neither, keep what is shown."""
    _take_upload(st.file_uploader("Upload an image", type=UPLOAD_TYPES, key="uploader",
                                  help="JPEG, PNG, WebP, BMP, GIF (first frame) or TIFF. Transparent "
                                       "pixels are seen on white."))
    examples = sorted(EXAMPLES_DIR.glob("*.png"))
    if "example" not in st.session_state:
        st.session_state["example"] = 0 if examples else None  # a new page starts with the first example
    if examples:
        names = [p.stem.replace("-", " ") for p in examples]
        st.pills("…or try an example", range(len(examples)), format_func=lambda i: names[i], key="example",
                 wrap=True, on_change=lambda: st.session_state.pop("upload", None))
    pick = st.session_state.get("example")
    if pick is not None and pick < len(examples):
        return examples[pick].name, examples[pick].read_bytes()
    return st.session_state.get("upload")  # the last upload: shown again with new settings


def show_result(shown: Shown, model_label: str, options: DecodeOptions, hard_model: bool,
                notice: str | None = None) -> None:
    result = shown.result
    if result.no_fit is not None:
        st.warning(_markdown_text(result.no_fit.message(shown.name)))
        return
    with st.container(key="caption"):
        st.header(_markdown_text(result.caption) if result.words else "(no words)", anchor=False)
    if result.words:  # each word shaded by how doubtful it is, its probability in a tooltip
        st.html(Html(page.word_probs_html(result.words, result.word_probs)))
    unlike = unfamiliar_notice(result, model_label)
    if unlike:  # this image, beside the fixed notice of a shapes-only model
        st.warning(unlike)
    if notice:  # right under the caption, where a photograph's "three objects ..." is read
        st.warning(notice)
    hard = f" · hard attention: {options.hard_attention}" if hard_model else ""
    waited = f" (after {shown.waited:.1f} s waiting for the model)" if shown.waited >= 0.05 else ""
    budget = "" if options.max_chars is None else f" · at most {options.max_chars} characters"
    st.caption(f"{shown.name} · {model_label} · beam {options.beam_size} · up to {options.max_len} words{hard}"
               f"{budget} · {shown.seconds * 1000:.0f} ms{waited} · log-probability {result.score:.2f} · "
               f"{familiarity_text(result)}")
    others = alternatives_list(result)
    if others:
        st.markdown(others)
    if not result.words:
        st.info("The model ended the caption before its first word, so there is no attention to show.")
        return
    # The picker, the big view and the grid with their pictures: one element, no request, no rerun;
    # a panel clicked picks its word.
    st.html(Html(shown.view))
    stem = Path(shown.name).stem
    buttons = st.container(horizontal=True)
    # Callables: made on the click (a figure costs several times the caption), not for every caption.
    buttons.download_button("Download the figure (PNG)", lambda: figure_png(shown, model_label),
                            file_name=f"{stem}-{shown.explain or 'attention'}.png", mime="image/png",
                            on_click="ignore")
    buttons.download_button("Download the result (JSON)", lambda: result_json(shown),
                            file_name=f"{stem}-caption.json", mime="application/json", on_click="ignore")


def show_last(left, right, captioner: Captioner, label: str, options: DecodeOptions, path: Path,
              modified: float, explain: str | None) -> None:
    """No image chosen: the last one shown stays, while it was made with these settings."""
    shown, picture = st.session_state.get("shown"), st.session_state.get("picture")
    if shown is None or picture is None or shown.key != (picture.digest, str(path), modified, options, explain):
        right.info("Upload an image, or pick an example, to get a caption.")
        return
    show_preview(left, picture, shown.name)
    show_all(right, shown, captioner, label, options)


def show_preview(left, picture: Picture, name: str) -> None:
    # Inside the page, not a media file: one request less per upload. The photo is defined here once
    # for the page (page.photo_var): a result drawn on the same JPEG (the big view, the grid) draws
    # it from here rather than carrying it again, and the browser decodes it once.
    left.html(Html(page.preview_html(picture, name)))


def show_all(right, shown: Shown, captioner: Captioner, label: str, options: DecodeOptions) -> None:
    with right:
        show_result(shown, label, options, captioner.model.decoder.attention.phi.stochastic,
                    shapes_notice(captioner, label))


def main() -> None:
    st.set_page_config(page_title="Show, Attend and Tell", page_icon=str(PAGE_ICON), layout="wide")
    st.title("Show, attend and tell", anchor=False)
    st.markdown("Upload a picture and the model describes it in words; then, for every word, see which part "
                "of the picture it was looking at when it wrote that word.")

    models = available_models()
    if not models:
        no_model_message()
        return
    label, options = sidebar(models)
    weights = models[label]
    try:
        path = inference.resolve_weights(weights)
        modified = path.stat().st_mtime
        captioner = load_captioner(str(path), modified)
    except (CheckpointError, OSError) as e:
        st.error(f"Cannot load the model **{_markdown_text(label)}**: {_clause(e)}. "
                 "Pick another model in the sidebar.")
        return
    if captioner.model.decoder.attention.phi.stochastic:
        mode = st.sidebar.radio(
            "Hard attention looks at", list(HARD_INFERENCE), format_func=lambda look: HARD_INFERENCE[look].describes,
            help="A hard-attention model picks one region per word. At inference it can use the expected "
                 "mix of regions (deterministic), the single most likely region, or a random draw.")
        options = replace(options, hard_attention=mode)
    model_card(captioner)
    # The stylesheet of the preview and the result: style only, so it takes no place on the page; sent
    # with the page, it stays while the fragment below reruns.
    st.html(STYLE)
    image_and_result(captioner, label, options, path, modified)


@st.fragment
def image_and_result(captioner: Captioner, label: str, options: DecodeOptions, path: Path, modified: float) -> None:
    """The upload, the examples and the result: a fragment, so that an upload or a picked example
    reruns this part alone (the title, the sidebar and the model card stay as they are)."""
    with logged_run() as run:
        show_image_and_result(run, captioner, label, options, path, modified)


def show_image_and_result(run: dict, captioner: Captioner, label: str, options: DecodeOptions, path: Path,
                          modified: float) -> None:
    left, right = st.columns([2, 3], gap="large")
    with left:
        chosen = choose_image()
    explain = MAPS[right.radio("The maps show", list(MAPS), format_func=MAP_NAMES.get, horizontal=True, key="maps",
                               help="Where the model looked before each word (its attention), or what in the "
                                    "image made it say the word: a gradient map of the word's probability, "
                                    "Grad-CAM on the encoder's last feature map or gradient × input on the "
                                    "annotation vectors. The gradient maps cost one backward pass per word.")]
    run["what"] = "-" if chosen is None else chosen[0]
    if chosen is None:
        show_last(left, right, captioner, label, options, path, modified, explain)
        return
    name, data = chosen
    digest = hashlib.sha256(data).hexdigest()
    # One per session: the last upload, decoded once for the model it is captioned with.
    picture, held = st.session_state.get("picture"), st.session_state.get("decoded")
    if picture is None or picture.digest != digest or held is None or held[0] != (digest, captioner.preprocess):
        try:
            picture, decoded = Picture.decode(digest, data, captioner.preprocess, pixel_limit())
        except ImageLoadError as e:
            left.error(f"Cannot read **{_markdown_text(name)}**: {_unreadable(e)}. Try another file.")
            return
        held = ((digest, captioner.preprocess), decoded)  # the caption below draws on them
        st.session_state["picture"], st.session_state["decoded"] = picture, held
    decoded = held[1]
    show_preview(left, picture, name)

    key = (digest, str(path), modified, options, explain)
    shown = st.session_state.get("shown")
    if shown is None or shown.key != key or shown.name != name:
        shown = shared = results_cache().get(key)  # an example, or the same photo from another student
        if shared is not None:
            shown = replace(shared, name=name, waited=0.0)
        else:
            with right:
                waiting = st.empty()
                waiting.html(Html(page.WRITING))

                def queued(ahead: int) -> None:
                    waiting.info(f"Waiting for the model: {ahead} {'caption' if ahead == 1 else 'captions'} "
                                 "ahead of yours…")

                try:
                    shown = caption_image(captioner, caption_gate(), key, name, data, options, picture, decoded,
                                          queued, explain)
                except RuntimeError as e:  # e.g. out of memory on a huge batch of beams
                    right.error(f"Captioning failed: {_clause(e)}.")
                    return
                finally:
                    waiting.empty()
            results_cache().put(key, replace(shown, waited=0.0))
            run["model_cpu"] = shown.cpu
        st.session_state["shown"] = shown
    show_all(right, shown, captioner, label, options)


if __name__ == "__main__":  # streamlit runs the page as __main__; importing it runs nothing
    main()
