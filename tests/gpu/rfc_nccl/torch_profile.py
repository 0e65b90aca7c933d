"""The job-trace case of issue 38: PyTorch's profiler (CPU + CUDA, Kineto/CUPTI) around STEPS training
steps of a 2-process FSDP-style loop over the NCCL that LD_PRELOAD names (the RFC build), one GPU.
Per step on a second group (new_group: an NCCL comm split) async all-gathers of the parameters and
reduce-scatters of the gradients, small and large, and an all-reduce of the loss on the default group.
Steps run unprofiled for WARMUP seconds first, so the profiled ones lie past the plugin's first calibrations.
Each rank writes its trace to OUTDIR/rankR.pt.trace.json and prints "rank=R trace=PATH"; run.sh merges each with `ncclscope export --merge` and check.py checks the alignment.

  python3 torch_profile.py OUTDIR STEPS WARMUP
"""

import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1 << 12, 1 << 20)  # f32 elements per shard: 16 KiB (LL, ~25 us) and 4 MiB (SIMPLE)


def step(group2, shards, fulls, loss):
    works = []
    for shard, full in zip(shards, fulls):
        works.append(dist.all_gather_into_tensor(full, shard, group=group2, async_op=True))
    for shard, full in zip(shards, fulls):
        works.append(dist.reduce_scatter_tensor(shard, full, group=group2, async_op=True))
    for w in works:
        w.wait()
    dist.all_reduce(loss)


def rank_main(rank, store, outdir, steps, warmup):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", 0))
    group2 = dist.new_group([0, 1])
    shards = [torch.ones(n, device="cuda") for n in SIZES]
    fulls = [torch.empty(2 * n, device="cuda") for n in SIZES]
    loss = torch.ones(1, device="cuda")
    until = time.monotonic() + warmup
    while time.monotonic() < until:
        step(group2, shards, fulls, loss)
        torch.cuda.synchronize()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            step(group2, shards, fulls, loss)
        torch.cuda.synchronize()
    path = os.path.join(outdir, f"rank{rank}.pt.trace.json")
    prof.export_chrome_trace(path)
    print(f"rank={rank} trace={path} torch={torch.__version__}", flush=True)
    dist.barrier()  # both traces written before either process ends
    # The traces are written: a teardown that hangs must not fail the case (mp.spawn would end the
    # other process when one exits non-zero).
    threading.Timer(10, lambda: os._exit(0)).start()
    dist.destroy_process_group()
    os._exit(0)


def main():
    outdir, steps, warmup = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    os.makedirs(outdir, exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(prefix="ncclscope-store-"), "store")
    mp.spawn(rank_main, args=(store, outdir, steps, warmup), nprocs=2)


if __name__ == "__main__":
    main()
