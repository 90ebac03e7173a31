"""Focal, OHEM cross-entropy, the weighted sum of losses and auxiliary outputs against values
computed by hand."""
import math

import pytest
import torch

import ds_seg  # noqa: F401
from ds_seg.models import segmentation_loss
from ds_seg.registry import LOSSES, build


def pixels(logits_PK, labels_P):
    """P pixels as a [1, K, 1, P] image and [1, 1, P] labels."""
    return logits_PK.t().reshape(1, -1, 1, logits_PK.shape[0]), labels_P.reshape(1, 1, -1)


def test_focal_by_hand():
    # Two classes, logits (0, ln 3): p = (1/4, 3/4).
    logits, labels = pixels(torch.tensor([[0.0, math.log(3)]] * 3), torch.tensor([1, 0, 255]))
    loss = build(LOSSES, dict(type='FocalLoss', gamma=2.0))(logits, labels)
    by_hand = (-(1 / 4) ** 2 * math.log(3 / 4) - (3 / 4) ** 2 * math.log(1 / 4)) / 2  # ignored pixel out
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)
    alpha = build(LOSSES, dict(type='FocalLoss', gamma=2.0, alpha=[0.25, 0.75]))(logits, labels)
    assert alpha.item() == pytest.approx((-0.75 * (1 / 16) * math.log(3 / 4) - 0.25 * (9 / 16) * math.log(1 / 4)) / 2,
                                         rel=1e-6)


def test_focal_with_gamma_zero_is_cross_entropy():
    logits, labels = torch.randn(2, 5, 6, 7), torch.randint(0, 5, (2, 6, 7))
    labels[0, 0] = 255
    focal = build(LOSSES, dict(type='FocalLoss', gamma=0.0))(logits, labels)
    ce = build(LOSSES, dict(type='CrossEntropyLoss'))(logits, labels)
    torch.testing.assert_close(focal, ce)


def test_ohem_keeps_pixels_below_threshold_or_the_min_kept_hardest():
    # True-class probabilities 0.9, 0.6, 0.3, 0.8 (two classes: logits (0, logit(p)), label 1).
    probs = torch.tensor([0.9, 0.6, 0.3, 0.8])
    logits, labels = pixels(torch.stack([torch.zeros(4), torch.log(probs / (1 - probs))], 1), torch.ones(4, dtype=torch.long))
    ce = -torch.log(probs)
    below = build(LOSSES, dict(type='OhemCrossEntropyLoss', thresh=0.7, min_kept=1))(logits, labels)
    assert below.item() == pytest.approx(((ce[1] + ce[2]) / 2).item(), rel=1e-5)  # p <= 0.7
    hardest3 = build(LOSSES, dict(type='OhemCrossEntropyLoss', thresh=0.7, min_kept=3))(logits, labels)
    assert hardest3.item() == pytest.approx(((ce[1] + ce[2] + ce[3]) / 3).item(), rel=1e-5)
    labels[0, 0, 2] = 255  # an ignored pixel is never kept, however hard
    ignored = build(LOSSES, dict(type='OhemCrossEntropyLoss', thresh=0.7, min_kept=1))(logits, labels)
    assert ignored.item() == pytest.approx(ce[1].item(), rel=1e-5)


def test_combined_is_the_weighted_sum():
    logits, labels = torch.randn(2, 4, 5, 5), torch.randint(0, 4, (2, 5, 5))
    combined = build(LOSSES, dict(type='CombinedLoss', losses=[dict(type='CrossEntropyLoss', loss_weight=1.0),
                                                               dict(type='DiceLoss', loss_weight=0.5)]))
    ce = build(LOSSES, dict(type='CrossEntropyLoss'))(logits, labels)
    dice = build(LOSSES, dict(type='DiceLoss'))(logits, labels)
    torch.testing.assert_close(combined(logits, labels), ce + 0.5 * dice)
    with pytest.raises(KeyError, match='DiceLoss'):
        build(LOSSES, dict(type='CombinedLoss', losses=[dict(type='DiceLos')]))


def test_segmentation_loss_adds_weighted_auxiliary_losses():
    ce = build(LOSSES, dict(type='CrossEntropyLoss'))
    main, aux, labels = torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4), torch.randint(0, 3, (1, 4, 4))
    torch.testing.assert_close(segmentation_loss(ce, main, labels), ce(main, labels))
    total = segmentation_loss(ce, {'logits': main, 'aux': [(0.4, aux)]}, labels)
    torch.testing.assert_close(total, ce(main, labels) + 0.4 * ce(aux, labels))
