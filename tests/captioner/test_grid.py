"""Self-attention over the annotation grid with a 2-D relative position bias (captioner/model/grid.py)."""

import pytest
import torch

from captioner.inference import Captioner, DecodeOptions
from captioner.io.checkpoint import load_checkpoint
from captioner.model.decoder import CaptionModel, Decoder, ModelConfig
from captioner.model.encoders import Annotations
from captioner.model.grid import GridBlock, GridSelfAttention
from captioner.search.decoding import beam_search, greedy
from captioner.search.options import Tokens
from tests.tiny import tiny_captioner, tiny_config, tiny_image, tiny_vocab, token_batch

GRID_ON = dict(grid_layers=1, grid_heads=2, rel_pos_clip=2)


def _trained(module: torch.nn.Module) -> torch.nn.Module:
    """Give every grid block of ``module`` weights as after some training: a new block is the
    identity (its branches' last layers and its bias table start at 0)."""
    with torch.no_grad():
        for block in (m for m in module.modules() if isinstance(m, GridBlock)):
            block.rel_bias.normal_()  # a table whose entries all differ
            for last in (block.out, block.ff[2]):
                last.weight.normal_(0, 0.3)
                last.bias.normal_(0, 0.1)
    return module


def _block(clip=2, heads=4, dim=16, seed=0) -> GridBlock:
    torch.manual_seed(seed)
    return _trained(GridBlock(dim, width=dim, heads=heads, ff=2 * dim, clip=clip))


# --- the attention itself ------------------------------------------------------------------
def test_self_attention_without_the_bias_is_permutation_equivariant_over_cells():
    block = _block()
    x = torch.randn(2, 12, 16)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    out = block(x, None)
    torch.testing.assert_close(block(x[:, perm], None), out[:, perm])
    assert not torch.allclose(out, x, atol=1e-3)  # and it does something
    # The position bias is what breaks the symmetry: with it, moving cells changes the result.
    bias = block.position_bias((3, 4))
    assert not torch.allclose(block(x[:, perm], bias), block(x, bias)[:, perm], atol=1e-4)


def test_a_block_computes_its_equations():
    """Against the block's equations written out one head and one query cell at a time."""
    block = _block(clip=1, heads=2, dim=8)
    x = torch.randn(2, 6, 8)
    bias = block.position_bias((2, 3))
    out = block(x, bias)
    with torch.no_grad():
        q, k, v = block.qkv(block.norm1(x)).chunk(3, dim=-1)  # (B, L, 8) each; 2 heads of 4
        expected = torch.empty_like(x)
        for b in range(2):
            heads = []
            for h in range(2):
                cols = slice(4 * h, 4 * h + 4)
                rows = []
                for i in range(6):
                    e = torch.stack([q[b, i, cols] @ k[b, j, cols] / 2.0 + bias[h, i, j] for j in range(6)])
                    rows.append(torch.softmax(e, 0) @ v[b, :, cols])
                heads.append(torch.stack(rows))  # (L, 4)
            y = x[b] + block.out(torch.cat(heads, 1))
            expected[b] = y + block.ff(block.norm2(y))
    torch.testing.assert_close(out, expected)


