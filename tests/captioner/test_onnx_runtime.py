"""The torch-free runtime (python -m captioner.onnx): its numpy search is the project's search,
its graphs give torch's numbers, its JSON lines are `captioner caption`'s, and it runs with
torch impossible to import."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from captioner.cli.main import main as cli_main
from captioner.inference import Captioner, DecodeOptions
from captioner.io import folder as fmt
from captioner.io.export import export
from captioner.model.familiarity import TrainingFeatures, pooled
from captioner.onnx import search as npsearch
from captioner.onnx.runtime import OnnxCaptioner
from captioner.onnx.runtime import main as onnx_main
from captioner.search import decoding
from captioner.search.options import Tokens
from captioner.search.record import significant
from tests.badtensors import CORRUPTIONS
from tests.builders import one_line, torch_step
from tests.tiny import tiny_captioner, tiny_config, tiny_image

ROOT = Path(__file__).resolve().parents[2]


def with_familiarity(cap: Captioner) -> Captioner:
    """The tiny captioner with a familiarity record fitted on its own features of 12 images."""
    batch = torch.stack([cap.preprocess(tiny_image(100 + i, (40, 30))) for i in range(12)])
    with torch.no_grad():
        cap.familiarity = TrainingFeatures.fit(pooled(cap.model.encode(batch).vectors), data="tiny images")
    return cap


@pytest.fixture(scope="module")
def model(tmp_path_factory, onnx_registry_once) -> tuple[Captioner, Path]:
    """A tiny captioner and its folder, exported with --onnx once for the module (the slow part)."""
    cap = with_familiarity(tiny_captioner(seed=5))
    folder = tmp_path_factory.mktemp("onnx") / "tiny"
    export(cap, folder, onnx=True)
    return cap, folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("images")
    paths = []
    for i in range(6):
        tiny_image(i, (40 + 3 * i, 30)).save(root / f"im{i}.png")
        paths.append(str(root / f"im{i}.png"))
    (root / "broken.png").write_bytes(b"not an image")
    return paths


def prepared(cap: Captioner, seed: int, b: int):
    images = torch.stack([cap.preprocess(tiny_image(seed * 10 + i, (40, 30))) for i in range(b)])
    dec = cap.model.decoder
    with torch.no_grad():
        ann = dec.annotate(cap.model.encode(images))
        keys = dec.attention.prepare(ann.vectors)
        h, c = dec.init_state(ann.vectors)
    return ann, keys, h, c


@pytest.mark.parametrize("beam,max_len,penalty,n", [(1, 6, 0.0, 1), (3, 6, 0.0, 1), (3, 2, 0.0, 1), (4, 5, 0.7, 1),
                                                    (2, 1, 0.0, 1), (3, 6, 0.0, 3), (4, 5, 0.7, 2), (2, 3, 0.0, 2)])
def test_the_numpy_search_is_the_torch_search(beam, max_len, penalty, n):
    for seed in range(4):
        cap = tiny_captioner(seed=seed)
        dec, _v = cap.model.decoder, cap.vocab
        ann, keys, h, c = prepared(cap, seed, 5)
        tokens = cap.tokens
        options = DecodeOptions(beam_size=beam, max_len=max_len, length_penalty=penalty, num_captions=n)
        args = (torch_step(dec, ann.grid), ann.vectors.numpy(), keys.numpy(), h.numpy(), c.numpy())
        if beam == 1:
            ours = decoding.greedy(dec, ann, tokens, options)
            theirs = npsearch.greedy(*args, tokens, options)
        else:
            ours = decoding.beam_search(dec, ann, tokens, options)
            theirs = npsearch.beam_search(*args, tokens, options)
        for a, b in zip(ours, theirs, strict=True):
            assert b.ids == a.ids
            assert [r.ids for r in b.runners_up] == [r.ids for r in a.runners_up]
            assert [r.score for r in b.runners_up] == pytest.approx([r.score for r in a.runners_up], abs=1e-5)
            assert b.score == pytest.approx(a.score, abs=1e-5)
            np.testing.assert_allclose(b.log_probs, a.log_probs.numpy(), atol=1e-5)
            np.testing.assert_allclose(b.heads, a.alphas_heads.numpy(), atol=1e-6)
            np.testing.assert_allclose(b.betas, a.betas.numpy(), atol=1e-6)
            assert len(b.ids) <= max_len + 1


class Table:
    """A step whose next-word log-probabilities depend on the previous word only (a table)."""

    def __init__(self, table: dict[int, dict[int, float]], vocab: int):
        self.logp = np.full((vocab, vocab), -np.inf, dtype=np.float32)
        for prev, nxt in table.items():
            for word, p in nxt.items():
                self.logp[prev, word] = np.log(p)

    def __call__(self, word, h, c, ann, keys):
        n = len(word)
        return self.logp[word], h, c, np.full((n, 1, 4), 0.25, np.float32), np.ones(n, np.float32)


def table_search(table: Table, **options):
    z = np.zeros((1, 4, 2), np.float32)
    return npsearch.beam_search(table, z, z, np.zeros((1, 3), np.float32), np.zeros((1, 3), np.float32),
                                Tokens(start=1, end=2, pad=0), DecodeOptions(**options))[0]


@pytest.mark.parametrize("k", [1, 3, 6])
def test_the_partitioned_top_k_is_the_stable_sort_ties_and_infinities_included(k):
    rng = np.random.default_rng(k)
    rows = [rng.standard_normal(300).astype(np.float32),  # no ties
            np.round(rng.standard_normal(300), 1).astype(np.float32),  # ties everywhere, at the k-th too
            np.full(300, npsearch.NINF), np.full(300, np.float32(-2.5))]  # all tied
    rows[2][[7, 150, 299]] = [-1.0, -1.0, -3.0]  # fewer finite than k for k = 6: -inf ties fill the rest
    rows[3][[5, 250]] = 0.0
    rows.append(rng.random(300).astype(np.float32) - 2)  # two equal largest, no tie at the k-th for k > 2:
    rows[4][[200, 10]] = 5.0  # the partition's own path orders them by index
    x = np.stack(rows)
    expected = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(npsearch._topk(x, k), expected)
    for row in x:  # row by row too: the whole-row fallback of one row must not decide for the others
        np.testing.assert_array_equal(npsearch._topk(row[None], k), np.argsort(-row, kind="stable")[None, :k])


def test_n_captions_search_until_the_nth_best_cannot_be_beaten():
    # <start> -> <end> 0.5 | A 0.5;  A -> <end> 0.9 | B 0.1;  B -> <end> 1
    table = Table({1: {2: 0.5, 3: 0.5}, 3: {2: 0.9, 4: 0.1}, 4: {2: 1.0}}, vocab=5)
    best = table_search(table, beam_size=3, max_len=5)
    # N = 1: done at once, the empty caption (log 0.5) being as good as any open beam can become
    assert best.ids == [2] and best.runners_up == []
    two = table_search(table, beam_size=3, max_len=5, num_captions=2)
    assert two.ids == [2] and [r.ids for r in two.runners_up] == [[3, 2]]
    assert two.runners_up[0].score == pytest.approx(np.log(0.45), abs=1e-6)
    three = table_search(table, beam_size=3, max_len=5, num_captions=3)
    assert [r.ids for r in three.runners_up] == [[3, 2], [3, 4, 2]]
    assert three.runners_up[1].score == pytest.approx(np.log(0.05), abs=1e-6)


def test_only_ended_captions_among_the_best_k_join_the_pool():
    # k = 1: "<end>" at once (0.4) ranks second to "A" (0.6), so it never joins; then "A <end>" (0.36)
    table = Table({1: {3: 0.6, 2: 0.4}, 3: {2: 0.6, 4: 0.4}, 4: {2: 1.0}}, vocab=5)
    found = table_search(table, beam_size=1, max_len=4)
    assert found.ids == [3, 2] and found.score == pytest.approx(np.log(0.36), abs=1e-6)


def test_after_max_len_words_only_end_may_come():
    # A -> B 0.95 | <end> 0.05;  B -> C 0.99 | <end> 0.01: of the captions of at most 2 words
    # "A" is the best finished one; "A B", cut off, would rank higher if the limit only cut
    table = Table({1: {3: 1.0}, 3: {4: 0.95, 2: 0.05}, 4: {5: 0.99, 2: 0.01}}, vocab=6)
    found = table_search(table, beam_size=2, max_len=2)
    assert found.ids == [3, 2] and found.score == pytest.approx(np.log(0.05), abs=1e-6)
    likely_end = Table({1: {3: 1.0}, 3: {4: 0.95, 2: 0.05}, 4: {5: 0.5, 2: 0.5}}, vocab=6)
    assert table_search(likely_end, beam_size=2, max_len=2).ids == [3, 4, 2]  # the end at the last step
    never = Table({1: {3: 1.0}, 3: {3: 1.0}}, vocab=4)  # <end> has p = 0: cut off at max_len words
    cut = table_search(never, beam_size=2, max_len=2)
    assert cut.ids == [3, 3] and cut.score == 0.0


def assert_captions_as_torch(cap: Captioner, rt: OnnxCaptioner, images: list[str]) -> list:
    """The runtime's captions of ``images`` are the torch captioner's, greedy and in a beam
    search of 3, with <unk> never a word and allowed: the same words, and scores, maps, gates and
    word probabilities to 1e-4. Returns the beam search's with <unk> allowed (an untrained model's
    likeliest word: its captions have words whose maps are compared)."""
    for beam, allow_unk in ((1, False), (3, False), (1, True), (3, True)):
        opts = DecodeOptions(beam_size=beam, max_len=8, allow_unk=allow_unk)
        ours = cap.caption_images(images, opts)
        theirs = rt.caption_files(images, opts)
        for a, b in zip(ours, theirs, strict=True):
            assert b.text == a.caption and b.words == a.words
            assert b.score == pytest.approx(a.score, abs=1e-4)
            np.testing.assert_allclose(b.alphas, a.alphas.numpy(), atol=1e-4)
            np.testing.assert_allclose(b.betas, a.betas.numpy(), atol=1e-4)
            np.testing.assert_allclose(b.word_probs, a.word_probs, atol=1e-4)
            if a.familiarity is not None:
                assert b.familiarity == a.familiarity.value and b.unfamiliar == a.familiarity.unfamiliar
    return list(zip(ours, theirs))


@pytest.mark.slow  # the module's ONNX export, seconds of tracing
def test_the_graphs_caption_as_torch_does(model, images):
    cap, folder = model
    pairs = assert_captions_as_torch(cap, OnnxCaptioner(folder), images[:6])
    assert all(a.familiarity is not None for a, _ in pairs)
    assert len({b.familiarity for _, b in pairs}) > 1  # not all the same value: the test could tell them apart


@pytest.mark.slow  # the module's ONNX export
def test_int8_parity_s_teacher_forced_log_prob_is_the_search_s_score(model, images):
    """benchmarks/int8_parity.py measures how near a tie two captions are by teacher forcing:
    on the search's own caption it must give the search's score (no length penalty)."""
    from benchmarks.int8_parity import caption_log_prob, tie_gaps

    rt = OnnxCaptioner(model[1])
    pixels = np.stack([rt.preprocess.array(rt.preprocess.load(p)) for p in images[:4]])
    caps = rt.caption_arrays(pixels, rt.options(beam_size=3))
    assert any(c.words for c in caps)
    for x, c in zip(pixels, caps):
        assert caption_log_prob(rt, x, c.words) == pytest.approx(c.score, abs=1e-4)
    short = rt.caption_arrays(pixels, rt.options(beam_size=3, max_len=1))  # other captions, scored the same way
    differ = [(a, b) for a, b in zip(caps, short) if a.text != b.text]
    assert differ
    gaps = tie_gaps(rt, pixels, caps, short)
    assert gaps == pytest.approx([a.score - b.score for a, b in differ], abs=1e-4)


# Every attention the exporter takes, one export each: each score with two heads, the other
# options (normaliser, mode, local window and its width, grid self-attention, coordinates)
# spread over them. Mean attention has one head only (the model refuses more). Each with the
# seed of a tiny model whose beam search gives captions of some words, not only <end>.
VARIANTS = {
    "additive": (5, dict(heads=2)),
    "concat-sparsemax": (5, dict(heads=2, score="concat", normalizer="sparsemax")),
    "dot-hard": (5, dict(heads=2, score="dot", attention="hard")),
    "scaled_dot-local": (6, dict(heads=2, score="scaled_dot", local_window=1.5)),
    "general-sparsemax-local-learned": (6, dict(heads=2, score="general", normalizer="sparsemax", local_window=1.5,
                                                local_width="learned")),
    "cosine-grid-coords": (5, dict(heads=2, score="cosine", grid_layers=1, grid_heads=2, coords=True)),
    "mean": (5, dict(attention="mean")),
}


def test_the_variants_cover_every_attention_option():
    """A score, normaliser, mode or width added to the registries must join VARIANTS."""
    from captioner.model.attention import LOCAL_WIDTHS, MODES, NORMALIZERS, SCORES

    seen = [tiny_config(**options) for _, options in VARIANTS.values()]
    assert {c.score for c in seen} == set(SCORES) and {c.normalizer for c in seen} == set(NORMALIZERS)
    assert {c.attention for c in seen} == set(MODES)
    assert {c.local_width for c in seen if c.local_window > 0} == set(LOCAL_WIDTHS)
    assert any(c.grid_layers for c in seen) and any(c.coords for c in seen)
    assert all(c.heads == 2 for c in seen if c.attention != "mean")


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory, onnx_registry_once) -> tuple[Captioner, OnnxCaptioner]:
    """A tiny captioner of one VARIANTS entry, exported by `captioner export --onnx` once for
    the module, and its folder in the runtime."""
    seed, options = VARIANTS[request.param]
    cap = tiny_captioner(seed=seed, **options)
    root = tmp_path_factory.mktemp(request.param)
    cap.save(root / "model.pt")
    assert cli_main(["export", str(root / "model.pt"), "--out", str(root / "folder"), "--onnx"]) == 0
    return cap, OnnxCaptioner(root / "folder")


@pytest.mark.slow  # an ONNX export per variant, seconds of tracing each
def test_the_graphs_give_torchs_numbers_for_every_attention(variant):
    """The encoder graph and the step graph against the torch model, on 3 images and 5 rows
    (counts the export did not trace with): each head's map, not only their mean."""
    cap, rt = variant
    dec = cap.model.decoder
    images = torch.stack([cap.preprocess(tiny_image(70 + i, (40, 30))) for i in range(3)])
    with torch.no_grad():
        ann = dec.annotate(cap.model.encode(images))
        keys = dec.attention.prepare(ann.vectors)
        h0, c0 = dec.init_state(ann.vectors)
        features = pooled(cap.model.encode(images).vectors)
    graph = rt.encode(images.numpy())
    for ours, theirs in zip((ann.vectors, keys, h0, c0, features), graph, strict=True):
        np.testing.assert_allclose(theirs, ours.numpy(), atol=1e-5)
    assert graph[1].shape == tuple(keys.shape)  # (B, heads, L, K) with several heads
    rows = torch.tensor([0, 2, 1, 1, 2])  # each row its image's annotations and keys
    g = torch.Generator().manual_seed(1)
    word = torch.randint(4, len(cap.vocab), (5,), generator=g)
    h = torch.randn(5, h0.shape[1], generator=g)
    c = torch.randn(5, c0.shape[1], generator=g)
    inputs = (word, h, c, ann.vectors[rows].contiguous(), keys[rows].contiguous())
    ours = torch_step(dec, ann.grid)(*(x.numpy() for x in inputs))
    theirs = rt.step(*(x.numpy() for x in inputs))
    for name, a, b in zip(("log_probs", "h", "c", "alpha", "beta"), ours, theirs, strict=True):
        assert b.shape == a.shape, name
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=name)
    assert ours[3].shape == (5, dec.attention.num_heads, ann.vectors.shape[1])


