"""Data that trained silently wrong: worker transforms that moved pixels but not the nodata mask,
palettes finer than a lookup bin, statistics of the wrong bands or of masked pixels or of the
first files only, a user std of 0, and class counts inferred over nodata. Real GeoTIFFs."""
import json
import os
import re

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import from_origin

from ds_seg.data import GeoTiffScenes
from ds_seg.data.raster import DataError
from ds_seg.data.transforms import Compose, PaletteDecoder, default_palette_tolerance

IGNORE = 255


def write_tif(path, array, nodata=None, photometric='MINISBLACK', **extra):
    array = array[None] if array.ndim == 2 else array
    with rasterio.open(path, 'w', driver='GTiff', width=array.shape[2], height=array.shape[1],
                       count=array.shape[0], dtype=array.dtype, crs='EPSG:32632',
                       transform=from_origin(500_000, 5_500_000, 0.1, 0.1), tiled=True, blockxsize=16,
                       blockysize=16, photometric=photometric, nodata=nodata, **extra) as dst:
        dst.write(array)
    return str(path)


# ------------------------------------------------------------------ nodata mask through transforms
@pytest.mark.parametrize('transform', [dict(type='RandomFlip', prob=1.0, direction='horizontal'),
                                       dict(type='RandomFlip', prob=1.0, direction='vertical'),
                                       dict(type='RandomRotate90', prob=1.0),
                                       dict(type='PhotoMetricDistortion', prob=1.0)])
def test_worker_transforms_move_the_nodata_mask_with_the_pixels(tmp_path, transform):
    """The device zeroes the input where ``nodata`` says: a flipped image under an unflipped mask
    blanked 1024 valid pixels a sample and let nodata through (exit 0)."""
    rng = np.random.default_rng(0)
    image = rng.integers(1, 255, (3, 64, 64)).astype(np.uint8)
    image[:, :, :16] = 0                                      # nodata: the left quarter
    image[:, :8, :] = 0                                       # and the top rows (not symmetric)
    label = rng.integers(0, 3, (64, 64)).astype(np.uint8)
    img = write_tif(tmp_path / 'a_image.tif', image, nodata=0)
    lbl = write_tif(tmp_path / 'a_label.tif', label)
    ds = GeoTiffScenes([img], [lbl], crop_size=64, classes=3, transforms=[transform], seed=1)
    for i in range(4):
        s = ds[i]
        nodata, lab = s['nodata'].numpy(), s['label'].numpy()
        assert nodata.sum() == (image[0] == 0).sum()
        # The labels hold no ignore_index but at nodata, so the label's ignored pixels show where
        # the transform put the nodata pixels: the mask must be exactly there.
        np.testing.assert_array_equal(nodata, lab == IGNORE)
        if transform['type'] != 'PhotoMetricDistortion':  # it changes values, not places
            assert (s['image'].numpy()[:, nodata] == 0).all() and (s['image'].numpy()[:, ~nodata] > 0).all()


def test_a_registered_transform_that_moves_pixels_without_the_mask_is_named():
    class Mirror:  # an old-style transform: (image, label, rng) only
        def __call__(self, image, label, rng):
            return image[..., ::-1], label[..., ::-1]

    image = np.ones((1, 4, 4), np.uint8)
    invalid = np.zeros((4, 4), bool)
    invalid[:, 0] = True
    label = np.where(invalid, IGNORE, 1).astype(np.uint8)
    with pytest.raises(ValueError, match=r"transforms\[0\] \(Mirror\) moved pixels but not the nodata mask"):
        Compose([Mirror()])(image, label, np.random.default_rng(0), invalid)
    class Crop:  # moves nothing of a mask without nodata pixels, but changes the shape
        def __call__(self, image, label, rng):
            return image[..., :2, :2], label[:2, :2]

    with pytest.raises(ValueError, match=r"transforms\[0\] \(Crop\) moved pixels but not the nodata mask"):
        Compose([Crop()])(image, np.ones((4, 4), np.uint8), np.random.default_rng(0), np.zeros((4, 4), bool))
    # Without a mask, or with one it leaves in place, it runs as before.
    out = Compose([Mirror()])(image, label, np.random.default_rng(0))
    assert out[2] is None and (out[1][:, -1] == IGNORE).all()


# ------------------------------------------------------------------ palettes
def test_palette_decoder_equals_the_distance_rule_for_every_colour():
    """The lookup table is exact: each colour gets what the distance rule says (within the
    tolerance of an entry, the nearest), for close palettes (grey codes 0, 1, 2) too."""
    rng = np.random.default_rng(0)
    cube = np.stack(np.meshgrid(*[np.arange(0, 256, 1)] * 2, indexing='ij'), 0).reshape(2, -1)
    for trial in range(40):
        k = int(rng.integers(2, 7))
        spread = 6 if trial % 2 else 256
        palette = list(dict.fromkeys(tuple(int(v) for v in rng.integers(0, spread, 3)) for _ in range(k)))
        ignore = [tuple(int(v) for v in rng.integers(0, 256, 3))] if trial % 3 == 0 else []
        tol = default_palette_tolerance(palette) if trial % 4 else int(rng.integers(0, 40))
        decode = PaletteDecoder(palette, tol, ignore, IGNORE)
        # All 65536 colours of a random plane through the RGB cube, plus each entry's neighbourhood.
        third = np.full((1, cube.shape[1]), int(rng.integers(0, 256)))
        order = rng.permutation(3)
        colours = np.concatenate([cube, third])[order]
        near = np.concatenate([np.clip(np.array(e)[:, None] + rng.integers(-tol - 2, tol + 3, (3, 300)), 0, 255)
                               for e in palette + ignore], 1)
        colours = np.concatenate([colours, near], 1).astype(np.uint8)
        entries = np.array(palette + ignore, np.int64)
        d = np.abs(colours.T.astype(np.int64)[:, None, :] - entries[None]).max(-1)
        values = np.array(list(range(len(palette))) + [IGNORE] * len(ignore))
        expect = np.where(d.min(1) <= tol, values[d.argmin(1)], -1)
        got = decode(colours.reshape(3, 1, -1)).reshape(-1)
        np.testing.assert_array_equal(got, expect)