def _reference_bias(table: torch.Tensor, grid: tuple[int, int], clip: int) -> torch.Tensor:
    """bias[h, i, j] = table[h, clip(row_j - row_i), clip(col_j - col_i)], one pair at a time."""
    gh, gw = grid
    n = gh * gw
    out = torch.empty(table.shape[0], n, n)
    for i in range(n):
        for j in range(n):
            dr = max(-clip, min(clip, j // gw - i // gw))
            dc = max(-clip, min(clip, j % gw - i % gw))
            out[:, i, j] = table[:, dr + clip, dc + clip]
    return out


def test_the_bias_depends_only_on_the_clipped_offset():
    block = _block(clip=2)
    table = block.rel_bias.detach()
    assert table.shape == (4, 5, 5)  # heads, 2 clip + 1 row offsets, 2 clip + 1 column offsets
    grid = (5, 7)
    bias = block.position_bias(grid).detach()  # (heads, L, L)
    torch.testing.assert_close(bias, _reference_bias(table, grid, 2), rtol=0, atol=0)

    def cell(r, c):
        return r * 7 + c

    # The same offset (1 row down, 2 columns left) from two different cells: the same bias.
    torch.testing.assert_close(bias[:, cell(0, 3), cell(1, 1)], bias[:, cell(3, 6), cell(4, 4)])
    # Offsets beyond the clip share the edge value: 4 columns right is 2 columns right.
    torch.testing.assert_close(bias[:, cell(2, 0), cell(2, 4)], bias[:, cell(2, 0), cell(2, 2)])
    torch.testing.assert_close(bias[:, cell(0, 0), cell(4, 6)], table[:, 4, 4])
    # Within the clip every offset has its own entry, and direction matters.
    assert not torch.allclose(bias[:, cell(2, 2), cell(2, 3)], bias[:, cell(2, 2), cell(2, 4)])
    assert not torch.allclose(bias[:, cell(2, 2), cell(3, 2)], bias[:, cell(2, 2), cell(1, 2)])
    assert not torch.allclose(bias[:, cell(2, 2), cell(3, 2)], bias[:, cell(2, 2), cell(2, 3)])  # rows vs columns


def test_one_table_serves_14x14_and_16x16_grids():
    torch.manual_seed(0)
    grid_attn = _trained(GridSelfAttention(16, layers=1, heads=4, rel_pos_clip=3))
    params = sum(p.numel() for p in grid_attn.parameters())
    block = grid_attn.blocks[0]
    b14, b16 = block.position_bias((14, 14)), block.position_bias((16, 16))
    assert b14.shape == (4, 196, 196) and b16.shape == (4, 256, 256)
    # The pair (row 2, col 5) -> (row 9, col 1) exists in both grids: the same bias.
    torch.testing.assert_close(b14[:, 2 * 14 + 5, 9 * 14 + 1], b16[:, 2 * 16 + 5, 9 * 16 + 1])
    torch.testing.assert_close(b16, _reference_bias(block.rel_bias.detach(), (16, 16), 3))
    # Both sizes run through the same parameters, and a 16x16 loss trains the same table.
    assert grid_attn(torch.randn(2, 196, 16), (14, 14)).shape == (2, 196, 16)
    grid_attn(torch.randn(2, 256, 16), (16, 16)).square().sum().backward()
    assert block.rel_bias.grad is not None and block.rel_bias.grad.abs().sum() > 0
    assert sum(p.numel() for p in grid_attn.parameters()) == params
    with pytest.raises(ValueError, match="grid 14x14 has 196 cells, the annotations 256"):
        grid_attn(torch.randn(1, 256, 16), (14, 14))


def test_a_narrower_block_keeps_the_annotation_size():
    torch.manual_seed(0)
    grid_attn = GridSelfAttention(48, layers=2, heads=4, rel_pos_clip=2, width=16, ff=24)
    a = torch.randn(3, 20, 48)
    assert grid_attn(a, (4, 5)).shape == (3, 20, 48)
    block = grid_attn.blocks[0]
    assert block.qkv.weight.shape == (3 * 16, 48) and block.out.weight.shape == (48, 16)
    assert block.ff[0].weight.shape == (24, 48)


# --- configuration -------------------------------------------------------------------------
def test_grid_fields_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match="grid_layers must be >= 0"):
        tiny_config(grid_layers=-1)
    with pytest.raises(ValueError, match="grid_heads must be >= 1"):
        tiny_config(grid_layers=1, grid_heads=0)
    with pytest.raises(ValueError, match="rel_pos_clip must be >= 0"):
        tiny_config(grid_layers=1, rel_pos_clip=-1)
    with pytest.raises(ValueError, match="grid width 128 .* is not divisible by grid_heads=3"):
        tiny_config(grid_layers=1, grid_heads=3)  # the small encoder: D = 128
    with pytest.raises(ValueError, match="grid_dim must be >= 0"):
        tiny_config(grid_layers=1, grid_dim=-8)
    # Off: the other grid fields are not in play, so they are not held against the config.
    assert tiny_config(grid_heads=3).grid_layers == 0


def test_train_config_takes_the_grid_fields_and_refuses_bad_ones(tmp_path):
    from captioner.train.config import apply_overrides, load_config

    cfg = load_config(None, ["model.grid_layers=2", "model.grid_heads=4", "model.rel_pos_clip=3"])
    assert (cfg.model.grid_layers, cfg.model.grid_heads, cfg.model.rel_pos_clip) == (2, 4, 3)
    with pytest.raises(ValueError, match="not divisible by grid_heads=5"):
        apply_overrides(load_config(None), ["model.grid_layers=1", "model.grid_heads=5"])


def test_captioner_train_refuses_bad_grid_fields_in_one_line(tmp_path, capsys):
    from captioner.cli.main import main

    code = main(["train", "--config", "train/configs/shapes-soft.toml", "--run-dir", str(tmp_path / "r"),
                 "--set", "model.grid_layers=1", "--set", "model.grid_heads=5"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "grid_heads=5" in err
    assert not (tmp_path / "r").exists()


# --- off by default: today's model ---------------------------------------------------------
# demo-soft's captions of three shapes images (generate_dataset(seed=7)), greedy and beam 3,
# as decoded before the grid module existed.
DEMO_CAPTIONS = {
    1: [("a small green circle to the left of a small white star", -3.047028),
        ("a red triangle a blue circle and a green cross", -2.870729),
        ("a dark background with a blue circle a purple circle and a purple cross", -2.829290)],
    3: [("an image with a small green circle and a small white star", -2.759223),
        ("a red triangle a blue circle and a green cross", -2.870728),
        ("this image shows a blue circle a purple circle and a purple cross", -2.764590)],
}


def test_grid_layers_zero_is_todays_model(tmp_path):
    from captioner.data.images import load_image
    from captioner.data.shapes import generate_dataset
    from captioner.io.bundled import DEMOS
    from captioner.io.loading import resolve_weights

    if not DEMOS["demo-soft"].installed:
        pytest.skip("demo-soft's weights are not here")
    saved = torch.load(resolve_weights("demo-soft"), weights_only=True)
    assert "grid_layers" not in saved["model_config"]  # written before the field existed
    cap = Captioner.load("demo-soft")
    assert cap.model.config.grid_layers == 0
    assert set(cap.model.state_dict()) == set(saved["state_dict"])  # not one key more
    generate_dataset(tmp_path, {"test": 3}, seed=7)
    images = [load_image(p) for p in sorted((tmp_path / "images" / "test").glob("*.png"))]
    for beam, expected in DEMO_CAPTIONS.items():
        got = cap.caption_images(images, DecodeOptions(beam_size=beam, max_len=20))
        assert [r.caption for r in got] == [c for c, _ in expected]
        for r, (_, score) in zip(got, expected):
            assert abs(r.score - score) < 1e-3
    # The decoder's entry point hands the encoder's annotations through untouched.
    ann = cap.model.encode(torch.randn(1, 3, 128, 128))
    assert cap.model.decoder.annotate(ann) is ann


# --- in the whole model --------------------------------------------------------------------
def _tiny_model(**overrides) -> CaptionModel:
    torch.manual_seed(0)
    return CaptionModel(tiny_config(**{**GRID_ON, **overrides}))


def test_a_new_grid_block_is_the_identity():
    """A model with new grid layers decodes as the same model without them, then learns."""
    with_grid, without = _tiny_model(grid_layers=2), _tiny_model(grid_layers=0)
    without.load_state_dict({k: v for k, v in with_grid.state_dict().items() if "grid_attention" not in k})
    images = torch.randn(2, 3, 32, 32)
    tokens, lengths = token_batch(tiny_vocab(), ["a red circle", "a blue star and a small square"])
    torch.testing.assert_close(with_grid(images, tokens, lengths).logits, without(images, tokens, lengths).logits)


def test_the_decoder_attends_over_the_annotations_after_self_attention():
    model = _trained(_tiny_model())
    assert model.decoder.grid_attention is not None
    ann = model.encode(torch.randn(2, 3, 32, 32))  # the small encoder: 2x2 cells of 128
    out = model.decoder.annotate(ann)
    assert out.grid == ann.grid and out.vectors.shape == ann.vectors.shape
    assert not torch.allclose(out.vectors, ann.vectors, atol=1e-3)
    keys = ["decoder.grid_attention.blocks.0.rel_bias", "decoder.grid_attention.blocks.0.qkv.weight"]
    assert all(k in model.state_dict() for k in keys)
    assert not any("grid_attention" in k for k in _tiny_model(grid_layers=0).state_dict())


def test_fast_forward_equals_the_step_by_step_form_with_grid_layers():
    torch.manual_seed(0)
    dec = _trained(Decoder(tiny_config(annotation_dim=16, grid_layers=2, grid_heads=4, rel_pos_clip=1)))
    ann = Annotations(torch.randn(3, 12, 16), (3, 4))
    tokens, lengths = token_batch(tiny_vocab(), ["a red circle", "a blue star and a small square", "a star"])
    grads = []
    for fn in (dec.forward, dec.forward_stepwise):
        dec.zero_grad()
        out = fn(ann, tokens, lengths)
        logp = torch.log_softmax(out.logits, -1).gather(2, tokens[:, 1:, None]).squeeze(2)
        (logp * out.mask).sum().neg().backward()
        grads.append((out.logits[out.mask], dec.grid_attention.blocks[1].rel_bias.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    assert grads[0][1].abs().sum() > 0


@pytest.mark.slow
def test_tiny_model_with_a_grid_layer_trains_and_the_bias_table_learns():
    model = _tiny_model(encoder="small8", image_size=(64, 64), grid_heads=4)  # 8x8 cells
    images = torch.randn(4, 3, 64, 64)
    tokens, lengths = token_batch(tiny_vocab(), ["a red circle", "a blue square", "a small green star",
                                                 "a large red square and a blue circle"])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    table = model.decoder.grid_attention.blocks[0].rel_bias
    before = table.detach().clone()
    losses = []
    for step in range(25):
        out = model(images, tokens, lengths)
        logp = torch.log_softmax(out.logits, -1).gather(2, tokens[:, 1:, None]).squeeze(2)
        loss = -(logp * out.mask).sum() / out.mask.sum()
        opt.zero_grad()
        loss.backward()
        if step > 0:  # from the second step on: the first moves the attention branch off 0
            assert table.grad is not None and table.grad.abs().sum() > 0  # gradients reach the bias table
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert (table.detach() - before).abs().max() > 1e-3


@pytest.mark.slow
def test_training_on_cached_features_trains_the_grid_layers(tiny_coco, tmp_path):
    from captioner.train.loop import train
    from tests.builders import nll_log, tiny_train_config

    run = tmp_path / "run"
    cfg = tiny_train_config(tiny_coco, **{"optim.max_steps": 30, "val.every_epochs": 0, "model.freeze_encoder": True,
                                          "data.feature_cache": True, "model.grid_layers": 1, "model.grid_heads": 4})
    outcome = train(cfg, run, progress=False)
    assert outcome.step == 30
    assert any(run.rglob("*.f16"))  # the steps read cached annotations
    nll = nll_log(run)
    assert sum(nll[-5:]) / 5 < sum(nll[:5]) / 5
    state = load_checkpoint(run / "last.pt").state_dict
    assert state["decoder.grid_attention.blocks.0.rel_bias"].abs().max() > 0  # it starts at 0


# --- decoding and checkpoints --------------------------------------------------------------
def test_the_grid_runs_once_per_image_batch_in_beam_search_and_greedy():
    cap = tiny_captioner(**GRID_ON)
    decoder = cap.model.decoder
    calls = []
    handle = decoder.grid_attention.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    try:
        ann = cap.model.encode(torch.randn(3, 3, 32, 32))
        beam = beam_search(decoder, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(beam_size=3, max_len=6))
        assert calls == [3]  # the 3 images once, not their 9 beams, not once a step
        calls.clear()
        first = greedy(decoder, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(max_len=6))
        assert calls == [3]
    finally:
        handle.remove()
    one = beam_search(decoder, ann, Tokens(start=1, end=2, pad=0), DecodeOptions(beam_size=1, max_len=6))
    assert [d.ids for d in one] == [d.ids for d in first]
    for d in beam:
        assert d.alphas.shape == (len(d.ids), 4)
        torch.testing.assert_close(d.alphas.sum(1), torch.ones(len(d.ids)))


def test_caption_and_checkpoint_round_trip_keep_the_grid(tmp_path):
    cap = tiny_captioner(**{**GRID_ON, "rel_pos_clip": 3}, grid_dim=64, grid_ff=96)
    _trained(cap.model)
    opts = DecodeOptions(beam_size=3, max_len=8)
    before = cap.caption_images([tiny_image(1), tiny_image(2)], opts)
    path = tmp_path / "grid.pt"
    cap.save(path)
    loaded = Captioner.load(path)
    cfg = loaded.model.config
    assert (cfg.grid_layers, cfg.grid_heads, cfg.rel_pos_clip, cfg.grid_dim, cfg.grid_ff) == (1, 2, 3, 64, 96)
    after = loaded.caption_images([tiny_image(1), tiny_image(2)], opts)
    assert [r.words for r in after] == [r.words for r in before]
    for a, b in zip(after, before):
        torch.testing.assert_close(a.alphas, b.alphas)
        assert abs(a.score - b.score) < 1e-5
    # Without the grid layers the same weights would caption differently: they are in use.
    plain = ModelConfig.from_dict({**cfg.to_dict(), "grid_layers": 0})
    model = CaptionModel(plain)
    model.load_state_dict({k: v for k, v in cap.model.state_dict().items() if "grid_attention" not in k})
    ann = model.encode(torch.randn(2, 3, 32, 32))
    assert not torch.allclose(loaded.model.decoder.annotate(ann).vectors, ann.vectors, atol=1e-3)


def test_captioner_caption_runs_a_checkpoint_with_grid_layers(tmp_path, capsys):
    import json

    from captioner.cli.main import main

    weights = tmp_path / "grid.pt"
    cap = tiny_captioner(**GRID_ON)
    cap.save(weights)
    paths = []
    for i in range(3):
        tiny_image(i).save(tmp_path / f"img{i}.png")
        paths.append(str(tmp_path / f"img{i}.png"))
    assert main(["caption", *paths, "--weights", str(weights), "--with-attention", "--max-len", "5",
                 "--workers", "0"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    expected = cap.caption_images([tiny_image(i) for i in range(3)], DecodeOptions(beam_size=3, max_len=5))
    assert [x["words"] for x in lines] == [r.words for r in expected]
    for rec in lines:
        assert len(rec["alphas"]) == len(rec["words"]) and len(rec["alphas"][0]) == 2  # 2x2 grid
