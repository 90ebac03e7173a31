"""Any timm model with ``features_only`` as an encoder (ConvNeXt, Swin, ResNet, EfficientNet...)."""
import re

from torch import nn

# Which of timm's feature levels a head gets (``levels=``), chosen by stride rather than by
# index: timm numbers levels per model (ResNets, EfficientNets, RegNets, MobileNets report a
# stride-2 stem level first, VGG a stride-1 one, ConvNeXt and Swin start at stride 4), so fixed
# indices pick the wrong maps, or ones that do not exist, on another family.
#   'pyramid':  every level at stride 4 or more (UperNet, FPN: strides 4, 8, 16, 32, as
#               mmsegmentation and segmentation_models_pytorch take them);
#   'low_high': the first level at stride 4 or more, the one before the last and the last
#               (DeepLabV3+'s low-level input, its auxiliary head's level, as mmsegmentation's
#               FCNHead on a ResNet's stage 3, and its ASPP input; the head reads the first and last).
LEVELS = ('pyramid', 'low_high')

from ..common import BACKBONES, meta_device, run_block
from ..pretrained import built_whole, check_band_map, create_timm_model, load_pretrained, timm_state_dict


def _wrapped_prefix(feature_net):
    """``'model.'`` or ``'body.'`` where timm's feature wrapper holds the classification model
    whole under that name (FeatureGetterNet; FeatureHookNet of PiT, NASNet, Xception), else None."""
    children = [name for name, _ in feature_net.named_children()]
    if type(feature_net).__name__ in ('FeatureGetterNet', 'FeatureHookNet') and len(children) == 1:
        return children[0] + '.'
    return None


def _original_key(key, flattened=None, prefix='model.'):
    """A key of timm's feature wrapper -> the classification model's key: FeatureListNet flattens
    a top-level Sequential's children into names of their own (``stages.0`` -> ``stages_0``,
    ``stem.conv1`` -> ``stem_conv1``, ``features.conv0`` -> ``features_conv0``); ``flattened``
    ({flat name: dotted path}, :func:`_flattened_names`) undoes that exactly (a name it lacks is the
    classifier's own: inception_resnet_v2's ``repeat_1``); unknown (None), a trailing ``_N`` is
    taken for ``.N``. A wrapper holding the model whole (:func:`_wrapped_prefix`) adds ``prefix``."""
    if prefix and key.startswith(prefix):
        return key[len(prefix):]
    head, _, rest = key.partition('.')
    if flattened is not None:
        return f'{flattened[head]}.{rest}' if head in flattened else key
    match = re.fullmatch(r'(.+)_(\d+)', head)
    return f'{match[1]}.{match[2]}.{rest}' if match else key


def _classifier(name):
    """timm's classification model ``name`` on the meta device (no memory, no weights), or None."""
    import timm
    try:
        def build():
            with meta_device():
                return timm.create_model(name, pretrained=False)
        # Outside ZeRO-3's partitioning: it builds every tensor on its own device, meta included
        # (a real model on every rank, and random draws that moved the heads' initial weights).
        return built_whole(build, partition=False)
    except Exception:  # not buildable so: judged without it
        return None


def _flattened_names(classifier):
    """{flat name: dotted path} of the modules timm's FeatureListNet renames when it flattens the
    classifier's top-level Sequentials (timm's own ``_module_list``), None where unknown."""
    if classifier is None:
        return None
    try:
        from timm.models._features import _module_list
    except ImportError:
        return None
    # A flat name that is also one of the classifier's own (inception_resnet_v2's repeat_1, beside
    # its Sequential repeat) is that module: timm flattens such models' features not at all.
    own = {name for name, _ in classifier.named_children()}
    return {flat: dotted for flat, dotted, _ in _module_list(classifier, flatten_sequential=True)
            if flat != dotted and flat not in own}


