"""All-reduce latency and bus bandwidth, one process per GPU, through PyTorch's NCCL (torch.distributed).

Each size is timed as CUDA-graph replays of K back-to-back all-reduces (best of 5 replays), so host launch
noise stays out of the small sizes. Rank 0 writes one JSON line per size to --out:
{"bytes", "us", "busbw_gbs"}; busBW = bytes / time * 2(n-1)/n (NCCL's and NCCL Inspector's definition).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sizes(lo: int, hi: int):
    s = lo
    while s <= hi:
        yield s
        s *= 4


def worker(rank: int, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=args.ranks,
        device_id=torch.device("cuda", rank),
    )
    n = args.ranks
    out = open(args.out, "w") if rank == 0 else None
    stream = torch.cuda.Stream()
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
        k = 20 if nbytes <= (16 << 20) else 5
        with torch.cuda.stream(stream):  # warm-up outside the graph, on the capture stream
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(k):
                dist.all_reduce(x)
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / k)  # us per all-reduce
        # Correctness: one eager all-reduce of ones gives n everywhere... after the replays x holds n**(1+3+5k).
        y = torch.ones(4, device="cuda")
        dist.all_reduce(y)
        assert float(y[0]) == n, f"all-reduce gave {float(y[0])}, expected {n}"
        if out:
            real = x.numel() * 4
            busbw = real / (best * 1e-6) / 1e9 * (2 * (n - 1) / n if n > 1 else 1)
            out.write(json.dumps({"bytes": real, "us": best, "busbw_gbs": busbw}) + "\n")
            out.flush()
        del graph
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=8)
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--port", type=int, default=29511)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    mp.spawn(worker, args=(args,), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