def test_grey_coded_palette_labels_decode_to_their_classes(tmp_path):
    """(0,0,0), (1,1,1), (2,2,2) fell in one 8-level bin: every pixel was class 2, mIoU 0, exit 0."""
    rng = np.random.default_rng(0)
    lab = rng.integers(0, 3, (64, 64)).astype(np.uint8)
    img = write_tif(tmp_path / 'g_image.tif', rng.integers(1, 255, (3, 64, 64)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'g_label.tif', np.stack([lab] * 3), photometric='RGB')
    ds = GeoTiffScenes([img], [lbl], crop_size=64, mode='grid', palette=[(0, 0, 0), (1, 1, 1), (2, 2, 2)])
    np.testing.assert_array_equal(ds[0]['label'].numpy(), lab)


def test_colour_coded_labels_honour_their_nodata_tag(tmp_path):
    """An RGB label with nodata=0: its black pixels were off-palette noise (more than
    palette_max_unmatched of them refused the file), and where black is a palette colour they
    trained as that class, where index labels refuse a tag that is a class."""
    rng = np.random.default_rng(0)
    palette = [(255, 255, 255), (0, 0, 255), (0, 255, 0)]
    classes = rng.integers(0, 3, (64, 64))
    colours = np.array(palette, np.uint8)[classes].transpose(2, 0, 1).copy()
    colours[:, 10:30, 10:30] = 0     # 400 px, 9.8 %: unlabelled
    img = write_tif(tmp_path / 'c_image.tif', rng.integers(1, 255, (3, 64, 64)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'c_label.tif', colours, nodata=0, photometric='RGB')
    label = GeoTiffScenes([img], [lbl], crop_size=64, mode='grid', palette=palette)[0]['label'].numpy()
    expected = classes.copy()
    expected[10:30, 10:30] = 255
    np.testing.assert_array_equal(label, expected)
    with pytest.raises(DataError, match=re.escape(f"{lbl}: its nodata tag is 0, and (0, 0, 0) is the palette colour "
                                                  "of class 3 ('class_3'); ")):
        GeoTiffScenes([img], [lbl], crop_size=64, mode='grid', palette=palette + [(0, 0, 0)])


def test_a_paletted_label_given_a_palette_is_told_it_holds_indices(tmp_path):
    """A one-band label with a colour table (as GDAL writes class maps) looks colour-coded in a
    viewer; with `palette` it was told only that it is not RGB."""
    img = write_tif(tmp_path / 't_image.tif', np.full((3, 32, 32), 7, np.uint8))
    lbl = write_tif(tmp_path / 't_label.tif', (np.arange(32 * 32).reshape(32, 32) % 2).astype(np.uint8),
                    photometric='PALETTE')
    with rasterio.open(lbl, 'r+') as dst:
        dst.write_colormap(1, {0: (0, 0, 0, 255), 1: (255, 0, 0, 255)})
    with pytest.raises(DataError, match=r"is a paletted file: its pixels are class indices already.*leave `palette` out"):
        GeoTiffScenes([img], [lbl], crop_size=32, palette=[(0, 0, 0), (255, 0, 0)])
    assert GeoTiffScenes([img], [lbl], crop_size=32, classes=2).num_classes == 2


@pytest.mark.parametrize('palette, named', [
    ([(255, 255, 255, 255), (0, 0, 255, 255)], r"palette\[0\] is \(255, 255, 255, 255\); each colour must be an "
                                               r"\(R, G, B\) triple of integers 0..255 \(drop the alpha"),
    ([(0, 0, 300), (0, 0, 0)], r"palette\[0\] is \(0, 0, 300\)"),
    ([(0, 0, 0.5), (0, 0, 0)], r"palette\[0\] is \(0, 0, 0.5\)"),
    ([(1, 2, 3), (1, 2, 3)], r"palette gives the colour \(1, 2, 3\) to more than one class \(class_0, class_1\)"),
])
def test_palettes_that_cannot_decode_are_named(tmp_path, palette, named):
    lab = np.zeros((3, 32, 32), np.uint8)
    img = write_tif(tmp_path / 'p_image.tif', np.ones((3, 32, 32), np.uint8))
    lbl = write_tif(tmp_path / 'p_label.tif', lab, photometric='RGB')
    with pytest.raises(ValueError, match=named):
        GeoTiffScenes([img], [lbl], crop_size=32, palette=palette, classes=2)


# ------------------------------------------------------------------ normalisation statistics
def test_computed_statistics_follow_the_selected_bands_in_their_order(tmp_path):
    """bands=[3, 2, 1] of a 3-band file took the file-order statistics (same count): band 3 was
    normalised with band 1's mean, and the checkpoint recorded it."""
    rng = np.random.default_rng(0)
    means = np.array([1000, 30000, 80])
    image = (means[:, None, None] + rng.normal(0, [[[10]], [[500]], [[3]]], (3, 64, 64))).astype(np.uint16)
    img = write_tif(tmp_path / 's_image.tif', image)
    lbl = write_tif(tmp_path / 's_label.tif', rng.integers(0, 2, (64, 64)).astype(np.uint8))
    for bands in ([3, 2, 1], [2, 3, 1], [3, 2], [1, 2, 3]):
        ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=2, bands=bands)
        np.testing.assert_allclose(ds.mean, [image[b - 1].mean() for b in bands], rtol=1e-4)
        np.testing.assert_allclose(ds.std, [image[b - 1].std() for b in bands], rtol=1e-3)


def test_statistics_leave_out_masked_pixels_and_read_every_scene(tmp_path):
    """Alpha-masked pixels (0 under alpha 0) halved the mean; scenes after the fourth were never
    read (a set of dark then bright patches got the dark ones' statistics)."""
    rng = np.random.default_rng(0)
    rgba = np.zeros((4, 64, 64), np.uint8)
    rgba[:3, :, :32] = rng.normal(140, 10, (3, 64, 32)).clip(1, 255)
    rgba[3, :, :32] = 255
    with rasterio.open(tmp_path / 'alpha_image.tif', 'w', driver='GTiff', width=64, height=64, count=4,
                       dtype='uint8', crs='EPSG:32632', transform=from_origin(500_000, 5_500_000, 0.1, 0.1),
                       photometric='RGB', alpha='YES') as dst:
        dst.write(rgba)
    img = str(tmp_path / 'alpha_image.tif')
    lbl = write_tif(tmp_path / 'alpha_label.tif', rng.integers(0, 2, (64, 64)).astype(np.uint8))
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=2, bands=[1, 2, 3])
    valid = rgba[:3, :, :32].reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(ds.mean, valid.mean(1), rtol=1e-4)
    np.testing.assert_allclose(ds.std, valid.std(1), rtol=1e-3)

    folder = tmp_path / 'many'
    folder.mkdir()
    images, labels, values = [], [], []
    for i in range(10):
        level = 20 if i < 4 else 200
        pixels = rng.normal(level, 5, (1, 32, 32)).clip(1, 255).astype(np.uint8)
        values.append(pixels)
        images.append(write_tif(folder / f'{i}_image.tif', pixels))
        labels.append(write_tif(folder / f'{i}_label.tif', rng.integers(0, 2, (32, 32)).astype(np.uint8)))
    ds = GeoTiffScenes(images, labels, crop_size=32, classes=2)
    everything = np.concatenate([v.ravel() for v in values]).astype(np.float64)
    np.testing.assert_allclose(ds.mean, [everything.mean()], rtol=1e-4)
    np.testing.assert_allclose(ds.std, [everything.std()], rtol=1e-3)