def _pruned_by_wrapper(feature_net, whole=None, flattened=None):
    """A predicate on a pretrained file's keys: True for tensors of the parts timm's feature
    wrapper removed (everything after the last feature stage: final norm, classifier, later
    stages). A tensor under a part the wrapper kept but which the model lacks is not excused."""
    if hasattr(feature_net, 'model') and hasattr(feature_net.model, 'blocks'):
        # FeatureGetterNet (ViTs) prunes in place: blocks after the last feature one, the final
        # norm (replaced by an Identity) and the head.
        depth = len(feature_net.model.blocks)
        block = re.compile(r'blocks\.(\d+)\.').match

        def pruned(key):
            found = block(key)
            return key.startswith('norm.') or bool(found) and int(found[1]) >= depth
        return pruned
    # The wrapper drops whole top-level parts of the classifier (its head, final norm, the stages
    # after the last feature level). A tensor under a part it kept must land in the model: judged
    # per module instead, a file of a richer architecture (seresnet18's squeeze-excitation
    # tensors into resnet18) lost those tensors without a word.
    prefix = _wrapped_prefix(feature_net)
    holder = getattr(feature_net, prefix[:-1]) if prefix else feature_net
    # (Parts that hold no tensor, a classifier reset to an Identity, take none of the file's.)
    units = tuple(name if prefix else _original_key(f'{name}.x', flattened)[:-2]
                  for name, module in holder.named_children() if next(iter(module.state_dict()), None))
    # What it dropped are the classifier's other top-level parts; a tensor under none of them
    # (a stray 'extra.weight', another model's part) lands nowhere and is refused by name. (A
    # classifier not buildable on the meta device: judged by the kept parts alone.)
    # (A flattened Sequential is one of them by its own name: its children after the last kept one.)
    dropped = None if whole is None else tuple(n for n, _ in whole.named_children() if n not in units)

    def pruned(key):
        if any(key == unit or key.startswith(f'{unit}.') for unit in units):
            return False
        return dropped is None or any(key == unit or key.startswith(f'{unit}.') for unit in dropped)
    return pruned


