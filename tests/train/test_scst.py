"""Self-critical training: the CIDEr-D reward against pycocoevalcap's, the samples and
their probabilities, the baselines, learning on a fixed batch, and the training loop's
SCST phase (resume, the training split's document frequencies, offline end to end)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.cider.cider_scorer import CiderScorer

from captioner.cli.main import main
from captioner.data.images import Preprocess
from captioner.data.vocab import tokenize
from captioner.evaluation.cider import CiderD, cider_d
from captioner.evaluation.metrics import _prepare
from captioner.io.checkpoint import load_checkpoint
from captioner.io.loading import resolve_weights
from captioner.model.decoder import CaptionModel
from captioner.model.encoders import Annotations
from captioner.train.config import ScstConfig, load_config, model_config, to_toml
from captioner.train.loop import train
from captioner.train.scst import ScstObjective, sample_captions, sample_log_probs
from tests.builders import tiny_train_config
from tests.pretrained import fake_torch_home, forbid_downloads
from tests.ranks import two_ranks_ok
from tests.tiny import tiny_config, tiny_image, tiny_vocab

# A corpus of six images' references: words in every image ("a"), in one image only, and
# repeated; punctuation and capitals that the tokenizer must remove.
CORPUS = [
    ["A red square on a table.", "a red box", "red square"],
    ["A green circle.", "a green ball on grass"],
    ["a blue square", "the blue box is small", "blue"],
    ["A yellow star in the sky.", "a yellow star"],
    ["a purple circle", "purple ball on a table"],
    ["a cyan square and a red circle", "two shapes", "a red circle and a cyan square, side by side"],
]
# (image, candidate): exact matches, partial matches, repeats (clipping), long and short
# captions (the length penalty), words the corpus never saw, an empty caption.
CASES = [
    (0, "a red square on a table"),
    (0, "red square"),
    (0, "red red red red red square"),
    (0, "a red square on a table on a table on a table with a red box"),
    (1, "a green ball"),
    (1, "A green circle on grass."),
    (2, "blue"),
    (2, "a zebra eats grass"),
    (3, "a yellow star in the sky"),
    (4, "a purple ball"),
    (5, "a red circle and a cyan square"),
    (5, "two shapes side by side"),
    (5, ""),
]


def _pycocoevalcap_score(image: int, candidate: str) -> float:
    """pycocoevalcap's CiderScorer over the whole corpus (its document frequencies), the
    candidate on ``image``, every other image's candidate a dummy; the score of ``image``."""
    scorer = CiderScorer(n=4, sigma=6.0)
    for i, refs in enumerate(CORPUS):
        test = candidate if i == image else "a"
        scorer += (" ".join(tokenize(test)), [" ".join(tokenize(r)) for r in refs])
    _, scores = scorer.compute_score()
    return float(scores[image])


@pytest.mark.parametrize("image,candidate", CASES)
def test_cider_d_equals_pycocoevalcap_given_the_same_document_frequencies(image, candidate):
    cider = CiderD(CORPUS)
    ours = cider.score(candidate, cider.references(CORPUS[image]))
    assert ours == pytest.approx(_pycocoevalcap_score(image, candidate), rel=1e-9, abs=1e-12)


def test_cider_d_scores_what_the_metrics_report_as_cider():
    """The corpus form: document frequencies from the scored images' references, as the
    evaluation's pycocoevalcap Cider computes them (after the metrics' tokenisation)."""
    references = {100 + i: refs for i, refs in enumerate(CORPUS)}
    candidates = {100 + i: c for i, (_, c) in zip(range(len(CORPUS)), CASES[::2])}
    mean, per_image = cider_d(references, candidates)
    theirs_mean, theirs = Cider().compute_score(*_prepare(references, candidates))
    assert mean == pytest.approx(theirs_mean, rel=1e-9)
    assert [per_image[i] for i in sorted(references)] == pytest.approx(list(theirs), rel=1e-9)
    assert theirs_mean > 0.5  # the cases score: a real comparison, not zeros


def test_cider_d_clips_repeats_and_penalises_length():
    cider = CiderD(CORPUS)
    refs = cider.references(CORPUS[0])
    assert cider.score("red square", refs) > cider.score("red red red red red square", refs)
    assert cider.score("a red square on a table", refs) > cider.score(
        "a red square on a table on a table on a table with a red box", refs)
    assert cider.score("", refs) == 0.0


# --------------------------------------------------------------------------- samples and rewards

# Four tiny images' references, in the tiny vocabulary's words.
REFS = [["a red circle", "a red circle and a small star"], ["a blue square", "a large blue square"],
        ["a green star", "a small green star"], ["a large red square", "a red square and a blue circle"]]