@pytest.mark.parametrize('kw, named', [
    (dict(std=[0, 1, 1]), r"std=\[0, 1, 1\]: each band's std must be a finite number > 0"),
    (dict(std=[1, -1, 1]), r"std=\[1, -1, 1\]: each band's std"),
    (dict(mean=[1, float('nan'), 1]), r"mean=\[1, nan, 1\]: each band's mean must be a finite number"),
    (dict(mean=['a', 1, 1]), r"mean=\['a', 1, 1\]: each band's mean"),
])
def test_a_given_std_of_zero_or_a_mean_that_is_no_number_is_refused(tmp_path, kw, named):
    """std=0 was replaced by 1 without a word: the band trained in raw file units."""
    img = write_tif(tmp_path / 'm_image.tif', np.full((3, 32, 32), 7, np.uint8))
    lbl = write_tif(tmp_path / 'm_label.tif', np.zeros((32, 32), np.uint8))
    with pytest.raises(ValueError, match=named):
        GeoTiffScenes([img], [lbl], crop_size=32, classes=2, **kw)


# ------------------------------------------------------------------ classes inferred from labels
@pytest.mark.parametrize('dtype, nodata', [('float32', float('nan')), ('uint8', 200), ('uint16', 65535),
                                           ('int16', -9999)])
def test_inferred_class_count_leaves_out_the_label_nodata_tag(tmp_path, dtype, nodata):
    """classes=None counted the nodata value as a class (NaN crashed int(); 200 gave 201
    classes and then a refusal telling the user to remove the tag)."""
    rng = np.random.default_rng(0)
    lab = rng.integers(0, 3, (32, 32)).astype(dtype)
    lab[:, :10] = nodata
    img = write_tif(tmp_path / 'c_image.tif', rng.integers(1, 255, (3, 32, 32)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'c_label.tif', lab, nodata=nodata)
    ds = GeoTiffScenes([img], [lbl], crop_size=32, mode='grid')
    assert ds.num_classes == 3
    got = ds[0]['label'].numpy()
    assert (got[:, :10] == IGNORE).all() and (got[:, 10:] == lab[:, 10:]).all()


def test_an_inferred_class_count_past_ignore_index_names_the_file_and_value(tmp_path):
    """One stray 256 in an int32 label, classes left out: 257 classes were inferred, then refused
    as "ignore_index 255 is also class 255 ... use an ignore_index outside 0..256 (255 usually)",
    naming neither the file nor the value. A value up to ignore_index - 1 still counts."""
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'c_image.tif', rng.integers(1, 255, (3, 32, 32)).astype(np.uint8))
    lab = rng.integers(0, 3, (32, 32)).astype(np.int32)
    ok = write_tif(tmp_path / 'ok_label.tif', lab)
    lab[5, 7] = 256
    stray = write_tif(tmp_path / 'stray_label.tif', lab)
    with pytest.raises(DataError, match=rf'^{re.escape(stray)}: label value 256 is above ignore_index 255, so '
                                        r'257 classes would be inferred, ignore_index among them; if 256 is a stray value, fix the file '
                                        r'or give `classes`'):
        GeoTiffScenes([img, img], [ok, stray], crop_size=32, mode='grid')
    lab[5, 7] = 254
    write_tif(tmp_path / 'stray_label.tif', lab)
    assert GeoTiffScenes([img], [stray], crop_size=32, mode='grid').num_classes == 255


def test_an_inferred_class_count_with_empty_classes_is_said(tmp_path):
    """A stray 7 in labels of 0..2, classes left out: 8 classes, 3..6 without a pixel, trained and
    scored without a word. Said, naming the value and its file; no note when every class has pixels
    or when `classes` was given (a class absent from the labels is then the user's choice)."""
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'c_image.tif', rng.integers(1, 255, (3, 32, 32)).astype(np.uint8))
    lab = rng.integers(0, 3, (32, 32)).astype(np.uint8)
    ok = write_tif(tmp_path / 'ok_label.tif', lab)
    assert not GeoTiffScenes([img], [ok], crop_size=32, mode='grid').notes
    lab[5, 7] = 7
    stray = write_tif(tmp_path / 'stray_label.tif', lab)
    ds = GeoTiffScenes([img, img], [ok, stray], crop_size=32, mode='grid')
    assert ds.num_classes == 8
    assert ds.notes == [f'classes: 8 counted from the largest label value, 7 (in {stray}), and classes 3, 4, 5, 6 '
                        'hold no pixel of any label file; if 7 is a stray value, fix that file or give `classes` '
                        '(the class names or count)']
    assert not GeoTiffScenes([img, img], [ok, stray], crop_size=32, mode='grid', classes=9).notes


def test_complex_pixels_are_refused_not_cut_to_their_real_part(tmp_path):
    """numpy dropped the imaginary part of a complex64 scene with one ComplexWarning."""
    from ds_seg.data.raster import DataError
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'slc_image.tif', (rng.normal(size=(2, 32, 32)) + 1j).astype(np.complex64))
    lbl = write_tif(tmp_path / 'slc_label.tif', rng.integers(0, 2, (32, 32)).astype(np.uint8))
    with pytest.raises(DataError, match=r"slc_image.tif holds complex \(complex64\) pixels; segmentation takes "
                                        r"real bands"):
        GeoTiffScenes([img], [lbl], crop_size=32, classes=2)
    # GDAL's complex integers (Sentinel-1 SLC products), a type numpy does not have
    with rasterio.open(tmp_path / 'cint_image.tif', 'w', driver='GTiff', width=32, height=32, count=1,
                       dtype='complex_int16', crs='EPSG:32632', transform=from_origin(500_000, 5_500_000, 0.1, 0.1)):
        pass
    with pytest.raises(DataError, match=r"cint_image.tif holds complex \(complex_int16\) pixels"):
        GeoTiffScenes([str(tmp_path / 'cint_image.tif')], [lbl], crop_size=32, classes=2)


