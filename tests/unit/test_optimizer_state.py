"""Optimizer state restored into another implementation of the same optimizer: ds_seg picks
torch's fused AdamW or DeepSpeed's FusedAdam by device and install, and ``torch_adam`` may change
between a run and its resume. Real torch optimizers; the DeepSpeed-form state is the one
DeepSpeed's FusedAdam writes (checked by hand against FusedAdam itself: building it here would be
a JIT build)."""
import copy

import torch

from ds_seg.engine.optimizer_state import kept_implementation

GRADS = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([[1.0, 0.25], [-0.5, 3.0]])]


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, 2))]


def _steps(optimizer, params, n):
    for _ in range(n):
        for p, g in zip(params, GRADS):
            p.grad = g.clone()
        optimizer.step()


def _trained(n, **options):
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, **options)
    _steps(optimizer, params, n)
    return params, optimizer


def _as_deepspeed_fused_adam_saves(state_dict):
    """``state_dict`` in the form DeepSpeed's FusedAdam saves: its own group settings, int step
    counts, and the group's count in its last parameter's state only (FusedAdam increments the
    state of the last parameter it visits; the others keep the count they started with)."""
    saved = copy.deepcopy(state_dict)
    for group in saved['param_groups']:
        for key in ('amsgrad', 'maximize', 'foreach', 'capturable', 'differentiable', 'fused',
                    'decoupled_weight_decay'):
            group.pop(key, None)
        group.update(bias_correction=True, step=0)
        for i in group['params']:
            count = int(saved['state'][i]['step'])
            saved['state'][i]['step'] = count if i == group['params'][-1] else 0
    return saved


def test_a_fused_adam_state_resumes_in_torch_adamw_at_the_step_it_reached():
    # Every parameter but the last took step 0 from the saved state: bias correction restarted,
    # and the first resumed step moved them as a first step would.
    expected, _ = _trained(3)
    weights, first = _trained(2)
    saved = _as_deepspeed_fused_adam_saves(first.state_dict())
    params = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    resumed = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01)
    with kept_implementation(resumed):
        resumed.load_state_dict(saved)
    assert [float(s['step']) for s in resumed.state.values()] == [2.0, 2.0]
    _steps(resumed, params, 1)
    for got, want in zip(params, expected):
        assert torch.equal(got, want)


def test_a_resume_keeps_this_runs_implementation_and_the_checkpoints_settings():
    # torch's load_state_dict put the saved groups' fused=None back: a run resumed on a device
    # where ds_seg chose the fused AdamW ran single-tensor while its summary said fused.
    _, first = _trained(2)
    saved = first.state_dict()
    saved['param_groups'][0]['weight_decay'] = 0.05  # a restored setting: the checkpoint's wins
    params = _params()
    resumed = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=True)
    with kept_implementation(resumed):
        resumed.load_state_dict(saved)
    group = resumed.param_groups[0]
    assert group['fused'] is True and group['weight_decay'] == 0.05
    assert [s['step'].dtype for s in resumed.state.values()] == [torch.float32, torch.float32]
    _steps(resumed, params, 1)
    assert [float(s['step']) for s in resumed.state.values()] == [3.0, 3.0]


def test_a_torch_state_keeps_its_own_counts_per_parameter():
    # torch counts each parameter's steps (one without a gradient does not step): kept as saved.
    params = _params()
    optimizer = torch.optim.AdamW(params, lr=0.1)
    _steps(optimizer, params, 2)
    params[1].grad = None
    params[0].grad = GRADS[0].clone()
    optimizer.step()
    again = torch.optim.AdamW(_params(), lr=0.1)
    with kept_implementation(again):
        again.load_state_dict(optimizer.state_dict())
    assert [float(s['step']) for s in again.state.values()] == [3.0, 2.0]
