"""Run a function on N real processes (gloo, CPU) and bring their results or tracebacks back.

    def _fn(tmp):           # module-level, so it can be pickled for spawned processes
        ...
        return value        # any picklable value, collected per rank
    results = run_on_ranks(_fn, world_size=2, args=(tmp_path,))

Each rank is a new process with RANK/WORLD_SIZE/LOCAL_RANK set, the caller's environment and a file://
rendezvous in a private temp dir, so concurrent test runs never fight over a port. A rank that
raises fails the test with its traceback; a run that exceeds ``timeout`` is killed and fails.
"""
import multiprocessing as mp
import os
import pickle
import tempfile
import traceback

# On CPU, ranks are forked from a server that imported these once (multiprocessing's forkserver):
# a fresh interpreter spends 5-7 s of CPU per rank importing torch and DeepSpeed, and
# deepspeed.initialize another 1-2 s importing torch._dynamo (torch.optim's first optimizer):
# most of a short run on 2 cores. ds_seg comes before DeepSpeed, as in a launched rank: its import
# puts the stand-ins for DeepSpeed's Muon modules in place (ds_workarounds), which the ranks then
# use as launch/train.py's do. The server starts no thread (checked: one), so a
# fork of it is as clean as a new interpreter. With a GPU, DeepSpeed's import probes CUDA, which
# a fork must not inherit: a fresh interpreter per rank (spawn) there.
_PRELOAD = ['torch', 'torch.distributed', 'torch._dynamo', 'ds_seg', 'deepspeed', 'ds_seg.engine.trainer']


def _context():
    import torch
    if torch.cuda.is_available():
        return mp.get_context('spawn')
    ctx = mp.get_context('forkserver')
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(fn, args, rank, world_size, init_file, queue, env):
    os.environ.clear()      # the caller's environment now, not the fork server's at its start
    os.environ.update(env)
    os.environ.update({'RANK': str(rank), 'WORLD_SIZE': str(world_size), 'LOCAL_RANK': str(rank),
                       'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '0',
                       'DS_SEG_INIT_METHOD': f'file://{init_file}', 'OMP_NUM_THREADS': '1'})
    try:
        import torch
        torch.set_num_threads(1)
        # Plain pickle bytes: torch's queue pickler would pass tensors as shared-memory handles
        # that vanish when this process exits before the parent reads them.
        queue.put((rank, 'ok', pickle.dumps(fn(*args))))
    except BaseException:  # noqa: B902 -- report everything, including SystemExit
        queue.put((rank, 'error', traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_on_ranks(fn, world_size=2, args=(), timeout=240, env=None):
    """Run ``fn(*args)`` on ``world_size`` processes; return the list of results by rank."""
    ctx = _context()
    env = {**os.environ, **(env or {})}
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, 'rendezvous')
        procs = [ctx.Process(target=_child, args=(fn, args, r, world_size, init_file, queue, env),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()
        results, errors = {}, {}
        import queue as queue_mod
        import time
        deadline = time.time() + timeout
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.time()
            if remaining <= 0:
                break
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    # a rank died without reporting (e.g. killed); give the others a moment
                    time.sleep(1.0)
                    if queue.empty():
                        break
                continue
            if status == 'ok':
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            raise AssertionError('\n'.join(f'--- rank {r} failed ---\n{tb}' for r, tb in sorted(errors.items())))
        if len(results) < world_size:
            missing = sorted(set(range(world_size)) - set(results))
            codes = {r: procs[r].exitcode for r in missing}
            raise AssertionError(f'ranks {missing} did not finish within {timeout}s (exit codes {codes})')
        return [results[r] for r in range(world_size)]
