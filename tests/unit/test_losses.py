"""Losses equal hand computations, ignore pixels, survive all-ignored batches, run in fp32."""
import math

import pytest
import torch

import ds_seg  # noqa: F401  (registers everything)
from ds_seg.models import CrossEntropyLoss, DiceLoss, LovaszLoss
from ds_seg.registry import LOSSES, build

IGNORE = 255


def _example():
    torch.manual_seed(0)
    logits_BKHW = torch.randn(2, 3, 4, 5, requires_grad=True)
    labels_BHW = torch.randint(0, 3, (2, 4, 5))
    labels_BHW[0, 0, :3] = IGNORE
    labels_BHW[1, 2, 4] = IGNORE
    return logits_BKHW, labels_BHW


def _hand_ce(logits_BKHW, labels_BHW, weight):
    """sum over valid pixels of w[y] * (logsumexp(z) - z[y]), divided by sum of w[y]."""
    num, den = 0.0, 0.0
    B, K, H, W = logits_BKHW.shape
    for b in range(B):
        for i in range(H):
            for j in range(W):
                y = int(labels_BHW[b, i, j])
                if y == IGNORE:
                    continue
                z = [float(logits_BKHW[b, k, i, j]) for k in range(K)]
                nll = math.log(sum(math.exp(v) for v in z)) - z[y]
                num += weight[y] * nll
                den += weight[y]
    return num / den


@pytest.mark.parametrize('weight', [None, [0.5, 2.0, 1.0]])
def test_cross_entropy_equals_hand_computation(weight):
    logits_BKHW, labels_BHW = _example()
    loss = CrossEntropyLoss(ignore_index=IGNORE, class_weight=weight)(logits_BKHW, labels_BHW)
    expected = _hand_ce(logits_BKHW.detach(), labels_BHW, weight or [1.0] * 3)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize('weight', [None, [0.5, 2.0, 1.0]])
@pytest.mark.parametrize('smoothing', [0.0, 0.1])
def test_cross_entropy_equals_torch_mean_with_loss_weight(weight, smoothing):
    logits_BKHW, labels_BHW = _example()
    loss = build(LOSSES, dict(type='CrossEntropyLoss', class_weight=weight, loss_weight=0.4,
                              label_smoothing=smoothing))(logits_BKHW, labels_BHW)
    expected = torch.nn.functional.cross_entropy(
        logits_BKHW, labels_BHW, ignore_index=IGNORE, label_smoothing=smoothing,
        weight=None if weight is None else torch.tensor(weight))
    torch.testing.assert_close(loss, 0.4 * expected)


def test_ignored_pixels_do_not_affect_loss_or_gradient():
    logits_BKHW, labels_BHW = _example()
    loss = CrossEntropyLoss()(logits_BKHW, labels_BHW)
    loss.backward()
    ignored = (labels_BHW == IGNORE).unsqueeze(1).expand_as(logits_BKHW)
    assert (logits_BKHW.grad[ignored] == 0).all()
    # Changing logits where the label is ignored changes nothing.
    shifted = (logits_BKHW.detach() + 10 * ignored).requires_grad_()
    assert CrossEntropyLoss()(shifted, labels_BHW).item() == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize('loss_cls', [CrossEntropyLoss, DiceLoss, LovaszLoss])
@pytest.mark.parametrize('weight', [None, [1.0, 2.0, 3.0]])
def test_all_ignored_gives_zero_with_grad_not_nan(loss_cls, weight):
    logits_BKHW = torch.randn(2, 3, 4, 4, requires_grad=True)
    labels_BHW = torch.full((2, 4, 4), IGNORE)
    kwargs = {'class_weight': weight} if loss_cls is CrossEntropyLoss else {}
    loss = loss_cls(**kwargs)(logits_BKHW, labels_BHW)
    assert loss.item() == 0.0
    loss.backward()
    assert (logits_BKHW.grad == 0).all()


