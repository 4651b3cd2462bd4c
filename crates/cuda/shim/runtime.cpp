// The host launcher: blocks in order on the calling thread, a block's threads as fibers.
// Included by the generated translation unit after the kernels, so the kernel table can refer
// to them (see build.rs).

#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

// Generous for kernels' local arrays; stacks are reserved once per OS thread and reused.
constexpr size_t kStack = 256 * 1024;

struct Barrier {
    unsigned expected = 0;
    unsigned arrived = 0;
    unsigned long long generation = 0;
};

// An asynchronous copy (cp.async) issued and not yet performed; group -1 until committed.
struct PendingCopy {
    void* dst;
    const void* src;
    bool valid;
    long long group;
};

struct Fiber {
    ucontext_t ctx;
    uint3 tid;
    bool done = false;
    Barrier* waiting = nullptr;
    unsigned long long wait_generation = 0;
    // This thread's cp.async copies held back until a wait needs them (g_defer_copies).
    std::vector<PendingCopy> copies;
    long long committed = 0;
};

struct Block {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    Fiber* current = nullptr;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<unsigned long long> warp_slots;  // 32 per warp
    std::vector<unsigned> warp_mma;              // 6 × 32 per warp (the mma emulation)
    std::vector<unsigned char> dynamic_shared;
    // Static shared arrays this block has declared (and filled with NaN bytes).
    std::vector<void*> shared_seen;
    void (*body)(void**) = nullptr;
    void** args = nullptr;
};

thread_local Block* g_block = nullptr;
// Run a block's threads last to first between barriers, and a launch's blocks last to first: a
// kernel that reads shared memory another thread writes without a barrier in between (or global
// memory another block of the launch writes) gets the stale value in one of the two orders, so
// running both catches a missing __syncthreads (or a dependence between blocks).
thread_local bool g_reverse = false;
thread_local std::vector<std::unique_ptr<unsigned char[]>> g_stacks;
// Perform each cp.async copy at the latest moment the PTX contract allows (the wait_group that
// covers its group) instead of at once, its destination NaN until then, so a kernel that reads a
// tile before waiting for it, or refills a stage a warp still reads, reads NaN.
thread_local bool g_defer_copies = false;
// The kernel this OS thread is running, for the fault report (see gany_host_report_faults).
thread_local const char* g_kernel = nullptr;
struct sigaction g_previous_segv;

[[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "cuda host shim: %s (block %u,%u,%u)\n", what, blockIdx.x, blockIdx.y,
                 blockIdx.z);
    std::abort();
}

unsigned linear_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

void fiber_main() {
    Block* b = g_block;
    b->body(b->args);
    b->current->done = true;
    // Returning resumes uc_link, the scheduler.
}

// Arrive at `bar`; unless this is the last arrival, yield until the barrier opens.
void arrive(Barrier& bar) {
    Block* b = g_block;
    if (++bar.arrived == bar.expected) {
        bar.arrived = 0;
        bar.generation++;
        return;
    }
    Fiber* me = b->current;
    me->waiting = &bar;
    me->wait_generation = bar.generation;
    swapcontext(&me->ctx, &b->scheduler);
    // Resumed by the scheduler after the barrier opened; our thread indices were restored.
}

// Out of line: getcontext returns twice, which must not clobber the caller's loop state.
__attribute__((noinline)) void prepare(Block& b, unsigned i) {
    Fiber& f = b.fibers[i];
    f.done = false;
    f.waiting = nullptr;
    // Copies a finished block never waited for never land, as on the device.
    f.copies.clear();
    f.committed = 0;
    f.tid = {i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks[i].get();
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &b.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
}

void run_block(Block& b, unsigned nthreads) {
    for (unsigned i = 0; i < nthreads; i++) prepare(b, i);
    unsigned left = nthreads;
    while (left > 0) {
        bool progressed = false;
        for (unsigned n = 0; n < nthreads; n++) {
            Fiber& f = b.fibers[g_reverse ? nthreads - 1 - n : n];
            if (f.done) continue;
            if (f.waiting && f.waiting->generation == f.wait_generation) continue;
            f.waiting = nullptr;
            threadIdx = f.tid;
            b.current = &f;
            swapcontext(&b.scheduler, &f.ctx);
            progressed = true;
            if (f.done) left--;
        }
        if (!progressed) {
            fail("deadlock: threads wait at a barrier that others never reach "
                 "(a __syncthreads or shuffle under divergent control flow, or an early return)");
        }
    }
}

}  // namespace

