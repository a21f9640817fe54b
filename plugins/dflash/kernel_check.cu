/*
 * GPU check of the DFlashAccept kernels (chains and draft trees) against the host logic, for a machine with a GPU:
 *
 *   nvcc -std=c++17 -O2 -arch=sm_90a plugins/dflash/kernel_check.cu plugins/dflash/dflash_accept_kernel.cu \
 *       -o /tmp/dflash_kernel_check && /tmp/dflash_kernel_check
 *
 * Every output of launchDFlashAccept must equal dflash_write_request over dflash_row_argmax (the functions
 * tests/test_dflash_plugin.py compares with speculative/core.py), for float32, float16 and bfloat16 logits,
 * with tied, non-finite, greedy and sampled rows and every accepted length, under both schedules (rows in
 * parallel, per request), chains and trees. Prints one line per case and schedule with its kernel time; exits 1
 * on any mismatch. It is no substitute for running the plugin inside a TensorRT engine.
 */
#include "dflash_accept_kernel.h"
#include "dflash_accept_logic.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

using namespace trtllm_dflash;

namespace
{

#define CHECK_CUDA(call)                                                                                               \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t const status_ = (call);                                                                            \
        if (status_ != cudaSuccess)                                                                                    \
        {                                                                                                              \
            std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(status_), __FILE__, __LINE__);                  \
            std::exit(2);                                                                                              \
        }                                                                                                              \
    } while (0)

enum class Kind
{
    kRandom,    // Gaussian logits: ties are rare
    kTies,      // small integers: most rows tie
    kNonFinite, // +inf (ties), -inf and NaN sprinkled in
};

struct Case
{
    char const* name;
    int32_t batch, blockSize, vocab;
    Kind kind;
};

// Logits rounded through the tested dtype, so host (float) and device (widened T) see the same values.
template <typename T>
float roundTrip(float x)
{
    if constexpr (std::is_same_v<T, __half>)
        return __half2float(__float2half(x));
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat162float(__float2bfloat16(x));
    else
        return x;
}

template <typename T>
T fromFloat(float x)
{
    if constexpr (std::is_same_v<T, __half>)
        return __float2half(x);
    else if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __float2bfloat16(x);
    else
        return x;
}