def test_validation_bands_are_compared_by_what_the_files_say_they_are(tmp_path):
    """data.val bands=[3, 2, 1] beside data.train's [1, 2, 3] is right for BGR validation files
    and wrong for RGB ones; the files' colour interpretation tells which, and where it says
    nothing (grey bands) one line asks the user to check."""
    from types import SimpleNamespace

    from rasterio.enums import ColorInterp

    from ds_seg.config import ConfigError
    from ds_seg.data.raster import DataError
    from ds_seg.engine.checkpointer import data_normalisation
    from ds_seg.engine.trainer import Trainer
    rng = np.random.default_rng(0)
    lbl = write_tif(tmp_path / 'b_label.tif', rng.integers(0, 2, (32, 32)).astype(np.uint8))

    def scene(name, interp):
        path = write_tif(tmp_path / f'{name}.tif', rng.integers(1, 255, (3, 32, 32)).astype(np.uint8))
        with rasterio.open(path, 'r+') as dst:
            dst.colorinterp = [getattr(ColorInterp, c) for c in interp]
        return path

    rgb, bgr = scene('rgb', ('red', 'green', 'blue')), scene('bgr', ('blue', 'green', 'red'))
    grey = scene('grey', ('gray', 'undefined', 'undefined'))
    train = GeoTiffScenes([rgb], [lbl], crop_size=32, classes=2)
    # Recorded with the model: predict and evaluate refuse a scene of another order.
    assert data_normalisation(train)['colours'] == ['red', 'green', 'blue']
    printed = []
    fake = SimpleNamespace(print=printed.append)
    check = lambda t, v: Trainer._check_val_band_order(fake, t, v)  # noqa: E731
    check(train, GeoTiffScenes([bgr], [lbl], crop_size=32, classes=2, mode='grid', bands=[3, 2, 1]))
    with pytest.raises(ConfigError, match=r"bands \[3, 2, 1\] hold blue, green, red .* data.train's bands hold red, "
                                          r"green, blue.* Select data.val.bands=\[1, 2, 3\]"):
        check(train, GeoTiffScenes([rgb], [lbl], crop_size=32, classes=2, mode='grid', bands=[3, 2, 1]))
    # The same `bands` of files in another order: the check was skipped and data.val scored BGR.
    with pytest.raises(ConfigError, match=r"bgr.tif: data.val's bands \[1, 2, 3\] hold blue, green, red .* "
                                          r"Select data.val.bands=\[3, 2, 1\]"):
        check(train, GeoTiffScenes([bgr], [lbl], crop_size=32, classes=2, mode='grid'))
    assert not printed
    check(GeoTiffScenes([grey], [lbl], crop_size=32, classes=2),
          GeoTiffScenes([grey], [lbl], crop_size=32, classes=2, mode='grid', bands=[3, 2, 1]))
    assert len(printed) == 1 and 'do not say which colour each band is' in printed[0]
    # One `bands` reads every scene of a dataset: a BGR scene among RGB ones was learnt swapped.
    with pytest.raises(DataError, match=r"bgr.tif: its bands \[1, 2, 3\] hold blue, green, red .* but .*rgb.tif's "
                                        r"hold red, green, blue"):
        GeoTiffScenes([rgb, grey, bgr], [lbl] * 3, crop_size=32, classes=2)
    assert GeoTiffScenes([rgb, grey], [lbl] * 2, crop_size=32, classes=2).band_colours == ['red', 'green', 'blue']
    assert GeoTiffScenes([grey], [lbl], crop_size=32, classes=2).band_colours is None
    # RGB + an undefined NIR band (the usual aerial 4-band file): compared on the bands they name.
    def scene4(name, interp):
        path = write_tif(tmp_path / f'{name}.tif', rng.integers(1, 255, (4, 32, 32)).astype(np.uint8))
        with rasterio.open(path, 'r+') as dst:
            dst.colorinterp = [getattr(ColorInterp, c) for c in interp]
        return path
    rgbn = scene4('rgbn', ('red', 'green', 'blue', 'undefined'))
    bgrn = scene4('bgrn', ('blue', 'green', 'red', 'undefined'))
    assert GeoTiffScenes([rgbn], [lbl], crop_size=32, classes=2).band_colours == ['red', 'green', 'blue', None]
    with pytest.raises(DataError, match=r"bgrn.tif: its bands \[1, 2, 3, 4\] hold blue, green, red, \(unsaid\)"):
        GeoTiffScenes([rgbn, bgrn], [lbl] * 2, crop_size=32, classes=2)
    with pytest.raises(ConfigError, match=r"data.val.bands=\[3, 2, 1, 4\]"):
        check(GeoTiffScenes([rgbn], [lbl], crop_size=32, classes=2),
              GeoTiffScenes([bgrn], [lbl], crop_size=32, classes=2, mode='grid'))
    # Every date of a time series, not only the first.
    with pytest.raises(DataError, match=r"bgr.tif: its bands \[1, 2, 3\] hold blue, green, red"):
        GeoTiffScenes([[rgb, grey], [grey, bgr]], [lbl, lbl], crop_size=32, classes=2)


def test_statistics_cached_by_an_earlier_version_are_computed_again(tmp_path):
    """A cache of the first four scenes with masked pixels in, keyed to the same files, kept the
    old (wrong) statistics for a set of four scenes or fewer."""
    import json

    from ds_seg.data.geotiff import STATS_CACHE_FILE, STATS_VERSION
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'v_image.tif', rng.normal(100, 5, (1, 32, 32)).clip(1, 255).astype(np.uint8))
    lbl = write_tif(tmp_path / 'v_label.tif', rng.integers(0, 2, (32, 32)).astype(np.uint8))
    right = GeoTiffScenes([img], [lbl], crop_size=32, classes=2).mean
    cache = tmp_path / STATS_CACHE_FILE
    old = json.loads(cache.read_text())
    old['version'] = STATS_VERSION - 1
    old['sets'][0]['mean'] = [1.0]
    cache.write_text(json.dumps(old))
    np.testing.assert_allclose(GeoTiffScenes([img], [lbl], crop_size=32, classes=2).mean, right)


# ------------------------------------------------------------------ a label's own mask band
def _label_with_mask(path, label, hidden):
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=True):
        with rasterio.open(path, 'w', driver='GTiff', width=label.shape[1], height=label.shape[0], count=1,
                           dtype='uint8', crs='EPSG:32632', transform=from_origin(500_000, 5_500_000, 0.1, 0.1),
                           tiled=True, blockxsize=16, blockysize=16) as dst:
            dst.write(label[None])
            dst.write_mask(np.where(hidden, 0, 255).astype(np.uint8))
    return str(path)


@pytest.mark.parametrize('hidden_value', [1, 9])   # a class, and a value that is no class
def test_pixels_a_label_mask_band_hides_are_ignored_not_learnt(tmp_path, hidden_value):
    """GDAL and QGIS show the pixels a label's mask band hides as empty; they were learnt (and
    counted in the class inference and the label check) as whatever value they held."""
    rng = np.random.default_rng(3)
    image = rng.integers(1, 255, (3, 48, 64)).astype(np.uint8)
    label = rng.integers(0, 3, (48, 64)).astype(np.uint8)
    hidden = np.zeros((48, 64), bool)
    hidden[:, :20] = True
    hidden[:5] = True
    label[hidden] = hidden_value
    img = write_tif(tmp_path / 'a_image.tif', image)
    lbl = _label_with_mask(tmp_path / 'a_label.tif', label, hidden)
    ds = GeoTiffScenes([img], [lbl], crop_size=(48, 64), classes=None, mode='grid')
    assert ds.num_classes == 3                       # the hidden 9s are no class
    got = ds[0]['label'].numpy()
    np.testing.assert_array_equal(got, np.where(hidden, IGNORE, label))