extern "C" void gany_syncthreads() {
    if (!g_block) fail("__syncthreads outside a launch");
    arrive(g_block->block_barrier);
}

extern "C" void gany_syncwarp() {
    if (!g_block) fail("warp exchange outside a launch");
    arrive(g_block->warp_barriers[linear_tid() / 32]);
}

extern "C" unsigned long long* gany_warp_slots() {
    return g_block->warp_slots.data() + 32 * (linear_tid() / 32);
}

extern "C" unsigned* gany_warp_mma_slots() {
    return g_block->warp_mma.data() + 6 * 32 * (linear_tid() / 32);
}

extern "C" void* gany_dynamic_shared() { return g_block->dynamic_shared.data(); }

extern "C" void gany_shared_begin(void* p, size_t bytes) {
    if (!g_block) fail("a shared array declared outside a launch");
    std::vector<void*>& seen = g_block->shared_seen;
    for (void* q : seen)
        if (q == p) return;
    seen.push_back(p);
    std::memset(p, 0xff, bytes);
}

namespace {
void perform(const PendingCopy& c) {
    if (c.valid) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
}
}  // namespace

extern "C" void gany_cp_async16(void* dst, const void* src, int valid) {
    if (!g_block) fail("cp.async outside a launch");
    // A 16-byte cp.async faults on the device unless both addresses are 16-byte aligned.
    if (((unsigned long long)dst | (unsigned long long)src) % 16 != 0)
        fail("a 16-byte cp.async with an address that is not 16-byte aligned");
    const PendingCopy c{dst, src, valid != 0, -1};
    if (g_defer_copies) {
        // Until the copy completes its destination holds nothing defined: NaN bytes, so a read
        // before the wait (or of a stage already being refilled) cannot pass by finding the
        // same tile left there by an earlier block.
        std::memset(dst, 0xff, 16);
        g_block->current->copies.push_back(c);
    } else {
        perform(c);
    }
}

extern "C" void gany_cp_commit() {
    Fiber* f = g_block->current;
    for (PendingCopy& c : f->copies)
        if (c.group < 0) c.group = f->committed;
    f->committed++;
}

// cp.async.wait_group n: every group but the n most recently committed is complete.
extern "C" void gany_cp_wait(int n) {
    Fiber* f = g_block->current;
    std::vector<PendingCopy> left;
    for (const PendingCopy& c : f->copies) {
        if (c.group >= 0 && c.group < f->committed - n) perform(c);
        else left.push_back(c);
    }
    f->copies.swap(left);
}

namespace {

// Calls a kernel with arguments passed as CUDA's driver API passes them: an array of pointers
// to each argument's value.
template <class... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
void call(void (*kernel)(A...), void** args) {
    call_with(kernel, args, std::index_sequence_for<A...>{});
}

struct Entry {
    const char* name;
    const char* signature;
    void (*call)(void**);
};

#define GANY_KERNEL(name, sig) {#name, sig, [](void** a) { call(&name, a); }},
const Entry kKernels[] = {
#include "kernel_table.inc"
};
#undef GANY_KERNEL

const Entry* find(const char* name) {
    for (const Entry& e : kKernels)
        if (std::strcmp(e.name, name) == 0) return &e;
    return nullptr;
}

// A fault inside a launch (under the bounds check: a kernel that reached an argument's guard
// page) names the kernel before the process dies; any other fault goes to the handler that was
// there before (Rust's stack-overflow report). Only async-signal-safe calls here.
void on_fault(int, siginfo_t* info, void*) {
    const char* kernel = g_kernel;
    if (kernel) {
        char line[256];
        size_t n = 0;
        auto put = [&](const char* s) {
            while (*s && n < sizeof(line) - 1) line[n++] = *s++;
        };
        put("cuda host shim: kernel ");
        put(kernel);
        put(" touched 0x");
        const unsigned long long a = (unsigned long long)info->si_addr;
        for (int shift = 60; shift >= 0; shift -= 4) {
            const char digit[2] = {"0123456789abcdef"[(a >> shift) & 15], 0};
            put(digit);
        }
        put(", outside its arguments' memory\n");
        if (write(STDERR_FILENO, line, n) < 0) {
        }
    }
    // Returning retries the access, which now reaches the previous handler.
    sigaction(SIGSEGV, &g_previous_segv, nullptr);
}

}  // namespace