template <typename T>
void* toDevice(std::vector<T> const& host)
{
    void* device = nullptr;
    CHECK_CUDA(cudaMalloc(&device, host.size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return device;
}

// The schedules every case runs, each on fresh outputs, with its name in the printed line.
std::pair<DFlashAcceptSchedule, char const*> const kSchedules[]
    = {{DFlashAcceptSchedule::kROWS_IN_PARALLEL, "rows"}, {DFlashAcceptSchedule::kPER_REQUEST, "per-request"}};

// How many of the device's want.size() int32 values differ from `want`.
int64_t mismatches(int32_t const* device, std::vector<int32_t> const& want)
{
    std::vector<int32_t> got(want.size());
    CHECK_CUDA(cudaMemcpy(got.data(), device, got.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
    int64_t count = 0;
    for (size_t i = 0; i < got.size(); ++i)
        count += got[i] != want[i];
    return count;
}

// launch() once (its outputs are the ones compared), then 20 times between events: microseconds per launch.
template <typename Launch>
float timedLaunches(Launch&& launch)
{
    CHECK_CUDA(launch());
    cudaEvent_t begin, end;
    CHECK_CUDA(cudaEventCreate(&begin));
    CHECK_CUDA(cudaEventCreate(&end));
    CHECK_CUDA(cudaEventRecord(begin));
    for (int32_t i = 0; i < 20; ++i)
        CHECK_CUDA(launch());
    CHECK_CUDA(cudaEventRecord(end));
    CHECK_CUDA(cudaEventSynchronize(end));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, begin, end));
    CHECK_CUDA(cudaEventDestroy(begin));
    CHECK_CUDA(cudaEventDestroy(end));
    return 1000.0f * ms / 20;
}

template <typename T>
bool runCase(Case const& c, DFlashLogitsType type, char const* typeName, std::mt19937& rng)
{
    int32_t const B = c.batch, S = c.blockSize, K = S - 1, V = c.vocab;
    size_t const n = static_cast<size_t>(B) * S * V;
    std::normal_distribution<float> gauss(0.0f, 3.0f);
    std::uniform_real_distribution<double> uniform(1e-12, 1.0);
    std::uniform_int_distribution<int32_t> small(-2, 2), token(0, V - 1), pct(0, 99);

    std::vector<float> logits(n), noise(n);
    for (size_t i = 0; i < n; ++i)
    {
        float x = c.kind == Kind::kTies ? static_cast<float>(small(rng)) : gauss(rng);
        if (c.kind == Kind::kNonFinite && pct(rng) < 15)
        {
            int32_t const p = pct(rng);
            x = p < 60 ? INFINITY : p < 90 ? -INFINITY : NAN;
        }
        logits[i] = roundTrip<T>(x);
        noise[i] = static_cast<float>(-std::log(-std::log(uniform(rng))));
    }
    float const temperatures[] = {0.0f, 0.7f, 1.0f, -1.0f, 1.3f};
    std::vector<float> temperature(B);
    std::vector<int32_t> starts(B), target(static_cast<size_t>(B) * S), draft(static_cast<size_t>(B) * K);
    for (int32_t b = 0; b < B; ++b)
    {
        temperature[b] = temperatures[pct(rng) % 5];
        starts[b] = pct(rng) * 1000 + pct(rng);
        for (int32_t j = 0; j < S; ++j)
        {
            size_t const row = (static_cast<size_t>(b) * S + j) * V;
            target[b * S + j] = dflash_row_argmax(&logits[row], &noise[row], V, temperature[b]);
        }
        // Accept a chosen 0..K drafts: copy the target's tokens up to it, then mismatch.
        int32_t const want = (b % S);
        for (int32_t j = 0; j < K; ++j)
        {
            int32_t const t = target[b * S + j];
            int32_t const mismatch = V > 1 ? (t + 1 + token(rng) % (V - 1)) % V : 1; // 1: outside a 1-token vocab
            draft[b * K + j] = j < want ? t : j == want ? mismatch : token(rng);
        }
    }

    std::vector<int32_t> accepted(B), committed(static_cast<size_t>(B) * S), nextBlock(committed.size()),
        nextPositions(committed.size()), newLengths(B);
    for (int32_t b = 0; b < B; ++b)
    {
        dflash_write_request(&draft[b * K], &target[b * S], K, starts[b], 31999, &accepted[b], &committed[b * S],
            &nextBlock[b * S], &nextPositions[b * S], &newLengths[b]);
    }

    std::vector<T> typedLogits(n);
    for (size_t i = 0; i < n; ++i)
        typedLogits[i] = fromFloat<T>(logits[i]);
    DFlashAcceptParams p{};
    p.draftTokens = static_cast<int32_t const*>(toDevice(draft));
    p.targetLogits = toDevice(typedLogits);
    p.temperature = static_cast<float const*>(toDevice(temperature));
    p.gumbelNoise = static_cast<float const*>(toDevice(noise));
    p.contextLengths = static_cast<int32_t const*>(toDevice(starts));
    p.batchSize = B;
    p.blockSize = S;
    p.vocabSize = V;
    p.maskTokenId = 31999;
    p.logitsType = type;

    // Each schedule on fresh outputs (filled with -7, so an output a schedule forgets to write shows).
    bool ok = true;
    for (auto const& [schedule, scheduleName] : kSchedules)
    {
        std::vector<int32_t> fillB(B, -7), fillBS(committed.size(), -7);
        p.schedule = schedule;
        p.accepted = static_cast<int32_t*>(toDevice(fillB));
        p.committedTokens = static_cast<int32_t*>(toDevice(fillBS));
        p.nextBlock = static_cast<int32_t*>(toDevice(fillBS));
        p.nextPositions = static_cast<int32_t*>(toDevice(fillBS));
        p.newContextLengths = static_cast<int32_t*>(toDevice(fillB));
        float const us = timedLaunches([&p] { return launchDFlashAccept(p, nullptr); });

        int64_t const wrong = mismatches(p.accepted, accepted) + mismatches(p.committedTokens, committed)
            + mismatches(p.nextBlock, nextBlock) + mismatches(p.nextPositions, nextPositions)
            + mismatches(p.newContextLengths, newLengths);
        for (int32_t* ptr : {p.accepted, p.committedTokens, p.nextBlock, p.nextPositions, p.newContextLengths})
            CHECK_CUDA(cudaFree(ptr));
        std::printf("%-10s %-9s B=%-4d block=%-3d V=%-7d %-11s mismatches=%lld  kernel %.1f us\n", c.name, typeName, B,
            S, V, scheduleName, static_cast<long long>(wrong), us);
        ok &= wrong == 0;
    }
    for (void const* ptr : {static_cast<void const*>(p.draftTokens), p.targetLogits,
             static_cast<void const*>(p.temperature), static_cast<void const*>(p.gumbelNoise),
             static_cast<void const*>(p.contextLengths)})
        CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
    return ok;
}

// Trees: random trees of N nodes (each node's parent among the earlier ones) whose tokens follow the target's
// own at a chosen share of nodes, so paths of every length occur; launchDFlashTreeAccept == dflash_tree_path.
template <typename T>
bool runTreeCase(Case const& c, DFlashLogitsType type, char const* typeName, std::mt19937& rng)
{
    int32_t const B = c.batch, N = c.blockSize, V = c.vocab;
    size_t const n = static_cast<size_t>(B) * N * V;
    std::normal_distribution<float> gauss(0.0f, 3.0f);
    std::uniform_real_distribution<double> uniform(1e-12, 1.0);
    std::uniform_int_distribution<int32_t> token(0, V - 1), pct(0, 99);
    std::vector<float> logits(n), noise(n);
    for (size_t i = 0; i < n; ++i)
    {
        logits[i] = roundTrip<T>(gauss(rng));
        noise[i] = static_cast<float>(-std::log(-std::log(uniform(rng))));
    }
    std::vector<float> temperature(B);
    std::vector<int32_t> parents(static_cast<size_t>(B) * N), tokens(parents.size());
    for (int32_t b = 0; b < B; ++b)
    {
        temperature[b] = pct(rng) < 50 ? 0.0f : 0.8f;
        int32_t const* par = &parents[static_cast<size_t>(b) * N];
        for (int32_t i = 0; i < N; ++i)
        {
            parents[b * N + i] = i == 0 ? -1 : std::uniform_int_distribution<int32_t>(0, i - 1)(rng);
            size_t const row = (static_cast<size_t>(b) * N + (i == 0 ? 0 : par[i])) * V;
            int32_t const t = dflash_row_argmax(&logits[row], &noise[row], V, temperature[b]);
            tokens[b * N + i] = i == 0 ? token(rng) : pct(rng) < 60 ? t : token(rng);
        }
        for (int32_t i = 1; i < N; ++i) // siblings never share a token (as speculative/tree.py builds them)
            for (int32_t j = 1; j < i; ++j)
                if (par[j] == par[i] && tokens[b * N + j] == tokens[b * N + i])
                    tokens[b * N + i] = -1 - i;
    }
    std::vector<int32_t> path(parents.size()), length(B), bonus(B);
    for (int32_t b = 0; b < B; ++b)
    {
        auto targetAt = [&](int32_t node) {
            size_t const row = (static_cast<size_t>(b) * N + node) * V;
            return dflash_row_argmax(&logits[row], &noise[row], V, temperature[b]);
        };
        length[b] = dflash_tree_path(&parents[b * N], &tokens[b * N], N, targetAt, &path[b * N], &bonus[b]);
    }
    std::vector<T> typedLogits(n);
    for (size_t i = 0; i < n; ++i)
        typedLogits[i] = fromFloat<T>(logits[i]);
    DFlashTreeAcceptParams p{};
    p.targetLogits = toDevice(typedLogits);
    p.temperature = static_cast<float const*>(toDevice(temperature));
    p.gumbelNoise = static_cast<float const*>(toDevice(noise));
    p.parents = static_cast<int32_t const*>(toDevice(parents));
    p.tokens = static_cast<int32_t const*>(toDevice(tokens));
    p.batchSize = B;
    p.numNodes = N;
    p.vocabSize = V;
    p.logitsType = type;
    int64_t longest = 0;
    for (int32_t l : length)
        longest = l > longest ? l : longest;
    // Each schedule on fresh outputs (filled with -7, so an output a schedule forgets to write shows); the
    // per-request one without a workspace, as a plugin would run it with none.
    bool ok = true;
    for (auto const& [schedule, scheduleName] : kSchedules)
    {
        std::vector<int32_t> fillB(B, -7), fillBN(parents.size(), -7);
        p.schedule = schedule;
        p.pathNodes = static_cast<int32_t*>(toDevice(fillBN));
        p.pathLength = static_cast<int32_t*>(toDevice(fillB));
        p.bonus = static_cast<int32_t*>(toDevice(fillB));
        p.targets = schedule == DFlashAcceptSchedule::kROWS_IN_PARALLEL ? static_cast<int32_t*>(toDevice(fillBN))
                                                                        : nullptr;
        float const us = timedLaunches([&p] { return launchDFlashTreeAccept(p, nullptr); });

        int64_t const wrong
            = mismatches(p.pathNodes, path) + mismatches(p.pathLength, length) + mismatches(p.bonus, bonus);
        for (int32_t* ptr : {p.pathNodes, p.pathLength, p.bonus, p.targets})
            CHECK_CUDA(cudaFree(ptr));
        std::printf("%-10s %-9s B=%-4d nodes=%-3d V=%-7d %-11s mismatches=%lld  longest path %lld  kernel %.1f us\n",
            c.name, typeName, B, N, V, scheduleName, static_cast<long long>(wrong), static_cast<long long>(longest),
            us);
        ok &= wrong == 0;
    }
    for (void const* ptr : {p.targetLogits, static_cast<void const*>(p.temperature),
             static_cast<void const*>(p.gumbelNoise), static_cast<void const*>(p.parents),
             static_cast<void const*>(p.tokens)})
        CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
    return ok;
}

} // namespace

int main()
{
    Case const cases[] = {
        {"ties", 256, 2, 7, Kind::kTies},
        {"ties", 128, 8, 513, Kind::kTies},
        {"ties", 64, 16, 1, Kind::kTies},
        {"random", 64, 16, 1000, Kind::kRandom},
        {"nonfinite", 64, 16, 777, Kind::kNonFinite},
        {"large", 16, 16, 151936, Kind::kRandom},
    };
    std::mt19937 rng(1234);
    bool ok = true;
    for (Case const& c : cases)
    {
        ok &= runCase<float>(c, DFlashLogitsType::kFLOAT32, "float32", rng);
        ok &= runCase<__half>(c, DFlashLogitsType::kFLOAT16, "float16", rng);
        ok &= runCase<__nv_bfloat16>(c, DFlashLogitsType::kBFLOAT16, "bfloat16", rng);
    }
    Case const trees[] = {
        {"tree", 64, 17, 1000, Kind::kRandom},
        {"tree", 16, 65, 151936, Kind::kRandom},
    };
    for (Case const& c : trees)
    {
        ok &= runTreeCase<float>(c, DFlashLogitsType::kFLOAT32, "float32", rng);
        ok &= runTreeCase<__half>(c, DFlashLogitsType::kFLOAT16, "float16", rng);
        ok &= runTreeCase<__nv_bfloat16>(c, DFlashLogitsType::kBFLOAT16, "bfloat16", rng);
    }
    std::printf(ok ? "OK: kernel == host logic\n" : "FAILED: kernel != host logic\n");
    return ok ? 0 : 1;
}
