"""The benchmark adapters and patch folders on the layouts real downloads take: files spelt in
upper case, a tree extracted twice, a copy of the images beside the labels, a partial download,
one id more or less. Each of these trained silently on the wrong files, or on fewer, before."""
import json
import os
import shutil

import numpy as np
import pytest
import rasterio

from ds_seg.data import DeepGlobeLandCover, ImageMaskFolder, InriaAerial, LoveDA, Potsdam, Vaihingen
from ds_seg.data.geotiff import DataError, GeoTiffScenes
from ds_seg.data.miniature import write_miniature

SIZE = 32


@pytest.fixture
def tree(tmp_path):
    def make(name):
        return write_miniature(name, str(tmp_path / name), size=SIZE)
    return make


def _rename(path, new_name):
    target = os.path.join(os.path.dirname(path), new_name)
    os.rename(path, target)
    return target


def test_upper_case_extensions_are_found_not_dropped(tree):
    potsdam = tree('Potsdam')
    _rename(f'{potsdam}/2_Ortho_RGB/top_potsdam_2_11_RGB.tif', 'top_potsdam_2_11_RGB.TIF')
    _rename(f'{potsdam}/5_Labels_all_noBoundary/top_potsdam_2_11_label_noBoundary.tif',
            'top_potsdam_2_11_label_noBoundary.TIF')
    assert Potsdam(potsdam, split='train', crop_size=SIZE).tiles == ['2_10', '2_11']
    inria = tree('InriaAerial')
    for name in os.listdir(f'{inria}/AerialImageDataset/train/images'):
        _rename(f'{inria}/AerialImageDataset/train/images/{name}', name.replace('.tif', '.TIF'))
        _rename(f'{inria}/AerialImageDataset/train/gt/{name}', name.replace('.tif', '.TIF'))
    assert len(InriaAerial(inria, split='train', crop_size=SIZE).scenes) == 4
    deepglobe = tree('DeepGlobeLandCover')
    for name in os.listdir(f'{deepglobe}/train'):
        _rename(f'{deepglobe}/train/{name}', name.replace('.jpg', '.JPG'))
    assert len(DeepGlobeLandCover(deepglobe, split='all', crop_size=SIZE).scenes) == 5
    loveda = tree('LoveDA')
    for folder in ('images_png', 'masks_png'):
        for name in os.listdir(f'{loveda}/Train/Urban/{folder}'):
            _rename(f'{loveda}/Train/Urban/{folder}/{name}', name.replace('.png', '.PNG'))
    assert len(LoveDA(loveda, split='train', domain='urban', crop_size=SIZE).scenes) == 2


def _repaint_corner(path):
    """The raster at ``path`` with one pixel changed: a copy that is no longer the same file."""
    import rasterio
    with rasterio.open(path, 'r+') as dst:
        pixels = dst.read()
        pixels[:, 0, 0] = 255 - pixels[:, 0, 0]
        dst.write(pixels)


def test_a_second_copy_of_the_tree_is_refused_naming_both_where_it_differs(tree, tmp_path):
    potsdam = tree('Potsdam')
    shutil.copytree(f'{potsdam}/2_Ortho_RGB', f'{potsdam}/old_copy/2_Ortho_RGB')
    # The same files twice (the tree extracted twice) are one file: which is read makes no difference.
    ds = Potsdam(potsdam, split='train', crop_size=SIZE)
    assert all('old_copy' not in s['image'] for s in ds.scenes)
    _repaint_corner(f'{potsdam}/old_copy/2_Ortho_RGB/top_potsdam_2_10_RGB.tif')
    with pytest.raises(DataError, match=r"Potsdam: top_potsdam_2_10_RGB\.tif is under .* 2 times \(.*2_Ortho_RGB/"
                                         r"top_potsdam_2_10_RGB\.tif; .*old_copy/2_Ortho_RGB/top_potsdam_2_10_RGB\.tif\)"):
        Potsdam(potsdam, split='train', crop_size=SIZE)
    loveda = tree('LoveDA')
    shutil.copytree(f'{loveda}/Train', f'{loveda}/backup/Train')
    with pytest.raises(DataError, match=r'LoveDA: Train/Urban/images_png is under .* twice'):
        LoveDA(loveda, split='train', crop_size=SIZE)


