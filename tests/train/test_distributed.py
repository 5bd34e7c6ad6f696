"""torch.distributed on CPU (gloo): two processes train like one over the same global batch,
and distributed captioning yields every image exactly once. torchrun itself starts the ranks
of the tests of its exit codes and messages (and the GPU check's CPU run trains under it,
tests/project/test_gpu_check.py); the others fork their ranks (tests.ranks)."""

import json

import pytest
import torch

from captioner.model.decoder import CaptionModel
from captioner.train.tensorboard import event_files
from tests.ranks import one_and_two_ranks, torchrun, two_ranks, two_ranks_ok
from tests.tiny import tiny_captioner, tiny_image


@pytest.mark.slow
def test_two_ranks_train_like_one_process_over_the_same_global_batch(tiny_coco, tmp_path):
    cfg, a, _ = one_and_two_ranks(tiny_coco, tmp_path)
    multi = tmp_path / "multi"
    torch.manual_seed(cfg.optim.seed)  # the weights both runs started from
    start = CaptionModel(a.model_config).state_dict()
    assert not torch.allclose(start["decoder.L_o.weight"], a.state_dict["decoder.L_o.weight"])  # they trained
    # Only rank 0 wrote: one log line per logged step, not two.
    steps = [json.loads(x)["step"] for x in (multi / "metrics.jsonl").read_text().splitlines() if '"nll"' in x]
    assert steps == sorted(set(steps))
    assert len(event_files(multi)) == 1  # and one TensorBoard event file, not one a rank


@pytest.mark.slow
def test_mean_attention_trains_on_two_ranks(tiny_coco, tmp_path):
    """The mean map reads no scores: DDP must not wait for their gradients (it stopped at step 2)."""
    _, a, b = one_and_two_ranks(tiny_coco, tmp_path, **{"model.attention": "mean"})
    assert b.train_state.step == 6


@pytest.mark.slow
def test_distributed_captioning_gives_every_image_exactly_once(tmp_path):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=1).save(weights)
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    paths = []
    for i in range(23):  # an odd count: the shards differ in size
        p = folder / ("sub" if i % 3 else "") / f"img{i:02d}.png"
        tiny_image(i, size=(24, 24)).save(p)
        paths.append(str(p))
    (folder / "broken.jpg").write_bytes(b"not an image")
    out = tmp_path / "out.jsonl"
    # One image is already done: it must not be captioned again.
    out.write_text(json.dumps({"image": paths[0], "caption": "x", "words": ["x"], "score": 0.0}) + "\n")
    caption = ["caption", str(folder), "--weights", str(weights), "--out", str(out), "--max-len", "5",
               "--batch-size", "3"]
    res = two_ranks(caption, tmp_path)
    # The broken file failed, the rest were captioned: every rank exits 1 (docs/scale.md), rank 0
    # having merged the parts and summed up.
    assert res.codes == [1, 1], res.stderr[-3000:]
    assert "captioned 22, failed 1, skipped 0 (not image files), already done 1" in res.stderr
    images = [json.loads(x)["image"] for x in out.read_text().splitlines()]
    assert sorted(images) == sorted(paths + [str(folder / "broken.jpg")])
    assert not list(tmp_path.glob("out.jsonl.part*"))  # parts merged and removed

    tiny_image(99, size=(24, 24)).save(folder / "broken.jpg", "JPEG")  # mended: tried again, its line replaced
    res = two_ranks_ok(caption, tmp_path)
    assert "captioned 1, failed 0, skipped 0 (not image files), already done 23, retried 1" in res.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["image"] for r in lines) == sorted(paths + [str(folder / "broken.jpg")])
    assert all("error" not in r for r in lines)


@pytest.mark.slow  # torchrun and two processes
def test_a_mistake_under_torchrun_is_said_once_on_its_own_line(tmp_path):
    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=1).save(weights)
    tiny_image(0, size=(24, 24)).save(tmp_path / "a.png")
    _, stderr = torchrun(["-m", "captioner.cli", "caption", str(tmp_path / "a.png"), "--weights", str(weights)],
                         tmp_path)
    errors = [line for line in stderr.splitlines() if "captioner caption: error:" in line]
    assert errors == ["captioner caption: error: under torchrun, --out FILE is required (ranks write parts "
                      "that are merged into it)"], stderr[-3000:]


SLOW_EXIT = '''
import os, sys, time
from captioner.cli.main import main
code = main(sys.argv[1:])
if os.environ.get("RANK") == "1":
    time.sleep(3)  # a rank that takes a while to exit: torchrun sees rank 0 end first
sys.exit(code)
'''


@pytest.mark.slow
def test_under_torchrun_every_rank_ends_with_its_own_exit_code_none_killed(tmp_path):
    """Some images fail: every rank exits 1, as the README says. torchrun stops the ranks still
    running with SIGTERM when the first exits non-zero; a rank whose work is done lets it pass."""
    import re

    weights = tmp_path / "tiny.pt"
    tiny_captioner(seed=1).save(weights)
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i in range(4):
        tiny_image(i, size=(24, 24)).save(folder / f"img{i}.png")
    (folder / "broken.jpg").write_bytes(b"not an image")
    script = tmp_path / "slow_exit.py"
    script.write_text(SLOW_EXIT)
    code, stderr = torchrun([str(script), "caption", str(folder), "--weights", str(weights),
                             "--out", str(tmp_path / "out.jsonl"), "--max-len", "4"], tmp_path)
    assert code == 1, stderr[-3000:]
    assert "captioned 4, failed 1" in stderr
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)
    assert codes and set(codes) == {"1"}, stderr[-3000:]  # no -15 (SIGTERM) for the slower rank
    assert "Signal 15" not in stderr  # torchrun still logs that it sent one; no rank died of it
