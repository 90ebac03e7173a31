"""Confusion matrix and metrics equal hand-computed values."""
import json

import pytest
import torch

from ds_seg.metrics import confusion_matrix, metrics_from_confusion

IGNORE = 255


def test_confusion_matrix_counts_truth_rows_prediction_columns_and_skips_ignore():
    labels_BHW = torch.tensor([[[0, 0, 1], [2, IGNORE, 1]]])
    pred_BHW = torch.tensor([[[0, 1, 1], [1, 2, 1]]])
    cm = confusion_matrix(pred_BHW, labels_BHW, num_classes=3, ignore_index=IGNORE)
    assert cm.dtype == torch.int64
    assert cm.tolist() == [[1, 1, 0],
                           [0, 2, 0],
                           [0, 1, 0]]


def test_confusion_matrix_accumulates_over_batches_like_one_batch():
    torch.manual_seed(0)
    labels_BHW = torch.randint(0, 4, (4, 9, 7))
    pred_BHW = torch.randint(0, 4, (4, 9, 7))
    whole = confusion_matrix(pred_BHW, labels_BHW, 4)
    parts = sum(confusion_matrix(pred_BHW[i:i + 1], labels_BHW[i:i + 1], 4) for i in range(4))
    assert torch.equal(whole, parts)
    assert whole.sum() == labels_BHW.numel()


def test_out_of_range_label_is_an_error_not_a_miscount():
    with pytest.raises(ValueError, match='outside'):
        confusion_matrix(torch.tensor([[0, 1]]), torch.tensor([[0, 7]]), num_classes=3)


def test_metrics_equal_hand_computation_with_absent_class():
    # Class 2 ('car') appears in neither truth nor prediction; class 3 ('tree') is predicted
    # but never true.
    cm = torch.tensor([[5, 1, 0, 0],
                       [2, 3, 0, 1],
                       [0, 0, 0, 0],
                       [0, 0, 0, 0]])
    names = ['road', 'building', 'car', 'tree']
    m = metrics_from_confusion(cm, names)

    iou = {'road': 5 / (6 + 7 - 5), 'building': 3 / (6 + 4 - 3), 'tree': 0 / (0 + 1 - 0)}
    f1 = {'road': 10 / 13, 'building': 6 / 10, 'tree': 0.0}
    assert m['OA'] == pytest.approx(8 / 12)
    assert m['mIoU'] == pytest.approx(sum(iou.values()) / 3)
    assert m['mF1'] == pytest.approx(sum(f1.values()) / 3)
    assert m['per_class']['road'] == pytest.approx(
        {'iou': iou['road'], 'f1': f1['road'], 'precision': 5 / 7, 'recall': 5 / 6})
    assert m['per_class']['car'] == {'iou': None, 'f1': None, 'precision': None, 'recall': None}
    assert m['per_class']['tree'] == {'iou': 0.0, 'f1': 0.0, 'precision': 0.0, 'recall': None}
    json.dumps(m, allow_nan=False)  # valid JSON, no NaN
    assert all(type(v) is float for v in (m['mIoU'], m['OA'], m['mF1']))


def test_exclude_drops_class_from_means_but_not_from_overall_accuracy():
    cm = torch.tensor([[4, 0, 1],
                       [1, 3, 0],
                       [2, 2, 1]])
    names = ['road', 'building', 'clutter']
    full = metrics_from_confusion(cm, names)
    excl = metrics_from_confusion(cm, names, exclude=('clutter',))
    iou_road, iou_building, iou_clutter = 4 / 8, 3 / 6, 1 / 6
    assert full['mIoU'] == pytest.approx((iou_road + iou_building + iou_clutter) / 3)
    assert excl['mIoU'] == pytest.approx((iou_road + iou_building) / 2)
    assert excl['mF1'] == pytest.approx((8 / 12 + 6 / 9) / 2)
    assert excl['OA'] == full['OA'] == pytest.approx(8 / 14)
    assert excl['per_class']['clutter']['iou'] == pytest.approx(iou_clutter)


def test_end_to_end_from_predictions_with_ignore():
    labels_BHW = torch.tensor([[[0, 1, IGNORE], [1, 1, IGNORE]]])
    pred_BHW = torch.tensor([[[0, 1, 0], [0, 1, 2]]])
    m = metrics_from_confusion(confusion_matrix(pred_BHW, labels_BHW, 3), ['a', 'b', 'c'])
    # Ignored pixels predicted 0 and 2 do not count: 'c' stays absent.
    assert m['per_class']['c']['iou'] is None
    assert m['OA'] == pytest.approx(3 / 4)
    assert m['mIoU'] == pytest.approx((1 / 2 + 2 / 3) / 2)


def test_empty_matrix_gives_none_and_bad_names_raise():
    m = metrics_from_confusion(torch.zeros(2, 2, dtype=torch.int64), ['a', 'b'])
    assert m['mIoU'] is None and m['OA'] is None and m['mF1'] is None
    with pytest.raises(ValueError, match='unknown'):
        metrics_from_confusion(torch.eye(2), ['a', 'b'], exclude=('clutter',))
    with pytest.raises(ValueError, match='class names'):
        metrics_from_confusion(torch.eye(2), ['a'])