def test_statistics_of_a_band_whose_mean_dwarfs_its_spread_are_exact(tmp_path):
    """sum(x^2)/n - mean^2 over uint32 counts near 2^30 cancelled below zero: the std came out 0
    and was replaced by 1, cached, without a word."""
    rng = np.random.default_rng(5)
    image = rng.integers(2 ** 30, 2 ** 30 + 1000, (2, 300, 400)).astype(np.uint32)
    image[1] = rng.integers(0, 50, (300, 400))                 # an ordinary band next to it
    label = rng.integers(0, 3, (300, 400)).astype(np.uint8)
    img = write_tif(tmp_path / 'a_image.tif', image)
    lbl = write_tif(tmp_path / 'a_label.tif', label)
    ds = GeoTiffScenes([img], [lbl], crop_size=64, classes=3)
    x = image.reshape(2, -1).astype(np.float64)
    eps = np.finfo(np.float32).eps                              # the dataset holds float32
    np.testing.assert_allclose(ds.mean, x.mean(1), rtol=eps)
    np.testing.assert_allclose(ds.std, x.std(1), rtol=eps)


def test_a_label_whose_mask_band_hides_whole_rows_of_blocks_loads(tmp_path):
    """The label scan reads 1024 rows at a time: a block the mask band hides whole (an
    unlabelled margin) was an empty array, and a ValueError traceback."""
    rng = np.random.default_rng(4)
    image = rng.integers(1, 255, (3, 1100, 16)).astype(np.uint8)
    label = rng.integers(0, 2, (1100, 16)).astype(np.uint8)
    hidden = np.zeros((1100, 16), bool)
    hidden[:1024] = True
    img = write_tif(tmp_path / 'a_image.tif', image)
    lbl = _label_with_mask(tmp_path / 'a_label.tif', label, hidden)
    ds = GeoTiffScenes([img], [lbl], crop_size=16, classes=2, mode='grid')
    window = ds.read_label(0, rasterio.windows.Window(0, 1016, 16, 16))
    np.testing.assert_array_equal(window, np.where(hidden[1016:1032], IGNORE, label[1016:1032]))


def test_a_label_vrt_of_sources_of_unknown_version_is_read_not_cached(tmp_path):
    """A label VRT over a zipped GeoTIFF (/vsizip/: no identity) made the label scan fail with
    "'NoneType' object is not subscriptable"; it is scanned every time instead of cached."""
    import zipfile

    from ds_seg.data.geotiff import LABELS_CACHE_FILE, cached_label_histograms
    label = write_tif(tmp_path / 'lab.tif', np.array([[0, 1], [1, 1]], np.uint8))
    with zipfile.ZipFile(tmp_path / 'lab.zip', 'w') as z:
        z.write(label, 'lab.tif')
    vrt = tmp_path / 'lab.vrt'
    vrt.write_text(f'<VRTDataset rasterXSize="2" rasterYSize="2"><VRTRasterBand dataType="Byte" band="1">'
                   f'<SimpleSource><SourceFilename relativeToVRT="0">/vsizip/{tmp_path}/lab.zip/lab.tif'
                   f'</SourceFilename><SourceBand>1</SourceBand></SimpleSource></VRTRasterBand></VRTDataset>')
    assert cached_label_histograms([str(vrt)]) == [{0.0: 1, 1.0: 3}]
    assert not (tmp_path / LABELS_CACHE_FILE).exists()


@pytest.mark.parametrize('dtype, base, spread', [('uint32', 2 ** 30, 300), ('int64', 2 ** 40, 300),
                                                 ('int32', 2 ** 29, 300), ('float64', 1e9, 0.5)])
def test_pixel_types_float32_cannot_hold_reach_the_model_exactly(tmp_path, dtype, base, spread):
    """uint32 counts around 2^30 with a spread of 300 were cast to float32 before the mean was
    taken off: the model saw 2 distinct values of 91 (int64 around 2^40: one), in training and
    in whole-scene prediction alike, and the mean itself was kept in float32 (34 counts off)."""
    from ds_seg.data import BatchPreprocessor
    from ds_seg.inference import predict_scene
    rng = np.random.default_rng(3)
    image = (base + rng.uniform(0, spread, (2, 64, 64))).astype(dtype)
    img = write_tif(tmp_path / 'w_image.tif', image)
    lbl = write_tif(tmp_path / 'w_label.tif', rng.integers(0, 3, (64, 64)).astype(np.uint8))
    ds = GeoTiffScenes([img], [lbl], crop_size=64, classes=3, mode='grid', split='val')
    x = image.reshape(2, -1).astype(np.float64)
    np.testing.assert_allclose(ds.mean, x.mean(1), rtol=1e-15, atol=0)
    exact = (image.astype(np.float64) - x.mean(1)[:, None, None]) / x.std(1)[:, None, None]
    sample = ds[0]
    prep = BatchPreprocessor.for_dataset(ds)
    seen = prep.images(sample['image'][None], None, 'cpu')[0]
    assert seen.dtype == torch.float32
    np.testing.assert_allclose(seen.numpy(), exact, atol=1e-5)   # float32 of the exact values

    inputs = []

    def forward(images_BCHW):
        inputs.append(images_BCHW.clone())
        return torch.zeros(images_BCHW.shape[0], 3, *images_BCHW.shape[-2:])
    predict_scene(forward, img, str(tmp_path / 'classes.tif'), mean=ds.mean.tolist(), std=ds.std.tolist(),
                  classes=['a', 'b', 'c'], tile=64, overlap=0, batch_size=1)
    np.testing.assert_allclose(inputs[0][0].numpy(), exact, atol=1e-5)


def test_statistics_count_the_pixels_the_selected_bands_call_data(tmp_path):
    """With bands=[1, 2, 3] of a 4-band file (nodata 0), an RGB collar of zeros where NIR still
    held values was nodata in every window but data in the statistics: every band's mean was 0.44
    sigma low. A selection of all bands (in any order) reuses the entry cached before."""
    rng = np.random.default_rng(9)
    image = rng.integers(1, 256, (4, 64, 64)).astype(np.uint8)
    image[:3, :, :20] = 0
    img = write_tif(tmp_path / 'c_image.tif', image, nodata=0)
    lbl = write_tif(tmp_path / 'c_label.tif', rng.integers(0, 3, (64, 64)).astype(np.uint8))
    rgb = GeoTiffScenes([img], [lbl], crop_size=32, classes=3, bands=[1, 2, 3])
    valid = image[:3, :, 20:].reshape(3, -1).astype(np.float64)
    np.testing.assert_allclose(rgb.mean, valid.mean(1), rtol=1e-12)
    np.testing.assert_allclose(rgb.std, valid.std(1), rtol=1e-12)
    every = GeoTiffScenes([img], [lbl], crop_size=32, classes=3, bands=[4, 3, 2, 1])
    whole = image.reshape(4, -1).astype(np.float64)   # no pixel is 0 in all four bands
    np.testing.assert_allclose(every.mean, whole.mean(1)[::-1], rtol=1e-12)
    from ds_seg.data.geotiff import STATS_CACHE_FILE
    cache = tmp_path / STATS_CACHE_FILE
    held = json.loads(cache.read_text())['sets']
    assert len(held) == 2 and sorted(str(e.get('nodata_bands')) for e in held) == ['None', '[1, 2, 3]']
    again = GeoTiffScenes([img], [lbl], crop_size=32, classes=3, bands=[3, 1, 2])   # from the cache
    np.testing.assert_array_equal(again.mean, rgb.mean[[2, 0, 1]])
    assert json.loads(cache.read_text())['sets'] == held


