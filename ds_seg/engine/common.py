"""What both backends need done to a model the same way: BatchNorm policy and gradient norms.

Keeping these in one place is what makes a DDP-vs-DeepSpeed comparison fair: the same BN
handling, the same precision of normalisation statistics, the same norm computation.
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import distributed


class FP32BatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that normalises in fp32 whatever the dtype of its input and parameters.

    DeepSpeed's fp16/bf16 modes cast parameters to half precision but leave buffers in fp32,
    so a stock BatchNorm fails with a dtype mismatch; casting the running statistics to half
    would instead make them drift (a 16-bit mean of thousands of updates). Here input and
    affine parameters are upcast for the normalisation only; statistics stay fp32.
    """

    def forward(self, x):
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        else:
            momentum = 0.0 if self.momentum is None else self.momentum
        use_batch_stats = self.training or not self.track_running_stats
        weight = self.weight.float() if self.weight is not None else None
        bias = self.bias.float() if self.bias is not None else None
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = F.batch_norm(x.float(),
                               self.running_mean if not self.training or self.track_running_stats else None,
                               self.running_var if not self.training or self.track_running_stats else None,
                               weight, bias, use_batch_stats, momentum, self.eps)
        return out.to(x.dtype)


BATCHNORM_STATS = ('running_mean', 'running_var')


def keep_batchnorm_fp32(model):
    """Swap every BatchNorm2d for :class:`FP32BatchNorm2d` in place (same parameters, buffers),
    with its running statistics in fp32 (ZeRO-3's zero.Init creates them in the training dtype)."""
    for module in model.modules():
        if type(module) is nn.BatchNorm2d:
            module.__class__ = FP32BatchNorm2d
        if isinstance(module, _BatchNorm):
            for name in BATCHNORM_STATS:
                stat = getattr(module, name, None)
                if stat is not None and stat.dtype != torch.float32:
                    stat.data = stat.data.float()
    return model


def prepare_batchnorm(model, device, world_size):
    """SyncBatchNorm on multi-GPU runs (gloo has no SyncBatchNorm kernel, so not on CPU).

    Without it each rank normalises with its own micro-batch statistics, as DDP does by
    default; running statistics are then averaged before evaluation and saving
    (:func:`average_buffers`).
    """
    if device.type == 'cuda' and world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def batchnorm_buffers(model):
    return [buf for m in model.modules() if isinstance(m, _BatchNorm)
            for name, buf in m.named_buffers(recurse=False) if name in BATCHNORM_STATS]


@torch.no_grad()
def average_buffers(model):
    """Make the model's floating-point buffers equal on every rank (neither backend synchronises
    buffers per step): BN running statistics averaged; any other float buffer (a user model's
    running scale, an EMA) averaged where the ranks' values differ, and left bit for bit where they
    agree. Else the checkpoint kept rank 0's value, every rank resumed from it, and a resumed run
    was no longer the run that never stopped."""
    bn = batchnorm_buffers(model)
    distributed.all_reduce_mean_(bn)
    bn_ids = {id(b) for b in bn}
    distributed.average_where_different_(
        [b for b in model.buffers() if b.is_floating_point() and id(b) not in bn_ids])


@torch.no_grad()
def global_grad_norm(parameters):
    """L2 norm of all gradients (after reduction, so equal on every rank)."""
    norms = [p.grad.detach().float().norm(2) for p in parameters if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms), 2))
