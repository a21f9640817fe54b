/*
 * Launcher of the DFlash acceptance kernel. No TensorRT dependency: the plugin (dflash_accept_plugin.cpp)
 * and a future torch custom op both call launchDFlashAccept.
 */
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

namespace trtllm_dflash
{

// What the kernel can run: t_0..t_K live in shared memory (one int32 per block row), and the vocabulary
// loop steps an int32 index by the block's 512 threads without overflowing.
constexpr int32_t kDFlashMaxBlockSize = 4096;
constexpr int32_t kDFlashMaxVocabSize = INT32_MAX - 512;

// How the B x (K+1) rows of a step (a tree's B x N rows) are reduced; the outputs are the same under each.
enum class DFlashAcceptSchedule : int32_t
{
    // kROWS_IN_PARALLEL when one CUDA block per row fits on the GPU at once (B x (K+1) at most the SMs times the
    // blocks each holds, as cudaOccupancyMaxActiveBlocksPerMultiprocessor says), else kPER_REQUEST. Zero, so
    // `DFlashAcceptParams p{}` gets it.
    kAUTO = 0,
    // One CUDA block per row, all at once, then one thread per request: a step costs about one row's reduction,
    // but every row is read, accepted or not. (Trees: every node's row, then each request's walk.)
    kROWS_IN_PARALLEL = 1,
    // One CUDA block per request, its rows in order up to the first rejected draft: reads (a + 1) rows, but a
    // request's rows take turns (at batch 1 with every draft accepted, 16 reductions one after another). (Trees:
    // the path's rows, node after node.)
    kPER_REQUEST = 2,
};

enum class DFlashLogitsType : int32_t
{
    kFLOAT32 = 0,
    kFLOAT16 = 1,
    kBFLOAT16 = 2,
};

// Device pointers, all row-major and contiguous. B = batchSize, K = blockSize - 1, V = vocabSize.
struct DFlashAcceptParams
{
    // Inputs.
    int32_t const* draftTokens;    // [B, K]
    void const* targetLogits;      // [B, K+1, V], float32 / float16 / bfloat16 (see logitsType)
    float const* temperature;      // [B]; <= 0 is greedy
    float const* gumbelNoise;      // [B, K+1, V]; read only for rows with temperature > 0
    int32_t const* contextLengths; // [B]; the anchor's position (start)

    // Outputs.
    int32_t* accepted;          // [B], 0..K
    int32_t* committedTokens;   // [B, K+1]: t_0..t_a, then -1
    int32_t* nextBlock;         // [B, blockSize]: [bonus, maskTokenId x K]
    int32_t* nextPositions;     // [B, blockSize]: new start + 0..blockSize-1
    int32_t* newContextLengths; // [B]: start + a + 1

    int32_t batchSize;
    int32_t blockSize;
    int32_t vocabSize;
    int32_t maskTokenId;
    DFlashLogitsType logitsType;
    DFlashAcceptSchedule schedule; // kAUTO unless a test or a benchmark picks one
};

// Enqueues the whole step on `stream` (one or two kernels, see DFlashAcceptSchedule). Returns
// cudaErrorInvalidValue for shapes it cannot run (blockSize outside 2..kDFlashMaxBlockSize, vocabSize outside
// 1..kDFlashMaxVocabSize, batchSize < 0, an unknown schedule), else the first CUDA error of choosing the schedule
// or launching.
cudaError_t launchDFlashAccept(DFlashAcceptParams const& params, cudaStream_t stream);

// Draft trees: the accepted path of each request's tree (dflash_accept_logic.h dflash_tree_path). B = batchSize,
// N = numNodes (node 0 the anchor), V = vocabSize.
struct DFlashTreeAcceptParams
{
    // Inputs.
    void const* targetLogits;  // [B, N, V], float32 / float16 / bfloat16 (see logitsType)
    float const* temperature;  // [B]; <= 0 is greedy
    float const* gumbelNoise;  // [B, N, V]; read only for rows with temperature > 0
    int32_t const* parents;    // [B, N]: parents[b, 0] = -1, parents[b, c] < c
    int32_t const* tokens;     // [B, N]: the nodes' tokens (node 0: the anchor)

    // Outputs.
    int32_t* pathNodes;  // [B, N]: the accepted path's nodes (0 first), then -1
    int32_t* pathLength; // [B]: nodes on the path, 1..N
    int32_t* bonus;      // [B]: the target's token after the path's last node

    // Workspace, dflashTreeAcceptWorkspaceSize bytes: every node's t under kROWS_IN_PARALLEL (the path overwrites
    // node slots of pathNodes that it still reads, so they cannot hold them). nullptr: kPER_REQUEST only.
    int32_t* targets; // [B, N]

    int32_t batchSize;
    int32_t numNodes;
    int32_t vocabSize;
    DFlashLogitsType logitsType;
    DFlashAcceptSchedule schedule; // kAUTO unless a test or a benchmark picks one
};

inline size_t dflashTreeAcceptWorkspaceSize(int64_t batchSize, int64_t numNodes)
{
    return static_cast<size_t>(batchSize * numNodes) * sizeof(int32_t);
}

// As launchDFlashAccept's schedules: kAUTO takes rows in parallel where `targets` is given and the B x N rows fit on
// the GPU at once. cudaErrorInvalidValue for numNodes outside 1..kDFlashMaxBlockSize, vocabSize outside
// 1..kDFlashMaxVocabSize, batchSize < 0, an unknown schedule or kROWS_IN_PARALLEL without `targets`.
cudaError_t launchDFlashTreeAccept(DFlashTreeAcceptParams const& params, cudaStream_t stream);

} // namespace trtllm_dflash
