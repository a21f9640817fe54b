/*
 * CUDA kernels of the DFlash acceptance step. A row j of a request's verify logits is reduced to t_j by one
 * thread block (a parallel argmax over the vocabulary with torch's first-index tie-break); then the request's
 * outputs come from the shared per-request logic (dflash_accept_logic.h). Two schedules (DFlashAcceptSchedule):
 *
 * - rows in parallel: one block per row of every request, each writing its t_j into committedTokens (the
 *   request's K+1 output slots, used as scratch), then one thread per request runs dflash_write_request over
 *   them in place. A step costs about one row's reduction; every row is read. Draft trees the same way: every
 *   node's t into a workspace, then one thread per request walks its tree (dflash_tree_path) over them.
 * - per request: one block per request reduces rows j = 0, 1, ... in turn and stops at the first row whose
 *   token does not match the next draft (rows after it cannot change the result), so a request reads
 *   (accepted + 1) rows, not K + 1, but they take turns: on the first GPU run (H100, V 151,936, bf16) a batch
 *   of 1 with all 15 drafts accepted took 435 us this way against 83 us for torch's ops. Trees: one block per
 *   request walks its path, reducing each node's row as it reaches it.
 */
#include "dflash_accept_kernel.h"
#include "dflash_accept_logic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>

