"""Train a segmentation model with DeepSpeed (or plain DDP for comparison).

    deepspeed launch/train.py --deepspeed_config ds_configs/zero2.json
    ds-seg-train --deepspeed_config zero3 --config unet_tiny_synthetic   # shipped names, any directory
    torchrun --nproc_per_node 2 launch/train.py --config configs/unet_synthetic.py
    python launch/train.py --backend ddp --cfg-options train.max_steps=20
    srun python launch/train.py ...            # Slurm: SLURM_* variables are enough
"""
import argparse
import os
import sys

from ds_seg.inputs import user_path
from ds_seg.cli import OneLineParser, exit_without_finalization, outlive_stdout, say_once_per_node
from ds_seg.config import (ConfigError, DS_CONFIGS_DIR, SBATCH_DIR, SBATCH_TEMPLATES, find_shipped, load_config,
                           load_ds_config)
from ds_seg.engine.faults import EXIT_INTERRUPTED
from ds_seg.registry import RegistryError


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', type=user_path, default=None, help='experiment config: a path, or the name of a shipped one '
                        '(unet_tiny_synthetic); default: the embedded synthetic-aerial UNet experiment')
    parser.add_argument('--deepspeed_config', '--deepspeed-config', type=user_path, dest='deepspeed_config',
                        default=str(DS_CONFIGS_DIR / 'zero2.json'),
                        help='DeepSpeed JSON (precision, ZeRO stage, optimizer, schedule, micro-batch): a path, '
                        'or the name of a shipped one (zero0 ... zero3_offload); also used by --backend ddp')
    parser.add_argument('--deepspeed', action='store_true', help='accepted for DeepSpeed compatibility')
    parser.add_argument('--backend', choices=['deepspeed', 'ddp'], default='deepspeed')
    parser.add_argument('--cfg-options', '--cfg_options', nargs='+', action='extend', default=[],
                        metavar='KEY=VALUE', help='override config keys, e.g. train.max_steps=20 data.crop_size=256 '
                                                  '(given twice: both sets apply, the later wins on a key)')
    parser.add_argument('--work-dir', '--work_dir', type=user_path, dest='work_dir', default=None)
    parser.add_argument('--resume', type=user_path, default=None,
                        help="'auto' (newest complete checkpoint in the work dir) or a checkpoint path")
    parser.add_argument('--local_rank', '--local-rank', type=int, default=None,
                        help='set by the deepspeed launcher; the LOCAL_RANK variable is what is used')
    parser.add_argument('--sbatch-template', nargs='?', const='one-node', choices=sorted(SBATCH_TEMPLATES),
                        help='print the Slurm batch script (one-node: one process per GPU started by the script; '
                        'multinode: one srun task per GPU) to fill in and submit, and exit: '
                        'ds-seg-train --sbatch-template > train.sbatch')
    return parser.parse_args(argv)


def _shown(path):
    """A path as messages show it: relative where it is under the current folder."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith('..') else rel


def _worker_message(exc):
    """The message a DataLoader worker's exception was raised with: the main process gets it
    wrapped in the worker's traceback text ("Caught DataError in DataLoader worker ...")."""
    text = str(exc)
    if text.startswith('Caught ') and '\nOriginal ' in text:
        # The worker's formatted traceback: its exception's line is the last that starts with
        # the exception's name (a chained cause's lines come first; the message may end in a newline).
        name = f'{type(exc).__module__}.{type(exc).__qualname__}: '
        lines = [line for line in text.splitlines() if line.startswith(name)]
        text = lines[-1][len(name):] if lines else text.strip().splitlines()[-1].split(': ', 1)[-1]
    return text.strip()


def main(argv=None):
    as_program = argv is None  # not a call from Python: this process's signal handling is ours
    if as_program:  # a stop signal during start-up is kept, not fatal
        from ds_seg import distributed
        outlive_stdout()   # `| head`, a full disk under `> log`: the run goes on (before DeepSpeed's logger takes stdout)
        from ds_seg.stop_signals import catch_stop_signals, interrupted_during_imports
        catch_stop_signals()
        distributed.EXIT_ON_CTRL_C_WHILE_WAITING = True
        if interrupted_during_imports():
            say_once_per_node('ds_seg: interrupted (Ctrl-C) before training started')
            exit_without_finalization(EXIT_INTERRUPTED)
    status = _train(argv, as_program)
    if as_program:
        exit_without_finalization(status)
    return status


