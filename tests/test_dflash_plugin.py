"""The DFlashAccept TensorRT plugin (plugins/dflash/) against the torch reference, on the CPU; the draft trees' walk
(dflash_tree_path, launchDFlashTreeAccept) against speculative/tree.py.

The plugin's per-request logic (dflash_accept_logic.h) is built with g++ into a small shared library
(host_reference.cpp) and compared, output for output, with speculative/core.py used the way
Decoder._dflash_step uses it. The CUDA kernel and the TensorRT wrapper are only compiled here (of the kernel's
launcher, the checks it makes before any CUDA call run): running them needs a GPU (plugins/dflash/README.md lists
what stays unverified).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from trtllm_dflash.speculative.core import (
    Sampling,
    accepted_lengths,
    block_input,
    bonus_tokens,
    gumbel_noise,
    request_seed,
    sample_tokens,
)
from trtllm_dflash.speculative.tree import accepted_paths, build_trees

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugins" / "dflash"
MASK = 31_999  # mask_token_id attribute; any int32 works
NVCC = shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if Path(p).exists()), None)
TENSORRT_ROOT = os.environ.get("TENSORRT_ROOT", "")
HAS_TRT_HEADERS = bool(TENSORRT_ROOT) and (Path(TENSORRT_ROOT) / "include" / "NvInfer.h").exists()
needs_trt = pytest.mark.skipif(not HAS_TRT_HEADERS, reason="TensorRT headers absent: set TENSORRT_ROOT to a "
                               "directory with include/NvInfer.h (CI has none)")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) is not installed")


def run(cmd: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(map(str, cmd))}\n{done.stdout}\n{done.stderr}"


# ---------------------------------------------------------------- host build of the per-request logic

@pytest.fixture(scope="module")
def host(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    lib = tmp_path_factory.mktemp("dflash_host") / "libdflash_accept_host.so"
    # -ffp-contract=off and no -ffast-math: scores must round like torch's float32 arithmetic.
    run([gxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
         PLUGIN_DIR / "host_reference.cpp", "-o", lib])
    cdll = ctypes.CDLL(str(lib))
    cdll.dflash_accept_host.restype = ctypes.c_int32
    cdll.dflash_accept_host.argtypes = [ctypes.c_int32] * 4 + [ctypes.c_void_p] * 10
    cdll.dflash_row_argmax_tree_host.restype = ctypes.c_int32
    cdll.dflash_row_argmax_tree_host.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, ctypes.c_float,
                                                 ctypes.c_int32]
    cdll.dflash_scores_host.restype = None
    cdll.dflash_scores_host.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                        ctypes.c_void_p]
    return cdll


def host_accept(host, draft, logits, temperature, noise, starts, block_size, mask=MASK):
    """One ctypes call over the whole batch; same tensors as the plugin's inputs and outputs."""
    B, V = logits.shape[0], logits.shape[-1]
    ins = [t.contiguous() for t in (draft.int(), logits.float(), temperature.float(), noise.float(), starts.int())]
    outs = {"accepted": torch.empty(B, dtype=torch.int32),
            "committed": torch.empty(B, block_size, dtype=torch.int32),
            "next_block": torch.empty(B, block_size, dtype=torch.int32),
            "next_positions": torch.empty(B, block_size, dtype=torch.int32),
            "new_lengths": torch.empty(B, dtype=torch.int32)}
    status = host.dflash_accept_host(B, block_size, V, mask, *[t.data_ptr() for t in ins],
                                     *[t.data_ptr() for t in outs.values()])
    assert status == 0
    return {k: v.long() for k, v in outs.items()}


def reference(draft, target, starts, block_size, mask=MASK):
    """Outputs from the target tokens, as Decoder._dflash_step computes and commits them."""
    accepted = accepted_lengths(draft, target)  # [B]
    bonus = bonus_tokens(target, accepted)  # [B]
    j = torch.arange(block_size)[None]
    drafts = torch.cat([draft, draft[:, :1]], dim=1)  # pad to block_size columns; column K is never a draft
    # block[row, 1 : n+1] + [bonus], then -1 padding.
    committed = torch.where(j < accepted[:, None], drafts, torch.where(j == accepted[:, None], bonus[:, None], -1))
    new_lengths = starts + accepted + 1
    return {"accepted": accepted, "committed": committed, "next_block": block_input(bonus, mask, block_size),
            "next_positions": new_lengths[:, None] + j, "new_lengths": new_lengths}