namespace trtllm_dflash
{
namespace
{

constexpr int32_t kThreadsPerBlock = 512;
constexpr int32_t kWarpSize = 32;
constexpr int32_t kLoadsInFlight = 4;      // per thread, in a row's reduction
constexpr int32_t kFinishThreads = 128;    // requests per block of the rows-in-parallel schedule's second kernel
constexpr uint32_t kFullWarp = 0xffffffffu;

// Logits are widened to float32 before any arithmetic (exact for fp16/bf16), as torch would do after
// `.float()`: the scores of fp16/bf16 logits equal the fp32 reference's on the widened values.
__device__ inline float toFloat(float x)
{
    return x;
}

__device__ inline float toFloat(__half x)
{
    return __half2float(x);
}

__device__ inline float toFloat(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

__device__ inline void keepBetter(float& bestValue, int32_t& bestIndex, float value, int32_t index)
{
    if (dflash_prefer(value, index, bestValue, bestIndex))
    {
        bestValue = value;
        bestIndex = index;
    }
}

__device__ inline void warpArgmax(float& bestValue, int32_t& bestIndex)
{
    for (int32_t offset = kWarpSize / 2; offset > 0; offset /= 2)
    {
        float const value = __shfl_down_sync(kFullWarp, bestValue, offset);
        int32_t const index = __shfl_down_sync(kFullWarp, bestIndex, offset);
        keepBetter(bestValue, bestIndex, value, index);
    }
}

// t_j of one row, written to *result (shared memory) and returned to every thread of the block. Must be called by
// all threads (it synchronizes).
template <typename T>
__device__ int32_t blockRowArgmax(T const* __restrict__ logits, float const* __restrict__ noise, int32_t vocabSize,
    float temperature, int32_t* result)
{
    __shared__ float warpValues[kThreadsPerBlock / kWarpSize];
    __shared__ int32_t warpIndices[kThreadsPerBlock / kWarpSize];
    bool const sampled = dflash_is_sampled(temperature);
    float bestValue = 0.0f;
    int32_t bestIndex = kDFlashNoIndex;
    // Each thread visits v, v + 512, v + 1024, ... in increasing order (the order host_reference.cpp's
    // dflash_row_argmax_tree_host emulates; dflash_prefer's order is total anyway). kLoadsInFlight of them are
    // loaded before any is compared, so that a thread has that many loads in flight instead of one.
    int32_t v = threadIdx.x;
    for (; static_cast<int64_t>(v) + (kLoadsInFlight - 1) * kThreadsPerBlock < vocabSize;
         v += kLoadsInFlight * kThreadsPerBlock)
    {
        float x[kLoadsInFlight];
        float n[kLoadsInFlight];
#pragma unroll
        for (int32_t u = 0; u < kLoadsInFlight; ++u)
        {
            x[u] = toFloat(logits[v + u * kThreadsPerBlock]);
            n[u] = sampled ? noise[v + u * kThreadsPerBlock] : 0.0f;
        }
#pragma unroll
        for (int32_t u = 0; u < kLoadsInFlight; ++u)
        {
            keepBetter(bestValue, bestIndex, dflash_score(x[u], temperature, n[u]), v + u * kThreadsPerBlock);
        }
    }
    for (; v < vocabSize; v += kThreadsPerBlock)
    {
        float const n = sampled ? noise[v] : 0.0f;
        keepBetter(bestValue, bestIndex, dflash_score(toFloat(logits[v]), temperature, n), v);
    }
    warpArgmax(bestValue, bestIndex);

    int32_t const lane = threadIdx.x % kWarpSize;
    int32_t const warp = threadIdx.x / kWarpSize;
    if (lane == 0)
    {
        warpValues[warp] = bestValue;
        warpIndices[warp] = bestIndex;
    }
    __syncthreads();
    if (warp == 0)
    {
        constexpr int32_t kWarps = kThreadsPerBlock / kWarpSize;
        bestValue = lane < kWarps ? warpValues[lane] : 0.0f;
        bestIndex = lane < kWarps ? warpIndices[lane] : kDFlashNoIndex;
        warpArgmax(bestValue, bestIndex);
        if (lane == 0)
        {
            *result = bestIndex;
        }
    }
    // Also orders this row's reads of warpValues before the next row's writes.
    __syncthreads();
    return *result;
}

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock) dflashAcceptKernel(DFlashAcceptParams p)
{
    extern __shared__ int32_t target[]; // [blockSize]: t_0..t_K; rows past the first mismatch stay unset

    int32_t const b = blockIdx.x;
    int32_t const numDrafts = p.blockSize - 1;
    float const temperature = p.temperature[b];
    int32_t const* draft = p.draftTokens + static_cast<int64_t>(b) * numDrafts;
    T const* logits = static_cast<T const*>(p.targetLogits);

    for (int32_t j = 0; j <= numDrafts; ++j)
    {
        int64_t const row = (static_cast<int64_t>(b) * p.blockSize + j) * p.vocabSize;
        int32_t const targetJ
            = blockRowArgmax(logits + row, p.gumbelNoise + row, p.vocabSize, temperature, &target[j]);
        // Every thread read the same targetJ, so the whole block leaves the loop together.
        if (!dflash_draft_continues(draft, numDrafts, j, targetJ))
        {
            break;
        }
    }

    // dflash_accepted_length stops at the row where the loop stopped, so it reads only computed rows.
    int32_t const accepted = dflash_accepted_length(draft, target, numDrafts);
    int32_t const start = p.contextLengths[b];
    int32_t const bonus = target[accepted];
    int64_t const out = static_cast<int64_t>(b) * p.blockSize;
    for (int32_t j = threadIdx.x; j < p.blockSize; j += kThreadsPerBlock)
    {
        p.committedTokens[out + j] = dflash_committed_token(target, accepted, j);
        p.nextBlock[out + j] = dflash_next_block_token(bonus, p.maskTokenId, j);
        p.nextPositions[out + j] = dflash_next_position(start, accepted, j);
    }
    if (threadIdx.x == 0)
    {
        p.accepted[b] = accepted;
        p.newContextLengths[b] = dflash_next_start(start, accepted);
    }
}

// Rows in parallel, first kernel: block r reduces row r of the [B * rowsPerRequest, V] logits to t, into
// targets[r] (a chain: committedTokens; a tree: the workspace).
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock) dflashRowKernel(void const* logits, float const* gumbelNoise,
    float const* temperature, int32_t rowsPerRequest, int32_t vocabSize, int32_t* targets)
{
    __shared__ int32_t target;

    int64_t const row = blockIdx.x;
    int64_t const first = row * vocabSize;
    int32_t const t = blockRowArgmax(static_cast<T const*>(logits) + first, gumbelNoise + first, vocabSize,
        temperature[row / rowsPerRequest], &target);
    if (threadIdx.x == 0)
    {
        targets[row] = t;
    }
}

// Rows in parallel, second kernel: one thread per request turns its t_0..t_K (in committedTokens) into the
// outputs. dflash_write_request may write committed over target: it reads t_j only at j <= a, which it keeps.
__global__ void __launch_bounds__(kFinishThreads) dflashFinishKernel(DFlashAcceptParams p)
{
    int32_t const b = blockIdx.x * kFinishThreads + threadIdx.x;
    if (b >= p.batchSize)
    {
        return;
    }
    int32_t const numDrafts = p.blockSize - 1;
    int64_t const out = static_cast<int64_t>(b) * p.blockSize;
    dflash_write_request(p.draftTokens + static_cast<int64_t>(b) * numDrafts, p.committedTokens + out, numDrafts,
        p.contextLengths[b], p.maskTokenId, &p.accepted[b], p.committedTokens + out, p.nextBlock + out,
        p.nextPositions + out, &p.newContextLengths[b]);
}

// kAUTO's choice: rows in parallel when every row's block is resident at once (one wave), where a step then costs
// one row's reduction; beyond, the per-request kernel reads fewer rows and is no longer left waiting. How many rows
// are resident at once on a GPU (its multiprocessors times the row kernel's blocks on each) is found on the first
// launch there and kept: it never changes, and the decode path (a launch per step, or its CUDA graph's capture)
// need not query the device every time.
template <typename T>
cudaError_t rowsFitOneWave(int64_t rows, bool& fits)
{
    constexpr int32_t kKnownDevices = 64;
    static std::atomic<int64_t> residentRows[kKnownDevices]{}; // 0: not known yet
    int32_t device = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status != cudaSuccess)
    {
        return status;
    }
    bool const kept = device >= 0 && device < kKnownDevices;
    int64_t resident = kept ? residentRows[device].load(std::memory_order_relaxed) : 0;
    if (resident == 0)
    {
        int32_t multiprocessors = 0;
        int32_t blocksPerMultiprocessor = 0;
        status = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
        if (status == cudaSuccess)
        {
            status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &blocksPerMultiprocessor, dflashRowKernel<T>, kThreadsPerBlock, 0);
        }
        if (status != cudaSuccess)
        {
            return status;
        }
        resident = static_cast<int64_t>(multiprocessors) * blocksPerMultiprocessor;
        if (kept)
        {
            residentRows[device].store(resident, std::memory_order_relaxed);
        }
    }
    fits = rows <= resident;
    return cudaSuccess;
}

