/*
 * The per-request logic of the DFlash acceptance step, shared by the CUDA kernel and the host reference.
 *
 * Source of truth: trtllm_dflash/speculative/core.py (sample_tokens, accepted_lengths, bonus_tokens,
 * block_input) as used by Decoder._dflash_step in trtllm_dflash/runtime/decoding.py. Vocabulary:
 *   block      [anchor, d_1 .. d_K] at positions start .. start+K, K = block_size - 1
 *   t_j        the target's token at block row j (it follows block[: j+1])
 *   accepted a the number of leading drafts with d_j == t_{j-1}, 0 <= a <= K
 *   bonus      t_a; committed tokens are t_0 .. t_a; the next block is [bonus, MASK x K] at start + a + 1.
 *
 * Nothing here depends on TensorRT or the CUDA runtime: g++ builds it for the tests (host_reference.cpp)
 * and nvcc for the kernel, so the CPU tests exercise the very functions the GPU runs.
 */
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__
#else
#define DFLASH_HD
#endif

namespace trtllm_dflash
{

// Sampling is on only for T > 0, as `torch.nonzero(temperature > 0)` in sample_tokens: 0, negative and NaN
// temperatures are greedy.
DFLASH_HD inline bool dflash_is_sampled(float temperature)
{
    return temperature > 0.0f;
}

// The value a row's argmax runs over: the raw logit (greedy) or `logit / T + noise` (Gumbel-max sampling),
// rounded to float32 after each operation like torch's `logits / temperature + noise` on float32 tensors.
// The explicit _rn intrinsics keep nvcc from contracting or approximating the division (--use_fast_math
// would still flush subnormals to zero: don't use it); the host build uses -ffp-contract=off, no -ffast-math.
DFLASH_HD inline float dflash_score(float logit, float temperature, float noise)
{
    if (!dflash_is_sampled(temperature))
    {
        return logit;
    }
#if defined(__CUDA_ARCH__)
    return __fadd_rn(__fdiv_rn(logit, temperature), noise);
#else
    return logit / temperature + noise;
#endif
}

DFLASH_HD inline bool dflash_is_nan(float x)
{
    return x != x;
}

// The index of an empty (value, index) pair, the identity of the argmax reduction (a thread that saw no
// element holds one): it never wins, and loses to every real candidate.
constexpr int32_t kDFlashNoIndex = INT32_MAX;

// True when candidate (value, index) must replace the current best of an argmax, in torch.argmax's order:
// NaN beats every number, a larger value wins, and equal values (NaN included) go to the smaller index.
// The order is total and independent of visiting order, so any reduction tree gives torch's answer.
// Example: [1, 3, NaN, 3, NaN] -> 2; [3, 1, 3] -> 0; [-0.0, +0.0] -> 0.
DFLASH_HD inline bool dflash_prefer(float value, int32_t index, float bestValue, int32_t bestIndex)
{
    if (index == kDFlashNoIndex || bestIndex == kDFlashNoIndex)
    {
        return bestIndex == kDFlashNoIndex && index != kDFlashNoIndex;
    }
    bool const nan = dflash_is_nan(value);
    bool const bestNan = dflash_is_nan(bestValue);
    if (nan != bestNan)
    {
        return nan;
    }
    if (!nan && value != bestValue)
    {
        return value > bestValue;
    }
    return index < bestIndex;
}

// t_j for one row: argmax over the vocabulary, serially. The kernel computes the same value with a
// parallel reduction over dflash_prefer; this is the host path. noise may be null when greedy.
DFLASH_HD inline int32_t dflash_row_argmax(
    float const* logits, float const* noise, int32_t vocabSize, float temperature)
{
    bool const sampled = dflash_is_sampled(temperature);
    float bestValue = 0.0f;
    int32_t bestIndex = kDFlashNoIndex;
    for (int32_t v = 0; v < vocabSize; ++v)
    {
        float const value = dflash_score(logits[v], temperature, sampled ? noise[v] : 0.0f);
        if (dflash_prefer(value, v, bestValue, bestIndex))
        {
            bestValue = value;
            bestIndex = v;
        }
    }
    return bestIndex;
}

// Whether acceptance goes on past row j, given t_j: draft d_{j+1} (draft[j]) exists and equals t_j.
// Rows after the first `false` never influence the result, so the kernel stops computing there.
DFLASH_HD inline bool dflash_draft_continues(int32_t const* draft, int32_t numDrafts, int32_t j, int32_t targetJ)
{
    return j < numDrafts && draft[j] == targetJ;
}

// accepted_lengths for one request: draft [K] = d_1..d_K, target [K+1] = t_0..t_K.
// Example: d = [5, 7, 9], t = [5, 7, 1, 4] -> 2 (bonus t_2 = 1). Reads target only up to the first mismatch.
DFLASH_HD inline int32_t dflash_accepted_length(int32_t const* draft, int32_t const* target, int32_t numDrafts)
{
    int32_t accepted = 0;
    while (dflash_draft_continues(draft, numDrafts, accepted, target[accepted]))
    {
        ++accepted;
    }
    return accepted;
}

// committed_tokens[j], j in 0..K: t_0..t_a (the accepted drafts, which equal t_0..t_{a-1}, then the bonus),
// then -1. Example: a = 2, t = [5, 7, 1, 4] -> [5, 7, 1, -1].
DFLASH_HD inline int32_t dflash_committed_token(int32_t const* target, int32_t accepted, int32_t j)
{
    return j <= accepted ? target[j] : -1;
}

// next_block[j], j in 0..block_size-1: block_input(bonus, mask_token_id) = [bonus, MASK, ..., MASK].
DFLASH_HD inline int32_t dflash_next_block_token(int32_t bonus, int32_t maskTokenId, int32_t j)
{
    return j == 0 ? bonus : maskTokenId;
}

// The bonus becomes the next anchor, at the position right after the last committed token.
DFLASH_HD inline int32_t dflash_next_start(int32_t start, int32_t accepted)
{
    return start + accepted + 1;
}

// next_positions[j]: the next block sits at next_start .. next_start + block_size - 1.
DFLASH_HD inline int32_t dflash_next_position(int32_t start, int32_t accepted, int32_t j)
{
    return dflash_next_start(start, accepted) + j;
}

// One request's outputs from its target tokens; the kernel writes the same elements in parallel.
// target [K+1]; committed [K+1]; nextBlock, nextPositions [K+1] (= block_size). committed may be target itself
// (the rows-in-parallel kernel keeps t_j there): a is found before anything is written, and afterwards only
// target[a] and target[j] at j <= a are read, which committed[j] = target[j] leaves as they were.
DFLASH_HD inline void dflash_write_request(int32_t const* draft, int32_t const* target, int32_t numDrafts,
    int32_t start, int32_t maskTokenId, int32_t* accepted, int32_t* committed, int32_t* nextBlock,
    int32_t* nextPositions, int32_t* newContextLength)
{
    int32_t const a = dflash_accepted_length(draft, target, numDrafts);
    for (int32_t j = 0; j <= numDrafts; ++j)
    {
        committed[j] = dflash_committed_token(target, a, j);
        nextBlock[j] = dflash_next_block_token(target[a], maskTokenId, j);
        nextPositions[j] = dflash_next_position(start, a, j);
    }
    *accepted = a;
    *newContextLength = dflash_next_start(start, a);
}

// ---------------------------------------------------------------------------------------------------------
// Draft trees (DDTree; trtllm_dflash/speculative/tree.py accepted_paths, Decoder._tree_step). A request's tree
// has N nodes: node 0 the anchor, node c > 0 a draft token whose parent parents[c] < c; t_i is the target's
// token at node i (it follows the path to node i). From node 0 the accepted path steps to the child whose token
// is t of the current node while one exists (siblings never share a token); the bonus is t of its last node.
// ---------------------------------------------------------------------------------------------------------

// The child of `node` whose token is `targetToken`, or -1. Children have larger indices than their parent.
// Example: parents [-1, 0, 0, 1], tokens [a, 5, 7, 9]: child of 0 with token 7 -> 2; of 1 with 9 -> 3.
DFLASH_HD inline int32_t dflash_tree_child(
    int32_t const* parents, int32_t const* tokens, int32_t numNodes, int32_t node, int32_t targetToken)
{
    for (int32_t c = node + 1; c < numNodes; ++c)
    {
        if (parents[c] == node && tokens[c] == targetToken)
        {
            return c;
        }
    }
    return -1;
}

// The accepted path of one request, written as its nodes path[0..n-1] (path[0] = 0) then -1 up to N; returns n.
// `targetAt(i)` gives t_i (computed on demand: only the path's nodes are needed). bonus = t of path[n-1].
// (A host or a device functor: nvcc checks the call in the instantiation that runs, not in both.)
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename TargetAt>
DFLASH_HD inline int32_t dflash_tree_path(int32_t const* parents, int32_t const* tokens, int32_t numNodes,
    TargetAt targetAt, int32_t* path, int32_t* bonus)
{
    int32_t n = 0;
    int32_t node = 0;
    int32_t t = 0;
    while (node >= 0)
    {
        path[n++] = node;
        t = targetAt(node);
        node = dflash_tree_child(parents, tokens, numNodes, node, t);
    }
    for (int32_t j = n; j < numNodes; ++j)
    {
        path[j] = -1;
    }
    *bonus = t;
    return n;
}

} // namespace trtllm_dflash