def test_a_copy_of_the_images_is_never_taken_for_vaihingens_full_labels(tree):
    vaihingen = tree('Vaihingen')
    shutil.copytree(f'{vaihingen}/top', f'{vaihingen}/top_backup')
    with pytest.raises(DataError, match=r'top_mosaic_09cm_area1\.tif is under .* outside top/ 2 times, with other '
                                         r'pixels'):
        Vaihingen(vaihingen, split='train', crop_size=SIZE, eroded=False)
    shutil.rmtree(f'{vaihingen}/ground_truth')   # the backup is now the only candidate
    with pytest.raises(DataError, match=r'label .*top_backup/top_mosaic_09cm_area1\.tif holds the same pixels as '
                                         r'its image .*top/top_mosaic_09cm_area1\.tif'):
        Vaihingen(vaihingen, split='train', crop_size=SIZE, eroded=False)


def test_isprs_training_reads_the_eroded_labels_as_mmsegmentation(tree):
    potsdam, vaihingen = tree('Potsdam'), tree('Vaihingen')
    for ds in (Potsdam(potsdam, split='train', crop_size=SIZE), Vaihingen(vaihingen, split='train', crop_size=SIZE)):
        assert all(s['label'].endswith('_noBoundary.tif') for s in ds.scenes)
    full = Potsdam(potsdam, split='train', crop_size=SIZE, eroded=False)
    assert all(s['label'].endswith('_label.tif') for s in full.scenes)
    shutil.rmtree(f'{potsdam}/5_Labels_all_noBoundary')
    with pytest.raises(DataError, match=r'top_potsdam_2_10_label_noBoundary\.tif not found under .* '
                                         r'\(5_Labels_all_noBoundary; eroded=False reads the full labels'):
        Potsdam(potsdam, split='train', crop_size=SIZE)


def test_a_partial_split_is_said_at_the_start_and_a_tile_id_string_is_one_tile(tree):
    from ds_seg.engine.trainer import data_notes
    potsdam = tree('Potsdam')
    train, val = Potsdam(potsdam, split='train', crop_size=SIZE), Potsdam(potsdam, split='val', crop_size=SIZE)
    assert data_notes(train, val) == [
        "data.train: Potsdam train: 2 of the split's 24 tiles found (missing 2_12, 3_10, 3_11, 3_12, 4_10, 4_11, "
        "...); using those found",
        "data.val: Potsdam val: 1 of the split's 14 tiles found (missing 6_15, 6_13, 3_13, 4_14, 6_14, 5_14, ...); "
        "using those found"]
    one = Potsdam(potsdam, split='train', crop_size=SIZE, tiles='2_10')
    assert one.tiles == ['2_10'] and one.notes == []
    assert Vaihingen(tree('Vaihingen'), split='train', crop_size=SIZE, areas=[1]).areas == ['1']


def test_validation_scenes_that_are_training_scenes_are_said(tree):
    from ds_seg.engine.trainer import data_notes
    potsdam = tree('Potsdam')
    train = Potsdam(potsdam, split='train', crop_size=SIZE, tiles=['2_10', '2_11'])
    val = Potsdam(potsdam, split='val', crop_size=SIZE, tiles=['2_11', '5_15'])
    assert data_notes(train, val) == ['data.val: 1 of its 2 scenes are also in data.train: its scores are not held out']
    assert data_notes(train, Potsdam(potsdam, split='val', crop_size=SIZE, tiles=['5_15'])) == []


def test_validation_scenes_that_are_copies_of_training_scenes_are_said(tmp_path):
    """The check compared files, not contents: a validation folder holding a cp of a training
    scene, or the synthetic data.val.split='train' (generated into its own cache folder), scored
    training scenes as held out without a word."""
    import shutil

    from ds_seg.data import GeoTiffScenes, SyntheticAerial
    from ds_seg.engine.trainer import data_notes
    train = SyntheticAerial(split='train', num_scenes=2, scene_size=64, cache_dir=str(tmp_path / 'a'), crop_size=32)
    same = SyntheticAerial(split='train', num_scenes=1, scene_size=64, cache_dir=str(tmp_path / 'b'), crop_size=32)
    assert train.scenes[0]['image'] != same.scenes[0]['image']
    said = 'data.val: 1 of its 1 scenes are also in data.train: its scores are not held out'
    assert data_notes(train, same) == [said]
    (tmp_path / 'val').mkdir()
    copies = [shutil.copy(train.scenes[1][k], tmp_path / 'val' / os.path.basename(train.scenes[1][k]))
              for k in ('image', 'label')]
    val = GeoTiffScenes([str(copies[0])], [str(copies[1])], crop_size=32, mode='grid', split='val', classes=train.classes)
    assert data_notes(train, val) == [said]
    assert data_notes(train, SyntheticAerial(split='val', num_scenes=1, scene_size=64, cache_dir=str(tmp_path / 'c'),
                                             crop_size=32)) == []