// A step under `schedule` (kAUTO: rowsFitOneWave's choice) for a chain's or a tree's params `p`: rows in parallel
// (the row kernel writes each of the B x rowsPerRequest rows' t into `targets`, then `finishKernel` runs one thread
// per request) or `perRequestKernel`, one block per request with `perRequestShared` bytes of shared memory.
template <typename T, typename Params>
cudaError_t launchSchedule(Params const& p, int32_t rowsPerRequest, int32_t* targets, DFlashAcceptSchedule schedule,
    void (*finishKernel)(Params), void (*perRequestKernel)(Params), size_t perRequestShared, cudaStream_t stream)
{
    int64_t const rows = static_cast<int64_t>(p.batchSize) * rowsPerRequest;
    bool rowsInParallel = schedule == DFlashAcceptSchedule::kROWS_IN_PARALLEL;
    if (schedule == DFlashAcceptSchedule::kAUTO)
    {
        cudaError_t const status = rowsFitOneWave<T>(rows, rowsInParallel);
        if (status != cudaSuccess)
        {
            return status;
        }
    }
    if (rowsInParallel && rows <= INT32_MAX)
    {
        dflashRowKernel<T><<<static_cast<uint32_t>(rows), kThreadsPerBlock, 0, stream>>>(
            p.targetLogits, p.gumbelNoise, p.temperature, rowsPerRequest, p.vocabSize, targets);
        cudaError_t const status = cudaGetLastError();
        if (status != cudaSuccess)
        {
            return status;
        }
        uint32_t const finishBlocks = static_cast<uint32_t>((p.batchSize + kFinishThreads - 1) / kFinishThreads);
        finishKernel<<<finishBlocks, kFinishThreads, 0, stream>>>(p);
        return cudaGetLastError();
    }
    perRequestKernel<<<p.batchSize, kThreadsPerBlock, perRequestShared, stream>>>(p);
    return cudaGetLastError();
}

// Draft trees: the block walks the tree from node 0, reducing the current node's row to t and stepping to the
// child whose token is t (every thread finds the same child), so a request costs (path length) rows.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock) dflashTreeAcceptKernel(DFlashTreeAcceptParams p)
{
    __shared__ int32_t target;

    int32_t const b = blockIdx.x;
    int64_t const first = static_cast<int64_t>(b) * p.numNodes;
    float const temperature = p.temperature[b];
    T const* logits = static_cast<T const*>(p.targetLogits);
    auto targetAt = [&](int32_t node) {
        int64_t const row = (first + node) * p.vocabSize;
        return blockRowArgmax(logits + row, p.gumbelNoise + row, p.vocabSize, temperature, &target);
    };
    // Every thread runs the walk (the reductions synchronize the block; the path's writes are the same values).
    int32_t bonus = 0;
    int32_t const n = dflash_tree_path(p.parents + first, p.tokens + first, p.numNodes, targetAt,
        p.pathNodes + first, &bonus);
    if (threadIdx.x == 0)
    {
        p.pathLength[b] = n;
        p.bonus[b] = bonus;
    }
}

