"""PyTorch as users run it: 2 ranks (processes) on the one GPU, torch.distributed over the NCCL that
LD_PRELOAD names (the RFC build), a few eager collectives, then CAPTURED collectives captured with
torch.cuda.graph and replayed REPLAYS times. f32 sum only (the RFC build's kernels). Rank 0 prints one
line "ops=<per rank>" for check.py.

  python3 torch_graphs.py CAPTURED REPLAYS
"""

import faulthandler
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EAGER = 6


def rank_main(rank, store, captured, replays):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", 0))
    x = torch.ones(1 << 18, device="cuda")
    out = torch.empty(2 << 18, device="cuda")
    half = torch.empty(1 << 17, device="cuda")
    calls = [lambda: dist.all_reduce(x),
             lambda: dist.all_gather_into_tensor(out, x),
             lambda: dist.reduce_scatter_tensor(half, x)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph's documentation asks
        for i in range(EAGER):
            calls[i % 3]()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(captured):
            calls[i % 3]()
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
    del g  # before the process group: a live graph holds NCCL's resources, and destroying under it hangs
    torch.cuda.synchronize()
    if rank == 0:
        print(f"torch {torch.__version__} nccl {torch.cuda.nccl.version()} ops={EAGER + captured * replays}",
              flush=True)
    # A teardown that hangs costs 10 s, not the case's time limit; where it hung goes to stderr.
    faulthandler.dump_traceback_later(8)
    threading.Timer(10, lambda: os._exit(9)).start()
    dist.destroy_process_group()
    os._exit(0)


def main():
    captured, replays = int(sys.argv[1]), int(sys.argv[2])
    store = os.path.join(tempfile.mkdtemp(prefix="ncclscope-store-"), "store")
    mp.spawn(rank_main, args=(store, captured, replays), nprocs=2)


if __name__ == "__main__":
    main()
