"""Cell centres appended to the annotations (model.coords): the context says where the map looks."""

import pytest
import torch

from captioner.inference import DecodeOptions
from captioner.model.decoder import CaptionModel, Decoder, ModelConfig, cell_centres
from captioner.model.encoders import Annotations
from tests.tiny import tiny_captioner, tiny_config, tiny_image, tiny_vocab, token_batch


def test_cell_centres_run_row_major_from_the_top_left_corner():
    xy = cell_centres((2, 4))
    assert xy.shape == (1, 8, 2)
    assert xy[0, 0].tolist() == [-0.75, -0.5]  # top left: x left, y up
    assert xy[0, 3].tolist() == [0.75, -0.5]  # top right
    assert xy[0, 4].tolist() == [-0.75, 0.5]  # second row
    assert xy[0, :, 0].sum() == 0 and xy[0, :, 1].sum() == 0  # centred


def test_the_decoder_attends_over_the_annotations_with_their_cell_centres():
    torch.manual_seed(0)
    dec = Decoder(tiny_config(annotation_dim=16, coords=True))
    ann = Annotations(torch.randn(3, 6, 16), (2, 3))
    out = dec.annotate(ann)
    assert out.vectors.shape == (3, 6, 18) and out.grid == (2, 3)
    torch.testing.assert_close(out.vectors[..., :16], ann.vectors)
    torch.testing.assert_close(out.vectors[..., 16:], cell_centres((2, 3)).expand(3, -1, -1))
    assert dec.lstm.weight_ih.shape[1] == dec.embedding.embedding_dim + 18
    # Off: the annotations pass untouched and the weights keep the encoder's D.
    plain = Decoder(tiny_config(annotation_dim=16))
    assert plain.annotate(ann) is ann and plain.lstm.weight_ih.shape[1] == plain.embedding.embedding_dim + 16


def test_the_context_carries_where_the_map_looks():
    """z_t's last two entries, as the step feeds them to the LSTM, are beta_t times the
    map-weighted mean of the cells' centres."""
    torch.manual_seed(0)
    dec = Decoder(tiny_config(annotation_dim=16, coords=True)).eval()
    ann = dec.annotate(Annotations(torch.randn(2, 6, 16), (2, 3)))
    a = ann.vectors
    h, c = dec.init_state(a)
    fed = []
    hook = dec.lstm.register_forward_hook(lambda mod, args, out: fed.append(args[0]))
    out = dec.step(torch.tensor([1, 2]), h, c, a, dec.attention.prepare(a), ann.grid)
    hook.remove()
    beta = torch.sigmoid(dec.f_beta(h))
    where = out.alpha @ cell_centres((2, 3))[0]  # (2, 2): each image's expected (x, y)
    torch.testing.assert_close(fed[0][:, -2:], beta * where)
    assert not torch.allclose(where[0], where[1])


def test_coords_off_is_the_model_without_the_field():
    cfg = tiny_config()
    assert cfg.coords is False
    saved = {k: v for k, v in cfg.to_dict().items() if k != "coords"}  # a checkpoint older than the field
    assert ModelConfig.from_dict(saved).coords is False


def test_fast_forward_equals_the_step_by_step_form_with_coords():
    torch.manual_seed(0)
    dec = Decoder(tiny_config(annotation_dim=16, coords=True))
    ann = Annotations(torch.randn(3, 12, 16), (3, 4))
    tokens, lengths = token_batch(tiny_vocab(), ["a red circle", "a blue star and a small square", "a star"])
    grads = []
    for fn in (dec.forward, dec.forward_stepwise):
        dec.zero_grad()
        out = fn(ann, tokens, lengths)
        logp = torch.log_softmax(out.logits, -1).gather(2, tokens[:, 1:, None]).squeeze(2)
        (logp * out.mask).sum().neg().backward()
        grads.append((out.logits[out.mask], dec.lstm.weight_ih.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    assert grads[0][1][:, -2:].abs().sum() > 0  # the centres' columns learn


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_batched_beam_search_is_each_images_own_with_coords(attention):
    cap = tiny_captioner(seed=2, coords=True, attention=attention)
    images = [tiny_image(i) for i in range(3)]
    opts = DecodeOptions(beam_size=3, max_len=8)
    together = cap.caption_images(images, opts)
    alone = [cap.caption(im, opts) for im in images]
    assert [r.words for r in together] == [r.words for r in alone]
    for r, s in zip(together, alone):
        assert abs(r.score - s.score) < 1e-4


def test_a_model_with_coords_trains_and_the_centres_weights_move():
    torch.manual_seed(0)
    model = CaptionModel(tiny_config(encoder="small8", image_size=(64, 64), coords=True))
    images = torch.randn(4, 3, 64, 64)
    tokens, lengths = token_batch(tiny_vocab(), ["a red circle", "a blue square", "a small green star",
                                                 "a large red square and a blue circle"])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = model.decoder.L_z.weight[:, -2:].detach().clone()
    losses = []
    for _ in range(15):
        out = model(images, tokens, lengths)
        logp = torch.log_softmax(out.logits, -1).gather(2, tokens[:, 1:, None]).squeeze(2)
        loss = -(logp * out.mask).sum() / out.mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.allclose(model.decoder.L_z.weight[:, -2:], before)