def test_statistics_are_computed_again_when_a_mask_sidecar_changes(tmp_path):
    """The cache was keyed to the image file alone: a rewritten img.tif.msk (the image's bytes,
    size and mtime unchanged) kept the statistics of the old mask."""
    rng = np.random.default_rng(4)
    image = rng.integers(1, 100, (3, 64, 64)).astype(np.uint8)
    image[:, :, :32] = 250
    path = str(tmp_path / 'm_image.tif')
    lbl = write_tif(tmp_path / 'm_label.tif', rng.integers(0, 3, (64, 64)).astype(np.uint8))
    mask = np.full((64, 64), 255, np.uint8)
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=False):
        with rasterio.open(path, 'w', driver='GTiff', width=64, height=64, count=3, dtype='uint8',
                           crs='EPSG:32632', transform=from_origin(500_000, 5_500_000, 0.1, 0.1)) as dst:
            dst.write(image)
            dst.write_mask(mask)
    assert os.path.exists(path + '.msk')
    first = GeoTiffScenes([path], [lbl], crop_size=32, classes=3)
    np.testing.assert_allclose(first.mean, image.reshape(3, -1).mean(1), rtol=1e-12)
    before = os.stat(path)
    mask[:, :32] = 0                                   # the bright half is masked from now on
    with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=False), rasterio.open(path, 'r+') as dst:
        dst.write_mask(mask)
    assert (os.stat(path).st_size, os.stat(path).st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = GeoTiffScenes([path], [lbl], crop_size=32, classes=3)
    np.testing.assert_allclose(second.mean, image[:, :, 32:].reshape(3, -1).mean(1), rtol=1e-12)


@pytest.mark.parametrize('palette', [False, True])
def test_labels_with_averaged_overviews_are_judged_by_their_pixels(tmp_path, palette):
    """The start-up check's decimated read came from overviews built by averaging (gdaladdo -r
    average): 'label value 205 is not a class index' for a file holding 0, 1, 2 and 255 only.
    A file that does hold a stray value is still refused, overviews or not."""
    from rasterio.enums import Resampling
    colours = [(0, 0, 0), (255, 0, 0), (0, 0, 255)]
    rng = np.random.default_rng(2)
    label = rng.integers(0, 3, (1200, 600)).astype(np.uint8)
    label[::3] = 255 if not palette else 0
    img = write_tif(tmp_path / 'o_image.tif', rng.integers(1, 255, (3, 1200, 600)).astype(np.uint8))

    def write_label(values):
        data = np.stack([np.array(colours, np.uint8)[values][..., i] for i in range(3)]) if palette else values
        path = write_tif(tmp_path / 'o_label.tif', data)
        with rasterio.open(path, 'r+') as dst:
            dst.build_overviews([2, 4, 8], Resampling.average)
        return path
    extra = dict(palette=colours, classes=('a', 'b', 'c')) if palette else dict(classes=3)
    ds = GeoTiffScenes([img], [write_label(label)], crop_size=64, **extra)
    assert ds.num_classes == 3
    # A VRT of the file: its source serves the averaged overviews to the VRT's decimated read.
    vrt = str(tmp_path / 'o_label.vrt')
    with rasterio.open(tmp_path / 'o_label.tif') as src:
        bands = ''.join(f'<VRTRasterBand dataType="Byte" band="{b}"><SimpleSource><SourceFilename relativeToVRT="1">'
                        f'o_label.tif</SourceFilename><SourceBand>{b}</SourceBand></SimpleSource></VRTRasterBand>'
                        for b in range(1, src.count + 1))
        t = src.transform
        open(vrt, 'w').write(f'<VRTDataset rasterXSize="{src.width}" rasterYSize="{src.height}"><SRS>{src.crs.wkt}'
                             f'</SRS><GeoTransform>{t.c}, {t.a}, {t.b}, {t.f}, {t.d}, {t.e}</GeoTransform>{bands}'
                             '</VRTDataset>')
    assert GeoTiffScenes([img], [vrt], crop_size=64, **extra).num_classes == 3
    if not palette:
        label[500:560, 300:360] = 7
        with pytest.raises(DataError, match='label value 7 is not a class index'):
            GeoTiffScenes([img], [write_label(label)], crop_size=64, **extra)


def test_a_crop_larger_than_every_training_scene_is_said(tmp_path):
    """crop_size=256 on 128 px scenes trained on windows three quarters padding without a word."""
    from ds_seg.engine.trainer import data_notes
    rng = np.random.default_rng(0)
    img = write_tif(tmp_path / 'p_image.tif', rng.integers(1, 255, (3, 40, 50)).astype(np.uint8))
    lbl = write_tif(tmp_path / 'p_label.tif', rng.integers(0, 2, (40, 50)).astype(np.uint8))
    notes = data_notes(GeoTiffScenes([img], [lbl], crop_size=64, classes=2), None)
    assert notes == ['data.crop_size 64x64 is larger than every training scene (the largest 40x50): at least 51.1% '
                     'of each window is padding, ignored by the loss; a crop_size within the scenes trains on more '
                     'pixels per step']
    assert data_notes(GeoTiffScenes([img], [lbl], crop_size=40, classes=2), None) == []
    # 99.92% padding was said as "at least 100%".
    assert 'at least 99.9% of each window' in data_notes(GeoTiffScenes([img], [lbl], crop_size=1600, classes=2), None)[0]


# ------------------------------------------------------------------ class names and stats.json
@pytest.mark.parametrize('classes, named', [
    # a mapping's values were dropped, its names taken in written order: file value 1 scored as 'road'
    ({'bg': 0, 'road': 2, 'building': 1}, r"classes is a mapping .*classes=\('bg', 'building', 'road'\), and map "
     r"file values .* label_map=\{0: 0, 1: 1, 2: 2\}"),
    # YAML 1.1's on/off: config.json kept True, eval.jsonl 'true'
    (['background', True, False], r"classes\[1\] is True, a bool, not a name \(YAML reads on/off"),
    (['a', None, 'b'], r"classes\[1\] is None, a NoneType, not a name"),
    (['a', 3.5, 'b'], r"classes\[1\] is 3.5, a float, not a name"),
    (['a', ' ', 'b'], r"classes\[1\] is ' ', an empty name"),
    (3.0, r"classes must be a tuple of names or a class count >= 1, got 3.0"),
    ([], r"classes must be a tuple of names or a class count >= 1, got \[\]"),
])
def test_class_names_are_distinct_text_in_index_order(tmp_path, classes, named):
    img = write_tif(tmp_path / 'c_image.tif', np.full((3, 32, 32), 7, np.uint8))
    lbl = write_tif(tmp_path / 'c_label.tif', np.zeros((32, 32), np.uint8))
    with pytest.raises(ValueError, match=named):
        GeoTiffScenes([img], [lbl], crop_size=32, classes=classes)


def _scene_with_stats(tmp_path, stats):
    img = write_tif(tmp_path / 's_image.tif', np.random.default_rng(0).integers(0, 255, (3, 32, 32), dtype=np.uint8))
    lbl = write_tif(tmp_path / 's_label.tif', (np.arange(32 * 32).reshape(32, 32) % 3).astype(np.uint8))
    (tmp_path / 'stats.json').write_text(json.dumps(stats))
    return img, lbl


@pytest.mark.parametrize('stats, named', [
    # ImageNet's 0-1 values from a converter, beside uint8 images: refused when given, trained on from the file
    (dict(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]), r"std=\[0.229, 0.224, 0.225\] is below 1 in every"),
    (dict(mean=[1, 2, 3, 4], std=[1, 2, 3, 4]), r"mean has 4 values; expected one per selected band"),
    (dict(mean=[1, 2, 3], std=[1, 0, 3]), r"std \[1.0, 0.0, 3.0\]: each band's std must be a finite number > 0"),
    (dict(mean='high', std=[1, 2, 3]), r"mean is 'high', not a list of numbers"),
    (dict(mean=[1, 2, 3], std=[1, 2, 3], classes=['a', True, 'c']), r"stats.json: 'classes'\[1\] is True"),
])
def test_a_stats_json_beside_the_images_is_checked_and_named(tmp_path, stats, named):
    img, lbl = _scene_with_stats(tmp_path, stats)
    with pytest.raises(ValueError, match=named) as exc:
        GeoTiffScenes([img], [lbl], crop_size=32)
    assert str(tmp_path / 'stats.json') in str(exc.value)