def test_deepglobe_val_is_decided_by_each_id_not_its_position(tree):
    deepglobe = tree('DeepGlobeLandCover')

    def ids(split):
        ds = DeepGlobeLandCover(deepglobe, split=split, crop_size=SIZE)
        return sorted(os.path.basename(s['image']).split('_')[0] for s in ds.scenes)
    assert ids('val') == ['105415'] and ids('train') == ['100694', '102122', '104113', '10452']
    # The first id sorted gone (a partial download): no other id changes side.
    for name in ('100694_sat.jpg', '100694_mask.png'):
        os.remove(f'{deepglobe}/train/{name}')
    assert ids('val') == ['105415'] and ids('train') == ['102122', '104113', '10452']
    notes = DeepGlobeLandCover(deepglobe, split='train', crop_size=SIZE).notes
    assert notes == ['DeepGlobeLandCover train folder: 4 of the official 803 labelled images found; a partial '
                     'download or extraction? using those found']


def test_one_label_for_two_images_of_a_folder_is_refused(tree):
    root = tree('ImageMaskFolder')
    image = os.path.join(root, 'img_dir', 'train', sorted(os.listdir(os.path.join(root, 'img_dir', 'train')))[0])
    shutil.copy(image, image[:-4] + '.jpg')
    with pytest.raises(DataError, match=r'train/0_0_0_32_32\.jpg and .*train/0_0_0_32_32\.png both pair with the '
                                         r'label .*ann_dir/train/0_0_0_32_32\.png'):
        ImageMaskFolder(root, split='train', classes=6, crop_size=SIZE)


def _scene(tmp_path, image):
    paths = []
    for name, array in (('a.tif', image), ('a_label.tif', np.zeros(image.shape[1:], np.uint8))):
        with rasterio.open(tmp_path / name, 'w', driver='GTiff', width=array.shape[-1], height=array.shape[-2],
                           count=1 if array.ndim == 2 else array.shape[0], dtype=array.dtype) as dst:
            dst.write(array if array.ndim == 3 else array[None])
        paths.append(str(tmp_path / name))
    return paths


def test_imagenet_statistics_in_0_1_units_for_8_bit_images_are_refused(tmp_path):
    image, label = _scene(tmp_path, np.random.default_rng(0).integers(0, 255, (3, 32, 32), dtype=np.uint8))
    with pytest.raises(ValueError, match=r'std=\[0\.229.*\] is below 1 in every band of uint8 images \(0-255\): mean '
                                         r'and std are in the file.s units, not 0-1'):
        GeoTiffScenes([image], [label], classes=2, crop_size=16, mean=[0.485, 0.456, 0.406],
                      std=[0.229, 0.224, 0.225])
    # The same in the file's units, and no normalisation at all (mean 0, std 1), are taken.
    GeoTiffScenes([image], [label], classes=2, crop_size=16, mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])
    GeoTiffScenes([image], [label], classes=2, crop_size=16, mean=[0, 0, 0], std=[1, 1, 1])


def test_a_broken_stats_json_is_named(tmp_path):
    image, label = _scene(tmp_path, np.random.default_rng(0).integers(0, 255, (3, 32, 32), dtype=np.uint8))
    (tmp_path / 'stats.json').write_text('{mean: [1, 2, 3]}')
    with pytest.raises(DataError, match=r'stats\.json: not valid JSON \(.*\); fix it, or move it away'):
        GeoTiffScenes([image], [label], classes=2, crop_size=16)
    (tmp_path / 'stats.json').write_text(json.dumps([1, 2, 3]))
    with pytest.raises(DataError, match=r'stats\.json: expected a JSON object with mean/std'):
        GeoTiffScenes([image], [label], classes=2, crop_size=16)