def row_noise(seeds, starts, temperature, block_size, vocab):
    """The host's gumbel_noise input: gumbel_noise(seed, start + j + 1, V) for sampled rows, NaN for greedy
    rows (NaN would win any argmax, so greedy results prove the plugin never reads it)."""
    noise = torch.full((len(seeds), block_size, vocab), float("nan"))
    for b in torch.nonzero(temperature > 0).flatten().tolist():
        for j in range(block_size):
            noise[b, j] = gumbel_noise(seeds[b], int(starts[b]) + j + 1, vocab)
    return noise


def biased_drafts(target, vocab, gen):
    """Drafts accepting a uniform 0..K of themselves: d_1..d_n = t_0..t_{n-1}, then a mismatch, then noise."""
    B, K = target.shape[0], target.shape[1] - 1
    want = torch.randint(0, K + 1, (B,), generator=gen)
    draft = torch.randint(0, vocab, (B, K), generator=gen)
    j = torch.arange(K)[None]
    draft = torch.where(j < want[:, None], target[:, :K], draft)
    miss = (target[:, :K] + torch.randint(1, vocab, (B, K), generator=gen)) % vocab  # != t_j since vocab >= 2
    return torch.where(j == want[:, None], miss, draft)


def make_cases(kind, batch, block_size, vocab, gen):
    """Logits, temperatures and seeds for one batch of one kind of case."""
    shape = (batch, block_size, vocab)
    if kind == "greedy-ties":  # small integers: most rows have a tied maximum
        logits = torch.randint(-2, 3, shape, generator=gen).float()
        temperature = torch.zeros(batch)
    elif kind == "sampled":
        logits = torch.randn(shape, generator=gen) * 3
        temperature = torch.rand(batch, generator=gen) * 2 + 0.05
    elif kind == "mixed":  # greedy (0 or negative) and sampled requests in one batch
        logits = torch.randn(shape, generator=gen) * 2
        temperature = torch.tensor([0.0, -1.0, 0.7, 1.0, 1.3])[torch.randint(0, 5, (batch,), generator=gen)]
    else:  # "non-finite": +inf ties (first +inf wins, sampled too: inf / T + g = inf), -inf, NaN
        logits = torch.randn(shape, generator=gen)
        special = torch.tensor([float("inf"), float("-inf"), float("nan")])
        where = torch.rand(shape, generator=gen) < 0.15
        pick = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), where.numel(), replacement=True, generator=gen)
        logits = torch.where(where, special[pick.view(shape)], logits)
        temperature = torch.where(torch.rand(batch, generator=gen) < 0.5, 0.0, 0.9)
    seeds = [request_seed(int(torch.randint(0, 1000, (1,), generator=gen)), f"r{i}") for i in range(batch)]
    return logits, temperature, seeds


# (kind, block_size, vocab, batch): 12,650 requests in all; every block size sees every accepted length.
SWEEP = [(kind, bs, v, n) for kind, n in [("greedy-ties", 700), ("sampled", 600), ("mixed", 600), ("non-finite", 200)]
         for bs, v in [(2, 7), (4, 33), (8, 5), (16, 64), (16, 300), (5, 2)]]
SWEEP += [("sampled", 16, 4096, 50)]  # one larger vocabulary


def test_host_logic_equals_torch_reference(host):
    gen = torch.Generator().manual_seed(1234)
    seen = {}  # block_size -> accepted lengths seen
    cases = ties = sampled_rows = 0
    for kind, block_size, vocab, batch in SWEEP:
        logits, temperature, seeds = make_cases(kind, batch, block_size, vocab, gen)
        starts = torch.randint(0, 1 << 20, (batch,), generator=gen)
        # Row j of the block chooses the token at position start + j + 1 (Decoder._dflash_step).
        positions = starts[:, None] + 1 + torch.arange(block_size)
        target = sample_tokens(logits, Sampling.plain(temperature, seeds), positions)
        draft = biased_drafts(target, vocab, gen)
        noise = row_noise(seeds, starts, temperature, block_size, vocab)

        got = host_accept(host, draft, logits, temperature, noise, starts, block_size)
        want = reference(draft, target, starts, block_size)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs for {kind}, block {block_size}, V {vocab}"

        seen.setdefault(block_size, set()).update(want["accepted"].tolist())
        cases += batch
        top = logits.max(-1, keepdim=True).values
        ties += int(((logits == top).sum(-1) > 1).sum()) if kind == "greedy-ties" else 0
        sampled_rows += int((temperature > 0).sum()) * block_size

    assert cases >= 10_000
    assert ties > 10_000 and sampled_rows > 10_000  # first-index tie-breaks and sampling really exercised
    assert all(seen[bs] == set(range(bs)) for bs in seen), seen  # accepted 0..K for every block size


