"""The acceptance step as ONNX: the plain-op graph equals speculative/core.py in onnxruntime; the plugin form
is one DFlashAccept node that TensorRT maps to plugins/dflash."""

from __future__ import annotations

import onnx
import pytest
import torch

from trtllm_dflash.compile.accept_graph import (
    INPUTS, OUTPUTS, PLUGIN_NAMESPACE, accept_step, export_accept_graph, plugin_accept_graph,
)
from trtllm_dflash.speculative.core import (
    Sampling, accepted_lengths, block_input, bonus_tokens, gumbel_noise, sample_tokens,
)

ort = pytest.importorskip("onnxruntime")
BLOCK, MASK = 8, 3


def cases(seed: int, batch: int, vocab: int, block: int = BLOCK):
    """Random verify passes whose drafts match the target's tokens for 0..K positions, greedy and sampled."""
    g = torch.Generator().manual_seed(seed)
    K = block - 1
    logits = torch.randint(-2, 3, (batch, K + 1, vocab), generator=g).float()  # small integers: many ties
    logits[batch // 2:] = torch.randn(batch - batch // 2, K + 1, vocab, generator=g) * 3
    temperature = torch.where(torch.rand(batch, generator=g) < 0.5, 0.0, 0.3 + torch.rand(batch, generator=g))
    seeds = torch.randint(0, 2**62, (batch,), generator=g).tolist()
    starts = torch.randint(0, 100, (batch,), generator=g)
    positions = starts[:, None] + 1 + torch.arange(K + 1)
    target = sample_tokens(logits, Sampling.plain(temperature, seeds), positions)  # the reference's own tokens
    draft = target[:, :-1].clone()
    for b, keep in enumerate(torch.randint(0, K + 1, (batch,), generator=g).tolist()):  # accept `keep` drafts
        draft[b, keep:] = (draft[b, keep:] + 1 + torch.randint(0, vocab - 1, (K - keep,), generator=g)) % vocab
    noise = torch.stack([torch.stack([gumbel_noise(s, int(p), vocab) for p in row]) for s, row in zip(seeds, positions)])
    accepted = accepted_lengths(draft, target)
    expected = {
        "accepted": accepted,
        "committed_tokens": torch.where(torch.arange(K + 1) <= accepted[:, None], target, -1),
        "next_block": block_input(bonus_tokens(target, accepted), MASK, block),
        "next_positions": (starts + accepted + 1)[:, None] + torch.arange(block),
        "new_context_lengths": starts + accepted + 1,
    }
    return (draft, logits, temperature, noise, starts), expected


@pytest.fixture(scope="module")
def plain_graph(tmp_path_factory):
    return export_accept_graph(tmp_path_factory.mktemp("accept") / "accept.onnx", MASK)


def test_torch_form_equals_core():
    seen = set()
    for seed in range(20):
        inputs, expected = cases(seed, batch=16, vocab=50)
        got = dict(zip(OUTPUTS, accept_step(*inputs, MASK, BLOCK)))
        for name in OUTPUTS:
            assert torch.equal(got[name], expected[name]), name
        seen |= set(expected["accepted"].tolist())
    assert seen == set(range(BLOCK))  # every accepted length occurred


def test_plain_graph_in_onnxruntime_equals_core(plain_graph):
    model = onnx.load(str(plain_graph))
    onnx.checker.check_model(model, full_check=True)
    ops = {n.op_type for n in model.graph.node}
    assert {"ArgMax", "CumSum", "GatherElements"} <= ops and "CumProd" not in ops, ops
    session = ort.InferenceSession(str(plain_graph), providers=["CPUExecutionProvider"])
    # batch, block and vocab are dynamic
    for seed, (batch, vocab, block) in enumerate([(16, 50, 8), (3, 500, 8), (1, 2, 2), (32, 101, 16), (5, 60, 4)]):
        inputs, expected = cases(100 + seed, batch, vocab, block)
        got = session.run(list(OUTPUTS), {n: t.numpy() for n, t in zip(INPUTS, inputs)})
        for name, value in zip(OUTPUTS, got):
            assert torch.equal(torch.from_numpy(value), expected[name]), (seed, name)


def test_plugin_form_is_one_dflash_accept_node(tmp_path):
    path = plugin_accept_graph(tmp_path / "accept_plugin.onnx", MASK, BLOCK)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    (node,) = model.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.op_type, node.domain) == ("DFlashAccept", PLUGIN_NAMESPACE)
    assert attrs == {"plugin_namespace": PLUGIN_NAMESPACE.encode(), "plugin_version": b"1", "block_size": BLOCK,
                     "mask_token_id": MASK}
    assert [i.name for i in model.graph.input] == list(INPUTS) and [o.name for o in model.graph.output] == list(OUTPUTS)
    with pytest.raises(Exception, match="DFlashAccept"):  # onnxruntime has no kernel for it: TensorRT's node
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_plain_graph_builds_with_tensorrt_rtx(plain_graph):
    """Ahead of time, on this CPU: ArgMax becomes TopK, CumSum a cumulative layer; SM89 and SM120."""
    trt = pytest.importorskip("tensorrt_rtx_bindings", reason="pip install 'trtllm-dflash[tensorrt-rtx]'")
    from trtllm_dflash.compile.tensorrt_build import DimRange, build_plan, layer_types, parse_graph

    shapes = {"batch": DimRange(1, 8, 32), "drafts": DimRange(1, 15, 63), "drafts + 1": DimRange(2, 16, 64),
              "vocab": DimRange(2, 4096, 200_000)}
    assert build_plan(trt, plain_graph, dtype_note="float32", shapes=shapes, targets=["SM89", "SM120"])
    layers = layer_types(parse_graph(trt, plain_graph).network)
    assert layers["TOPK"] == 1 and layers["CUMULATIVE"] == 1, layers