def test_dice_perfect_prediction_is_near_zero_and_wrong_is_near_one():
    labels_BHW = torch.randint(0, 4, (2, 16, 16))
    labels_BHW[:, :2] = IGNORE
    onehot_BKHW = torch.nn.functional.one_hot(labels_BHW.clamp(max=3), 4).permute(0, 3, 1, 2).float()
    dice = DiceLoss(smooth=1e-3)
    assert dice(30 * onehot_BKHW, labels_BHW).item() == pytest.approx(0.0, abs=1e-6)
    wrong_BKHW = 30 * onehot_BKHW.roll(1, dims=1)  # always predicts the next class
    assert dice(wrong_BKHW, labels_BHW).item() == pytest.approx(1.0, abs=1e-3)


def test_dice_equals_hand_computation_and_ignores_pixels():
    logits_BKHW, labels_BHW = _example()
    loss = DiceLoss(smooth=1.0)(logits_BKHW, labels_BHW)
    valid = labels_BHW != IGNORE
    probs_BKHW = logits_BKHW.detach().softmax(1)
    dices = []
    for k in range(3):
        p = probs_BKHW[:, k][valid]
        g = (labels_BHW[valid] == k).float()
        dices.append((2 * (p * g).sum() + 1) / (p.sum() + g.sum() + 1))
    assert loss.item() == pytest.approx(1 - torch.stack(dices).mean().item(), rel=1e-5)


@pytest.mark.parametrize('loss_cls', [CrossEntropyLoss, DiceLoss, LovaszLoss])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_low_precision_logits_are_computed_in_fp32(loss_cls, dtype):
    logits_BKHW, labels_BHW = _example()
    low_BKHW = logits_BKHW.detach().to(dtype).requires_grad_()
    loss = loss_cls()(low_BKHW, labels_BHW)
    assert loss.dtype == torch.float32
    # Same value as fp32 on the same (rounded) logits: only the input was rounded.
    torch.testing.assert_close(loss, loss_cls()(low_BKHW.detach().float(), labels_BHW))
    loss.backward()
    assert low_BKHW.grad.dtype == dtype


def _reference_lovasz(logits_BKHW, labels_BHW, classes):
    """Berman et al.'s lovasz_softmax_flat (per_image=False): the valid pixels selected, one
    class at a time, absent classes skipped for 'present'."""
    valid = labels_BHW != IGNORE
    probs_PK = logits_BKHW.detach().softmax(1).permute(0, 2, 3, 1)[valid]
    labels_P = labels_BHW[valid]
    losses = []
    for c in range(probs_PK.shape[1]):
        fg = (labels_P == c).float()
        if classes == 'present' and fg.sum() == 0:
            continue
        errors, perm = (fg - probs_PK[:, c]).abs().sort(descending=True)
        fg_sorted = fg[perm]
        gts = fg_sorted.sum()
        jaccard = 1 - (gts - fg_sorted.cumsum(0)) / (gts + (1 - fg_sorted).cumsum(0))
        jaccard[1:] = jaccard[1:] - jaccard[:-1].clone()
        losses.append(torch.dot(errors, jaccard))
    return torch.stack(losses).mean().item()


@pytest.mark.parametrize('classes', ['present', 'all'])
def test_lovasz_equals_the_reference_implementation_and_ignores_pixels(classes):
    logits_BKHW, labels_BHW = _example()
    labels_BHW = labels_BHW.clone()
    labels_BHW[labels_BHW == 2] = 1  # class 2 absent: 'present' and 'all' differ
    loss = LovaszLoss(classes=classes)(logits_BKHW, labels_BHW)
    assert loss.item() == pytest.approx(_reference_lovasz(logits_BKHW, labels_BHW, classes), rel=1e-6)
    assert LovaszLoss(classes='present')(logits_BKHW, labels_BHW).item() != \
        pytest.approx(LovaszLoss(classes='all')(logits_BKHW, labels_BHW).item(), rel=1e-3)
    loss.backward()
    ignored = (labels_BHW == IGNORE).unsqueeze(1).expand_as(logits_BKHW)
    assert (logits_BKHW.grad[ignored] == 0).all() and logits_BKHW.grad.abs().sum() > 0


