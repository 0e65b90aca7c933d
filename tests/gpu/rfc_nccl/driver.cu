// Two NCCL ranks on one GPU in one process (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1), driving the
// cases of tests/gpu/rfc_nccl/run.sh through whatever profiler plugin NCCL_PROFILER_PLUGIN names.
//   driver eager ROUNDS                   ROUNDS x (all-reduce, all-gather, reduce-scatter), sizes cycling
//   driver graph OPS REPLAYS SYNC EAGER   a graph of OPS mixed collectives, REPLAYS launches; SYNC=1:
//                                         synchronize after each replay; EAGER: eager collectives between
//   driver cost OPS BYTES REPLAYS         a graph of OPS all-reduces of BYTES; prints the best replay's
//                                         microseconds per all-reduce
// Every case prints one line "ops=<per rank> ..." for the checker.
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); exit(2); } } while (0)
#define NK(x) do { ncclResult_t res_ = (x); if (res_ != ncclSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, ncclGetErrorString(res_)); exit(3); } } while (0)

static const int R = 2;
static ncclComm_t comms[R];
static cudaStream_t streams[R];
static float* sendbuf[R];
static float* recvbuf[R];
static const size_t MAX_BYTES = 16u << 20;
static const size_t SIZES[] = {8, 1024, 64u << 10, 1u << 20, 16u << 20};
static const int NSIZES = sizeof(SIZES) / sizeof(SIZES[0]);

enum Coll { ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER };

// One collective on both ranks (a group: the two ranks live in this one thread).
static void launch(Coll c, size_t bytes) {
    size_t n = bytes / sizeof(float);
    if (n < R) n = R;
    NK(ncclGroupStart());
    for (int r = 0; r < R; r++) {
        switch (c) {
        case ALL_REDUCE:
            NK(ncclAllReduce(sendbuf[r], recvbuf[r], n, ncclFloat32, ncclSum, comms[r], streams[r]));
            break;
        case ALL_GATHER:
            NK(ncclAllGather(sendbuf[r], recvbuf[r], n / R, ncclFloat32, comms[r], streams[r]));
            break;
        case REDUCE_SCATTER:
            NK(ncclReduceScatter(sendbuf[r], recvbuf[r], n / R, ncclFloat32, ncclSum, comms[r], streams[r]));
            break;
        }
    }
    NK(ncclGroupEnd());
}

static void sync_all() {
    for (int r = 0; r < R; r++) CK(cudaStreamSynchronize(streams[r]));
}

// Captures `body` on rank 0's stream with rank 1's stream joined in through events.
template <class F> static cudaGraphExec_t capture(F body) {
    cudaEvent_t fork, join;
    CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    CK(cudaStreamBeginCapture(streams[0], cudaStreamCaptureModeGlobal));
    CK(cudaEventRecord(fork, streams[0]));
    CK(cudaStreamWaitEvent(streams[1], fork, 0));
    body();
    CK(cudaEventRecord(join, streams[1]));
    CK(cudaStreamWaitEvent(streams[0], join, 0));
    cudaGraph_t g;
    CK(cudaStreamEndCapture(streams[0], &g));
    cudaGraphExec_t exec;
    CK(cudaGraphInstantiate(&exec, g, 0));
    CK(cudaGraphDestroy(g));
    return exec;
}

// Before ncclCommDestroy: a graph holds references to the communicators' resources. Without this,
// every graph case hung after its last replay on NCCL 2.30.7 (2026-12-04), with or without a plugin.
static void destroy(cudaGraphExec_t exec) {
    sync_all();
    CK(cudaGraphExecDestroy(exec));
}

// A teardown that hangs costs TEARDOWN_S seconds (default 10), not the case's whole time limit: the
// ops line is already out, and the plugin has forwarded everything (the daemon drains at exit).
static void teardown_hung(int) {
    static const char msg[] = "driver: teardown hung, exiting\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(9);
}

