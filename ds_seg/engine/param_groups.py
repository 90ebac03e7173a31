"""The ViT fine-tuning recipe as optimizer parameter groups, handed identically to DeepSpeed and
to DDP: layer-wise learning-rate decay (BEiT, mmseg, DINOv2 heads), no weight decay on norms,
biases, position embeddings and tokens, and a lower learning rate for the pretrained backbone
than for the freshly initialised heads.

Each group carries ``lr_mult``. The LR schedule (DeepSpeed's, in both backends) computes one base
LR per step; :func:`scale_lr_by_group` multiplies it into every group after each scheduler step,
so the schedule applies to every group proportionally whatever the scheduler type.

Example (experiment config)::

    optim = dict(layer_decay=0.75, paramwise=dict(no_weight_decay=True, backbone_lr_mult=0.1))
"""
import re

from ..config import ConfigError

# Parameters that are positions or tokens rather than weights: never decayed.
NO_DECAY_NAMES = ('pos_embed', 'cls_token', 'reg_token', 'dist_token', 'mask_token', 'register_tokens',
                  'absolute_pos_embed', 'relative_position_bias_table')
# Within a ViT (ds_seg's ViT: blocks.i; TimmViT: model.blocks.i).
_BLOCK = re.compile(r'(?:model\.)?blocks\.(\d+)\.')
_EMBED = re.compile(r'(?:model\.)?(patch_embed|pos_embed|cls_token|reg_token|dist_token|mask_token)')


def _layer_id(name, num_blocks, vit_prefix):
    """0 for the patch/position embeddings and tokens, i + 1 for block i, num_blocks + 1 for the
    rest. ``vit_prefix``: where the ViT sits (``backbone.``; ``backbone.encoder.`` in a temporal
    model); its blocks are ``blocks.i`` (ds_seg's ViT) or ``model.blocks.i`` (TimmViT)."""
    if not num_blocks or not name.startswith(vit_prefix):
        return num_blocks + 1
    inner = name[len(vit_prefix):]
    found = _BLOCK.match(inner)
    if found:
        return int(found[1]) + 1
    if _EMBED.match(inner):
        return 0
    return num_blocks + 1


def _find_vit(model):
    """(prefix, module) of the ViT in the model's backbone (nested in a temporal encoder too), or
    (None, None). Transformer blocks only: timm's EfficientNet/MobileNet features have
    model.blocks.N too (stages, stem outside them), and decay counted over them trained the stem
    at the full LR and the first stage at decay^7."""
    from ..models.backbones.timm_vit import TimmViT
    from ..models.backbones.vit import ViT
    for name, module in model.named_modules():
        if (name == 'backbone' or name.startswith('backbone.')) and isinstance(module, (ViT, TimmViT)):
            return name + '.', module
    return None, None


def _fresh_prefixes(model):
    """Parameter-name prefixes of the backbone's freshly initialised parts, which train with the
    heads: each backbone module names its own in ``fresh_modules`` (a ViT's pyramid neck, a
    temporal encoder's fusion convolutions)."""
    return tuple(f'{name}.{part}.' for name, module in model.named_modules()
                 if name.startswith('backbone') for part in getattr(module, 'fresh_modules', ()))


def _ndim(param):
    """Dimensions of the parameter as the model defines it: under ZeRO-3 it is built partitioned,
    an empty 1-D tensor with the real shape in ``ds_shape`` (every weight counted as a bias or norm,
    and ``no_weight_decay`` switched weight decay off for all of them)."""
    return len(getattr(param, 'ds_shape', param.shape))


def _in_backbone(name, fresh):
    return name.startswith('backbone.') and not name.startswith(fresh)