def test_lovasz_of_hard_predictions_is_one_minus_iou_per_present_class():
    """With one-hot probabilities the Lovasz extension equals the Jaccard loss it extends:
    mean over the classes in the labels of 1 - IoU, counted by hand over the valid pixels."""
    torch.manual_seed(1)
    labels_BHW = torch.randint(0, 4, (2, 12, 10))
    labels_BHW[0, :3] = IGNORE
    predicted_BHW = torch.where(torch.rand(2, 12, 10) < 0.6, labels_BHW.clamp(max=3), torch.randint(0, 4, (2, 12, 10)))
    logits_BKHW = 60.0 * torch.nn.functional.one_hot(predicted_BHW, 4).permute(0, 3, 1, 2).float()
    valid = labels_BHW != IGNORE
    ious = []
    for c in range(4):
        truth, pred = (labels_BHW == c) & valid, (predicted_BHW == c) & valid
        if truth.any():
            ious.append((truth & pred).sum().item() / (truth | pred).sum().item())
    expected = 1 - sum(ious) / len(ious)
    assert LovaszLoss()(logits_BKHW, labels_BHW).item() == pytest.approx(expected, abs=1e-6)
    assert LovaszLoss()(logits_BKHW, labels_BHW.masked_fill(~valid, 0).clamp(max=3)).item() != \
        pytest.approx(expected, abs=1e-3), 'the ignored pixels count when they are labels'


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match='labels'):
        CrossEntropyLoss()(torch.randn(2, 3, 8, 8), torch.zeros(2, 4, 4, dtype=torch.long))


@pytest.mark.parametrize('cfg, named', [
    (dict(type='CrossEntropyLoss', loss_weight='1.0'), "loss_weight must be a number >= 0, got '1.0'"),
    (dict(type='CrossEntropyLoss', loss_weight=-1.0), 'loss_weight must be a number >= 0'),
    (dict(type='CrossEntropyLoss', label_smoothing=1.5), 'label_smoothing must be a number in [0, 1]'),
    (dict(type='DiceLoss', smooth=0), 'smooth must be a number > 0'),
    (dict(type='FocalLoss', gamma=-2), 'gamma must be a number >= 0'),
    (dict(type='FocalLoss', gamma='2'), "gamma must be a number >= 0, got '2'"),
    (dict(type='OhemCrossEntropyLoss', thresh=-1), 'thresh must be a number in (0, 1]'),
    (dict(type='OhemCrossEntropyLoss', min_kept=-5), 'min_kept must be an integer >= 0'),
    (dict(type='OhemCrossEntropyLoss', min_kept=1e5), 'min_kept must be an integer >= 0'),
    (dict(type='LovaszLoss', classes='presnt'), "LovaszLoss classes must be one of 'present', 'all'"),
    (dict(type='CombinedLoss', losses=[dict(type='CrossEntropyLoss'), dict(type='FocalLoss', loss_weight=float('inf'))]),
     'loss.losses[1] (FocalLoss)'),
    # one member without its list was iterated as its keys ("dictionary update sequence element...")
    (dict(type='CombinedLoss', losses=dict(type='DiceLoss')), "CombinedLoss losses must be a list of dicts"),
])
def test_loss_hyperparameters_out_of_range_are_refused_when_built(cfg, named):
    """A string or out-of-range loss setting used to fail only at the first step (after the work
    dir was written: '1.0' * tensor, label_smoothing 1.5) or to train silently wrong (an OHEM
    thresh of -1 keeps no pixel: loss 0 for the whole run; a negative gamma). Now building the
    loss, before any training, is one line naming the key."""
    from ds_seg.config import ConfigError
    with pytest.raises(ConfigError, match='check the values under loss') as info:
        build(LOSSES, cfg, where='loss')
    assert named in str(info.value) and '\n' not in str(info.value)


def test_loss_hyperparameters_in_range_build():
    for cfg in (dict(type='CrossEntropyLoss', loss_weight=0, label_smoothing=1.0), dict(type='FocalLoss', gamma=0),
                dict(type='OhemCrossEntropyLoss', thresh=1.0, min_kept=0), dict(type='DiceLoss', smooth=1e-6)):
        build(LOSSES, cfg, where='loss')
