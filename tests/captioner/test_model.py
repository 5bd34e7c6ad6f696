"""The decoder against the paper's equations."""

import pytest
import torch
import torch.nn.functional as F

from captioner.model.decoder import CaptionModel, attention_penalty
from captioner.model.encoders import Annotations
from tests.tiny import tiny_config, tiny_vocab, token_batch

CAPTIONS = ["a red circle and a blue square", "a small star", "a large green circle"]


def _model(**kw) -> CaptionModel:
    torch.manual_seed(0)
    return CaptionModel(tiny_config(**kw))


def _forward(model, images=None):
    tokens, lengths = token_batch(tiny_vocab(), CAPTIONS)
    images = images if images is not None else torch.randn(len(CAPTIONS), 3, 32, 32)
    return model(images, tokens, lengths), tokens, lengths


def test_shapes_and_normalisation():
    model = _model()
    out, tokens, lengths = _forward(model)
    b, t = tokens.shape[0], tokens.shape[1] - 1
    v, l = len(tiny_vocab()), 2 * 2  # 32 px / 16 = 2x2 grid
    assert out.logits.shape == (b, t, v)
    assert out.alphas.shape == (b, t, l)
    assert out.betas.shape == (b, t)
    assert out.mask.tolist() == [[i < n - 1 for i in range(t)] for n in lengths.tolist()]
    assert (out.alphas >= 0).all()
    torch.testing.assert_close(out.alphas.sum(-1), torch.ones(b, t))
    assert ((out.betas > 0) & (out.betas < 1)).all()
    assert model.decoder.f_beta.out_features == 1  # a scalar gate, not a D-vector


def test_step_matches_the_equations():
    """One decoder step recomputed by hand from the module's weights."""
    model = _model().eval()
    d = model.decoder
    torch.manual_seed(1)
    a = torch.randn(2, 4, model.config.annotation_dim)
    y = torch.tensor([1, 5])
    h0 = torch.tanh(d.init_h(a.mean(1)))
    c0 = torch.tanh(d.init_c(a.mean(1)))
    att = d.attention
    e = (torch.tanh(a @ att.key_proj.weight.T + att.key_proj.bias + (h0 @ att.query_proj.weight.T
                                                                      + att.query_proj.bias)[:, None])
         @ att.v.weight.T).squeeze(-1) + att.v.bias
    alpha = torch.softmax(e, -1)
    beta = torch.sigmoid(h0 @ d.f_beta.weight.T + d.f_beta.bias)  # (B, 1)
    z = beta * (alpha[:, :, None] * a).sum(1)
    emb = d.embedding.weight[y]
    h1, c1 = d.lstm(torch.cat([emb, z], 1), (h0, c0))
    logits = (emb + h1 @ d.L_h.weight.T + d.L_h.bias + z @ d.L_z.weight.T + d.L_z.bias) @ d.L_o.weight.T + d.L_o.bias

    h, c = d.init_state(a)
    o = d.step(y, h, c, a, att.prepare(a), (2, 2))
    torch.testing.assert_close(o.alpha, alpha)
    torch.testing.assert_close(o.beta, beta.squeeze(1))
    torch.testing.assert_close(o.h, h1)
    torch.testing.assert_close(o.logits, logits)


def test_annotation_projection_computed_once_per_image():
    model = _model()
    calls = []
    model.decoder.attention.key_proj.register_forward_hook(lambda *args: calls.append(1))
    out, _, _ = _forward(model)
    assert out.logits.shape[1] > 1
    assert len(calls) == 1


def test_penalty_ignores_padding():
    alphas = torch.rand(2, 3, 4)
    alphas = alphas / alphas.sum(-1, keepdim=True)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    expected = (((1 - alphas[0].sum(0)) ** 2).sum() + ((1 - alphas[1, 0]) ** 2).sum()) / 2
    torch.testing.assert_close(attention_penalty(alphas, mask), expected)
    changed = alphas.clone()
    changed[1, 1:] = torch.tensor([1.0, 0, 0, 0])  # padded steps: must not matter
    torch.testing.assert_close(attention_penalty(changed, mask), expected)


def test_every_parameter_gets_a_gradient():
    model = _model(attention="soft").train()
    out, tokens, _ = _forward(model)
    targets = tokens[:, 1:]
    loss = F.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), ignore_index=0)
    loss = loss + attention_penalty(out.alphas, out.mask)
    loss.backward()
    missing = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)]
    assert missing == []


def test_hard_attention_learns_where_to_look_only_through_the_score_function():
    """With sampled contexts (the expected context off), z_t = beta_t a_{s_t} does not depend
    on alpha: the attention's own parameters get gradient only from the REINFORCE term
    lambda_r (r - b) d log p(s|a). With it every parameter learns; without it they get none."""
    from captioner.train.config import HardConfig
    from captioner.train.losses import HardAttentionObjective

    model = _model(attention="hard").train()
    tokens, lengths = token_batch(tiny_vocab(), CAPTIONS)
    images = torch.randn(len(CAPTIONS), 3, 32, 32)
    attention = {n for n, _ in model.named_parameters() if n.startswith("decoder.attention.")}

    def gradient_sizes(lambda_r):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same samples and dropout masks for both
        objective = HardAttentionObjective(HardConfig(lambda_r=lambda_r, entropy=0.0, expected_context_prob=0.0),
                                           0.0, baseline=-1.0)
        parts = objective(model, images, tokens, lengths)
        assert parts.sampled
        parts.loss.backward()
        return {n: 0.0 if p.grad is None else float(p.grad.abs().sum()) for n, p in model.named_parameters()}

    with_reinforce = gradient_sizes(0.1)
    assert [n for n, g in with_reinforce.items() if g == 0] == []
    without = gradient_sizes(0.0)
    assert {n for n, g in without.items() if g == 0} == attention


