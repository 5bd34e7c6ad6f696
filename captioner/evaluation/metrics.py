"""Caption metrics as the field reports them: BLEU-1..4, METEOR, ROUGE-L, CIDEr.

The scorers are pycocoevalcap's (the COCO caption evaluation code). Two deliberate
differences from its ``COCOEvalCap`` driver:

- Tokenisation of references and candidates uses :func:`captioner.data.vocab.tokenize` (the
  tokenizer the vocabulary is built with) instead of running the Stanford PTBTokenizer
  in java. It reproduces that tokenizer's output on captions (full stops inside a
  caption, commas, clitics, brackets as ``-lrb-``, hyphens, numbers; a table is checked
  against java in the tests), so the scores are the official script's.
- SPICE is left out: it needs a separate model download.

Other languages are scored on the tokens of their data set's tokenizer (the one the
model's vocabulary was built with): BLEU, ROUGE-L and CIDEr count n-grams of whatever
tokens they are given, so on Chinese they are character n-gram scores (comparable only
with other character-level figures). METEOR matches English stems, synonyms
and paraphrases: it is computed for the "ptb" tokenizer only.

BLEU is corpus-level (clipped n-gram counts and lengths are summed over all images
before the precision and brevity penalty are computed), as in the COCO evaluation;
ROUGE-L is the mean over images; CIDEr's IDF weights come from the references passed in,
so CIDEr depends on the whole set being scored.

METEOR runs a java subprocess (the jar ships with pycocoevalcap); it is used only when
``java`` is on PATH, and the subprocess is always shut down before returning.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from captioner.data.vocab import PTB, Tokenizer

METRIC_NAMES: tuple[str, ...] = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")

# Stand-in for an empty candidate, for METEOR only. Some versions of pycocoevalcap's
# METEOR wrapper and jar mis-handle an empty hypothesis line (the reply goes missing, so
# the read blocks or fails to parse); one made-up alphanumeric word is safe everywhere.
# It is not an English word, so METEOR's exact, stem, synonym and paraphrase matchers
# never match it: that image scores 0, as an empty caption should, and the corpus score
# only counts one extra unmatched hypothesis word. BLEU, ROUGE-L and CIDEr handle empty
# strings themselves and see the true empty caption.
EMPTY_PLACEHOLDER = "emptycaptionplaceholder"


def java_available() -> bool:
    return shutil.which("java") is not None


def meteor_wanted(meteor: bool | None, tokenizer: Tokenizer = PTB) -> bool:
    """Whether METEOR runs for a request (``caption_metrics``'s ``meteor``) on captions
    tokenised by ``tokenizer``: None, when java is available and the captions are English;
    True, always, or ValueError (not English) / RuntimeError (no java); False, never. Asked
    before a long decode too, so that a request that cannot be met fails at once."""
    if meteor and tokenizer is not PTB:
        raise ValueError(f"METEOR scores English only; these captions are tokenised as {tokenizer.name}")
    if meteor is None:
        return tokenizer is PTB and java_available()
    if meteor and not java_available():
        raise RuntimeError("METEOR needs java on PATH (it runs pycocoevalcap's meteor-1.5.jar); "
                           "install a Java runtime or pass meteor=False")
    return bool(meteor)


def caption_metrics(references: Mapping[int, Sequence[str]], candidates: Mapping[int, str],
                    meteor: bool | None = None, tokenizer: Tokenizer = PTB) -> dict[str, float]:
    """Score ``candidates`` (one caption per image id) against ``references`` (several per id).

    Both dicts must have the same image ids: a candidate with no references cannot be
    scored, and a reference image without a candidate usually means decoding skipped it.
    ``meteor``: None runs METEOR when java is available and the captions are English
    (``tokenizer`` "ptb"), True requires it, False skips it. ``tokenizer``: the data set's.

    Returns floats under the keys of :data:`METRIC_NAMES`, in that order ("METEOR" only
    when it ran).
    """
    meteor = meteor_wanted(meteor, tokenizer)

    gts, res = _prepare(references, candidates, tokenizer)

    # Imported where scoring needs it, not with this module.
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError as e:
        raise ImportError("caption metrics need pycocoevalcap, a dependency of captioner: "
                          "pip install pycocoevalcap") from e

    scores: dict[str, float] = {}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)  # verbose=1 prints to stdout
    for n, value in enumerate(bleu, start=1):
        scores[f"BLEU-{n}"] = float(value)
    if meteor:
        scores["METEOR"] = _meteor(gts, res)[0]
    scores["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return scores


def meteor_scores(references: Mapping[int, Sequence[str]],
                  candidates: Mapping[int, str]) -> tuple[float, dict[int, float]]:
    """METEOR alone: the corpus score and each image's score (needs java on PATH).

    Per-image scores help find the worst captions; the corpus score is what
    :func:`caption_metrics` reports (METEOR aggregates its statistics over the corpus,
    so it is not the mean of the per-image scores).
    """
    if not java_available():
        raise RuntimeError("METEOR needs java on PATH (it runs pycocoevalcap's meteor-1.5.jar)")
    return _meteor(*_prepare(references, candidates))


def _meteor(gts: dict[int, list[str]], res: dict[int, list[str]]) -> tuple[float, dict[int, float]]:
    ids = list(gts)
    safe_res = {k: [c if c else EMPTY_PLACEHOLDER] for k, [c] in res.items()}
    with _meteor_scorer() as scorer:
        corpus, per_image = scorer.compute_score(gts, safe_res)
    return float(corpus), {k: float(v) for k, v in zip(ids, per_image)}


def coco_results_json(candidates: Mapping[int, str]) -> list[dict[str, Any]]:
    """Candidates in the COCO results format, ``[{"image_id": ..., "caption": ...}]``, by id."""
    return [{"image_id": int(image_id), "caption": caption} for image_id, caption in sorted(candidates.items())]


def _prepare(references: Mapping[int, Sequence[str]], candidates: Mapping[int, str],
             tokenizer: Tokenizer = PTB) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """Check the ids and tokenise both sides into pycocoevalcap's {id: [space-joined tokens]}."""
    if not candidates:
        raise ValueError("no candidates to score")
    missing_refs = sorted(set(candidates) - set(references))
    missing_cands = sorted(set(references) - set(candidates))
    if missing_refs or missing_cands:
        raise ValueError(
            f"references and candidates must cover the same images: {len(missing_refs)} candidate(s) "
            f"without references (e.g. {missing_refs[:5]}), {len(missing_cands)} reference image(s) "
            f"without a candidate (e.g. {missing_cands[:5]})")

    gts: dict[int, list[str]] = {}
    res: dict[int, list[str]] = {}
    for image_id in sorted(candidates):
        refs = [" ".join(tokenizer.scored(r)) for r in references[image_id]]
        # A reference with no words would make ROUGE-L match the empty string; drop it.
        refs = [r for r in refs if r]
        if not refs:
            raise ValueError(f"image {image_id} has no non-empty reference caption")
        gts[image_id] = refs
        res[image_id] = [" ".join(tokenizer.scored(candidates[image_id]))]
    return gts, res


@contextmanager
def _meteor_scorer() -> Iterator[Any]:
    """pycocoevalcap's Meteor, with its java subprocess shut down on exit.

    Meteor only stops java in ``__del__``, which first takes a lock that compute_score
    leaves held if it fails midway: that finaliser would then block forever. The subclass
    replaces it with an idempotent, lock-free close that is called right here.
    """
    from pycocoevalcap.meteor.meteor import Meteor

    class _ClosingMeteor(Meteor):
        def close(self, read_stderr: bool = False) -> str:
            """Stop java (idempotent); with ``read_stderr``, return what it wrote there."""
            proc = getattr(self, "meteor_p", None)
            if proc is None:
                return ""
            self.meteor_p = None
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:  # broken pipe: java is already gone
                    pass
            # The jar has no graceful shutdown command and holds no state worth saving.
            proc.kill()
            proc.wait()
            err = ""
            if read_stderr and proc.stderr is not None:
                err = proc.stderr.read().decode(errors="replace").strip()[-2000:]
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            return err

        def __del__(self) -> None:
            self.close()

    scorer = _ClosingMeteor()
    try:
        yield scorer
    except ValueError as e:
        # A reply that is not a number (typically empty) means java failed, e.g. it could
        # not reserve the 2 GB heap the wrapper asks for; its stderr says why.
        raise RuntimeError(f"METEOR failed: {e}; java said: {scorer.close(read_stderr=True)!r}") from e
    finally:
        scorer.close()
