"""Segmentation losses: ``loss(logits_BKHW, labels_BHW) -> scalar``.

Shape legend: B batch, K classes, H/W height/width.

Both losses compute in fp32 whatever the logits' dtype: softmax and log-sum-exp over bf16/fp16
logits lose enough precision to change the loss by more than the differences between ZeRO
stages that the tests compare.

Example::

    from ds_seg.registry import LOSSES, build
    loss_fn = build(LOSSES, dict(type='CrossEntropyLoss', ignore_index=255))
    loss = loss_fn(logits_BKHW, labels_BHW)
"""
import torch
import torch.nn.functional as F
from torch import nn

from ds_seg.config import checked_number
from ds_seg.registry import LOSSES


def _check_shapes(logits_BKHW, labels_BHW):
    if logits_BKHW.dim() != 4 or labels_BHW.shape != (logits_BKHW.shape[0], *logits_BKHW.shape[2:]):
        raise ValueError(f'expected logits [B, K, H, W] and labels [B, H, W] of the same B, H, W; '
                         f'got {tuple(logits_BKHW.shape)} and {tuple(labels_BHW.shape)}')


@LOSSES.register_module()
class CrossEntropyLoss(nn.Module):
    """Pixel-wise cross-entropy, averaged over the pixels that are not ``ignore_index``.

    With ``class_weight`` the average is torch's weighted mean, ``sum(w[y] * l) / sum(w[y])``
    over non-ignored pixels. A batch in which every pixel is ignored (a crop of nodata) gives a
    loss of 0 that still has a graph, instead of NaN, so the step and the collectives of
    gradient accumulation go on unchanged on every rank.

    Example::

        loss_fn = CrossEntropyLoss(class_weight=[1.0, 2.0, 1.0], label_smoothing=0.1)
        loss = loss_fn(torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2, 8, 8)))
    """

    def __init__(self, ignore_index=255, class_weight=None, loss_weight=1.0, label_smoothing=0.0):
        super().__init__()
        self.ignore_index = ignore_index
        self.loss_weight = checked_number(type(self).__name__, 'loss_weight', loss_weight)
        self.label_smoothing = checked_number(type(self).__name__, 'label_smoothing', label_smoothing, high=1.0)
        # A buffer follows the module to the logits' device; not persistent, so checkpoints
        # stay independent of the loss configuration.
        weight = None if class_weight is None else torch.as_tensor(class_weight, dtype=torch.float32)
        self.register_buffer('class_weight', weight, persistent=False)

    def forward(self, logits_BKHW, labels_BHW):
        _check_shapes(logits_BKHW, labels_BHW)
        labels_BHW = labels_BHW.long()
        weight = self.class_weight
        if weight is not None:
            weight = weight.to(logits_BKHW.device)
        # Sum, then divide ourselves: torch's 'mean' is 0/0 = NaN when every pixel is ignored.
        total = F.cross_entropy(logits_BKHW.float(), labels_BHW, weight=weight,
                                ignore_index=self.ignore_index, reduction='sum',
                                label_smoothing=self.label_smoothing)
        valid_BHW = labels_BHW != self.ignore_index
        if weight is None:
            denom = valid_BHW.sum().float()
        else:
            # Ignored pixels index class 0 here, then count zero through the mask.
            denom = (weight[labels_BHW.masked_fill(~valid_BHW, 0)] * valid_BHW).sum()
        # With no valid pixel ``total`` is exactly 0, so clamping the denominator returns 0
        # (with a graph) without a host synchronisation to test for that case.
        return self.loss_weight * total / denom.clamp_min(torch.finfo(torch.float32).tiny)


@LOSSES.register_module()
class DiceLoss(nn.Module):
    """Multiclass soft Dice loss, ``1 - mean_k dice_k``, over softmax probabilities.

    ``dice_k = (2 * sum(p_k * g_k) + smooth) / (sum(p_k) + sum(g_k) + smooth)`` with the sums
    over every non-ignored pixel of the batch (not per image, so a class missing from one crop
    does not dominate). ``smooth`` > 0 makes a class absent from both labels and prediction
    count as a perfect match and keeps an all-ignored batch at 0 rather than NaN.

    Example::

        loss_fn = DiceLoss(ignore_index=255)
        loss = loss_fn(torch.randn(2, 6, 8, 8), torch.randint(0, 6, (2, 8, 8)))
    """

    def __init__(self, ignore_index=255, smooth=1.0, loss_weight=1.0):
        super().__init__()
        self.ignore_index = ignore_index
        self.smooth = checked_number(type(self).__name__, 'smooth', smooth, low_open=True)  # > 0: it avoids 0/0
        self.loss_weight = checked_number(type(self).__name__, 'loss_weight', loss_weight)

    def forward(self, logits_BKHW, labels_BHW):
        _check_shapes(logits_BKHW, labels_BHW)
        num_classes = logits_BKHW.shape[1]
        labels_BHW = labels_BHW.long()
        valid_B1HW = (labels_BHW != self.ignore_index).unsqueeze(1)
        probs_BKHW = logits_BKHW.float().softmax(dim=1) * valid_B1HW
        onehot_BKHW = F.one_hot(labels_BHW.masked_fill(~valid_B1HW.squeeze(1), 0), num_classes)
        onehot_BKHW = onehot_BKHW.permute(0, 3, 1, 2).float() * valid_B1HW
        dims = (0, 2, 3)
        intersection_K = (probs_BKHW * onehot_BKHW).sum(dims)
        denom_K = probs_BKHW.sum(dims) + onehot_BKHW.sum(dims)
        dice_K = (2 * intersection_K + self.smooth) / (denom_K + self.smooth)
        return self.loss_weight * (1 - dice_K.mean())