def test_mean_mode_is_uniform_and_ignores_the_state():
    model = _model(attention="mean")
    out, _, _ = _forward(model)
    torch.testing.assert_close(out.alphas, torch.full_like(out.alphas, 0.25))


def test_hard_sample_is_exactly_one_annotation():
    model = _model(attention="hard")
    a = torch.randn(5, 4, model.config.annotation_dim)
    att = model.decoder.attention
    h = torch.randn(5, model.config.hidden_dim)
    step = att(att.prepare(a), a, h, (2, 2), sample=True)
    torch.testing.assert_close(step.context, a[torch.arange(5), step.sample])
    torch.testing.assert_close(step.sample_log_prob, torch.log(step.alpha[torch.arange(5), step.sample]))


def test_annotations_from_encoder_cover_the_grid():
    model = _model()
    ann = model.encode(torch.randn(2, 3, 64, 48))
    assert isinstance(ann, Annotations)
    assert ann.grid == (4, 3)
    assert ann.vectors.shape == (2, 12, model.config.annotation_dim)


def test_hard_inference_modes():
    """Expected context (default) is the soft context; argmax takes one annotation."""
    model = _model(attention="hard").eval()
    att = model.decoder.attention
    a = torch.randn(3, 4, model.config.annotation_dim)
    h = torch.randn(3, model.config.hidden_dim)
    keys = att.prepare(a)
    expected = att(keys, a, h, (2, 2))
    torch.testing.assert_close(expected.context, torch.einsum("bl,bld->bd", expected.alpha, a))
    top = att(keys, a, h, (2, 2), argmax=True)
    torch.testing.assert_close(top.context, a[torch.arange(3), expected.alpha.argmax(-1)])


def test_small_encoder_cells_are_centred_on_their_pixel_blocks():
    """Cell (2, 5) sees exactly its own 16x16 block (rows 32-47, columns 80-95) and 7 px
    around it, the same on every side: the grid the overlays and the pointing game use is
    the encoder's own, with no half-cell shift."""
    from captioner.model.encoders import create_encoder

    enc = create_encoder("small").eval()
    with torch.no_grad():
        for m in enc.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.constant_(m.weight, 0.05)
        blank = enc(torch.zeros(1, 3, 128, 128)).vectors

        def seen(y: int, x: int) -> bool:
            dot = torch.zeros(1, 3, 128, 128)
            dot[:, :, y, x] = 10.0
            return bool((enc(dot).vectors - blank).view(8, 8, -1)[2, 5].abs().sum() > 0)

    for y, x in [(40, 88), (32, 80), (47, 95), (25, 88), (54, 88), (40, 73), (40, 102)]:
        assert seen(y, x), (y, x)
    for y, x in [(24, 88), (55, 88), (40, 72), (40, 103)]:
        assert not seen(y, x), (y, x)


def test_small8_encoder_cells_are_centred_on_their_pixel_blocks():
    """Cell (5, 11) of the 16x16 grid sees its own 8x8 block (rows 40-47, columns 88-95)
    and 7 px around it on every side."""
    from captioner.model.encoders import create_encoder

    enc = create_encoder("small8").eval()
    with torch.no_grad():
        for m in enc.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.constant_(m.weight, 0.05)
        blank = enc(torch.zeros(1, 3, 128, 128))
        assert blank.grid == (16, 16)

        def seen(y: int, x: int) -> bool:
            dot = torch.zeros(1, 3, 128, 128)
            dot[:, :, y, x] = 10.0
            return bool((enc(dot).vectors - blank.vectors).view(16, 16, -1)[5, 11].abs().sum() > 0)

    for y, x in [(40, 88), (47, 95), (33, 88), (54, 88), (40, 81), (40, 102)]:
        assert seen(y, x), (y, x)
    for y, x in [(32, 88), (55, 88), (40, 80), (40, 103)]:
        assert not seen(y, x), (y, x)


@pytest.mark.parametrize("name,channels,grid", [
    pytest.param("vgg16", 512, (14, 14), marks=pytest.mark.slow),  # VGG's 138M weights: seconds to initialise
    ("resnet50", 2048, (7, 7)), ("resnet101", 2048, (7, 7))])
def test_torchvision_encoders_give_the_papers_grids(name, channels, grid):
    """Random weights (no download): VGG-16 conv5_3 is 14x14x512 at 224 px, ResNet layer4 7x7x2048."""
    from captioner.model.encoders import create_encoder

    enc = create_encoder(name).eval()
    with torch.no_grad():
        ann = enc(torch.randn(1, 3, 224, 224))
    assert ann.grid == grid and ann.vectors.shape == (1, grid[0] * grid[1], channels)
    assert not any(p.requires_grad for p in enc.parameters())  # frozen unless fine-tuned


@pytest.mark.slow  # VGG-16, built twice
def test_fine_tuning_unfreezes_only_the_last_blocks():
    from captioner.model.encoders import create_encoder

    enc = create_encoder("vgg16", fine_tune_blocks=1)
    trainable = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert trainable == {"trunk.28.weight", "trunk.28.bias"}  # conv5_3 only
    assert create_encoder("vgg16", fine_tune_blocks=1, freeze=True).trainable is False