@pytest.mark.slow  # an ONNX export per variant, seconds of tracing each
def test_every_attention_the_exporter_takes_captions_as_torch_does(variant, images):
    cap, rt = variant
    pairs = assert_captions_as_torch(cap, rt, images[:4])
    assert any(a.words for a, _ in pairs)  # not every caption empty: some maps were compared


@pytest.mark.slow
def test_the_json_lines_are_those_of_captioner_caption(model, images, capsys):
    cap, folder = model
    assert cli_main(["caption", *images[:3], "--weights", str(folder), "--max-len", "6", "--with-attention",
                     "--quiet"]) == 0
    theirs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert onnx_main([str(folder), *images[:3], "--max-len", "6", "--with-attention"]) == 0
    ours = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for a, b in zip(theirs, ours, strict=True):
        assert set(a) == set(b)
        for key in ("image", "caption", "words", "familiarity", "unfamiliar", "model", "training_data"):
            assert b.get(key) == a.get(key), key
        for key in ("score", "word_probs", "alphas", "betas", "end_prob"):
            np.testing.assert_allclose(b[key], a[key], atol=2e-4, err_msg=key)
        total = sum(np.log(b["word_probs"])) + np.log(b["end_prob"])  # score = sum log p(word) + log p(<end>)
        assert total == pytest.approx(b["score"], abs=1e-3)