def _check(optim_cfg):
    layer_decay = optim_cfg.get('layer_decay')
    paramwise = dict(optim_cfg.get('paramwise') or {})
    if layer_decay is not None and not (isinstance(layer_decay, (int, float)) and 0 < layer_decay <= 1):
        raise ConfigError(f'optim.layer_decay must be a number in (0, 1] (e.g. 0.75) or None, got {layer_decay!r}.')
    mult = paramwise.get('backbone_lr_mult', 1.0)
    if not isinstance(mult, (int, float)) or mult <= 0:
        raise ConfigError(f'optim.paramwise.backbone_lr_mult must be a positive number, got {mult!r}.')
    if paramwise.get('freeze_backbone') and (layer_decay is not None or mult != 1.0):
        # Both set the backbone's LR, which a frozen backbone does not have.
        given = 'optim.layer_decay' if layer_decay is not None else 'optim.paramwise.backbone_lr_mult'
        raise ConfigError(f'{given} sets the learning rate of backbone parameters that '
                          'optim.paramwise.freeze_backbone=True does not train; leave one of them out.')
    return layer_decay, bool(paramwise.get('no_weight_decay', False)), float(mult)


def freeze_backbone_asked(optim_cfg):
    return bool(dict((optim_cfg or {}).get('paramwise') or {}).get('freeze_backbone'))


def freeze_backbone(model, optim_cfg):
    """``optim.paramwise.freeze_backbone``: the backbone's parameters stop training (the parts it
    names in ``fresh_modules``, a ViT's neck, train with the heads), and its modules stay in eval
    mode whenever the model trains: BatchNorm keeps the pretrained statistics and dropout / drop
    path stay off, so the heads learn on the features the backbone was trained to give. Call once,
    after the weights are loaded and before a backend wraps the model. The line to print, or None
    where the config does not ask for it.

    Example::

        line = freeze_backbone(model, dict(paramwise=dict(freeze_backbone=True)))
    """
    if not freeze_backbone_asked(optim_cfg):
        return None
    _check(optim_cfg)
    fresh = _fresh_prefixes(model)
    frozen = [p for n, p in model.named_parameters() if _in_backbone(n, fresh)]
    if not frozen:
        model_name = getattr(model, 'registered_as', type(model).__name__)
        raise ConfigError(f'optim.paramwise.freeze_backbone: model {model_name} has no backbone (parameters named '
                          'backbone.*), so nothing would be frozen; use a model with a pretrained backbone '
                          '(UperNet, SegFormer, FPN, ...), or leave it out.')
    for param in frozen:
        param.requires_grad_(False)

    def is_frozen(name):  # by name: SyncBatchNorm conversion replaces the module objects later
        return (name == 'backbone' or name.startswith('backbone.')) and not f'{name}.'.startswith(fresh)
    plain_train = model.train

    def train(mode=True):
        plain_train(mode)
        for name, module in model.named_modules():
            if is_frozen(name):
                module.training = False
        return model
    model.train = train  # DDP's, DeepSpeed's and the trainer's train()/eval() all come through here
    train(model.training)
    count = sum(_numel(p) for p in frozen)
    trained = sum(_numel(p) for p in model.parameters() if p.requires_grad)
    fresh_parts = '/'.join(sorted({prefix.split('.')[-2] for prefix in fresh}))
    with_fresh = f" and the backbone's fresh {fresh_parts}" if fresh else ''
    return (f'optim.paramwise.freeze_backbone: {count:,} backbone parameters frozen, in eval mode (their norm '
            f'statistics kept); training {trained:,} parameters of the heads{with_fresh}')


def _numel(param):
    """Elements of the parameter as the model defines it (ZeRO-3: its ``ds_numel``)."""
    return getattr(param, 'ds_numel', param.numel())