# --- what a compiler may do to the plan's arithmetic (issue 27) -------------------------------------------------

def divide_then_add(logits, temperature, noise):
    """The graph's where(T > 0, logits / T + noise, logits) as torch (and onnxruntime on the CPU) evaluate it."""
    sampled = (temperature > 0)[:, None, None]
    return torch.where(sampled, logits / temperature[:, None, None] + noise, logits)


def reciprocal_fma(logits, temperature, noise):
    """The same as TensorRT may fuse it: a multiply by float32(1 / T), then one rounding of product + noise (FMA)."""
    sampled = (temperature > 0)[:, None, None]
    inverse = (1.0 / temperature).float().double()[:, None, None]
    return torch.where(sampled, (logits.double() * inverse + noise.double()).float(), logits)


def near_tie(seed: int, temperature: float, vocab: int = 64):
    """A sampled row (request seed `seed`, one position) whose two best tokens are so close that the two forms above
    order them differently: logits chosen around the Gumbel noise of that very seed and position."""
    from trtllm_dflash.speculative.core import gumbel_rows

    noise = gumbel_rows(seed, torch.tensor([1]), vocab)[0]
    T = torch.tensor([temperature])
    g = torch.Generator().manual_seed(seed)
    up, down = torch.tensor(1e9), torch.tensor(-1e9)
    for _ in range(100):
        base = float(torch.randn(1, generator=g)) * 3
        logits = torch.full((1, 1, vocab), -1e4)
        logits[0, 0, 0] = (base - noise[0]) * temperature
        tie = torch.tensor((base - float(noise[1])) * temperature)
        for steps in range(-10, 11):  # token 1 a few float32 steps either side of the tie
            logits[0, 0, 1] = tie
            for _ in range(abs(steps)):
                logits[0, 0, 1] = torch.nextafter(logits[0, 0, 1], up if steps > 0 else down)
            n = noise[None, None]
            if not torch.equal(divide_then_add(logits, T, n).argmax(-1), reciprocal_fma(logits, T, n).argmax(-1)):
                return logits, T
    raise AssertionError("no near-tie found")


def test_the_plan_inputs_choose_the_same_token_whatever_the_compiler_fuses():
    from trtllm_dflash.speculative.core import AcceptPlanInputs, Sampling, gumbel_rows, sample_tokens

    found = 0
    for seed in range(6):
        logits, T = near_tie(seed, temperature=0.7 + 0.13 * seed)  # 1 / T inexact: T != 1
        sampling, positions = Sampling.plain(T, [seed]), torch.tensor([[1]])
        want = sample_tokens(logits, sampling, positions)
        # the raw inputs (logits, T, noise): the two forms disagree, so a fused plan could pick another token
        raw = (logits, T, gumbel_rows(seed, positions[0], logits.shape[-1])[None])
        assert not torch.equal(divide_then_add(*raw).argmax(-1), reciprocal_fma(*raw).argmax(-1))
        # the plan's inputs: scores with T = 1 and noise 0, for which both forms are exact
        plan = AcceptPlanInputs.make(logits, sampling, positions)
        inputs = (plan.scores, plan.temperature, plan.noise)
        assert torch.equal(divide_then_add(*inputs).argmax(-1), want)
        assert torch.equal(reciprocal_fma(*inputs).argmax(-1), want)
        found += 1
    assert found == 6
    # greedy rows keep their logits and temperature 0
    logits = torch.randn(2, 3, 10)
    plan = AcceptPlanInputs.make(logits, Sampling.greedy(2), torch.zeros(2, 3, dtype=torch.long))
    assert torch.equal(plan.scores, logits) and plan.temperature.tolist() == [0.0, 0.0] and not plan.noise.any()


def test_plain_graph_with_the_plan_inputs_equals_core(plain_graph):
    """accept.onnx given AcceptPlanInputs (what both executors now give it) accepts and picks the bonus token as core."""
    from trtllm_dflash.speculative.core import AcceptPlanInputs

    session = ort.InferenceSession(str(plain_graph), providers=["CPUExecutionProvider"])
    for seed in range(5):
        (draft, logits, temperature, _, starts), _ = cases(200 + seed, batch=16, vocab=80)
        seeds = torch.randint(0, 2**62, (16,), generator=torch.Generator().manual_seed(seed)).tolist()
        sampling = Sampling.plain(temperature, seeds)
        positions = starts[:, None] + 1 + torch.arange(logits.shape[1])
        target = sample_tokens(logits, sampling, positions)
        accepted = accepted_lengths(draft, target)
        plan = AcceptPlanInputs.make(logits, sampling, positions)
        feed = dict(zip(INPUTS, (draft, plan.scores, plan.temperature, plan.noise, starts)))
        got = dict(zip(OUTPUTS, session.run(list(OUTPUTS), {k: v.numpy() for k, v in feed.items()})))
        assert torch.equal(torch.from_numpy(got["accepted"]), accepted)
        assert torch.equal(torch.from_numpy(got["next_block"][:, 0]), bonus_tokens(target, accepted))