def test_statistics_and_class_names_taken_from_a_stats_json_are_said(tmp_path):
    img, lbl = _scene_with_stats(tmp_path, dict(mean=[10, 20, 30], std=[2, 3, 4], classes=['x', 'y', 'z']))
    ds = GeoTiffScenes([img], [lbl], crop_size=32)
    assert ds.classes == ('x', 'y', 'z') and ds.mean.tolist() == [10, 20, 30]
    assert ds.notes == [f"mean/std and the class names from {tmp_path / 'stats.json'} (move it away to have them "
                        "computed from the images)"]
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=('a', 'b', 'c'), mean=[1, 1, 1])
    assert ds.notes == [f"std from {tmp_path / 'stats.json'} (move it away to have them computed from the images)"]


def test_options_that_act_through_an_absent_setting_are_said_as_unused(tmp_path):
    """stac_bands without stac read every band, label_fill on raster labels filled nothing, a val
    set's cat_max_ratio redrew nothing: each was dropped without a word."""
    img = write_tif(tmp_path / 'u_image.tif', np.random.default_rng(0).integers(0, 255, (3, 32, 32), dtype=np.uint8))
    lbl = write_tif(tmp_path / 'u_label.tif', (np.arange(32 * 32).reshape(32, 32) % 3).astype(np.uint8))
    ds = GeoTiffScenes([img], [lbl], crop_size=32, label_field='cls', label_fill=1, stac_bands=['B04'],
                       palette_tolerance=5, rare_class_temperature=0.5)
    assert [n.split(' is not used')[0] for n in ds.notes] == [
        "label_field='cls'", 'label_fill=1', "stac_bands=['B04']", 'palette_tolerance=5', 'rare_class_temperature=0.5']
    assert "stac_bands=['B04'] is not used: it takes effect only with `stac`" in ds.notes[2]
    val = GeoTiffScenes([img], [lbl], crop_size=32, split='val', cat_max_ratio=0.5, boundary_ignore=2)
    assert val.notes == [f"{k} is not used: it takes effect only with random (training) windows; this set reads grid "
                         "windows (mode='grid', every window once, never redrawn, rescaled or augmented)"
                         for k in ('cat_max_ratio=0.5', 'boundary_ignore=2')]
    # Defaults given explicitly, and the settings of a training set that uses them, say nothing.
    quiet = [GeoTiffScenes([img], [lbl], crop_size=32, split='val', max_retries=10, sampling='uniform', augment=None),
             GeoTiffScenes([img], [lbl], crop_size=32, cat_max_ratio=0.5, boundary_ignore=2, label_fill=0,
                           random_scale=(0.5, 2.0), palette_max_unmatched=0.02)]
    assert [getattr(d, 'notes', []) for d in quiet] == [[], []]


def test_a_class_count_predict_cannot_write_is_said_at_the_start(tmp_path):
    """300 classes trained to the end; predict.py then refused the model (uint8 class maps)."""
    from ds_seg.engine.trainer import data_notes
    img = write_tif(tmp_path / 'k_image.tif', np.full((3, 32, 32), 7, np.uint8))
    lbl = write_tif(tmp_path / 'k_label.tif', (np.arange(32 * 32).reshape(32, 32) % 300).astype(np.uint16))
    notes = data_notes(GeoTiffScenes([img], [lbl], crop_size=32, classes=300, ignore_index=1000), None)
    assert notes == ['data.train: 300 classes: the run trains and evaluates, but predict.py writes uint8 class maps '
                     '(255 is their nodata), so it cannot run a model of more than 255 classes']
    lbl255 = write_tif(tmp_path / 'k255_label.tif', (np.arange(32 * 32).reshape(32, 32) % 255).astype(np.uint8))
    assert data_notes(GeoTiffScenes([img], [lbl255], crop_size=32, classes=255, ignore_index=1000), None) == []