def _close_without_the_process_group(trainer):
    """What trainer.close() does that waits on no other rank, before an os._exit that skips it:
    the tracker runs end (FAILED, not RUNNING for ever) and the work-dir lock is released (a
    stale one was only taken over by the next run)."""
    trainer.log.close(trainer.exit_reason)
    trainer.lock.release()


def _train(argv, as_program):
    args = parse_args(argv)
    if args.sbatch_template:  # an installed wheel has no launch/slurm/ to copy them from
        sys.stdout.write((SBATCH_DIR / SBATCH_TEMPLATES[args.sbatch_template]).read_text())
        return 0
    try:
        for option, value in (('--work-dir', args.work_dir), ('--resume', args.resume), ('--config', args.config),
                              ('--deepspeed_config', args.deepspeed_config)):
            if value is not None and not value.strip():  # '' became the default (a fresh run, the default dir)
                raise ConfigError(f"{option} is empty; give a path, or leave {option} out for its default")
        from ds_seg import distributed
        distributed.check_environment()  # before DeepSpeed's import reads DEEPSPEED_TIMEOUT
        cfg = load_config(args.config, args.cfg_options)
        ds_config = load_ds_config(args.deepspeed_config)
        from ds_seg.engine.trainer import Trainer
        trainer = Trainer(cfg, ds_config, backend=args.backend, work_dir=args.work_dir, resume=args.resume,
                          ds_config_source=_shown(find_shipped(args.deepspeed_config, DS_CONFIGS_DIR, '.json')))
    except (ConfigError, RegistryError, FileNotFoundError, KeyboardInterrupt) as exc:
        # A user mistake (one line that names the file or key) or a Ctrl-C, before any training starts.
        interrupted = isinstance(exc, KeyboardInterrupt)
        say_once_per_node('ds_seg: interrupted (Ctrl-C) before training started' if interrupted
                          else f'ds_seg: error: {exc}')
        if as_program:  # a Python caller keeps its process group (DeepSpeed holds it)
            from ds_seg import distributed
            distributed.close()
        return EXIT_INTERRUPTED if interrupted else 2
    from ds_seg.data.raster import DataError
    from ds_seg.engine.faults import (EXIT_CODES, EXIT_DATA_ERROR, EXIT_IO_ERROR, EXIT_LOST_RANK, LostRankError,
                                      RunIOError, resume_advice)
    try:
        summary = trainer.fit()
    except DataError as exc:
        # A window the start-up checks did not sample. The other ranks wait in a collective for
        # this one: they stop as for a lost rank, and this rank skips the teardown that would wait.
        advice = resume_advice(trainer.checkpointer.last_complete(), 'fix the file')
        print(f'ds_seg: error: {_worker_message(exc)} (at step {trainer.step}; {advice.rstrip(".")})',
              file=sys.stderr, flush=True)
        _close_without_the_process_group(trainer)
        os._exit(EXIT_DATA_ERROR)
    except LostRankError as exc:
        print(f'ds_seg: error: {exc}', file=sys.stderr, flush=True)
        _close_without_the_process_group(trainer)
        os._exit(EXIT_LOST_RANK)  # skip process-group teardown: it would wait on the dead rank
    except RunIOError as exc:
        if trainer.rank == 0:
            print(f'ds_seg: error: {exc}', file=sys.stderr, flush=True)
        return EXIT_IO_ERROR
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop began: the last checkpoint is intact
        if trainer.rank == 0:
            last = trainer.checkpointer.last_complete()
            print(f'ds_seg: interrupted (Ctrl-C) at step {trainer.step}; '
                  + (f'the last complete checkpoint ({last}) is intact: continue with --resume auto'
                     if last else 'no checkpoint was written'), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        if as_program:  # the outcome is decided: a late stop signal must not change the exit status
            from ds_seg.engine.faults import ignore_stop_signals
            ignore_stop_signals()
        trainer.close()
    return EXIT_CODES.get(summary['exit_reason'], 1)


if __name__ == '__main__':
    sys.exit(main())