def segmentation_loss(criterion, outputs, labels_BHW):
    """``criterion`` on a model's output: logits, or a dict from a model with auxiliary heads
    (``{'logits': ..., 'aux': [(weight, aux_logits), ...]}``) whose weighted losses are added.

    Example::

        loss = segmentation_loss(loss_fn, model(images_BCHW), labels_BHW)
    """
    if not isinstance(outputs, dict):
        return criterion(outputs, labels_BHW)
    loss = criterion(outputs['logits'], labels_BHW)
    for weight, aux_BKHW in outputs.get('aux', ()):
        loss = loss + weight * criterion(aux_BKHW, labels_BHW)
    return loss


def _valid_mean(values, valid):
    # Clamped denominator: an all-ignored batch gives 0 with a graph, no host synchronisation.
    return (values * valid).sum() / valid.sum().float().clamp_min(1.0)


@LOSSES.register_module()
class FocalLoss(nn.Module):
    """Multiclass focal loss (Lin et al. 2017), ``-alpha_y (1 - p_y)^gamma log p_y``, averaged
    over non-ignored pixels; ``gamma=0`` and no ``alpha`` is plain cross-entropy.

    Example::

        loss_fn = FocalLoss(gamma=2.0, alpha=[0.25] * 6)
        loss = loss_fn(torch.randn(2, 6, 8, 8), torch.randint(0, 6, (2, 8, 8)))
    """

    def __init__(self, gamma=2.0, alpha=None, ignore_index=255, loss_weight=1.0):
        super().__init__()
        self.gamma = checked_number(type(self).__name__, 'gamma', gamma)
        self.ignore_index = ignore_index
        self.loss_weight = checked_number(type(self).__name__, 'loss_weight', loss_weight)
        alpha = None if alpha is None else torch.as_tensor(alpha, dtype=torch.float32)
        self.register_buffer('alpha', alpha, persistent=False)

    def forward(self, logits_BKHW, labels_BHW):
        _check_shapes(logits_BKHW, labels_BHW)
        labels_BHW = labels_BHW.long()
        valid_BHW = labels_BHW != self.ignore_index
        target_BHW = labels_BHW.masked_fill(~valid_BHW, 0)
        logp_BHW = logits_BKHW.float().log_softmax(1).gather(1, target_BHW.unsqueeze(1)).squeeze(1)
        loss_BHW = -(1 - logp_BHW.exp()).pow(self.gamma) * logp_BHW
        if self.alpha is not None:
            loss_BHW = loss_BHW * self.alpha.to(loss_BHW.device)[target_BHW]
        return self.loss_weight * _valid_mean(loss_BHW, valid_BHW)


@LOSSES.register_module()
class OhemCrossEntropyLoss(nn.Module):
    """Cross-entropy over the hard pixels only (online hard example mining, as mmsegmentation's
    OHEM sampler): pixels whose true-class probability is below ``thresh``, but at least the
    ``min_kept`` hardest non-ignored pixels of the batch.

    Example::

        loss_fn = OhemCrossEntropyLoss(thresh=0.7, min_kept=100000)
    """

    def __init__(self, thresh=0.7, min_kept=100000, ignore_index=255, class_weight=None, loss_weight=1.0):
        super().__init__()
        self.thresh = checked_number(type(self).__name__, 'thresh', thresh, low_open=True, high=1.0)  # a probability
        self.min_kept = checked_number(type(self).__name__, 'min_kept', min_kept, integer=True)
        self.ignore_index = ignore_index
        self.loss_weight = checked_number(type(self).__name__, 'loss_weight', loss_weight)
        weight = None if class_weight is None else torch.as_tensor(class_weight, dtype=torch.float32)
        self.register_buffer('class_weight', weight, persistent=False)

    def forward(self, logits_BKHW, labels_BHW):
        _check_shapes(logits_BKHW, labels_BHW)
        labels_BHW = labels_BHW.long()
        valid = (labels_BHW != self.ignore_index).flatten()
        target = labels_BHW.masked_fill(labels_BHW == self.ignore_index, 0).flatten()
        weight = None if self.class_weight is None else self.class_weight.to(logits_BKHW.device)
        loss = F.cross_entropy(logits_BKHW.float(), target.view_as(labels_BHW), reduction='none').flatten()
        with torch.no_grad():
            prob = logits_BKHW.float().softmax(1).gather(1, target.view_as(labels_BHW).unsqueeze(1)).flatten()
            prob = prob.masked_fill(~valid, float('inf'))  # ignored pixels are never selected
            # The threshold rises to the min_kept-th smallest probability when fewer are below it.
            k = min(self.min_kept, prob.numel())
            kth = prob.kthvalue(k).values if k > 0 else prob.new_tensor(0.0)
            thresh = torch.maximum(kth, prob.new_tensor(self.thresh)) if self.min_kept > 0 else prob.new_tensor(self.thresh)
            keep = (prob <= thresh) & valid
        w = keep.float() if weight is None else keep.float() * weight[target]
        return self.loss_weight * (loss * w).sum() / w.sum().clamp_min(torch.finfo(torch.float32).tiny)


