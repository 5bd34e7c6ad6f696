"""CHAIR: how often captions name objects that are not in the image (Rohrbach et al. 2018).

An image's objects are the COCO categories of its instance annotations plus the
categories its reference captions name. A caption's object mentions are found so:

1. lower-case it and split it into words as nltk's ``word_tokenize`` does (the Treebank
   rules, a full stop ending a word split off; no downloaded data needed);
2. put each word in the singular (:func:`singularize`);
3. read two-word phrases first, left to right: "hot dog", "teddy bear", "motor bike"... name
   one object; "baby"/"adult" before an animal and "passenger" before "jet"/"train" name
   the animal or vehicle, not a person; "toilet seat" is the toilet, "bow tie" the tie;
   "home plate" and "train track" name nothing;
4. drop "seat" from a caption that names a toilet;
5. map what is left through the synonym list to the 80 categories.

``CHAIRi`` = hallucinated mentions / all mentions (each mention counts, repeats too);
``CHAIRs`` = captions with at least one hallucinated mention / captions.

The synonym list is the reference implementation's ``data/synonyms.txt``, shipped verbatim
as ``captioner/data/chair_synonyms.txt`` (one category a line, its COCO name first). It has
defects, which :class:`ObjectWords` keeps by default so that figures compare with
published ones (``corrected=True`` mends them; ``evaluate`` reports both):

- two entries begin with a space (" motor bike", " cheesecake": a doubled space after the
  comma) and so never match: "motor bike" names nothing, "cheesecake" no cake;
- "iPhone" is written with a capital and captions are lower-cased: it never matches;
- "stove top oven" has three words, but phrases are read two words at a time: it is two
  mentions of an oven ("stove", "oven");
- the reference's singular forms come from the ``pattern`` package, which strips the s of
  words that end in one: "bus", "minibus" and "airbus" become "bu", "minibu", "airbu" and
  never match (only their plurals count), "glass" becomes "glas" (the reference maps "wine
  glas" for it), "ties" becomes "ty" (never a tie), and the plurals of words in -ie stay
  plural ("doggies", "collies": no dog); :func:`singularize` gives these same forms.
  Corrected, a word in the list as written, or without its final s, is taken so.

Pure functions over strings: no model, no torch import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from nltk.tokenize import NLTKWordTokenizer

SYNONYMS_FILE = Path(__file__).parents[1] / "data" / "chair_synonyms.txt"

# Two-word phrases that name one object, read before single words (the reference's list;
# "stove top oven" is there too, and with three words it never matches).
_OBJECT_PHRASES = ("motor bike", "motor cycle", "air plane", "traffic light", "street light", "traffic signal",
                   "stop light", "fire hydrant", "stop sign", "parking meter", "suit case", "sports ball",
                   "baseball bat", "baseball glove", "tennis racket", "wine glass", "hot dog", "cell phone",
                   "mobile phone", "teddy bear", "hair drier", "potted plant", "bow tie", "laptop computer",
                   "stove top oven", "home plate", "train track")
_YOUNG_OR_GROWN = ("bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe",
                   "animal", "cub")  # "baby X" / "adult X" is the animal, not a person
_CARRIES_PASSENGERS = ("jet", "train")  # "passenger X" is the vehicle, not a person
_PHRASE_AS = {"bow tie": "tie", "toilet seat": "toilet", "wine glas": "wine glass"}

# Singular forms as the reference's ``pattern.en.singularize`` gives them. Irregular
# endings first ("policemen", "grandchildren"), then the regular ones; a word that ends in
# s and fits none of them loses the s, a singular too ("bus" -> "bu", see above).
_SAME_IN_BOTH = frozenset({"scissors", "species", "series", "news", "bison", "salmon", "trout", "tuna", "swine",
                           "shears", "pliers", "clippers", "luggage", "equipment", "furniture", "rice",
                           "diabetes", "measles", "herpes", "chassis", "christmas", "swiss", "corps"})
_IRREGULAR_ENDINGS = (("children", "child"), ("people", "person"), ("men", "man"), ("feet", "foot"),
                      ("teeth", "tooth"), ("geese", "goose"), ("oxen", "ox"), ("kine", "cow"),
                      ("leaves", "leaf"), ("loaves", "loaf"), ("mice", "mouse"), ("lice", "louse"))
_IE_NOUNS = frozenset({"doggie", "collie", "cookie", "movie", "zombie", "veggie", "hippie", "rookie", "beanie",
                       "birdie", "sweetie", "hoagie", "cutie", "junkie", "pixie", "hankie", "auntie"})
_ENDINGS = (  # (ending, replacement): the first that fits
    ("shoes", "shoe"), ("oes", "o"), ("buses", "bus"), ("xes", "x"), ("ches", "ch"), ("sses", "ss"),
    ("shes", "sh"), ("quies", "quy"),
    ("alves", "alf"), ("elves", "elf"), ("olves", "olf"), ("eaves", "eaf"), ("arves", "arf"), ("erves", "erve"),
    ("nives", "nife"), ("lives", "life"), ("wives", "wife"), ("lves", "lf"), ("rves", "rf"),
    ("aves", "ave"), ("eves", "eve"), ("oves", "ove"), ("sives", "sive"), ("tives", "tive"), ("hives", "hive"),
    ("ves", "fe"), ("s", ""))


def singularize(word: str) -> str:
    """The singular of a lower-case English noun, as the CHAIR reference computes it.

    Its quirks are kept where they change which objects a caption names: a singular
    ending in s loses it ("bus" -> "bu", "glass" -> "glas"), "ties" gives "ty", and the
    plural of a noun in -ie stays plural ("doggies"). Words that are the same in both
    numbers ("sheep", "scissors") are left alone.
    """
    if word in _SAME_IN_BOTH:
        return word
    for ending, replacement in _IRREGULAR_ENDINGS:
        if word.endswith(ending):
            return word[: len(word) - len(ending)] + replacement
    if word.endswith("ies"):
        if word[:-1] in _IE_NOUNS:  # the reference leaves these plural: "doggies", "collies" name no dog
            return word
        if len(word) > 3 and word[-4] not in "aeiouy":
            return word[:-3] + "y"
    for ending, replacement in _ENDINGS:
        if word.endswith(ending):
            return word[: len(word) - len(ending)] + replacement
    return word


_WORDS = NLTKWordTokenizer()
_STOP_AFTER_WORD = re.compile(r"^(.*\w)\.$")


def caption_words(caption: str) -> list[str]:
    """The caption's lower-cased words as the reference reads them (nltk's ``word_tokenize``:
    Treebank rules within sentences, each sentence's full stop split off)."""
    words: list[str] = []
    for token in _WORDS.tokenize(caption.lower()):
        stop = _STOP_AFTER_WORD.match(token)
        words.extend((stop.group(1), ".") if stop else (token,))
    return words


