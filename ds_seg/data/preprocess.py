"""The device half of the data pipeline: normalisation, nodata, flips and rotations of a batch.

Datasets yield windows as read from the file (``image``: uint8/uint16/... in file units,
``label``: compact integers, ``nodata``: bool mask, ``geom``: the sample's flip/rotation code)
and the trainer finishes them here, on the device, after the copy. Why not in the workers:
a float32 image is 4x the bytes of a uint8 one through the loader's shared memory and the
host-to-device copy, and normalising or flipping costs a worker about as much as reading the
window from a tiled file, while on a GPU it is free. mmsegmentation does the same with its
``SegDataPreProcessor``.

``geom`` packs three draws: bit 0 horizontal flip, bit 1 vertical flip, bits 2-3 the number of
90-degree counter-clockwise turns (``torch.rot90``), applied in that order to image, label and
nodata mask alike.

Example::

    prep = BatchPreprocessor.for_dataset(train_set)
    for batch in loader:
        images_BCHW, labels_BHW = prep(batch, device)   # float32 normalised, int64
"""
import numpy as np
import torch

_TORCH_HAS = (np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64)
# Pixel types whose values float32 does not hold exactly (above 2**24): cast to float32 before
# the mean is subtracted, a uint32 band of counts around 2**30 with a spread of 300 reached the
# model as 2 distinct values (int64 around 2**40 as one). Their windows are carried as int64 or
# float64 and normalised in float64 (WIDE_TORCH), then handed on as float32.
WIDE = (np.int32, np.uint32, np.int64, np.uint64, np.float64)
WIDE_TORCH = (torch.int32, torch.int64, torch.float64)


def host_dtype(file_dtype):
    """The dtype image windows carry to the device for rasters of ``file_dtype``: the file's
    own where torch has it (uint8, uint16, int8, int16, int32, int64, float32, float64), uint32
    as int64 and uint64 as float64 (both exact where float32 is not), anything else as float32."""
    file_dtype = np.dtype(file_dtype)
    if file_dtype.type in _TORCH_HAS:
        return file_dtype
    return np.dtype({np.uint32: np.int64, np.uint64: np.float64}.get(file_dtype.type, np.float32))


def work_dtype(image_dtype):
    """The floating type host-side arithmetic on windows of ``image_dtype`` (resizes, colour
    jitter) runs in: float64 for the :data:`WIDE` types, float32 for the others."""
    return np.dtype(np.float64 if np.dtype(image_dtype).type in WIDE else np.float32)


def geom_code(hflip, vflip, quarter_turns):
    """The ``geom`` value of a sample (see the module docstring)."""
    return int(bool(hflip)) | int(bool(vflip)) << 1 | (int(quarter_turns) % 4) << 2


def apply_geom(x, code):
    """Flip/rotate the last two dims of ``x`` as ``geom`` code ``code`` says."""
    dims = [d for d, bit in ((-1, 1), (-2, 2)) if code & bit]
    if dims:
        x = x.flip(dims)
    turns = (code >> 2) & 3
    return torch.rot90(x, turns, (-2, -1)) if turns else x


class BatchPreprocessor:
    """``(batch, device) -> (images_BCHW float32, labels_BHW int64)``.

    images: ``(raw - mean) / std`` per band in float32, 0 where ``nodata``; labels: int64
    (nodata pixels are already ``ignore_index`` from the dataset). Whole-scene prediction
    (:mod:`ds_seg.inference`) normalises its windows with :meth:`images`, so training and
    prediction inputs agree bit for bit. ``mean``/``std`` None: images are only cast (a
    dataset that yields normalised floats). A band with std 0 is constant: it normalises to 0.
    """

    def __init__(self, mean=None, std=None):
        if (mean is None) != (std is None):
            raise ValueError('BatchPreprocessor: give both mean and std, or neither')
        self.mean = self.std = None
        if mean is not None:
            # float64 as given (a float32 mean of 2**30 counts is 34 counts off), float32 copies
            # for the usual types, whose normalisation stays in float32.
            std = np.asarray(std, np.float64).reshape(-1)
            self.mean = torch.as_tensor(np.asarray(mean, np.float64)).reshape(1, -1, 1, 1)
            self.std = torch.as_tensor(np.where(std > 0, std, 1.0)).reshape(1, -1, 1, 1)
        self._on_device = {}

    @classmethod
    def for_dataset(cls, dataset):
        """The preprocessor for a dataset's samples: its ``mean``/``std`` when it has them."""
        mean, std = getattr(dataset, 'mean', None), getattr(dataset, 'std', None)
        return cls(mean, std) if mean is not None and std is not None else cls()

    def _stats(self, device, dtype):
        if (device, dtype) not in self._on_device:
            # Host to device, once: queued with the step's work, the host does not wait for it.
            self._on_device[device, dtype] = tuple(t.to(dtype).to(device, non_blocking=True)
                                                   for t in (self.mean, self.std))
        return self._on_device[device, dtype]

    def images(self, image, nodata, device):
        """Raw ``image`` (B, C, H, W) and bool ``nodata`` (B, H, W) or None -> normalised float32
        on ``device`` (always a new tensor: the caller's are never modified)."""
        device = torch.device(device)
        # Decided on the type as read: uint16 is widened to int32 below, and stays in float32.
        work = torch.float64 if image.dtype in WIDE_TORCH else torch.float32
        if image.dtype == torch.uint16:
            # Moved as int16 bits and widened there: casts from uint16 have few kernels
            # outside the CPU ("barebones" unsigned dtype), int16 -> int32 has them everywhere.
            image = image.view(torch.int16).to(device, non_blocking=True).to(torch.int32).bitwise_and_(0xFFFF)
        else:
            image = image.to(device, non_blocking=True)
        image = image.to(work, copy=True)  # copy: on the CPU .to() returns the input
        if self.mean is not None:
            if image.shape[1] != self.mean.shape[1]:
                raise ValueError(f'batch has {image.shape[1]} band(s) but the normalisation has '
                                 f'{self.mean.shape[1]} (mean/std of the training set)')
            mean, std = self._stats(device, work)
            image.sub_(mean).div_(std)
        image = image.to(torch.float32)
        if nodata is not None:
            image.masked_fill_(nodata.to(device, non_blocking=True).unsqueeze(1), 0.0)
        return image

    def __call__(self, batch, device):
        image = self.images(batch['image'], batch.get('nodata'), device)
        label = batch['label'].to(device, non_blocking=True).to(torch.int64, copy=True)
        if 'geom' in batch:
            # Read on the host: the codes never went to the device, so this does not synchronise.
            for i, code in enumerate(batch['geom'].tolist()):
                if code:
                    image[i] = apply_geom(image[i], code)
                    label[i] = apply_geom(label[i], code)
        return image, label