// Trees, rows in parallel, second kernel: one thread per request walks its tree over the nodes' t in the workspace.
__global__ void __launch_bounds__(kFinishThreads) dflashTreeFinishKernel(DFlashTreeAcceptParams p)
{
    int32_t const b = blockIdx.x * kFinishThreads + threadIdx.x;
    if (b >= p.batchSize)
    {
        return;
    }
    int64_t const first = static_cast<int64_t>(b) * p.numNodes;
    int32_t const* targets = p.targets + first;
    int32_t bonus = 0;
    p.pathLength[b] = dflash_tree_path(p.parents + first, p.tokens + first, p.numNodes,
        [targets](int32_t node) { return targets[node]; }, p.pathNodes + first, &bonus);
    p.bonus[b] = bonus;
}

bool knownSchedule(DFlashAcceptSchedule schedule)
{
    return schedule == DFlashAcceptSchedule::kAUTO || schedule == DFlashAcceptSchedule::kROWS_IN_PARALLEL
        || schedule == DFlashAcceptSchedule::kPER_REQUEST;
}

// launch(T{}) with T the logits' element type.
template <typename Launch>
cudaError_t withLogitsType(DFlashLogitsType type, Launch&& launch)
{
    switch (type)
    {
    case DFlashLogitsType::kFLOAT32: return launch(float{});
    case DFlashLogitsType::kFLOAT16: return launch(__half{});
    case DFlashLogitsType::kBFLOAT16: return launch(__nv_bfloat16{});
    }
    return cudaErrorInvalidValue;
}

} // namespace

cudaError_t launchDFlashTreeAccept(DFlashTreeAcceptParams const& params, cudaStream_t stream)
{
    if (params.batchSize < 0 || params.numNodes < 1 || params.numNodes > kDFlashMaxBlockSize
        || params.vocabSize < 1 || params.vocabSize > kDFlashMaxVocabSize || !knownSchedule(params.schedule)
        || (params.schedule == DFlashAcceptSchedule::kROWS_IN_PARALLEL && params.targets == nullptr))
    {
        return cudaErrorInvalidValue;
    }
    if (params.batchSize == 0)
    {
        return cudaSuccess;
    }
    // Without a workspace only the per-request form can run (kROWS_IN_PARALLEL without one was refused above).
    DFlashAcceptSchedule const schedule
        = params.targets != nullptr ? params.schedule : DFlashAcceptSchedule::kPER_REQUEST;
    return withLogitsType(params.logitsType, [&](auto t) {
        using T = decltype(t);
        return launchSchedule<T>(params, params.numNodes, params.targets, schedule, dflashTreeFinishKernel,
            dflashTreeAcceptKernel<T>, 0, stream);
    });
}

cudaError_t launchDFlashAccept(DFlashAcceptParams const& params, cudaStream_t stream)
{
    static_assert(kDFlashMaxVocabSize <= INT32_MAX - kThreadsPerBlock, "the vocabulary loop would overflow");
    static_assert(kDFlashMaxBlockSize * sizeof(int32_t) <= 48 * 1024, "t_0..t_K need an opt-in shared size");
    if (params.batchSize < 0 || params.blockSize < 2 || params.blockSize > kDFlashMaxBlockSize
        || params.vocabSize < 1 || params.vocabSize > kDFlashMaxVocabSize || !knownSchedule(params.schedule))
    {
        return cudaErrorInvalidValue;
    }
    if (params.batchSize == 0)
    {
        return cudaSuccess;
    }
    return withLogitsType(params.logitsType, [&](auto t) {
        using T = decltype(t);
        return launchSchedule<T>(params, params.blockSize, params.committedTokens, params.schedule, dflashFinishKernel,
            dflashAcceptKernel<T>, static_cast<size_t>(params.blockSize) * sizeof(int32_t), stream);
    });
}

} // namespace trtllm_dflash