int main(int argc, char** argv) {
    if (argc < 2) { fprintf(stderr, "usage: driver eager|graph|cost ...\n"); return 1; }
    int devs[R] = {0, 0};
    NK(ncclCommInitAll(comms, R, devs));
    fprintf(stderr, "driver: communicators ready\n");  // progress on stderr (unbuffered): where a hang is
    for (int r = 0; r < R; r++) {
        CK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
        CK(cudaMalloc(&sendbuf[r], MAX_BYTES));
        CK(cudaMalloc(&recvbuf[r], MAX_BYTES));
        CK(cudaMemset(sendbuf[r], 0, MAX_BYTES));
    }
    const char* mode = argv[1];
    if (!strcmp(mode, "eager") && argc == 3) {
        int rounds = atoi(argv[2]);
        for (int i = 0; i < rounds; i++) {
            for (int c = 0; c < 3; c++) launch((Coll)c, SIZES[(i + c) % NSIZES]);
            sync_all();
        }
        printf("ops=%d\n", rounds * 3);
    } else if (!strcmp(mode, "graph") && argc == 6) {
        int ops = atoi(argv[2]), replays = atoi(argv[3]), sync = atoi(argv[4]), eager = atoi(argv[5]);
        // Deterministic mix: the same graph in every run.
        unsigned x = 12345;
        auto next = [&]() { x = x * 1103515245u + 12345u; return (x >> 16) & 0x7fff; };
        std::vector<std::pair<Coll, size_t>> plan;
        for (int i = 0; i < ops; i++) plan.push_back({(Coll)(next() % 3), SIZES[next() % NSIZES]});
        for (int i = 0; i < 4; i++) launch(ALL_REDUCE, SIZES[i % NSIZES]);
        sync_all();
        cudaGraphExec_t exec = capture([&] { for (auto& p : plan) launch(p.first, p.second); });
        fprintf(stderr, "driver: captured\n");
        int eager_ops = 4;
        for (int r = 0; r < replays; r++) {
            CK(cudaGraphLaunch(exec, streams[0]));
            if (sync) CK(cudaStreamSynchronize(streams[0]));
            if (r + 1 < replays)
                for (int e = 0; e < eager; e++, eager_ops++) launch((Coll)(e % 3), SIZES[e % NSIZES]);
        }
        sync_all();
        fprintf(stderr, "driver: replays done\n");
        destroy(exec);
        printf("ops=%d eager=%d captured=%d replays=%d\n", eager_ops + ops * replays, eager_ops, ops, replays);
    } else if (!strcmp(mode, "cost") && argc == 5) {
        int ops = atoi(argv[2]), replays = atoi(argv[4]);
        size_t bytes = strtoull(argv[3], nullptr, 10);
        cudaGraphExec_t exec = capture([&] { for (int i = 0; i < ops; i++) launch(ALL_REDUCE, bytes); });
        fprintf(stderr, "driver: captured\n");
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        CK(cudaGraphLaunch(exec, streams[0]));  // warm-up
        CK(cudaStreamSynchronize(streams[0]));
        float best = 1e30f;
        for (int r = 0; r < replays; r++) {
            CK(cudaEventRecord(a, streams[0]));
            CK(cudaGraphLaunch(exec, streams[0]));
            CK(cudaEventRecord(b, streams[0]));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            if (ms < best) best = ms;
        }
        destroy(exec);
        printf("ops=%d us_per_op=%.3f\n", ops * (replays + 1), best * 1000.0f / ops);
    } else {
        fprintf(stderr, "bad arguments\n");
        return 1;
    }
    fflush(stdout);
    signal(SIGALRM, teardown_hung);
    alarm(getenv("TEARDOWN_S") ? atoi(getenv("TEARDOWN_S")) : 10);
    // Both ranks live in this thread: finalize them in one group, then destroy.
    ncclResult_t fin = ncclGroupStart();
    for (int r = 0; r < R && fin == ncclSuccess; r++) fin = ncclCommFinalize(comms[r]);
    ncclResult_t end = ncclGroupEnd();
    if (fin != ncclSuccess || end != ncclSuccess)
        fprintf(stderr, "driver: grouped finalize: %s / %s\n", ncclGetErrorString(fin), ncclGetErrorString(end));
    for (int r = 0; r < R; r++) NK(ncclCommDestroy(comms[r]));
    fprintf(stderr, "driver: communicators destroyed\n");
    return 0;
}