def test_evaluating_scenes_without_georeference_warns_nothing(tree):
    """LoveDA's PNGs (and ISPRS's label TIFFs) have no georeference: each evaluation during
    training printed rasterio's NotGeoreferencedWarning with its source line."""
    import warnings

    import torch
    from rasterio.errors import NotGeoreferencedWarning

    from ds_seg.inference import evaluate_scenes
    ds = LoveDA(tree('LoveDA'), split='val', crop_size=SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter('error', NotGeoreferencedWarning)
        result = evaluate_scenes(lambda x: torch.zeros(x.shape[0], 7, *x.shape[2:]), ds, tile=SIZE, overlap=8)
    assert int(result['confusion'].sum()) == sum(int((np.asarray(ds[i]['label']) != 255).sum()) for i in range(len(ds)))



def test_vaihingens_full_labels_in_both_of_its_archives_are_one_label(tree):
    """ISPRS_semantic_labeling_Vaihingen.zip holds the training areas' full labels in
    gts_for_participants/, and the ground_truth_COMPLETE archive holds them again: with both
    unzipped, eroded=False refused every training area as a duplicate. The same pixels, written
    apart (another compression), are one label; a copy whose pixels differ is still refused."""
    import rasterio
    vaihingen = tree('Vaihingen')
    os.makedirs(f'{vaihingen}/gts_for_participants')
    for name in os.listdir(f'{vaihingen}/ground_truth'):
        with rasterio.open(f'{vaihingen}/ground_truth/{name}') as src:
            profile = dict(src.profile, compress='lzw')
            with rasterio.open(f'{vaihingen}/gts_for_participants/{name}', 'w', **profile) as dst:
                dst.write(src.read())
    copy = f'{vaihingen}/gts_for_participants/top_mosaic_09cm_area1.tif'
    assert open(copy, 'rb').read() != open(f'{vaihingen}/ground_truth/top_mosaic_09cm_area1.tif', 'rb').read()
    ds = Vaihingen(vaihingen, split='train', crop_size=SIZE, eroded=False)
    assert [os.path.basename(os.path.dirname(s['label'])) for s in ds.scenes] == ['ground_truth'] * len(ds.scenes)
    _repaint_corner(copy)
    with pytest.raises(DataError, match=r'top_mosaic_09cm_area1\.tif is under .* outside top/ 2 times, with other '
                                         r'pixels \(.*ground_truth/top_mosaic_09cm_area1\.tif; '
                                         r'.*gts_for_participants/top_mosaic_09cm_area1\.tif\)'):
        Vaihingen(vaihingen, split='train', crop_size=SIZE, eroded=False)


def test_a_deepglobe_image_without_its_png_mask_is_one_line_naming_it(tree):
    """A mask saved as JPEG (lossy: colour codes blended at every class edge) or missing was
    '..._mask.png: no such file', naming a file the user never had."""
    deepglobe = tree('DeepGlobeLandCover')
    mask = sorted(n for n in os.listdir(f'{deepglobe}/train') if n.endswith('_mask.png'))[0]
    ident = mask[:-len('_mask.png')]
    os.rename(f'{deepglobe}/train/{mask}', f'{deepglobe}/train/{ident}_mask.jpg')
    with pytest.raises(DataError, match=rf"DeepGlobeLandCover: .*train/{ident}_mask\.jpg is a JPEG mask, whose "
                                        rf"compression changes the colour codes along every class edge; use the "
                                        rf"official PNG masks \({ident}_mask\.png\)"):
        DeepGlobeLandCover(deepglobe, split='all', crop_size=SIZE)
    os.remove(f'{deepglobe}/train/{ident}_mask.jpg')
    with pytest.raises(DataError, match=rf"DeepGlobeLandCover: .*train/{ident}_sat\.jpg has no mask {ident}_mask\.png "
                                        r"beside it \(a partial extraction\?\); extract the official train/ folder"):
        DeepGlobeLandCover(deepglobe, split='all', crop_size=SIZE)


def test_a_relative_data_root_that_is_missing_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cls in (Potsdam, LoveDA):
        with pytest.raises(DataError, match=rf'{cls.__name__}: data_root data/x is not a directory \(relative to '
                                            rf'{tmp_path}\)$'):
            cls('data/x', crop_size=SIZE)
    with pytest.raises(DataError, match=rf'data_root {tmp_path}/x is not a directory$'):
        Potsdam(str(tmp_path / 'x'), crop_size=SIZE)