@BACKBONES.register_module()
class TimmBackbone(nn.Module):
    """``timm.create_model(name, features_only=True)`` with ``out_channels``/``strides``.

    ``pretrained=True`` fetches timm's default weights for ``name`` (network needed once; then
    the timm/Hugging Face cache); ``pretrained='path'`` reads a local ``.pth``/``.safetensors``
    of the classification model. Either way the first layer is adapted to ``in_channels``
    (:func:`~ds_seg.models.pretrained.adapt_input_weight`) and loading also works on a ZeRO-3
    partitioned model. Features are returned channels-first whatever timm's layout (Swin: NHWC).
    ``levels`` picks timm's feature levels by stride (:data:`LEVELS`) for any family; without it,
    ``out_indices`` (timm's numbering) or every level. ``band_map`` maps a multispectral pretrained
    file's bands onto the data's (one file band index or None per data band).

    Example::

        enc = TimmBackbone('convnext_tiny', in_channels=13, out_indices=(0, 1, 2, 3))
        feats = enc(torch.randn(1, 13, 256, 256))    # 96/192/384/768 channels, strides 4..32
    """

    def __init__(self, name='resnet50', in_channels=3, out_indices=None, output_stride=None, pretrained=False,
                 activation_checkpointing=False, levels=None, band_map=None, **timm_kwargs):
        super().__init__()
        from ...config import ConfigError
        check_band_map(band_map, in_channels, pretrained, name)
        kwargs = dict(timm_kwargs)
        if levels is not None and (levels not in LEVELS or out_indices is not None):
            raise ConfigError(f"{name}: levels must be one of {', '.join(LEVELS)} (or None, with out_indices), "
                              f"got levels={levels!r}, out_indices={out_indices!r}.")
        if out_indices is not None:
            kwargs['out_indices'] = tuple(out_indices)
        if output_stride is not None:
            kwargs['output_stride'] = output_stride
        self.model = create_timm_model(name, features_only=True, in_chans=in_channels, **kwargs)
        info = self.model.feature_info
        strides = list(info.reduction())
        # Indices into the feature list timm returns; every level is computed anyway (each feeds
        # the next), so leaving some out costs nothing and changes no parameter.
        self._take = list(range(len(strides)))
        if levels is not None:
            deep = [i for i, s in enumerate(strides) if s >= 4]
            if not deep:
                raise ConfigError(f"{name}: timm's features have strides {strides}, none at 4 or more; "
                                  "choose another backbone.")
            if levels == 'pyramid' and len({strides[i] for i in deep}) < 2:
                # One-stride models (BEiT, XCiT, MLP-Mixer...) gave UperNet three maps at stride 16
                # and trained without a word.
                raise ConfigError(f"model.backbone {name!r}: timm's features have strides "
                                  f"{[strides[i] for i in deep]}, one scale, not the pyramid (4, 8, 16, 32) "
                                  "that UperNet/FPN take; choose a hierarchical backbone (convnext, swin, resnet...) or a plain ViT (vit_*, "
                                  "deit*, eva*: ds_seg adds the pyramid).")
            last = len(strides) - 1
            # The auxiliary head's level was the stride-4 one (in_index=-2 of two levels): a weak
            # signal, on the largest map.
            self._take = deep if levels == 'pyramid' else [deep[0], *([last - 1] if last - 1 > deep[0] else []), last]
        self.out_channels = [list(info.channels())[i] for i in self._take]
        self.strides = [strides[i] for i in self._take]
        # The segmentor pads inputs to the deepest stride (mmseg's size_divisor=32): a stem or
        # downsampler without padding (ConvNeXt's 4x4/4, 2x2/2) floors the size, so at 65x97 the
        # last row and column had no influence on any logit, and the feature grids, 64x96 wide,
        # were stretched over 65x97.
        self.size_divisor = max(strides)
        self.channels_last_output = str(getattr(self.model, 'output_fmt', 'NCHW')).endswith('NHWC')
        self.activation_checkpointing = activation_checkpointing
        self._blocks = self._checkpoint_units() if activation_checkpointing else None
        if pretrained:
            source = timm_state_dict(name) if pretrained is True else pretrained
            first = _band_input_weight(self.model, in_channels)
            whole = _classifier(name)
            flattened, prefix = _flattened_names(whole), _wrapped_prefix(self.model)
            load_pretrained(self.model, source, rename=lambda key: _original_key(key, flattened, prefix),
                            allow_unused=_pruned_by_wrapper(self.model, whole, flattened), band_map=band_map,
                            input_key=_original_key(first, flattened, prefix), where=f'{name} pretrained',
                            origin=f"timm's weights for {name}" if pretrained is True else None)

    def _checkpoint_units(self):
        """(name, module) pairs to checkpoint one by one: the blocks of sequential stages, the other
        top-level modules whole. timm's FeatureListNet/FeatureDictNet are walked so; its
        EfficientNet/MobileNet feature nets (stem, then ``blocks`` stages) by ``_stage_out_idx``.
        timm's own checkpointing is not used where the model has BatchNorm: it recomputes the
        forward in backward in training mode, updating every running statistic twice a step."""
        if hasattr(self.model, 'return_layers') and hasattr(self.model, 'items'):
            units = []
            for name, module in self.model.items():
                children = list(module.children()) if isinstance(module, nn.Sequential) else []
                units.append((name, children or [module]))
            return units
        stages = getattr(self.model, 'blocks', None)
        if (hasattr(self.model, '_stage_out_idx') and getattr(self.model, 'feature_hooks', None) is None
                and isinstance(stages, nn.Sequential) and hasattr(self.model, 'conv_stem')):
            self._stem_stages = True
            return [(i, list(stage.children()) if isinstance(stage, nn.Sequential) else [stage])
                    for i, stage in enumerate(stages)]
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in self.model.modules()):
            from ...config import ConfigError
            raise ConfigError(f"activation_checkpointing: timm's {type(self.model).__name__} can only checkpoint "
                              "through timm, which updates its BatchNorm statistics twice a step; leave "
                              "activation_checkpointing out for this backbone.")
        self.model.set_grad_checkpointing(True)  # no statistics to update twice
        return None

    def _stem_stage_features(self, x):
        """EfficientNetFeatures'/MobileNetV3Features' forward, each block of each stage checkpointed
        with run_block."""
        m = self.model
        x = m.bn1(m.conv_stem(x))
        if getattr(m, 'act1', None) is not None:  # MobileNetV3's stem activation (EfficientNet's is in bn1)
            x = m.act1(x)
        features = [x] if 0 in m._stage_out_idx else []
        for i, blocks in self._blocks:
            for block in blocks:
                x = run_block(block, x, checkpointing=next(block.parameters(), None) is not None)
            if i + 1 in m._stage_out_idx:
                features.append(x)
        return features

    def forward(self, images_BCHW):
        if self._blocks is None:
            features = self.model(images_BCHW)
        elif getattr(self, '_stem_stages', False):
            features = self._stem_stage_features(images_BCHW)
        else:
            features, x = [], images_BCHW
            for name, blocks in self._blocks:
                for block in blocks:
                    # Parameter-free units (an in-place ReLU, pooling) are cheap to keep, and an
                    # in-place one would overwrite the input its own checkpoint saved.
                    has_params = next(block.parameters(), None) is not None
                    x = run_block(block, x, checkpointing=has_params)
                if name in self.model.return_layers:
                    features.append(x)
        features = [features[i] for i in self._take]
        if self.channels_last_output:
            features = [f.permute(0, 3, 1, 2) for f in features]
        return features


def _band_input_weight(model, in_channels):
    """The name of the weight that takes the bands: the first convolution built for
    ``in_channels`` inputs, else the model's first 4-d weight (ds_shape: ZeRO-3 partitioned).
    The first 4-d weight alone was a position embedding in Hiera (SAM 2), PiT, Visformer, TNT and
    VOLO: band_map rewrote the pretrained embedding (93 of 96 channels made one mean) and left
    the real first layer in the file's band order."""
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Conv2d) and module.in_channels == in_channels and module.groups == 1:
            return f'{module_name}.weight' if module_name else 'weight'
    return next(n for n, p in model.named_parameters() if len(getattr(p, 'ds_shape', p.shape)) == 4)