// Install the fault report (once per process; later calls do nothing).
extern "C" void gany_host_report_faults() {
    static std::atomic<bool> installed{false};
    if (installed.exchange(true)) return;
    struct sigaction sa = {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
}

// Order of a block's threads between barriers on this OS thread: first to last (0) or last to
// first (1).
extern "C" void gany_host_set_reverse(int reverse) { g_reverse = reverse != 0; }

// When cp.async copies land on this OS thread's launches: at issue (0) or at the wait that
// covers them (1).
extern "C" void gany_host_set_defer_copies(int defer) { g_defer_copies = defer != 0; }

// The argument kinds of a kernel, one letter each: p pointer, i int, u unsigned, l long long,
// f float, d double. Null for an unknown name.
extern "C" const char* gany_host_signature(const char* name) {
    const Entry* e = find(name);
    return e ? e->signature : nullptr;
}

// Wide accesses made by kernels launched from this OS thread so far.
extern "C" unsigned long long gany_host_wide_accesses() { return gany_wide_count; }

extern "C" unsigned gany_host_kernel_count() { return sizeof(kKernels) / sizeof(kKernels[0]); }
extern "C" const char* gany_host_kernel_name(unsigned i) { return kKernels[i].name; }

namespace {
int launch_entry(const Entry* e, const unsigned grid[3], const unsigned block[3], size_t shared,
                 void** args);
}  // namespace

// Runs `name` over `grid` blocks of `block` threads with `shared` bytes of dynamic shared
// memory. Returns 0, or 1 for an unknown kernel, 2 for a bad configuration.
extern "C" int gany_host_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                                size_t shared, void** args) {
    const Entry* e = find(name);
    if (!e) return 1;
    return launch_entry(e, grid, block, shared, args);
}

// The table's index of `name`, or -1: what a launcher resolves once per kernel, so that its
// later launches skip the search (gany_host_launch_at).
extern "C" int gany_host_index(const char* name) {
    const Entry* e = find(name);
    return e ? (int)(e - kKernels) : -1;
}

extern "C" const char* gany_host_signature_at(unsigned i) { return kKernels[i].signature; }

// gany_host_launch for the kernel at index `i` of the table; 1 for an index past its end.
extern "C" int gany_host_launch_at(unsigned i, const unsigned grid[3], const unsigned block[3],
                                   size_t shared, void** args) {
    if (i >= sizeof(kKernels) / sizeof(kKernels[0])) return 1;
    return launch_entry(&kKernels[i], grid, block, shared, args);
}

namespace {
int launch_entry(const Entry* e, const unsigned grid[3], const unsigned block[3], size_t shared,
                 void** args) {
    const unsigned nthreads = block[0] * block[1] * block[2];
    // The device's limits: at most 1024 threads (and 64 in z) a block, a grid's y and z at
    // most 65535 and x below 2^31.
    if (nthreads == 0 || nthreads > 1024 || block[2] > 64 || grid[0] == 0 || grid[1] == 0 ||
        grid[2] == 0 || grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535)
        return 2;
    if (g_block) fail("a launch from inside a kernel");
    while (g_stacks.size() < nthreads) g_stacks.emplace_back(new unsigned char[kStack]);
    Block b;
    b.fibers.resize(nthreads);
    b.block_barrier.expected = nthreads;
    const unsigned warps = (nthreads + 31) / 32;
    b.warp_barriers.resize(warps);
    for (unsigned w = 0; w < warps; w++)
        b.warp_barriers[w].expected = w + 1 < warps ? 32 : nthreads - 32 * w;
    b.warp_slots.assign(32 * warps, 0);
    b.warp_mma.assign(6 * 32 * warps, 0);
    b.body = e->call;
    b.args = args;
    blockDim = {block[0], block[1], block[2]};
    gridDim = {grid[0], grid[1], grid[2]};
    g_block = &b;
    g_kernel = e->name;
    // Blocks in order, or last to first under the reversed schedule (see g_reverse).
    const unsigned long long nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    for (unsigned long long n = 0; n < nblocks; n++) {
        const unsigned long long id = g_reverse ? nblocks - 1 - n : n;
        const unsigned x = id % grid[0], y = (id / grid[0]) % grid[1],
                       z = (unsigned)(id / ((unsigned long long)grid[0] * grid[1]));
        blockIdx = {x, y, z};
        // Uninitialised shared memory reads as NaN (0xff bytes), to catch kernels that rely on
        // it being zero or on what an earlier block left.
        b.dynamic_shared.assign(shared, 0xff);
        b.shared_seen.clear();
        run_block(b, nthreads);
    }
    g_block = nullptr;
    g_kernel = nullptr;
    return 0;
}
}  // namespace