@LOSSES.register_module()
class LovaszLoss(nn.Module):
    """Lovasz-Softmax loss (Berman et al. 2018): the Lovasz extension of the Jaccard loss, a
    convex surrogate of ``1 - IoU`` per class on softmax probabilities, averaged over the
    classes (``'present'``: those in the batch's labels, as mmsegmentation's default; ``'all'``).
    Computed over every non-ignored pixel of the batch at once (mmseg's ``per_image=False``).
    With one-hot probabilities it is exactly ``mean_c (1 - IoU_c)``; it optimises mIoU directly,
    usually beside cross-entropy in a ``CombinedLoss``.

    Example::

        loss_fn = CombinedLoss(losses=[dict(type='CrossEntropyLoss'), dict(type='LovaszLoss', loss_weight=0.5)])
    """

    CLASS_SETS = ('present', 'all')

    def __init__(self, ignore_index=255, classes='present', loss_weight=1.0):
        super().__init__()
        if classes not in self.CLASS_SETS:
            raise ValueError(f"LovaszLoss classes must be one of {', '.join(map(repr, self.CLASS_SETS))}, "
                             f"got {classes!r}")
        self.ignore_index, self.classes = ignore_index, classes
        self.loss_weight = checked_number(type(self).__name__, 'loss_weight', loss_weight)

    def forward(self, logits_BKHW, labels_BHW):
        _check_shapes(logits_BKHW, labels_BHW)
        num_classes = logits_BKHW.shape[1]
        labels_P = labels_BHW.long().flatten()
        valid_P = labels_P != self.ignore_index
        probs_KP = logits_BKHW.float().softmax(dim=1).permute(1, 0, 2, 3).reshape(num_classes, -1)
        fg_KP = F.one_hot(labels_P.masked_fill(~valid_P, 0), num_classes).T.float() * valid_P
        # Ignored pixels get error 0 and no foreground: sorted last, they add nothing and change
        # no valid pixel's weight (a fixed shape: no host synchronisation to select pixels).
        errors_KP = (fg_KP - probs_KP).abs() * valid_P
        errors_sorted_KP, order_KP = errors_KP.sort(dim=1, descending=True)
        fg_sorted_KP = fg_KP.gather(1, order_KP)
        # The Lovasz gradient: the increments of the Jaccard loss along the sorted errors.
        total_K1 = fg_sorted_KP.sum(1, keepdim=True)
        intersection_KP = total_K1 - fg_sorted_KP.cumsum(1)
        union_KP = total_K1 + (1 - fg_sorted_KP).cumsum(1)
        jaccard_KP = 1 - intersection_KP / union_KP
        grad_KP = torch.cat([jaccard_KP[:, :1], jaccard_KP[:, 1:] - jaccard_KP[:, :-1]], dim=1)
        loss_K = (errors_sorted_KP * grad_KP).sum(1)
        counted_K = total_K1.squeeze(1) > 0 if self.classes == 'present' else torch.ones_like(loss_K, dtype=torch.bool)
        # Clamped: a batch with no valid pixel gives 0 (with a graph), not NaN.
        return self.loss_weight * (loss_K * counted_K).sum() / counted_K.sum().clamp_min(1)


@LOSSES.register_module()
class CombinedLoss(nn.Module):
    """A weighted sum of LOSSES entries: each ``dict(type=..., loss_weight=w, ...)``.

    Example::

        loss_fn = CombinedLoss(losses=[dict(type='CrossEntropyLoss', loss_weight=1.0),
                                       dict(type='DiceLoss', loss_weight=0.5)])
    """

    def __init__(self, losses):
        super().__init__()
        from ds_seg.registry import build
        if not losses:
            raise ValueError('CombinedLoss needs at least one loss in losses=[...].')
        if isinstance(losses, (dict, str)):  # one loss without its list: iterated as its keys
            raise ValueError(f"CombinedLoss losses must be a list of dicts, e.g. [dict(type='CrossEntropyLoss'), "
                             f"dict(type='DiceLoss')], got {losses!r}")
        self.losses = nn.ModuleList(build(LOSSES, dict(cfg), where=f'loss.losses[{i}]') for i, cfg in enumerate(losses))

    def forward(self, logits_BKHW, labels_BHW):
        # Each member applies its own loss_weight.
        return sum(loss_fn(logits_BKHW, labels_BHW) for loss_fn in self.losses)
