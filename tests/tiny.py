"""Tiny experiments shared by the distributed and launcher tests."""
import copy
import json
import os
import signal

from ds_seg.config import REPO_ROOT, load_config

TINY_CONFIG = str(REPO_ROOT / 'configs' / 'unet_tiny_synthetic.py')


def tiny_cfg(cache_dir, **train):
    """UNetTiny on 2 small synthetic scenes; every step logged, no eval or checkpoint unless asked."""
    options = [f'data.train.cache_dir={str(cache_dir)!r}', f'data.val.cache_dir={str(cache_dir)!r}',
               'train.log_interval=1', 'train.eval_interval=0', 'train.checkpoint_interval=0',
               'train.warmup_log_steps=0']
    options += [f'train.{k}={v!r}' for k, v in train.items()]
    return load_config(TINY_CONFIG, options)


def ds_config(stage, precision='fp32', micro_batch=2, grad_accum=1, **extra):
    """A shipped DeepSpeed JSON with the test's precision and batch (torch Adam: no JIT build)."""
    name = 'zero3_offload' if stage == 'offload' else f'zero{stage}'
    ds = json.loads((REPO_ROOT / 'ds_configs' / f'{name}.json').read_text())
    ds = copy.deepcopy(ds)
    ds['train_micro_batch_size_per_gpu'] = micro_batch
    ds['gradient_accumulation_steps'] = grad_accum
    ds['optimizer']['params']['torch_adam'] = True
    ds['scheduler']['params']['warmup_num_steps'] = 3
    ds.pop('fp16', None)
    ds.pop('bf16', None)
    if precision == 'fp16':
        ds['fp16'] = {'enabled': True, 'loss_scale': 0, 'initial_scale_power': 16, 'hysteresis': 1}
    elif precision == 'bf16':
        ds['bf16'] = {'enabled': True}
    if stage == 'offload':
        ds['zero_force_ds_cpu_optimizer'] = False
    ds.update(extra)
    return ds


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def logged_losses(work_dir):
    """The loss of every row of ``work_dir/metrics.jsonl``."""
    import os
    return [row['loss'] for row in read_jsonl(os.path.join(work_dir, 'metrics.jsonl'))]


def finished(dataset, index):
    """Sample ``index`` as the model sees it: through the loader's collation and the trainer's
    device step (normalised float32 image, int64 label, flips applied), on the CPU."""
    import torch.utils.data
    from ds_seg.data import BatchPreprocessor
    batch = torch.utils.data.default_collate([dataset[index]])
    image, label = BatchPreprocessor.for_dataset(dataset)(batch, 'cpu')
    return image[0], label[0]


def argparse_refusal(main, argv, capsys):
    """``(exit status, stderr)`` of a command's ``main(argv)`` that argparse stops (SystemExit)."""
    import pytest
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, capsys.readouterr().err


def signal_at_step(trainer, step, signum=signal.SIGUSR1):
    """This process receives ``signum`` as ``trainer`` starts its step ``step`` (1-based): a
    scheduler's signal in the middle of a real run, at a step the test decides."""
    real_step = trainer.train_step

    def train_step(want_grad_norm=False):
        if trainer.step + 1 == step:
            os.kill(os.getpid(), signum)   # the handler has run when os.kill returns
        return real_step(want_grad_norm=want_grad_norm)
    trainer.train_step = train_step


def fit_and_close(trainer):
    """``trainer.fit()``'s summary; the trainer is closed whatever happens."""
    try:
        return trainer.fit()
    finally:
        trainer.close()