@pytest.mark.slow
def test_several_captions_and_a_broken_image(model, images, tmp_path):
    _, folder = model
    out = tmp_path / "lines.jsonl"
    broken = str(Path(images[0]).parent / "broken.png")
    code = onnx_main([str(folder), images[0], broken, "--beam-size", "3", "--num-captions", "2", "--out", str(out)])
    assert code == 1  # one image failed, the other captioned
    first, second = (json.loads(line) for line in out.read_text().splitlines())
    assert first["alternatives"][0] == {"caption": first["caption"], "score": first["score"]}
    assert 1 <= len(first["alternatives"]) <= 2
    assert second["image"] == broken and "error" in second


def test_probabilities_keep_four_significant_digits():
    assert significant(0.000123456) == 0.0001235 and significant(0.99996) == 1.0 and significant(0.0) == 0.0


@pytest.mark.slow
def test_the_runtime_runs_with_torch_impossible_to_import(model, images, tmp_path):
    _, folder = model
    script = f"""
import importlib.abc, json, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchvision", "nltk"):
            raise ImportError(f"{{name}} is not installed here")
sys.meta_path.insert(0, Blocker())
import captioner
from captioner.onnx.runtime import main
code = main([{str(folder)!r}, {images[0]!r}, "--beam-size", "2", "--out", {str(tmp_path / "o.jsonl")!r}])
print(json.dumps({{"code": code, "torch": "torch" in sys.modules, "nltk": "nltk" in sys.modules}}))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 0, "torch": False, "nltk": False}
    line = json.loads((tmp_path / "o.jsonl").read_text())
    assert line["image"] == images[0] and line["words"] and line["familiarity"] is not None


@pytest.mark.slow
def test_a_folder_without_graphs_or_with_one_missing_is_refused(model, images, tmp_path, capsys):
    cap, folder = model
    export(cap, tmp_path / "plain")
    assert onnx_main([str(tmp_path / "plain"), images[0]]) == 2
    assert "no ONNX graphs" in capsys.readouterr().err
    shutil.copytree(folder, tmp_path / "cut")
    (tmp_path / "cut" / fmt.STEP_ONNX).unlink()
    assert onnx_main([str(tmp_path / "cut"), images[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fmt.STEP_ONNX in err[0]
    shutil.copytree(folder, tmp_path / "no-data")
    (tmp_path / "no-data" / fmt.ENCODER_DATA).unlink()  # the graph without the weights it points to
    assert onnx_main([str(tmp_path / "no-data"), images[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fmt.ENCODER_DATA in err[0] and "weights" in err[0]
    with pytest.raises(SystemExit) as e:
        onnx_main([str(folder), images[0], "--beam-size", "0"])
    assert e.value.code == 2


@pytest.mark.slow  # reads the module's ONNX export
@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS)
def test_a_corrupt_familiarity_file_is_refused_in_one_line(model, images, corrupt, tmp_path, capsys):
    """The runtime reads one safetensors file, the familiarity record (the weights are in the
    graphs): broken any way, it is one line and exit code 2."""
    _, folder = model
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    path = copy / fmt.FAMILIARITY
    path.write_bytes(corrupt(path.read_bytes()))
    assert onnx_main([str(copy), images[0]]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("python -m captioner.onnx: error: ") and str(path) in line


@pytest.mark.slow
def test_a_character_budget_gives_captioner_caption_s_captions_and_names_an_image_none_fits(model, images,
                                                                                           capsys):
    from dataclasses import replace

    from captioner.data.vocab import Spelling

    cap, folder = model
    flags = ["--max-len", "6", "--beam-size", "3", "--max-chars", "8"]
    assert cli_main(["caption", *images[:4], "--weights", str(folder), *flags, "--quiet"]) == 0
    theirs = [json.loads(line)["caption"] for line in capsys.readouterr().out.splitlines()]
    assert onnx_main([str(folder), *images[:4], *flags]) == 0
    ours = [json.loads(line)["caption"] for line in capsys.readouterr().out.splitlines()]
    assert ours == theirs and all(0 < len(c) <= 8 for c in ours)
    rt = OnnxCaptioner(folder)
    rt.words = [("aa" if w == "a" else w) for w in rt.words]  # no word of one character: a budget of 1 fits none
    s = rt.special
    rt.tokens = replace(rt.tokens, spelling=Spelling.of(rt.words, rt.tokenizer, (s["pad"], s["start"], s["end"])))
    [missed] = rt.caption_files(images[:1], rt.options(beam_size=3, max_len=6, max_chars=1))
    free = rt.caption_files(images[:1], rt.options(beam_size=3, max_len=6, num_captions=3))[0]
    assert missed.words == [] and missed.no_fit.max_chars == 1
    assert missed.no_fit.shortest == min((text for text, _ in free.alternatives), key=len)


def test_onnxruntimes_threads_sleep_between_runs_unless_asked_to_spin(model):
    """Two sessions take turns (the encoder, then a step per word): threads of one left spinning
    take the cores the other needs, which on 2 cores made a caption at batch 1 half as slow
    again (docs/export.md). So each session's threads sleep between runs; --spin lets them spin."""
    _, folder = model
    key = "session.intra_op.allow_spinning"
    for spin, said in ((False, "0"), (True, "1")):
        rt = OnnxCaptioner(folder, threads=2, spin=spin)
        for session in (rt.encoder, rt.decoder):
            assert session.get_session_options().get_session_config_entry(key) == said
            assert session.get_session_options().intra_op_num_threads == 2
    from captioner.io import quantize

    timed = quantize.load_graphs({n: folder / n for n in (fmt.ENCODER_ONNX, fmt.STEP_ONNX)})
    assert [s.get_session_options().get_session_config_entry(key) for s in timed] == ["0", "0"]  # as the runtime


def test_the_command_passes_spin_on(model, images, monkeypatch):
    from captioner.onnx.runtime import build_parser

    _, folder = model
    made = []
    real = OnnxCaptioner.__init__

    def init(self, *args, **kwargs):
        made.append(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(OnnxCaptioner, "__init__", init)
    for flags, spin in (([], False), (["--spin"], True)):
        assert onnx_main([str(folder), images[0], *flags]) == 0
        assert made.pop()["spin"] is spin
    assert "--spin" in build_parser().format_help()