def test_tree_host_logic_equals_the_decoders_paths(host):
    """Draft trees (dflash_tree_path, the kernel's walk): per request the accepted path and the bonus equal
    Decoder._tree_step's (sample_tokens at start + depth + 1, then speculative/tree.py accepted_paths), on trees from
    build_trees (padded rows included), greedy and sampled, with the target following a child at most nodes so that
    paths of every length occur."""
    host.dflash_tree_accept_host.restype = ctypes.c_int32
    host.dflash_tree_accept_host.argtypes = [ctypes.c_int32] * 3 + [ctypes.c_void_p] * 8
    gen = torch.Generator().manual_seed(99)
    B, depth, k, vocab = 300, 6, 3, 40
    lengths = set()
    for budget in (1, 5, 14, 30):
        anchors = torch.randint(0, vocab, (B,), generator=gen).tolist()
        cands = [[torch.randperm(vocab, generator=gen)[:k].tolist() for _ in range(depth)] for _ in range(B)]
        lps = [[torch.rand(k, generator=gen).log().sort(descending=True).values.tolist() for _ in range(depth)]
               for _ in range(B)]
        trees = build_trees(anchors, cands, lps, budget)
        N = trees.nodes
        parents, tokens, depths = (torch.tensor(x) for x in (trees.parents, trees.tokens, trees.depths))
        logits = torch.randn(B, N, vocab, generator=gen)
        for b in range(B):  # at 70% of the nodes with children, the target's token is one child's
            for node in range(N):
                children = [c for c in range(N) if trees.parents[b][c] == node]
                if children and torch.rand(1, generator=gen) < 0.7:
                    pick = children[int(torch.randint(0, len(children), (1,), generator=gen))]
                    logits[b, node, trees.tokens[b][pick]] += 60.0
        temperature = torch.tensor([0.0, 1.0, -1.0, 0.8])[torch.randint(0, 4, (B,), generator=gen)]
        seeds = [request_seed(int(torch.randint(0, 1000, (1,), generator=gen)), f"t{b}") for b in range(B)]
        starts = torch.randint(0, 1 << 20, (B,), generator=gen)
        positions = starts[:, None] + depths + 1  # as Decoder._tree_step
        target = sample_tokens(logits, Sampling.plain(temperature, seeds), positions).tolist()
        want = accepted_paths(trees, target)
        noise = torch.full((B, N, vocab), float("nan"))  # NaN: greedy rows must never read it
        for b in torch.nonzero(temperature > 0).flatten().tolist():
            for node in range(N):
                noise[b, node] = gumbel_noise(seeds[b], int(positions[b, node]), vocab)
        ins = [logits.float().contiguous(), temperature.float(), noise.contiguous(), parents.int().contiguous(),
               tokens.int().contiguous()]
        path, length, bonus = torch.empty(B, N, dtype=torch.int32), torch.empty(B, dtype=torch.int32), \
            torch.empty(B, dtype=torch.int32)
        assert host.dflash_tree_accept_host(B, N, vocab, *[t.data_ptr() for t in ins + [path, length, bonus]]) == 0
        for b in range(B):
            assert path[b, : length[b]].tolist() == want[b] and (path[b, length[b]:] == -1).all()
            assert int(bonus[b]) == target[b][want[b][-1]]
        lengths.update(length.tolist())
    assert lengths >= set(range(1, depth + 2)), lengths  # from the anchor alone to a full-depth path
    z = torch.zeros(1)
    assert host.dflash_tree_accept_host(1, 0, 5, *[z.data_ptr()] * 8) == 1  # a tree has its anchor


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_hand_made_block(host, temperature):
    """d = [5, 7, 9], t = [5, 7, 1, 4] -> accepted 2, committed [5, 7, 1, -1], next block [1, M, M, M]."""
    target = torch.tensor([[5, 7, 1, 4]])
    logits = torch.zeros(1, 4, 10).scatter(-1, target[..., None], 1e4)  # Gumbel noise cannot move a 1e4 margin
    noise = torch.randn(1, 4, 10)
    got = host_accept(host, torch.tensor([[5, 7, 9]]), logits, torch.tensor([temperature]), noise,
                      torch.tensor([40]), block_size=4)
    assert {k: v.tolist() for k, v in got.items()} == {
        "accepted": [2], "committed": [[5, 7, 1, -1]], "next_block": [[1, MASK, MASK, MASK]],
        "next_positions": [[43, 44, 45, 46]], "new_lengths": [43]}