def build_param_groups(model, optim_cfg):
    """The parameters to hand to the optimizer: a plain list when ``optim_cfg`` asks for nothing,
    else groups ``{'params', 'lr_mult', 'name'[, 'weight_decay': 0.0]}`` (groups without a
    ``weight_decay`` key use the optimizer's). The group with ``lr_mult == 1`` (the heads) comes
    first, so the LR a backend logs is the base schedule.

    Example::

        groups = build_param_groups(model, dict(layer_decay=0.75, paramwise=dict(no_weight_decay=True)))
        [(g['name'], g['lr_mult']) for g in groups]   # [('layer13', 1.0), ..., ('layer0_no_decay', 0.02)]
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    layer_decay, no_weight_decay, backbone_mult = _check(optim_cfg or {})
    if layer_decay is None and not no_weight_decay and backbone_mult == 1.0 and not freeze_backbone_asked(optim_cfg):
        return [p for _, p in named]
    # (A frozen backbone gets groups too: the checkpoint's layout then counts the trained tensors,
    # and a resume that freezes otherwise is refused in one line, not inside DeepSpeed's loader.)
    vit_prefix, vit = _find_vit(model)
    num_blocks = 0 if vit is None else 1 + max(
        [int(m[1]) for m in (_BLOCK.match(n) for n, _ in vit.named_parameters()) if m], default=-1)
    fresh = _fresh_prefixes(model)
    model_name = getattr(model, 'registered_as', type(model).__name__)  # as the config names it
    if layer_decay is not None and num_blocks == 0:
        raise ConfigError(f'optim.layer_decay: model {model_name} has no ViT blocks '
                          '(backbone.blocks.N); layer-wise decay applies to ViT backbones only. Set it to None.')
    if backbone_mult != 1.0 and not any(_in_backbone(n, fresh) for n, _ in named):
        raise ConfigError(f'optim.paramwise.backbone_lr_mult: model {model_name} has no backbone '
                          "(parameters named backbone.*), so it would change nothing; leave it out, or use a "
                          'model with a pretrained backbone.')
    groups = {}
    for name, param in named:
        layer = _layer_id(name, num_blocks, vit_prefix)
        mult = 1.0
        if layer_decay is not None:
            mult *= layer_decay ** (num_blocks + 1 - layer)
        in_backbone = _in_backbone(name, fresh)
        if in_backbone:
            mult *= backbone_mult
        decay = not (no_weight_decay and (_ndim(param) <= 1 or name.rsplit('.', 1)[-1] in NO_DECAY_NAMES))
        key = (layer if layer_decay is not None else 0, in_backbone, mult, decay)
        group = groups.setdefault(key, {'params': [], 'lr_mult': mult,
                                        'name': f'layer{key[0]}{"_backbone" if key[1] else ""}'
                                                f'{"" if decay else "_no_decay"}'})
        if not decay:
            group['weight_decay'] = 0.0
        group['params'].append(param)
    # The heads' group (lr_mult 1) first whatever the other multipliers: backends log the first
    # group's LR (a backbone_lr_mult of 2 logged the backbone's, twice the heads').
    return sorted(groups.values(), key=lambda g: (g['lr_mult'] != 1.0, -g['lr_mult'], g['name']))


def group_layout(groups):
    """What a checkpoint records of :func:`build_param_groups`' answer: ``[name, lr_mult,
    weight_decay override or None, number of tensors]`` per group, or None for one plain group. A
    resume restores every group's settings from the optimizer state, so other groups (another
    ``optim`` recipe) cannot continue it."""
    if not groups or not isinstance(groups[0], dict):
        return None
    return [[g['name'], g['lr_mult'], g.get('weight_decay'), len(g['params'])] for g in groups]


def apply_schedule_now(scheduler):
    """After a resume: the groups' LR is the checkpoint's, which its schedule set for the next
    step. A resume may change the schedule (its parameters, the ``lr`` it starts from): the
    restored step count and this run's parameters say what that step's LR is. Without this, the
    first resumed step trained at the old schedule's LR. A no-op without a scheduler."""
    if scheduler is None:
        return
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr()):
        group['lr'] = lr * group.get('lr_mult', 1.0)


def scale_lr_by_group(optimizer, scheduler):
    """Make every group's LR ``scheduled LR x lr_mult`` now and after every ``scheduler.step()``.

    Groups are built with one base LR so every DeepSpeed scheduler (absolute ones such as
    WarmupLR as well as WarmupCosineLR, which scales each group's initial LR) computes the same
    base value for all; the multiplier is applied afterwards. A no-op for groups without
    ``lr_mult``.

    Example::

        scale_lr_by_group(engine.optimizer, engine.lr_scheduler)
    """
    def apply():
        for group in optimizer.param_groups:
            if group.get('lr_mult', 1.0) != 1.0:
                group['lr'] = group['lr'] * group['lr_mult']

    apply()
    if scheduler is not None:
        step = scheduler.step

        def scaled_step(*args, **kwargs):
            result = step(*args, **kwargs)
            apply()
            return result

        scheduler.step = scaled_step
