"""The decoding options, checked once where they are made: the rule of each field and its edges,
the command lines' flags held to the same rules, and the torch-free runtime checking them
without the ``captioner`` command's module."""

import argparse
import math
import subprocess
import sys

import pytest

from captioner.cli.main import main
from captioner.onnx.runtime import main as onnx_main
from captioner.search.options import MAX_WORDS, DecodeOptions, OptionError, Tokens, count, parser

# (field, a value just inside its rule, one just outside)
EDGES = [("beam_size", 1, 0), ("max_len", 1, 0), ("num_captions", 1, 0), ("length_penalty", 0.0, -1e-9),
         ("unfamiliar_below", 0.0, -1e-9), ("unfamiliar_below", 1.0, 1.0 + 1e-9),
         ("hard_attention", "sample", "samples"), ("allow_unk", True, 1), ("max_chars", 1, 0)]


@pytest.mark.parametrize("field, good, bad", EDGES)
def test_each_field_takes_its_edge_and_refuses_one_step_past_it(field, good, bad):
    assert getattr(DecodeOptions(**{field: good}), field) == good
    with pytest.raises(OptionError) as e:
        DecodeOptions(**{field: bad})
    assert e.value.option == field and e.value.value == bad
    assert isinstance(e.value, ValueError)  # what the Python API has always raised


@pytest.mark.parametrize("field, bad", [("beam_size", 2.0), ("beam_size", True), ("max_len", "20"),
                                        ("length_penalty", math.nan), ("length_penalty", math.inf),
                                        ("unfamiliar_below", math.nan), ("num_captions", None)])
def test_values_of_the_wrong_kind_are_refused_not_coerced(field, bad):
    with pytest.raises(OptionError, match=field):
        DecodeOptions(**{field: bad})


def test_num_captions_may_equal_the_beam_size_not_exceed_it():
    assert DecodeOptions(beam_size=4, num_captions=4).num_captions == 4
    with pytest.raises(OptionError) as e:
        DecodeOptions(beam_size=4, num_captions=5)
    assert e.value.for_command().startswith("--num-captions 5: more than the beam size (4)")


def test_a_model_trained_on_long_captions_may_decode_past_the_flag_s_cap():
    assert DecodeOptions(max_len=MAX_WORDS + 20).max_len == MAX_WORDS + 20
    assert parser("max_len")(str(MAX_WORDS)) == MAX_WORDS
    with pytest.raises(argparse.ArgumentTypeError, match=f"at most {MAX_WORDS} words, got {MAX_WORDS + 1}"):
        parser("max_len")(str(MAX_WORDS + 1))


@pytest.mark.parametrize("field, kind, text, message", [
    ("beam_size", int, "0", "must be >= 1, got 0"), ("beam_size", int, "2.5", "not a whole number: '2.5'"),
    ("length_penalty", float, "-1", "must be a number >= 0"), ("length_penalty", float, "nan", ">= 0"),
    ("unfamiliar_below", float, "2", "must be a share from 0 to 1, got 2"),
    ("unfamiliar_below", float, "x", "not a number: 'x'")])
def test_a_flag_is_held_to_its_field_s_rule_as_argparse_reads_it(field, kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parser(field, kind)(text)


def test_counts_that_are_not_options_start_at_one():
    assert count("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        count("0")


def test_greedy_is_width_one_without_a_length_penalty():
    assert DecodeOptions(beam_size=1).greedy
    assert not DecodeOptions(beam_size=1, length_penalty=0.5).greedy
    assert not DecodeOptions(beam_size=2).greedy


def test_unk_is_never_a_word_unless_the_options_allow_it():
    tokens = Tokens(start=1, end=2, pad=0, unk=3)
    assert tokens.never(DecodeOptions()) == (1, 0, 3)
    assert tokens.never(DecodeOptions(allow_unk=True)) == (1, 0)
    assert Tokens(start=1, end=2, pad=0).never(DecodeOptions()) == (1, 0)  # a vocabulary without <unk>


def test_the_caption_command_refuses_options_before_any_work_in_one_line(tmp_path, capsys):
    image = tmp_path / "nowhere.png"  # never read: the options are refused first
    assert main(["caption", str(image), "--beam-size", "3", "--num-captions", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-captions 4: more than the beam size (3)" in err


def test_the_runtime_refuses_the_same_options_in_the_same_words(tmp_path, capsys):
    assert onnx_main([str(tmp_path / "no-model"), str(tmp_path / "x.png"), "--beam-size", "2",
                      "--num-captions", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--num-captions 3: more than the beam size (2)" in err
    with pytest.raises(SystemExit) as e:
        onnx_main([str(tmp_path), "x.png", "--max-len", str(MAX_WORDS + 1)])
    assert e.value.code == 2 and f"at most {MAX_WORDS} words" in capsys.readouterr().err


def test_the_runtime_checks_its_options_without_the_caption_command_s_module():
    code = ("import sys, captioner.onnx.runtime; "
            "print(sorted(m for m in sys.modules if m.startswith(('captioner.cli', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_captioner_command_without_torch_says_what_to_use_in_one_line():
    """A torch-free install (the runtime's) has the `captioner` command too: it names the runtime's
    command and exits 2, for --help as for any subcommand, never with a traceback."""
    code = ("import importlib.abc, sys\n"
            "class Blocker(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('no torch here')\n"
            "sys.meta_path.insert(0, Blocker())\n"
            "from captioner.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    for args in (["--help"], ["caption", "x.png"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout == "", args
        assert done.stderr.count("\n") == 1 and "python -m captioner.onnx FOLDER IMAGES" in done.stderr, done.stderr
