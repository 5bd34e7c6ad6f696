"""Length-aware batching (data.length_buckets): batches of about one caption length, every
caption once per epoch, the same batches for the same (seed, epoch), and exact resume."""

import pytest
import torch

from captioner.io.checkpoint import load_checkpoint
from captioner.train.loop import _epoch_batches, train
from tests.builders import tiny_train_config


def _lengths(n: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(5)
    return torch.randint(4, 22, (n,), generator=g).tolist()


def _padding(batches, lengths) -> int:
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)


def test_batches_hold_about_one_length_and_every_caption_once():
    lengths = _lengths()
    batches = _epoch_batches(len(lengths), 32, seed=3, epoch=0, lengths=lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert sum(len(b) < 32 for b in batches) == 1  # only the last of the sorted run is short
    # 500 captions over 18 lengths: about 28 a length, so a batch spans at most 3 lengths.
    assert max(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) <= 2
    plain = _epoch_batches(len(lengths), 32, seed=3, epoch=0)
    assert _padding(batches, lengths) * 10 < _padding(plain, lengths)
    # Batches come in random order, not shortest first.
    firsts = [min(lengths[i] for i in b) for b in batches]
    assert firsts != sorted(firsts)


def test_batch_order_depends_on_seed_and_epoch_only():
    lengths = _lengths()
    a = _epoch_batches(len(lengths), 32, seed=3, epoch=1, lengths=lengths)
    torch.manual_seed(123)  # the global RNG plays no part
    assert _epoch_batches(len(lengths), 32, seed=3, epoch=1, lengths=lengths) == a
    assert _epoch_batches(len(lengths), 32, seed=3, epoch=2, lengths=lengths) != a
    assert _epoch_batches(len(lengths), 32, seed=4, epoch=1, lengths=lengths) != a


@pytest.mark.slow
def test_resume_with_length_buckets_reproduces_the_uninterrupted_run(tiny_coco, tmp_path):
    sets = {"data.length_buckets": "true", "optim.max_steps": 9}
    straight = tmp_path / "straight"
    train(tiny_train_config(tiny_coco, **sets), straight, progress=False)
    split = tmp_path / "split"
    assert train(tiny_train_config(tiny_coco, **{**sets, "optim.max_steps": 5}), split, progress=False).step == 5
    assert train(tiny_train_config(tiny_coco, **sets), split, resume=True, progress=False).step == 9
    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(split / "last.pt")
    assert a.train_state.epoch >= 1  # an epoch boundary was crossed
    assert a.train_state.config["data"]["length_buckets"] is True
    for k in a.state_dict:
        assert torch.equal(a.state_dict[k], b.state_dict[k]), k


def test_length_buckets_change_the_batches_training_sees(tiny_coco, tmp_path, monkeypatch):
    """The switch reaches the loop. Batches cut from one sorted run span disjoint ranges of
    lengths, so within an epoch their spreads (longest - shortest) add up to at most the
    spread of all the lengths seen; random batches each span most of it."""
    import captioner.train.objectives as objectives

    seen, real = [], objectives.soft_loss

    def recording(model, images, tokens, lengths, lam):
        seen.append(lengths.tolist())
        return real(model, images, tokens, lengths, lam)

    monkeypatch.setattr(objectives, "soft_loss", recording)
    # 6 steps of 2 captions: all within the first epoch (12 or more captions).
    train(tiny_train_config(tiny_coco, **{"data.length_buckets": "true", "optim.batch_size": 2, "optim.max_steps": 6,
                                          "val.every_epochs": 0}), tmp_path / "run", progress=False)
    assert len(seen) == 6
    every = [n for batch in seen for n in batch]
    assert max(every) > min(every)  # the data has captions of several lengths
    assert sum(max(b) - min(b) for b in seen) <= max(every) - min(every)
