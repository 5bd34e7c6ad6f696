"""The project's tokenizer against the COCO evaluation toolkit's (pycocoevalcap's PTBTokenizer).

PTBTokenizer runs Stanford's PTBTokenizer (java) with ``-lowerCase`` and then drops the
tokens in its PUNCTUATIONS list. That list spells the bracket tokens in upper case
(``-LRB-``) while the tokens come out lower-cased, so ``-lrb-``/``-rrb-`` survive; and
``&``, ``%``, ``#``, ``$`` are not in the list either. The table below is what the toolkit
gives (checked live against java in the last test).
"""

from __future__ import annotations

import pytest

from captioner.data.vocab import tokenize
from captioner.evaluation.metrics import java_available

TABLE = [
    ("A dog sits. It is on the grass.", "a dog sits it is on the grass"),
    ("A man, a woman and a child.", "a man a woman and a child"),
    ("A dog's bone is on the man's plate.", "a dog 's bone is on the man 's plate"),
    ("The dogs' toys aren't here, don't touch.", "the dogs toys are n't here do n't touch"),
    ("A cat (orange) on a mat.", "a cat -lrb- orange -rrb- on a mat"),
    ("A {curly} and [square] word", "a -lcb- curly -rcb- and -lsb- square -rsb- word"),
    ("A black-and-white photo of a T-shirt.", "a black-and-white photo of a t-shirt"),
    ("Two people at 3.5 p.m. with 1,000 balloons.", "two people at 3.5 p.m. with 1,000 balloons"),
    ('A sign reads "STOP" near the road!', "a sign reads stop near the road"),
    ("What is this? A U.S. flag.", "what is this a u.s. flag"),
    ("A  man   with  spaces.\n", "a man with spaces"),
    ("Cats & dogs; birds: all 100% #1 $5 fun...", "cats & dogs birds all 100 % # 1 $ 5 fun"),
    ("A girl's bike -- red -- by the  door.", "a girl 's bike red by the door"),
    ("It's 10:30 on a 12/25 sign at St. Mary's.", "it 's 10:30 on a 12/25 sign at st. mary 's"),
    ("Mr. Smith's car, e.g. a Ford.", "mr. smith 's car e.g. a ford"),
    ("A 'quoted' word and `ticks`.", "a quoted word and ticks"),
    ("Dr. Who and I'm cannot gonna wanna", "dr. who and i 'm can not gon na wan na"),
    ("the end .", "the end"),
    ("A man wearing a hat , standing", "a man wearing a hat standing"),
    ("people watching a tv.", "people watching a tv"),
    ("U.S.A. and a.m.", "u.s.a. and a.m."),
    ("A café with naïve décor", "a café with naïve décor"),
    ("A man 's hat", "a man 's hat"),
    ("There's a 12-year-old boy. He's at the o'clock tower.",
     "there 's a 12-year-old boy he 's at the o'clock tower"),
    ("Two dogs play.  One runs.\n", "two dogs play one runs"),
    ("A plate of food, a fork, and a knife.", "a plate of food a fork and a knife"),
    ("The letter B. Then a dog.", "the letter b then a dog"),  # one letter and a stop: no abbreviation
]


@pytest.mark.parametrize("caption, expected", TABLE)
def test_tokenize_matches_the_coco_toolkit(caption: str, expected: str) -> None:
    assert " ".join(tokenize(caption)) == expected


def test_full_stop_inside_a_caption_is_its_own_token() -> None:
    # "sits." would be a different vocabulary word from "sits", and BLEU would miss it.
    assert tokenize("A dog sits. It is") == ["a", "dog", "sits", "it", "is"]


@pytest.mark.skipif(not java_available(), reason="PTBTokenizer needs java")
def test_table_is_what_pycocoevalcap_gives() -> None:
    pytest.importorskip("pycocoevalcap")
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    got = PTBTokenizer().tokenize({i: [{"caption": c}] for i, (c, _) in enumerate(TABLE)})
    assert {i: got[i][0] for i in range(len(TABLE))} == {i: e for i, (_, e) in enumerate(TABLE)}