def test_a_file_value_a_partial_label_map_passes_into_a_mapped_class_is_said(tmp_path):
    """label_map={1: 0, 2: 1, 3: 2} left file value 0 as class 0, merged with file value 1, silently."""
    img = write_tif(tmp_path / 'p_image.tif', np.full((3, 32, 32), 7, np.uint8))
    lbl = write_tif(tmp_path / 'p_label.tif', (np.arange(32 * 32).reshape(32, 32) % 4).astype(np.uint8))
    ds = GeoTiffScenes([img], [lbl], crop_size=32, classes=('a', 'b', 'c'), label_map={1: 0, 2: 1, 3: 2})
    assert ds.notes == ["label_map: file value 0 is not listed, so it is read as class 0 ('a'), as is file value 1, "
                        "which label_map maps there; if 0 is no class, list it: label_map={..., 0: 255}"]
    whole = GeoTiffScenes([img], [lbl], crop_size=32, classes=('a', 'b', 'c'), label_map={0: 255, 1: 0, 2: 1, 3: 2})
    assert not getattr(whole, 'notes', [])
    # A partial map that merges nothing (a swap of two values, the rest passed through) says nothing.
    swap = GeoTiffScenes([img], [lbl], crop_size=32, classes=4, label_map={1: 2, 2: 1})
    assert not getattr(swap, 'notes', [])


def _refused_fill(tmp_path, rng, img, holds, kind, value):
    """Training on ``img`` (with a label) is refused with the untagged-fill line; (label, image,
    that line)."""
    lbl = write_tif(tmp_path / 'f_label.tif', rng.integers(0, 3, (48, 48)).astype(np.uint8))
    untagged = write_tif(tmp_path / 'f_image.tif', img)
    said = (f'{untagged}: {holds} in 6.2% of its pixels (a sampled read), a fill value that {kind} for no data, '
            f'but the file has no nodata tag for it, so it would be read as data; tag it (rio edit-info --nodata '
            f'{value} FILE) to have those pixels masked')
    with pytest.raises(DataError) as refused:
        GeoTiffScenes([untagged], [lbl], crop_size=32, classes=3)
    assert str(refused.value) == said
    return lbl, untagged, said


def test_an_untagged_float_fill_value_is_refused_in_training_and_prediction(tmp_path, capsys):
    """float32 reflectance with ArcGIS's no-data fill (-3.4028235e38) and no nodata tag: statistics
    of about 1e38 were computed and cached, and the run trained to NaN losses (blamed on the LR) or
    to chance. Refused naming the file, the band and the fix; tagged, the same file trains."""
    from ds_seg.cli import predict
    fill = float(np.finfo(np.float32).min)
    rng = np.random.default_rng(0)
    img = rng.random((3, 48, 48)).astype(np.float32)
    img[:, :12, :12] = fill
    lbl, untagged, said = _refused_fill(tmp_path, rng, img, 'band 1 holds -3.4028235e+38', 'float rasters use',
                                        '-3.4028235e+38')
    # The band named is the file's, whichever bands are selected; float64's own extreme is a fill too.
    img64 = rng.random((3, 48, 48))
    img64[2, :12, :12] = -np.finfo(np.float64).max
    third = write_tif(tmp_path / 'h_image.tif', img64)
    with pytest.raises(DataError, match=rf'^{re.escape(third)}: band 3 holds -1.7976931e\+308 in 6.2% '):
        GeoTiffScenes([third], [lbl], crop_size=32, classes=3, bands=[3, 1])
    # Tagged: trains on the reflectances alone.
    tagged = write_tif(tmp_path / 'g_image.tif', img, nodata=fill)
    ds = GeoTiffScenes([tagged], [lbl], crop_size=32, classes=3)
    assert 0 < ds.mean[0] < 1 and 0 < ds.std[0] < 1
    from ds_seg.models import UNetTiny
    torch.save({'state_dict': UNetTiny(3, 3).state_dict(), 'model': dict(type='UNetTiny', in_channels=3, num_classes=3),
                'classes': ['a', 'b', 'c'], 'data': {'bands': [1, 2, 3], 'mean': [0.5] * 3, 'std': [0.3] * 3,
                                                     'dtype': 'float32'}}, tmp_path / 'w.pt')
    capsys.readouterr()
    assert predict.main(['--checkpoint', str(tmp_path / 'w.pt'), '--input', untagged,
                         '--output', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'predict: error: --input {said}'], err
    assert not (tmp_path / 'out').exists()
    from ds_seg.cli import evaluate
    assert evaluate.main(['--checkpoint', str(tmp_path / 'w.pt'), '--images', untagged, '--labels', lbl,
                          '--output', str(tmp_path / 'eval')]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f'evaluate: error: --images {said}'], err
    assert not (tmp_path / 'eval').exists()


def test_an_untagged_integer_fill_is_refused_and_data_spanning_the_type_is_not(tmp_path, capsys):
    """int16 with -32768 voids and no nodata tag (SRTM-style elevation, or reflectances written
    by a processor that fills with the type's lowest): the voids were averaged into the band's
    mean and std (here a mean of about -2000 for data of 0..3000) without a word. Refused as the
    float fill is; a band whose values truly reach down to the type's range is data."""
    from ds_seg.cli import predict
    rng = np.random.default_rng(0)
    img = rng.integers(0, 3000, (2, 48, 48)).astype(np.int16)
    img[:, :12, :12] = -32768
    img[1, 40:, 40:] = -32768          # and a void in band 2 alone
    lbl, untagged, said = _refused_fill(tmp_path, rng, img, 'band 1 holds -32768', "is int16's lowest, which tools use",
                                        '-32768')
    # The file's band number, whichever bands are selected.
    with pytest.raises(DataError, match=rf'^{re.escape(untagged)}: band 2 holds -32768 in 9% '):
        GeoTiffScenes([untagged], [lbl], crop_size=32, classes=3, bands=[2, 1])
    from ds_seg.models import UNetTiny
    torch.save({'state_dict': UNetTiny(2, 3).state_dict(), 'model': dict(type='UNetTiny', in_channels=2, num_classes=3),
                'classes': ['a', 'b', 'c'], 'data': {'bands': [1, 2], 'mean': [1500.0] * 2, 'std': [900.0] * 2,
                                                     'dtype': 'int16'}}, tmp_path / 'w.pt')
    capsys.readouterr()
    assert predict.main(['--checkpoint', str(tmp_path / 'w.pt'), '--input', untagged,
                         '--output', str(tmp_path / 'out')]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f'predict: error: --input {said}']
    # Tagged, the voids of every band are masked, and the data's statistics remain.
    both = img.copy()
    both[:, 40:, 40:] = -32768
    tagged = write_tif(tmp_path / 'g_image.tif', both, nodata=-32768)
    assert all(1000 < m < 2000 for m in GeoTiffScenes([tagged], [lbl], crop_size=32, classes=3).mean)
    # Data spanning the type (a difference image of -32768..32767) is not a fill.
    spread = rng.integers(-32768, 32767, (2, 48, 48), endpoint=True).astype(np.int16)
    spread[0, 0, 0] = -32768
    assert GeoTiffScenes([write_tif(tmp_path / 'h_image.tif', spread)], [lbl], crop_size=32, classes=3).std[0] > 10000
