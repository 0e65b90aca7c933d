"""One-rank PyTorch NCCL job for the GPU machine: init_process_group("nccl", world_size=1), a few
all-reduces, destroy. Run by torch_nccl_one_rank.sh with NCCL_PROFILER_PLUGIN pointing at the plugin."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist


def main() -> int:
    steps = int(os.environ.get("STEPS", "20"))
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl {torch.cuda.nccl.version()}", flush=True)
    torch.cuda.set_device(0)
    store = os.path.join(tempfile.mkdtemp(prefix="ncclscope-store-"), "store")
    try:  # device_id (torch >= 2.3) creates the NCCL communicator now instead of at the first collective
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
    except TypeError:
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(steps):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    value = x[0].item()
    print(f"all_reduce x{steps}: x[0] = {value}", flush=True)
    dist.destroy_process_group()
    print("destroyed the process group", flush=True)
    return 0 if value == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
