"""Pipeline-parallel and MoE traffic as PyTorch runs it: 2 ranks (processes) on the one GPU over the NCCL
that LD_PRELOAD names (the RFC build), STEPS eager steps (on a side stream, as torch.cuda.graph's
documentation asks of a warm-up), then one step captured with torch.cuda.graph and replayed REPLAYS times.

  a2a   MoE: per step an all-gather on the default group, then on a second group (new_group: an NCCL comm
        split) an all_to_all_single of the tokens and an all-reduce
  pp    pipeline parallelism, 2 stages: per step MICRO micro-batches, each a batch_isend_irecv of the
        activations forward (stage 0 -> 1) with the previous micro-batch's gradients backward, every
        batch in flight until the step's end, then an all-reduce of the loss on the same group

Sizes alternate between steps (small: LL; large: SIMPLE); f32 only (the RFC build's kernels). Each rank
prints one line, "rank=R <what>=<count> ...", the operations it ran per (function, peer): check.py
compares what the daemon delivered with it.

  python3 torch_p2p.py MODE STEPS REPLAYS
"""

import collections
import faulthandler
import os
import sys
import tempfile
import threading

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICRO = 4
SIZES = (1 << 10, 1 << 18)  # f32 elements: 4 KiB and 1 MiB


class Step:
    """One training step's communication; `calls` counts what it ran per (function, peer)."""

    def __init__(self, mode, rank, size, calls):
        self.mode, self.rank, self.peer, self.calls = mode, rank, 1 - rank, calls
        self.x = torch.ones(size, device="cuda")
        self.out = torch.empty(2 * size, device="cuda")
        self.a2a_out = torch.empty(size, device="cuda")
        self.act = [torch.ones(size, device="cuda") for _ in range(MICRO)]
        self.grad = [torch.ones(size, device="cuda") for _ in range(MICRO)]
        self.loss = torch.ones(1, device="cuda")

    def run(self, group2):
        if self.mode == "a2a":
            dist.all_gather_into_tensor(self.out, self.x)
            self.calls["AllGather"] += 1
            dist.all_to_all_single(self.a2a_out, self.x, group=group2)
            for r in range(2):  # NCCL's grouped send/recv to every rank, itself included
                self.calls[f"Send:{r}"] += 1
                self.calls[f"Recv:{r}"] += 1
            dist.all_reduce(self.x, group=group2)
            self.calls["AllReduce"] += 1
            return
        works = []
        for m in range(MICRO + 1):
            ops = []
            if m < MICRO:  # activations forward
                ops.append(dist.P2POp(dist.isend if self.rank == 0 else dist.irecv, self.act[m], self.peer))
            if m > 0:  # the previous micro-batch's gradients backward
                ops.append(dist.P2POp(dist.irecv if self.rank == 0 else dist.isend, self.grad[m - 1],
                                      self.peer))
            for op in ops:
                self.calls[f"{'Send' if op.op is dist.isend else 'Recv'}:{self.peer}"] += 1
            works += dist.batch_isend_irecv(ops)
            self.x.mul_(1.0001)  # compute while the transfers are in flight
        for w in works:
            w.wait()
        dist.all_reduce(self.loss)
        self.calls["AllReduce"] += 1


def rank_main(rank, store, mode, steps, replays):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", 0))
    group2 = dist.new_group([0, 1]) if mode == "a2a" else None
    calls = collections.Counter()
    eager = [Step(mode, rank, SIZES[i % 2], calls) for i in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(steps):
            eager[i % 2].run(group2)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    captured = collections.Counter()
    step = Step(mode, rank, SIZES[1], captured)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step.run(group2)
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
    for k, n in captured.items():
        calls[k] += n * replays
    del g  # before the process group: a live graph holds NCCL's resources, and destroying under it hangs
    torch.cuda.synchronize()
    counts = " ".join(f"{k}={n}" for k, n in sorted(calls.items()))
    print(f"rank={rank} {counts} torch={torch.__version__} nccl={torch.cuda.nccl.version()}", flush=True)
    faulthandler.dump_traceback_later(8)
    threading.Timer(10, lambda: os._exit(9)).start()
    dist.destroy_process_group()
    os._exit(0)


def main():
    mode, steps, replays = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = os.path.join(tempfile.mkdtemp(prefix="ncclscope-store-"), "store")
    mp.spawn(rank_main, args=(store, mode, steps, replays), nprocs=2)


if __name__ == "__main__":
    main()