@dataclass(frozen=True)
class Mention:
    """One object a caption names: the words as read (singular, a phrase joined by a
    space), the COCO category, and where: tokens ``first`` to ``last`` of the word list."""

    words: str
    category: str
    first: int
    last: int


class ObjectWords:
    """Finds the COCO objects a caption names (the module docstring's steps 2-5).

    ``corrected``: the synonym list's entries stripped and lower-cased, three-word phrases
    read before two-word ones, and a word that is in the list as written, or once its s
    is dropped, taken so ("bus", "ties", "doggies"); False (default): the reference's behaviour, defects included.
    """

    def __init__(self, corrected: bool = False, synonyms_file: Path = SYNONYMS_FILE) -> None:
        self.corrected = corrected
        self.category_of: dict[str, str] = {}  # word or phrase -> COCO category
        for line in synonyms_file.read_text(encoding="utf-8").splitlines():
            entries = [e.strip().lower() for e in line.split(",")] if corrected else line.strip().split(", ")
            for entry in entries:
                self.category_of[entry] = entries[0]
        phrases = {p: p for p in _OBJECT_PHRASES}
        phrases.update({f"{q} {a}": a for a in _YOUNG_OR_GROWN for q in ("baby", "adult")})
        phrases.update({f"passenger {v}": v for v in _CARRIES_PASSENGERS})
        phrases.update(_PHRASE_AS)
        self.phrases = phrases
        self.longest = max(len(p.split()) for p in phrases) if corrected else 2
        self._known = frozenset(self.category_of) | {w for p in phrases for w in p.split()}

    def _singular(self, word: str) -> str:
        if self.corrected:  # the word as written, or without its s ("ties", "doggies"), when the list has it
            for form in (word, singularize(word), word[:-1] if word.endswith("s") else word):
                if form in self._known:
                    return form
        return singularize(word)

    def mentions(self, words: Sequence[str]) -> list[Mention]:
        """The object mentions in a list of lower-case words, in order."""
        singular = [self._singular(w) for w in words]
        units: list[tuple[str, int, int]] = []  # (word or phrase as read, first, last)
        i = 0
        while i < len(singular):
            for n in range(min(self.longest, len(singular) - i), 1, -1):
                phrase = " ".join(singular[i:i + n])
                if phrase in self.phrases:
                    units.append((self.phrases[phrase], i, i + n - 1))
                    i += n
                    break
            else:
                units.append((singular[i], i, i))
                i += 1
        if any(u[0] == "toilet" for u in units):  # "the seat of the toilet" is no chair
            units = [u for u in units if u[0] != "seat"]
        return [Mention(w, self.category_of[w], first, last) for w, first, last in units if w in self.category_of]

    def caption_mentions(self, caption: str) -> list[Mention]:
        """The object mentions of a caption given as text."""
        return self.mentions(caption_words(caption))

    def categories(self, caption: str) -> set[str]:
        return {m.category for m in self.caption_mentions(caption)}

    def category(self, coco_name: str) -> str:
        """The list's name for a COCO category name (its first entry: the same for all 80)."""
        return self.category_of.get(coco_name, coco_name)


