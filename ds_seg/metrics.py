"""Confusion matrix and the segmentation metrics derived from it.

Shape legend: B batch, H/W height/width, K classes.

Evaluation accumulates one int64 confusion matrix per rank with :func:`confusion_matrix`,
all-reduces it (a sum, so exact in any order), and turns it into numbers with
:func:`metrics_from_confusion`. Counting in a matrix rather than averaging per-batch scores is
what makes the result independent of batch size and world size.

Example::

    cm = torch.zeros(K, K, dtype=torch.int64, device=device)
    for images_BCHW, labels_BHW in loader:
        cm += confusion_matrix(model(images_BCHW).argmax(1), labels_BHW, K)
    # all-reduce cm here when distributed
    result = metrics_from_confusion(cm, class_names, exclude=('clutter',))
    result['mIoU'], result['per_class']['building']['iou']
"""
import math

import torch


def confusion_matrix(pred_BHW, labels_BHW, num_classes, ignore_index=255):
    """Count pixels: ``cm[t, p]`` is the number of pixels of ground truth ``t`` predicted ``p``.

    Pixels labelled ``ignore_index`` are not counted. Returns an int64 ``[K, K]`` tensor on the
    inputs' device (no host copy, so it can be all-reduced directly).
    Raises ValueError for any other label or prediction outside ``[0, num_classes)``: counting
    them into a wrong cell, or dropping them, would make the metrics silently wrong.

    Example::

        confusion_matrix(torch.tensor([[0, 1]]), torch.tensor([[0, 0]]), num_classes=2)
        # tensor([[1, 1], [0, 0]])
    """
    if pred_BHW.shape != labels_BHW.shape:
        raise ValueError(f'prediction {tuple(pred_BHW.shape)} and labels {tuple(labels_BHW.shape)} '
                         f'differ in shape')
    valid = labels_BHW != ignore_index
    labels = labels_BHW[valid].long()
    pred = pred_BHW[valid].long()
    # One host synchronisation per batch; evaluation is not the hot path and a silent
    # miscount is worse.
    out_of_range = (labels < 0) | (labels >= num_classes) | (pred < 0) | (pred >= num_classes)
    if out_of_range.any():
        raise ValueError(f'labels or predictions outside [0, {num_classes}) that are not '
                         f'ignore_index={ignore_index}: labels {labels[out_of_range].unique().tolist()}, '
                         f'predictions {pred[out_of_range].unique().tolist()}')
    counts = torch.bincount(labels * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def _nan_to_none(x):
    return None if math.isnan(x) else float(x)


def metrics_from_confusion(cm, class_names, exclude=()):
    """mIoU, overall accuracy, mean F1 and per-class IoU/F1/precision/recall from a confusion matrix.

    ``cm`` has ground truth on rows and predictions on columns (as :func:`confusion_matrix`).
    A class with no pixel in either the ground truth or the prediction has no defined IoU or F1:
    it is reported as None and left out of the means (mmsegmentation's nanmean convention).
    Precision is None for a class never predicted, recall for a class absent from the ground
    truth. Classes named in ``exclude`` (e.g. clutter) are left out of mIoU and mF1 but still
    count in OA, which is over all pixels. Values are plain Python floats (or None), ready for
    JSON.

    Example::

        cm = torch.tensor([[3, 1], [0, 4]])
        metrics_from_confusion(cm, ['road', 'building'])['mIoU']   # (3/4 + 4/5) / 2 = 0.775
    """
    cm = torch.as_tensor(cm).detach().to('cpu', torch.float64)
    num_classes = cm.shape[0]
    if cm.shape != (num_classes, num_classes) or len(class_names) != num_classes:
        raise ValueError(f'confusion matrix of shape {tuple(cm.shape)} does not match '
                         f'{len(class_names)} class names')
    unknown = set(exclude) - set(class_names)
    if unknown:
        raise ValueError(f'exclude names unknown classes {sorted(unknown)}; classes are {list(class_names)}')

    tp = cm.diagonal()
    gt = cm.sum(dim=1)
    pred = cm.sum(dim=0)
    # float64 division gives NaN for 0/0, which marks exactly the undefined cases.
    iou = tp / (gt + pred - tp)
    f1 = 2 * tp / (gt + pred)
    precision = tp / pred
    recall = tp / gt

    keep = torch.tensor([name not in exclude for name in class_names])
    total = cm.sum()
    return {
        'mIoU': _nan_to_none(iou[keep].nanmean().item()),
        'OA': _nan_to_none((tp.sum() / total).item()),
        'mF1': _nan_to_none(f1[keep].nanmean().item()),
        'per_class': {
            name: {'iou': _nan_to_none(iou[k].item()), 'f1': _nan_to_none(f1[k].item()),
                   'precision': _nan_to_none(precision[k].item()),
                   'recall': _nan_to_none(recall[k].item())}
            for k, name in enumerate(class_names)
        },
    }
