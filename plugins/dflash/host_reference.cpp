/*
 * A C ABI over the per-request logic in dflash_accept_logic.h, for tests: the same functions the CUDA
 * kernel runs, built with a host compiler and called from Python through ctypes.
 *
 *   g++ -O2 -std=c++17 -shared -fPIC -ffp-contract=off host_reference.cpp -o libdflash_accept_host.so
 *
 * No -ffast-math: the scores must round like torch's float32 `logits / temperature + noise`, and NaN logits
 * must keep torch.argmax's meaning. The kernel differs only in how a row's argmax is reduced (in parallel,
 * over the same total order, dflash_prefer) and in stopping after the first rejected row.
 */
#include "dflash_accept_logic.h"

#include <vector>

using namespace trtllm_dflash;

// Same tensors and meaning as the plugin (README.md), on host memory; logits are float32 only.
// Returns 0, or 1 for shapes the plugin would refuse (blockSize < 2, vocabSize < 1, batchSize < 0).
extern "C" int32_t dflash_accept_host(int32_t batchSize, int32_t blockSize, int32_t vocabSize, int32_t maskTokenId,
    int32_t const* draftTokens, float const* targetLogits, float const* temperature, float const* gumbelNoise,
    int32_t const* contextLengths, int32_t* accepted, int32_t* committedTokens, int32_t* nextBlock,
    int32_t* nextPositions, int32_t* newContextLengths)
{
    if (batchSize < 0 || blockSize < 2 || vocabSize < 1)
    {
        return 1;
    }
    int32_t const numDrafts = blockSize - 1;
    for (int32_t b = 0; b < batchSize; ++b)
    {
        // As the kernel's rows-in-parallel schedule: every row's t_j into the request's committedTokens, then
        // dflash_write_request over them in place. (Its per-request schedule stops after the first rejected row
        // and keeps t_j apart; the results agree because dflash_accepted_length never reads past the first
        // mismatch, and dflash_write_request rewrites in place only what it no longer reads.)
        int64_t const out = static_cast<int64_t>(b) * blockSize;
        for (int32_t j = 0; j < blockSize; ++j)
        {
            int64_t const row = (out + j) * vocabSize;
            committedTokens[out + j]
                = dflash_row_argmax(targetLogits + row, gumbelNoise + row, vocabSize, temperature[b]);
        }
        dflash_write_request(draftTokens + static_cast<int64_t>(b) * numDrafts, committedTokens + out, numDrafts,
            contextLengths[b], maskTokenId, &accepted[b], committedTokens + out, nextBlock + out,
            nextPositions + out, &newContextLengths[b]);
    }
    return 0;
}

// The kernel's reduction order for one row, emulated serially: `threads` strided partial argmaxes, each
// warp folded by shuffle-down offsets 16, 8, 4, 2, 1, then the warp results folded the same way. Tests
// compare it with dflash_row_argmax to show that the tree order cannot change a tie-break or NaN result.
// threads must be a multiple of 32 and at most 32 * 32 (as the kernel's 512).
extern "C" int32_t dflash_row_argmax_tree_host(
    float const* logits, float const* noise, int32_t vocabSize, float temperature, int32_t threads)
{
    constexpr int32_t kWarp = 32;
    if (threads < kWarp || threads % kWarp != 0 || threads > kWarp * kWarp || vocabSize < 1)
    {
        return -1;
    }
    bool const sampled = dflash_is_sampled(temperature);
    std::vector<float> value(threads, 0.0f);
    std::vector<int32_t> index(threads, kDFlashNoIndex);
    for (int32_t t = 0; t < threads; ++t)
    {
        for (int32_t v = t; v < vocabSize; v += threads)
        {
            float const score = dflash_score(logits[v], temperature, sampled ? noise[v] : 0.0f);
            if (dflash_prefer(score, v, value[t], index[t]))
            {
                value[t] = score;
                index[t] = v;
            }
        }
    }
    // Lane i takes lane i + offset's pair; lanes past the warp read their own (ignored) values on the GPU,
    // and only lane 0's final pair is used, so folding lanes below `offset` is the same computation.
    auto foldWarp = [](float* warpValue, int32_t* warpIndex) {
        for (int32_t offset = kWarp / 2; offset > 0; offset /= 2)
        {
            for (int32_t lane = 0; lane < offset; ++lane)
            {
                if (dflash_prefer(warpValue[lane + offset], warpIndex[lane + offset], warpValue[lane], warpIndex[lane]))
                {
                    warpValue[lane] = warpValue[lane + offset];
                    warpIndex[lane] = warpIndex[lane + offset];
                }
            }
        }
    };
    int32_t const warps = threads / kWarp;
    std::vector<float> warpValue(kWarp, 0.0f);
    std::vector<int32_t> warpIndex(kWarp, kDFlashNoIndex);
    for (int32_t w = 0; w < warps; ++w)
    {
        foldWarp(&value[w * kWarp], &index[w * kWarp]);
        warpValue[w] = value[w * kWarp];
        warpIndex[w] = index[w * kWarp];
    }
    foldWarp(warpValue.data(), warpIndex.data());
    return warpIndex[0];
}

// dflash_score elementwise: out[i] = the value row argmaxes run over. Tests compare it bit for bit with
// torch's float32 `logits / temperature + noise`.
extern "C" void dflash_scores_host(
    float const* logits, float const* noise, int64_t count, float temperature, float* out)
{
    for (int64_t i = 0; i < count; ++i)
    {
        out[i] = dflash_score(logits[i], temperature, noise[i]);
    }
}

// Draft trees (dflash_tree_path): logits [B, N, V] of the tree's nodes, parents / tokens [B, N] (parents[0] = -1),
// temperature [B], gumbelNoise [B, N, V]; outputs pathNodes [B, N] (the accepted path, then -1), pathLength [B]
// (nodes on it, the anchor included) and bonus [B]. Returns 0, or 1 for shapes the kernel refuses.
extern "C" int32_t dflash_tree_accept_host(int32_t batchSize, int32_t numNodes, int32_t vocabSize,
    float const* targetLogits, float const* temperature, float const* gumbelNoise, int32_t const* parents,
    int32_t const* tokens, int32_t* pathNodes, int32_t* pathLength, int32_t* bonus)
{
    if (batchSize < 0 || numNodes < 1 || vocabSize < 1)
    {
        return 1;
    }
    for (int32_t b = 0; b < batchSize; ++b)
    {
        int64_t const first = static_cast<int64_t>(b) * numNodes;
        auto targetAt = [&](int32_t node) {
            int64_t const row = (first + node) * vocabSize;
            return dflash_row_argmax(targetLogits + row, gumbelNoise + row, vocabSize, temperature[b]);
        };
        pathLength[b] = dflash_tree_path(parents + first, tokens + first, numNodes, targetAt, pathNodes + first,
            &bonus[b]);
    }
    return 0;
}