@lru_cache(maxsize=2)
def object_words(corrected: bool = False) -> ObjectWords:
    """The shared :class:`ObjectWords` (the list is read once)."""
    return ObjectWords(corrected)


# ------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class ImageChair:
    """One caption's CHAIR: the objects it names (COCO categories, each mention, in
    order), those of them not among the image's objects, and the image's objects."""

    image_id: int
    named: tuple[str, ...]
    hallucinated: tuple[str, ...]
    objects: tuple[str, ...]  # sorted

    @property
    def chair_i(self) -> float | None:
        return len(self.hallucinated) / len(self.named) if self.named else None


def image_objects(instance_categories: Iterable[str], references: Iterable[str],
                  words: ObjectWords) -> frozenset[str]:
    """An image's objects: its instances' categories and those its reference captions name."""
    found = {words.category(c) for c in instance_categories}
    for ref in references:
        found |= words.categories(ref)
    return frozenset(found)


def caption_chair(image_id: int, caption: str, objects: frozenset[str], words: ObjectWords) -> ImageChair:
    named = tuple(m.category for m in words.caption_mentions(caption))
    return ImageChair(image_id, named, tuple(c for c in named if c not in objects), tuple(sorted(objects)))


@dataclass(frozen=True)
class ChairSummary:
    """A split's CHAIR, with the reference's synonym list as it is and corrected.
    ``chair_i`` is None when no caption names an object."""

    n_captions: int
    n_mentions: int
    n_hallucinated: int
    chair_s: float
    chair_i: float | None
    corrected_chair_s: float
    corrected_chair_i: float | None


def _rates(per_image: Sequence[ImageChair]) -> tuple[float, float | None, int, int]:
    mentions = sum(len(c.named) for c in per_image)
    hallucinated = sum(len(c.hallucinated) for c in per_image)
    chair_s = sum(bool(c.hallucinated) for c in per_image) / len(per_image) if per_image else 0.0
    return chair_s, (hallucinated / mentions if mentions else None), mentions, hallucinated


def chair(captions: Mapping[int, str], instance_categories: Mapping[int, Sequence[str]],
          references: Mapping[int, Sequence[str]]) -> tuple[ChairSummary, list[ImageChair]]:
    """CHAIR of ``captions`` (image id -> caption), each image's objects from its instance
    categories (COCO names; an image with none: an empty list) and its reference captions.
    The per-image records are the reference behaviour's, in image id order."""
    rates = []
    for corrected in (False, True):
        words = object_words(corrected)
        per_image = [caption_chair(i, captions[i], image_objects(instance_categories.get(i, ()),
                                                                 references.get(i, ()), words), words)
                     for i in sorted(captions)]
        rates.append(_rates(per_image))
        if not corrected:
            kept = per_image
    (chair_s, chair_i, mentions, hallucinated), (c_s, c_i, _, _) = rates
    return ChairSummary(len(kept), mentions, hallucinated, chair_s, chair_i, c_s, c_i), kept