def test_sampled_ties_go_to_the_first_index(host):
    """With T = 1 and zero noise the score is the logit itself: integer logits tie, as in
    sample_tokens' `(logits / T + noise).argmax(-1)`."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randint(-1, 2, (400, 6, 9), generator=gen).float()
    temperature = torch.ones(400)
    target = (logits / temperature[:, None, None] + torch.zeros_like(logits)).argmax(-1)
    draft = biased_drafts(target, 9, gen)
    starts = torch.zeros(400, dtype=torch.long)
    got = host_accept(host, draft, logits, temperature, torch.zeros_like(logits), starts, block_size=6)
    want = reference(draft, target, starts, 6)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_scores_round_like_torch(host):
    """Sampled scores equal torch's float32 `logits / T + noise` bit for bit (no reciprocal multiply, no
    fused or reordered arithmetic), over magnitudes from subnormal to huge; greedy scores are the logits."""
    gen = torch.Generator().manual_seed(3)
    magnitude = 2.0 ** torch.randint(-140, 120, (200_000,), generator=gen).float()
    logits = torch.randn(200_000, generator=gen) * magnitude
    noise = gumbel_noise(11, 5, 200_000)
    for temperature in [0.0, 0.05, 0.3, 0.7, 1.0, 1.3, 3.0, 1e-30, 1e30]:
        got = torch.empty_like(logits)
        host.dflash_scores_host(logits.data_ptr(), noise.data_ptr(), logits.numel(), temperature, got.data_ptr())
        t = torch.tensor(temperature, dtype=torch.float32)
        want = logits / t + noise if temperature > 0 else logits
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), temperature


@pytest.mark.parametrize("threads", [32, 64, 512], ids=lambda t: f"{t}-threads")
def test_kernel_reduction_order_keeps_torch_argmax(host, threads):
    """The kernel reduces a row as `threads` strided partial argmaxes folded by warp shuffles; emulated on the
    host, that order gives torch.argmax on ties, NaN and infinities, for vocabularies above and below the
    thread count."""
    gen = torch.Generator().manual_seed(threads)
    for vocab in [1, 2, 31, 33, 511, 513, 1500]:
        rows = torch.randint(-2, 3, (60, vocab), generator=gen).float()
        rows[:20] = torch.where(torch.rand(20, vocab, generator=gen) < 0.2, float("nan"), rows[:20])
        rows[20:40] = torch.where(torch.rand(20, vocab, generator=gen) < 0.1, float("inf"), rows[20:40])
        rows[40:45] = float("-inf")
        for row in rows:
            got = host.dflash_row_argmax_tree_host(row.data_ptr(), None, vocab, 0.0, threads)
            assert got == int(row.argmax()), (vocab, row.tolist())


def test_host_refuses_shapes_the_plugin_refuses(host):
    z = torch.zeros(4, dtype=torch.int32)
    assert host.dflash_accept_host(1, 1, 10, MASK, *[z.data_ptr()] * 10) == 1  # block_size 1: no drafts
    assert host.dflash_accept_host(1, 4, 0, MASK, *[z.data_ptr()] * 10) == 1  # empty vocabulary


# ---------------------------------------------------------------- compile checks (no GPU needed)

@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernel_compiles_with_nvcc(tmp_path, arch):
    run([NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-c", PLUGIN_DIR / "dflash_accept_kernel.cu",
         "-o", tmp_path / "kernel.o"])


LAUNCH_SHIM = r"""
#include "dflash_accept_kernel.h"
using namespace trtllm_dflash;
// What launchDFlashTreeAccept returns for these parameters (pointers other than the workspace: none).
extern "C" int tree_launch(int schedule, int withWorkspace, int batch, int nodes, int vocab)
{
    DFlashTreeAcceptParams p{};
    static int32_t workspace;
    p.targets = withWorkspace ? &workspace : nullptr;
    p.schedule = static_cast<DFlashAcceptSchedule>(schedule);
    p.batchSize = batch;
    p.numNodes = nodes;
    p.vocabSize = vocab;
    return static_cast<int>(launchDFlashTreeAccept(p, nullptr));
}
"""


@needs_nvcc
def test_tree_launcher_refuses_before_it_touches_a_gpu(tmp_path):
    """launchDFlashTreeAccept's checks run on the host, before any CUDA call, so they run here: rows in parallel
    without a workspace, an unknown schedule and bad shapes are cudaErrorInvalidValue (1); an empty batch launches
    nothing (0) under every schedule."""
    (tmp_path / "shim.cu").write_text(LAUNCH_SHIM)
    run([NVCC, "-std=c++17", "-O2", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-I", PLUGIN_DIR,
         tmp_path / "shim.cu", PLUGIN_DIR / "dflash_accept_kernel.cu", "-o", tmp_path / "libshim.so"])
    launch = ctypes.CDLL(str(tmp_path / "libshim.so")).tree_launch
    auto, rows, per_request = 0, 1, 2
    assert launch(rows, 0, 4, 17, 1000) == 1  # rows in parallel need the workspace
    assert launch(7, 1, 4, 17, 1000) == 1  # no such schedule
    assert launch(auto, 1, 4, 0, 1000) == 1 and launch(auto, 1, -1, 17, 1000) == 1 and launch(auto, 1, 4, 17, 0) == 1
    for schedule in (auto, rows, per_request):
        assert launch(schedule, 1, 0, 17, 1000) == 0


@needs_nvcc
def test_gpu_check_program_builds(tmp_path):
    """kernel_check.cu, the kernel-vs-host-logic check for a GPU machine (README.md), compiles and links."""
    run([NVCC, "-std=c++17", "-O2", "-arch=sm_90a", PLUGIN_DIR / "kernel_check.cu",
         PLUGIN_DIR / "dflash_accept_kernel.cu", "-o", tmp_path / "dflash_kernel_check"])


@needs_trt
@pytest.mark.parametrize("source", ["dflash_accept_plugin.cpp", "dflash_tree_accept_plugin.cpp",
                                    "dflash_accept_creator.cpp"])
def test_plugin_wrapper_compiles_against_tensorrt_headers(source):
    cuda_include = Path("/usr/local/cuda/include")
    if not (cuda_include / "cuda_runtime_api.h").exists():
        pytest.skip("CUDA headers absent at /usr/local/cuda/include")
    run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-isystem",
         Path(TENSORRT_ROOT) / "include", "-isystem", cuda_include, "-I", PLUGIN_DIR, PLUGIN_DIR / source])


@needs_trt
@needs_nvcc
def test_cmake_builds_a_library_that_needs_no_libnvinfer(tmp_path):
    """CMake configure + build; the link refuses undefined symbols, and the library loads without TensorRT
    (and without a GPU) and hands out its two creators (DFlashAccept, DFlashTreeAccept)."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    build = tmp_path / "build"
    run(["cmake", "-S", PLUGIN_DIR, "-B", build, f"-DTENSORRT_ROOT={TENSORRT_ROOT}",
         f"-DCMAKE_CUDA_COMPILER={NVCC}", "-DCMAKE_CUDA_ARCHITECTURES=90a"])
    run(["cmake", "--build", build, "-j2"])
    lib = ctypes.CDLL(str(build / "libtrtllm_dflash_plugins.so"))
    count = ctypes.c_int32(0)
    lib.getCreators.restype = ctypes.c_void_p
    assert lib.getCreators(ctypes.byref(count)) and count.value == 2