def _tiny_batch(n: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    model = CaptionModel(tiny_config())
    images = torch.stack([Preprocess(size=(32, 32))(tiny_image(i)) for i in range(n)])
    return model, images


def _stepwise_log_p(decoder, ann, tokens, ended, vocab):
    """log p of each sampled caption, one decoder step at a time with the full softmax
    (<start> and <pad> excluded): every word, then <end>, or for a cut caption log (1 - p(<end>))."""
    a = ann.vectors
    keys = decoder.attention.prepare(a)
    out = []
    for r in range(tokens.shape[0]):
        h, c = decoder.init_state(a[r:r + 1])
        total, t = 0.0, 0
        while True:
            o = decoder.step(tokens[r, t:t + 1], h, c, a[r:r + 1], keys[r:r + 1], ann.grid)
            h, c = o.h, o.c
            logits = o.logits.float().clone()
            logits[0, [vocab.start, vocab.pad]] = float("-inf")
            logp = F.log_softmax(logits, -1)[0]
            word = int(tokens[r, t + 1])
            if word == vocab.end:
                total += float(logp[word]) if ended[r] else float(torch.log1p(-logp[word].exp()))
                break
            total += float(logp[word])
            t += 1
        out.append(total)
    return torch.tensor(out)


@torch.no_grad()
def test_end_belongs_to_every_finished_sample_and_to_its_log_probability():
    vocab = tiny_vocab()
    model, images = _tiny_batch()
    with torch.no_grad():
        model.decoder.L_o.bias[vocab.end] += 1.5  # some samples end within 3 words, some do not
    model.eval()
    k, max_len = 6, 3
    ann = model.encode(images)
    s = sample_captions(model.decoder, ann, vocab, k=k, max_len=max_len, generator=torch.Generator().manual_seed(3))
    assert s.ended.any() and not s.ended.all()  # both kinds are checked
    for r in range(len(s.words)):
        n = int(s.lengths[r])
        assert int(s.tokens[r, n - 1]) == vocab.end and (s.tokens[r, n:] == vocab.pad).all()
        assert "<end>" not in s.words[r] and len(s.words[r]) == n - 2
        if not s.ended[r]:  # cut off: max_len words, no <end> among them
            assert len(s.words[r]) == max_len
    # The log-probability includes the <end> draw (or, cut off, its absence), as drawn and
    # as the teacher-forced pass computes it for the gradient.
    rows = Annotations(ann.vectors.repeat_interleave(k, 0), ann.grid)
    expected = _stepwise_log_p(model.decoder, rows, s.tokens, s.ended, vocab)
    torch.testing.assert_close(s.log_probs, expected, rtol=1e-5, atol=1e-5)
    forced, _ = sample_log_probs(model, ann, s, vocab)
    torch.testing.assert_close(forced, expected, rtol=1e-5, atol=1e-5)


def test_a_cut_off_sample_gets_the_reward_of_what_it_says():
    vocab = tiny_vocab()
    model, images = _tiny_batch()
    with torch.no_grad():
        model.decoder.L_o.bias[vocab.end] = -30.0  # never ends
    objective = ScstObjective(ScstConfig(samples=2, max_len=4), vocab, REFS)
    s = sample_captions(model.decoder, model.encode(images), vocab, k=2, max_len=4, generator=objective.generator)
    assert not s.ended.any() and all(len(w) == 4 for w in s.words)
    got = objective.rewards(s.words, [i for i in range(4) for _ in range(2)])
    cider = CiderD(REFS)
    want = [cider.score(" ".join(w), cider.references(REFS[r // 2])) for r, w in enumerate(s.words)]
    assert got.tolist() == pytest.approx(want)


def test_the_leave_one_out_baseline_is_the_mean_of_the_image_s_other_samples():
    objective = ScstObjective(ScstConfig(samples=4, baseline="loo"), tiny_vocab(), REFS)
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 4.0, 0.0]], dtype=torch.float64)
    b = objective.baselines(rewards)
    for i in range(2):
        for j in range(4):
            others = [rewards[i, x] for x in range(4) if x != j]
            assert float(b[i, j]) == pytest.approx(float(sum(others)) / 3)
    greedy = ScstObjective(ScstConfig(samples=4, baseline="greedy"), tiny_vocab(), REFS)
    assert greedy.baselines(rewards, torch.tensor([0.5, 2.0], dtype=torch.float64)).tolist() == [[0.5] * 4, [2.0] * 4]
    with pytest.raises(ValueError, match="at least 2"):
        ScstObjective(ScstConfig(samples=1, baseline="loo"), tiny_vocab(), REFS)
    with pytest.raises(ValueError, match="scst.baseline"):
        ScstObjective(ScstConfig(baseline="mean"), tiny_vocab(), REFS)


def test_samples_come_from_the_model_in_eval_mode_and_leave_batch_norm_as_it_was():
    """The tiny model's encoder is trained from scratch, with batch norm. Called on the
    model in training mode, the objective samples, scores and weighs its captions as the
    model decodes at test time (batch norm on its running statistics, dropout off): the
    same samples, rewards and loss as on the model in eval mode; the running statistics do
    not move, and the model is back in training mode afterwards."""
    vocab = tiny_vocab()
    model, images = _tiny_batch(seed=1)
    model.decoder.dropout.p = 0.5
    norms = [m for m in model.encoder.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and model.encoder.trainable
    for m in norms:  # statistics unlike those of these four images' batch
        m.running_mean.uniform_(-0.5, 0.5)
        m.running_var.uniform_(0.5, 2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = {}
    for mode in ("train", "eval"):
        model.load_state_dict(before)
        getattr(model, mode)()
        objective = ScstObjective(ScstConfig(samples=3, max_len=5), vocab, REFS, seed=4)
        parts = objective(model, images, torch.arange(4))
        parts.loss.backward()
        got[mode] = parts
        assert model.training == (mode == "train")
        assert all(m.training == (mode == "train") for m in model.modules())
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), (mode, k)  # running statistics included
    assert got["train"].reward == got["eval"].reward
    assert float(got["train"].loss) == pytest.approx(float(got["eval"].loss), abs=1e-6)
    # Against what training mode would have drawn: batch statistics change the model.
    model.load_state_dict(before)
    with torch.no_grad():
        train_mode = model.train().encode(images).vectors
        eval_mode = model.eval().encode(images).vectors
    assert (train_mode - eval_mode).abs().max() > 0.1


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine lose much to them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _with_batch_statistics(model: CaptionModel, images: torch.Tensor) -> CaptionModel:
    """Batch norm's running statistics set to those of ``images``, as in a model trained on
    them: SCST starts from a trained model and samples with its running statistics."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
    with torch.no_grad():
        model.train().encode(images)
    for m in norms:
        m.momentum = 0.1
    return model


def _overfit(baseline: str, flip: bool, steps: int = 40) -> list[float]:
    """The decoder tuned on a fixed batch, as the project's SCST configs do: over a frozen
    encoder (whose batch norm the objective runs on its running statistics)."""
    model, images = _tiny_batch()
    _with_batch_statistics(model, images).encoder.freeze()
    objective = ScstObjective(ScstConfig(samples=5, baseline=baseline, max_len=6), tiny_vocab(), REFS)
    if flip:
        objective.advantages = lambda rewards, baselines: baselines - rewards
    optimizer = torch.optim.Adam([q for q in model.parameters() if q.requires_grad], lr=0.01)
    rewards = []
    for _ in range(steps):
        parts = objective(model, images, torch.arange(4))
        optimizer.zero_grad()
        parts.loss.backward()
        optimizer.step()
        rewards.append(parts.reward)
    return rewards


@pytest.mark.slow  # 40 SCST steps each way: seconds
@pytest.mark.parametrize("baseline", ["loo", "greedy"])
def test_scst_raises_the_reward_of_a_fixed_batch_and_the_flipped_sign_lowers_it(baseline, one_thread):
    up = _overfit(baseline, flip=False)
    down = _overfit(baseline, flip=True)
    assert up[0] == down[0]  # the same start and the same samples until the first step
    first = sum(up[:5]) / 5
    assert first > 0.2  # the untrained model's samples earn something: there is room to fall
    assert sum(up[-5:]) / 5 > 2 * first
    assert sum(down[-5:]) / 5 < 0.5 * first


def test_the_document_frequencies_are_the_training_split_s():
    """Rewards against CIDEr-D's document frequencies from the references given (the
    training split's): an image outside them changes them, so the loop must give only those."""
    train_only = ScstObjective(ScstConfig(), tiny_vocab(), REFS)
    with_eval = ScstObjective(ScstConfig(), tiny_vocab(), REFS + [["a red circle", "a small red circle"]])
    caption = [["a", "red", "circle"]]
    assert float(train_only.rewards(caption, [0])) != pytest.approx(float(with_eval.rewards(caption, [0])))


# --------------------------------------------------------------------------- the training loop

SCST = {"scst.enabled": True, "scst.samples": 3, "scst.max_len": 6, "optim.lr": 0.001, "optim.encoder_lr": 0.001,
        "val.every_epochs": 0}


@pytest.mark.slow
@pytest.mark.parametrize("sets", [{}, {"model.attention": "hard", "scst.baseline": "greedy",
                                       "model.freeze_encoder": True, "data.feature_cache": True}],
                         ids=["soft-loo", "hard-greedy-feature-cache"])
def test_a_resumed_scst_run_equals_the_uninterrupted_one(tiny_coco, tmp_path, sets, one_thread):
    sets = {**SCST, **sets, "optim.max_steps": 9}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(tiny_train_config(tiny_coco, **sets), straight, progress=False)
    assert train(tiny_train_config(tiny_coco, **{**sets, "optim.max_steps": 5}), split, progress=False).step == 5
    assert train(tiny_train_config(tiny_coco, **sets), split, resume=True, progress=False).step == 9

    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k
    assert a.train_state.epoch >= 1  # an epoch boundary was crossed
    assert torch.equal(a.train_state.objective["scst"][0]["generator"], b.train_state.objective["scst"][0]["generator"])
    logged = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in logged if "reward" in r]
    assert len(rewards) == 9 and all(r >= 0 for r in rewards) and any(r > 0 for r in rewards)
    assert "baseline" not in logged[0]  # a hard model under SCST runs no REINFORCE of its attention


@pytest.mark.slow
def test_the_evaluation_split_s_captions_do_not_change_the_reward(tiny_coco, tmp_path, one_thread):
    """Two SCST runs whose validation splits say different things train the same weights:
    the rewards' document frequencies are the training split's alone (were the validation
    references among them, N and every idf would change, and the rewards with them)."""
    sets = {**SCST, "optim.max_steps": 4}
    train(tiny_train_config(tiny_coco, **sets), tmp_path / "a", progress=False)
    val = tiny_coco / "captions_val.json"
    data = json.loads(val.read_text())
    for ann in data["annotations"]:
        ann["caption"] = "a red square on a table"
    val.write_text(json.dumps(data))
    train(tiny_train_config(tiny_coco, **sets), tmp_path / "b", progress=False)
    a, b = load_checkpoint(tmp_path / "a" / "last.pt"), load_checkpoint(tmp_path / "b" / "last.pt")
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k
    rewards = [json.loads(x).get("reward") for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert any(r for r in rewards if r)  # samples earned rewards: the weights moved by them


CONFIGS = Path(__file__).resolve().parents[2] / "train" / "configs"


def test_shapes_scst_starts_from_demo_soft_on_its_data():
    """The shapes-scst config's model takes demo-soft's weights whole, and its data are
    shapes-soft's, so that the vocabulary built at start-up is demo-soft's (init_from checks)."""
    cfg, soft = load_config(CONFIGS / "shapes-scst.toml"), load_config(CONFIGS / "shapes-soft.toml")
    assert cfg.scst.enabled and cfg.optim.lr == 5e-5
    source = load_checkpoint(resolve_weights(cfg.model.init_from))  # a bundled model's name
    model = CaptionModel(model_config(cfg.model, len(source.vocab)))
    model.load_state_dict(source.state_dict)  # strict: every weight fits
    for key in ("dir", "train_split", "shapes_train", "shapes_seed", "shapes_image_size", "min_count",
                "max_vocab", "max_caption_len"):
        assert getattr(cfg.data, key) == getattr(soft.data, key), key
    coco, xe = load_config(CONFIGS / "coco-vgg19-scst.toml"), load_config(CONFIGS / "coco-vgg19-soft.toml")
    assert coco.scst.enabled and coco.optim.lr == 5e-5
    assert vars(coco.data) == vars(xe.data)
    assert {**vars(coco.model), "init_from": ""} == vars(xe.model)


@pytest.mark.slow
def test_an_scst_phase_fine_tunes_a_coco_checkpoint_offline(tmp_path, photos, monkeypatch, capsys):
    """On real photographs in COCO's layout with Karpathy's split file: a cross-entropy run
    from "ImageNet" weights, then with no weights to download an SCST phase from its
    checkpoint over the feature cache, then evaluation of the fine-tuned model."""
    coco = photos / "coco"
    split_file = coco / "dataset_coco.json"
    fake_torch_home(tmp_path / "torch-home", monkeypatch, "resnet18")
    common = ["model.encoder=resnet18", "model.image_size=64", "model.resize=73", "model.embed_dim=16",
              "model.hidden_dim=16", "model.attention_dim=16", "optim.batch_size=8", "optim.threads=1",
              "data.workers=0", "data.min_count=1", "val.limit=2", "val.max_len=6", f"data.dir={coco}",
              f"data.karpathy={split_file}"]
    config = tmp_path / "c.toml"
    config.write_text('name = "offline"\n')
    xe, scst = tmp_path / "xe", tmp_path / "scst"

    def run(folder, sets):
        args = ["train", "--config", str(config), "--run-dir", str(folder), "--quiet"]
        return main(args + [a for s in common + sets for a in ("--set", s)])

    assert run(xe, ["model.encoder_pretrained=true", "optim.max_steps=4"]) == 0
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    asked = forbid_downloads(monkeypatch)
    assert run(scst, [f"model.init_from={xe / 'last.pt'}", "model.freeze_encoder=true", "data.feature_cache=true",
                      "scst.enabled=true", "scst.samples=3", "scst.max_len=6", "optim.lr=5e-5",
                      "optim.max_steps=3", "optim.log_every=1"]) == 0
    logged = [json.loads(x) for x in (scst / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "reward" in r] == [1, 2, 3]
    start, tuned = load_checkpoint(xe / "last.pt").state_dict, load_checkpoint(scst / "last.pt").state_dict
    assert all(torch.equal(start[k], tuned[k]) for k in start if k.startswith("encoder."))  # frozen
    assert not torch.equal(start["decoder.L_o.weight"], tuned["decoder.L_o.weight"])  # fine-tuned
    assert main(["evaluate", "--data", str(coco), "--karpathy", str(split_file), "--split", "test",
                 "--weights", str(scst / "best.pt"), "--beam-size", "1", "--max-len", "6", "--no-meteor",
                 "--device", "cpu", "--out", str(tmp_path / "test.json")]) == 0
    assert json.loads((tmp_path / "test.json").read_text())["metrics"]["CIDEr"] >= 0
    assert asked == []


@pytest.mark.slow
def test_two_ranks_run_an_scst_phase_and_resume_it(tiny_coco, tmp_path):
    """On two ranks each draws its own samples (its own generator, saved per rank)
    and the resumed run goes on with both."""
    cfg = tiny_train_config(tiny_coco, **{**SCST, "optim.max_steps": 4, "optim.threads": 1, "model.dropout": 0.0})
    path = tmp_path / "cfg.toml"
    path.write_text(to_toml(cfg))
    run = tmp_path / "run"
    two_ranks_ok(["train", "--config", path, "--run-dir", run, "--quiet"], tmp_path)
    first = load_checkpoint(run / "last.pt").train_state
    samplers = [s["generator"] for s in first.objective["scst"]]
    assert first.step == 4 and len(samplers) == 2 and not torch.equal(*samplers)
    two_ranks_ok(["train", "--resume", run, "--set", "optim.max_steps=6", "--quiet"], tmp_path)
    again = load_checkpoint(run / "last.pt").train_state
    assert again.step == 6 and not torch.equal(again.objective["scst"][0]["generator"], samplers[0])


@pytest.mark.parametrize("setting,message", [("scst.baseline=mean", "scst.baseline must be one of loo, greedy"),
                                             ("scst.samples=1", "at least 2 with the loo baseline"),
                                             ("scst.max_len=0", "scst.max_len counts words")])
def test_an_scst_section_the_objective_cannot_use_is_refused_when_the_config_loads(tmp_path, setting, message):
    with pytest.raises(ValueError, match=message):
        tiny_train_config(tmp_path, **dict([setting.split("=")]))
    assert tiny_train_config(tmp_path, **{"scst.samples": 1, "scst.baseline": "greedy"}).scst.samples == 1


def test_cider_d_of_chinese_counts_characters():
    from captioner.data.vocab import tokenizer_named

    corpus = [["一个红色的圆形", "红色的大圆形"], ["一个蓝色的方形", "蓝色的小方形"], ["绿色的星形", "一个绿色的星形"]]
    chars = CiderD(corpus, tokenizer=tokenizer_named("chars"))
    refs = chars.references(corpus[0])
    assert chars.score("红色的圆形", refs) > chars.score("红色的方形", refs) > chars.score("蓝色的方形", refs)
    assert chars.score("红 色 的 圆 形", refs) == chars.score("红色的圆形", refs)  # words joined as SCST joins them
    chars2 = CiderD([[c + "。" for c in captions] for captions in corpus], tokenizer=tokenizer_named("chars2"))
    refs2 = chars2.references([c + "。" for c in corpus[0]])
    assert chars2.score("红色的圆形", refs2) == pytest.approx(chars.score("红色的圆形", refs))  # marks not scored
