"""The one boundary between the training loop and an engine (DeepSpeed, or plain DDP).

:class:`Backend` is what the trainer, the checkpointer, the metrics and ds_seg.memory may use;
the two implementations are ds_seg/engine/deepspeed_backend.py (the only ``deepspeed.initialize``)
and ds_seg/engine/ddp_backend.py. This module is the only place that picks one by name.
"""
from typing import ContextManager, Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class Backend(Protocol):
    name: str                      # 'deepspeed' or 'ddp': recorded in checkpoints and logs
    zero_stage: Optional[int]      # None under DDP
    precision: str                 # as run (RunSpec.precision)
    global_batch: int
    state_partitioned: bool        # optimizer state split over ranks (resume elsewhere reshards)
    optimizer_impl: str            # what runs the update, e.g. 'torch.AdamW fused' (speed.optimizer_impl)
    param_group_layout: Optional[list]  # param_groups.group_layout of the optimizer's groups

    @property
    def module(self) -> torch.nn.Module: ...

    # -- resolving the run (class-level: asked before the backend exists) -----------------
    uses_deepspeed_comm: bool      # the process group is initialised through deepspeed.comm

    @staticmethod
    def precision_run(precision: str) -> str:
        """The precision the JSON's ``precision`` runs as under this backend."""

    @staticmethod
    def zero_stage_of(ds_config: dict) -> Optional[int]: ...

    # -- building ------------------------------------------------------------------------
    @staticmethod
    def construction_context(spec) -> ContextManager:
        """The context the model is built in (``zero.Init`` under ZeRO-3)."""

    gather: object                 # None, or params -> context making partitioned params whole

    # -- one optimizer step = grad_accum x (forward, backward, step) -----------------------
    def train(self) -> None: ...
    def eval(self) -> None: ...
    def forward(self, images_BCHW: torch.Tensor): ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def is_boundary(self) -> bool: ...
    def step(self, want_grad_norm: bool = False) -> bool:
        """Finish a micro-step; at a boundary the optimizer steps. No host read in bf16/fp32."""

    # -- read at log steps only (they may synchronise) -----------------------------------
    def grad_norm(self) -> Optional[float]: ...
    def loss_scale(self) -> Optional[float]: ...
    def lr(self) -> float: ...

    @property
    def skipped_steps(self) -> int: ...

    # -- state -----------------------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Make buffers equal on every rank (before evaluation and saving): BN running statistics
        averaged, other float buffers averaged where they differ (common.average_buffers)."""

    def state_holders(self) -> tuple:
        """(module, optimizer, inner torch optimizer) whose tensors ds_seg.memory counts."""

    def resume_refusal(self, marker: dict, where: str) -> Optional[str]:
        """One line saying why this run cannot continue a checkpoint of this backend, or None."""

    def save(self, directory: str, tag: str, client_state: dict) -> None: ...
    def load(self, directory: str, tag: str) -> dict: ...


BACKENDS = ('deepspeed', 'ddp')


def backend_class(name):
    """The implementation for ``--backend NAME`` (imported on demand: DDP needs no DeepSpeed)."""
    if name == 'ddp':
        from .ddp_backend import DDPBackend
        return DDPBackend
    if name == 'deepspeed':
        from .deepspeed_backend import DeepSpeedBackend
        return DeepSpeedBackend
    raise ValueError(f'backend must be one of {BACKENDS}, not {name!r}')


def build_model(spec, build):
    """``build()`` inside the backend's construction context (ZeRO-3: parameters partitioned as
    they are created, pretrained weights gathered module by module)."""
    with backend_class(spec.backend).construction_context(spec):
        return build()


def load_weights(spec, model, state_dict, adapt=None):
    """Fill ``model`` (built by :func:`build_model`) from a state dict; (missing, unexpected).
    ``adapt``: as in :func:`ds_seg.models.pretrained.load_state_dict_into`."""
    from ..models.pretrained import load_state_dict_into
    return load_state_dict_into(model, state_dict, adapt=adapt, gather=backend_class(spec.backend).gather)


def build_backend(spec, model, optim_cfg=None, unused_parameters=()) -> Backend:
    """``unused_parameters``: names of trained parameters the model's forward does not use (the
    trainer's meta-device check): DDP must be told to look for them (DeepSpeed finds them itself)."""
    return backend_class(spec.backend)(model, spec, optim_cfg, unused_parameters=unused_parameters)
