"""GeoTIFF output: a class map (and optionally probabilities) written block row by block row.

Example::

    with rasterio.open('scene.tif') as src:
        w = GeoTiffRowWriter('classes.tif', src.profile, classes=['a', 'b'])
    w.write(0, classes_hW)
    w.close()
"""
import json
import os

import rasterio
from rasterio.windows import Window

CLASS_NODATA = 255


def default_palette(num_classes):
    """A fixed, distinct RGB colour per class (the synthetic data set's palette first)."""
    from ..data.synthetic import PALETTE
    extra = [(int(r * 255), int(g * 255), int(b_ * 255)) for r, g, b_ in _tab20()]
    colours = list(PALETTE) + extra
    return [tuple(colours[i % len(colours)]) for i in range(num_classes)]


def _tab20():
    # matplotlib's tab20 without importing matplotlib in the prediction path
    hexes = ('1f77b4 aec7e8 ff7f0e ffbb78 2ca02c 98df8a d62728 ff9896 9467bd c5b0d5 '
             '8c564b c49c94 e377c2 f7b6d2 7f7f7f c7c7c7 bcbd22 dbdb8d 17becf 9edae5').split()
    return [tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)) for h in hexes]


def _up16(n):
    return -(-int(n) // 16) * 16


class GeoTiffRowWriter:
    """A class-map GeoTIFF (and optionally a probabilities GeoTIFF) written block row by row.

    Georeferencing comes from the input; the files are tiled (``block`` x ``block``), ZSTD
    compressed, BigTIFF when needed. Rows must arrive as whole block rows, top to bottom:
    overlapping or partial writes into compressed tiles would inflate the file and slow it.

    Example::

        with rasterio.open('scene.tif') as src:
            w = GeoTiffRowWriter('classes.tif', src.profile, classes=['a', 'b'])
        w.write(0, classes_hW)   # rows 0..block-1
        w.close()
    """

    def __init__(self, path, src_profile, classes, probs_path=None, block=256,
                 row_offset=0, height=None):
        self.classes = list(classes)
        k = len(self.classes)
        if k > 255:
            raise ValueError(f"{k} classes do not fit a uint8 class map with nodata {CLASS_NODATA}")
        whole = height is None or (row_offset == 0 and height == src_profile['height'])
        height = src_profile['height'] if height is None else height
        transform = src_profile['transform'] @ rasterio.Affine.translation(0, row_offset)
        georef = dict(crs=src_profile.get('crs'), transform=transform)
        # A scene located by ground control points or RPCs (no geotransform) gives its class map
        # the same, so it opens in place in QGIS; a rank's part file (rows of it) needs none.
        gcps, gcp_crs = src_profile.get('gcps') or ((), None)
        if whole and gcps:
            georef = dict(gcps=gcps, crs=gcp_crs)
        if whole and src_profile.get('rpcs'):
            georef['rpcs'] = src_profile['rpcs']
        # Tiles no larger than the scene needs (rounded up to GeoTIFF's 16): a reader decodes a
        # whole tile, and one of `block` px over a small scene cost its every reader that much.
        tile = min(block, _up16(max(src_profile['width'], height)))
        common = dict(driver='GTiff', width=src_profile['width'], height=height, tiled=True,
                      blockxsize=tile, blockysize=tile, compress='zstd', BIGTIFF='IF_SAFER', **georef)
        self.block = block
        self.dst = rasterio.open(path, 'w', count=1, dtype='uint8', nodata=CLASS_NODATA,
                                 photometric='PALETTE', **common)
        palette = default_palette(k)
        self.dst.write_colormap(1, {i: tuple(palette[i][:3]) + (255,) for i in range(k)}
                                | {CLASS_NODATA: (0, 0, 0, 0)})
        self.dst.set_band_description(1, 'class')
        # A scene georeferenced as PixelIsPoint: its class map too, or a reader that takes the raster
        # type literally (GTIFF_POINT_GEO_IGNORE) puts the two half a pixel apart.
        point = dict(AREA_OR_POINT='Point') if src_profile.get('area_or_point') == 'Point' else {}
        self.dst.update_tags(classes=json.dumps(self.classes), nodata_class=str(CLASS_NODATA), **point,
                             **{f'CLASS_{i}': n for i, n in enumerate(self.classes)})
        self.probs = None
        if probs_path:
            # 0..250 in steps of 1/250 (255 stays free as nodata)
            self.probs = rasterio.open(probs_path, 'w', count=k, dtype='uint8', nodata=255,
                                       photometric='MINISBLACK', interleave='band', **common)
            for i, n in enumerate(self.classes):
                self.probs.set_band_description(i + 1, n)
            self.probs.update_tags(classes=json.dumps(self.classes), scale='1/250', **point)

    def write(self, y0, classes_hW, probs_KhW=None):
        h = classes_hW.shape[0]
        if y0 % self.block:
            raise ValueError(f"row {y0} is not at a block boundary ({self.block})")
        window = Window(0, y0, classes_hW.shape[1], h)
        self.dst.write(classes_hW, 1, window=window)
        if self.probs is not None and probs_KhW is not None:
            self.probs.write(probs_KhW, window=window)

    def close(self):
        self.dst.close()
        if self.probs is not None:
            self.probs.close()


def join_parts(out_path, probs_path, profile, plan, block):
    """Copy the ranks' part files into the final GeoTIFF, one block row at a time."""
    first = f'{out_path}.part0'
    with rasterio.open(first) as p:
        names = json.loads(p.tags()['classes'])
    writer = GeoTiffRowWriter(out_path, profile, names, probs_path, block)
    try:
        for r in range(plan.world_size):
            a, b = plan.band(r)
            if a >= b:
                continue
            paths = [f'{out_path}.part{r}'] + ([f'{probs_path}.part{r}'] if probs_path else [])
            srcs = [rasterio.open(p) for p in paths]
            try:
                for y in range(a, b, block):
                    win = Window(0, y - a, profile['width'], min(block, b - y))
                    writer.write(y, srcs[0].read(1, window=win),
                                 srcs[1].read(window=win) if probs_path else None)
            finally:
                for s in srcs:
                    s.close()
            for p in paths:
                os.remove(p)
    finally:
        writer.close()
