"""The folded fusion (export/fusion.py) equals the plain equations of docs/concepts/fusion.md ("What AdapterHub computes")
(tests/reference.py), block by block on random weights, at both sites an adapter sits: after the FFN and after the
attention block, with the pretrained LayerNorm before the adapters (Pfeiffer, ``ln_before``) or not (Houlsby). The
assembled model is batch-invariant and stateless."""

import itertools

import pytest
import torch

from fusionserve.export.build import build_model
from fusionserve.export.checkpoint import AdapterLayer, FusionLayer
from fusionserve.export.fusion import AdapterLayerBlock, PlainBlock, fold_adapter, fold_fusion, fold_nothing
from fusionserve.export.nonlinearity import ACTIVATIONS
from fusionserve.export.spec import load_spec
from tests.adapterhub_models import PAIRS, SENTENCES, TASKS
from tests.backbone_models import ARCHS
from tests.reference import plain_adapter, plain_fusion

HIDDEN = 32
TOL = 1e-5
# Bottleneck sizes per N, deliberately mixed so the zero-padding path of the folded block is exercised.
BOTTLENECKS = {1: [8], 2: [4, 16], 5: [8, 4, 16, 2, 8]}
# Adapter weights at std 0.3 and fusion weights at 0.15 give a softmax that is clearly non-uniform yet not
# one-hot (max weight ~0.6 for N = 5), so the scores, not just the argmax, are checked.
ADAPTER_STD, FUSION_STD = 0.3, 0.15
# (query, key, value, query_before_ln): every combination the folded block accepts; value off = 'static'.
FLAGS = list(itertools.product([True, False], repeat=4))
# The adapters' input: LN(f + a) (original_ln_before: seq_bn, Pfeiffer) or f (double_seq_bn, Houlsby).
LN_BEFORE = pytest.mark.parametrize("ln_before", [True, False], ids=["ln-before", "houlsby"])


def _flag_id(flags):
    return "-".join(f"{name}{'+' if on else '-'}" for name, on in zip(("q", "k", "v", "qbln"), flags, strict=True))


def _adapter(gen: torch.Generator, r: int) -> AdapterLayer:
    def rand(*shape):
        return torch.randn(*shape, generator=gen) * ADAPTER_STD

    return AdapterLayer(down_w=rand(r, HIDDEN), down_b=rand(r), up_w=rand(HIDDEN, r), up_b=rand(HIDDEN))


def _fusion(gen: torch.Generator, query: bool, key: bool, value: bool) -> FusionLayer:
    def rand(*shape):
        return torch.randn(*shape, generator=gen) * FUSION_STD

    return FusionLayer(
        query_w=rand(HIDDEN, HIDDEN) if query else None,
        query_b=rand(HIDDEN) if query else None,
        key_w=rand(HIDDEN, HIDDEN) if key else None,
        key_b=rand(HIDDEN) if key else None,
        value_w=rand(HIDDEN, HIDDEN) if value else None,
    )


def _layer_norm(gen: torch.Generator) -> torch.nn.LayerNorm:
    # A non-identity affine part, so a wrong placement of LN (or using it once instead of twice) shows.
    ln = torch.nn.LayerNorm(HIDDEN)
    with torch.no_grad():
        ln.weight.copy_(1 + 0.3 * torch.randn(HIDDEN, generator=gen))
        ln.bias.copy_(0.3 * torch.randn(HIDDEN, generator=gen))
    return ln


def _inputs(gen: torch.Generator, batch: int = 3, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.randn(batch, seq, HIDDEN, generator=gen)  # sub-layer output before the residual (FFN or attention)
    a = torch.randn(batch, seq, HIDDEN, generator=gen)  # the residual: the sub-layer's input
    return f, a


def _run(block, f, a, ln, task=0, bias=None):
    """The block on f: the projection ``mm`` = f without a bias, unless one is given (then f = mm + bias, see
    test_projection_bias_is_part_of_f: a split of f into mm + bias is not exact in float32)."""
    bias = torch.zeros(HIDDEN) if bias is None else bias
    mm = f if not bias.any() else f - bias
    mm0, a0 = mm.clone(), a.clone()
    with torch.no_grad():
        out, s = block(mm, bias, a, ln, torch.tensor([task]))
    # the blocks must not edit their inputs in place: the caller reuses them
    assert torch.equal(mm, mm0) and torch.equal(a, a0)
    return out, s


@LN_BEFORE
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("n", sorted(BOTTLENECKS))
@pytest.mark.parametrize("flags", FLAGS, ids=_flag_id)
def test_folded_fusion_equals_plain(flags, n, act, ln_before):
    query, key, value, query_before_ln = flags
    gen = torch.Generator().manual_seed(1000 * n + sum(1 << i for i, on in enumerate(flags) if on) + 99 * ln_before)
    adapters = [_adapter(gen, r) for r in BOTTLENECKS[n]]
    fusion = _fusion(gen, query, key, value)
    ln = _layer_norm(gen)
    f, a = _inputs(gen)

    r = max(BOTTLENECKS[n])
    block = AdapterLayerBlock(adapters, act, [fold_fusion(adapters, r, list(range(n)), fusion, query_before_ln)], ln_before)
    assert block.r == r  # the padding path is taken whenever sizes differ
    out, s = _run(block, f, a, ln)
    with torch.no_grad():
        ref_out, ref_s = plain_fusion(f, a, ln, adapters, act, fusion, query_before_ln, ln_before)

    assert out.shape == f.shape and s.shape == (*f.shape[:2], n)
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=TOL, rtol=0)
    if n > 1:  # guard against a test that passes on a trivial (uniform) softmax
        assert (ref_s.max(-1).values - ref_s.min(-1).values).mean() > 0.05


@pytest.mark.parametrize(
    ("n_total", "positions"),
    [(5, [0, 2, 3]), (5, [4, 1]), (3, [2]), (4, [0, 1, 2])],
    ids=["some-absent", "unordered", "one-present", "last-absent"],
)
@pytest.mark.parametrize("query_before_ln", [False, True])
@LN_BEFORE
def test_folded_fusion_over_part_of_the_stack(n_total, positions, query_before_ln, ln_before):
    """The layer's stack holds adapters the task does not fuse (other tasks' adapters, or the task's own left
    out of this layer): the softmax runs over the fused ones alone and reports exactly zero for the others."""
    gen = torch.Generator().manual_seed(7 * n_total + len(positions))
    stack = [_adapter(gen, r) for r in [16, 4, 8, 2, 8][:n_total]]
    adapters = [stack[p] for p in positions]
    fusion = _fusion(gen, query=True, key=True, value=True)
    ln = _layer_norm(gen)
    f, a = _inputs(gen)

    block = AdapterLayerBlock(stack, "relu", [fold_fusion(stack, 16, positions, fusion, query_before_ln)], ln_before)
    out, s = _run(block, f, a, ln)
    with torch.no_grad():
        ref_out, ref_s = plain_fusion(f, a, ln, adapters, "relu", fusion, query_before_ln, ln_before)

    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=0)
    assert s.shape == (*f.shape[:2], n_total)
    absent = [p for p in range(n_total) if p not in positions]
    assert torch.all(s[..., absent] == 0)
    torch.testing.assert_close(s[..., positions], ref_s, atol=TOL, rtol=0)
    torch.testing.assert_close(s.sum(-1), torch.ones(f.shape[:2]), atol=TOL, rtol=0)


@LN_BEFORE
@pytest.mark.parametrize("task", ["fusion", "adapter", "nothing"])
def test_projection_bias_is_part_of_f(ln_before, task):
    """The blocks take the site's projection and its bias apart (the bias joins the adapters' mix before the
    projection does, for ONNX Runtime's attention fusion): the result is the plain equations on f = mm + bias."""
    gen = torch.Generator().manual_seed(5 + ln_before)
    stack = [_adapter(gen, r) for r in (8, 4)]
    fusion = _fusion(gen, True, True, True)
    ln = _layer_norm(gen)
    mm, a = _inputs(gen)
    bias = torch.randn(HIDDEN, generator=gen)
    f = mm + bias  # what AdapterHub's sub-layer hands its adapters (dense with bias)
    folded = {"fusion": fold_fusion(stack, 8, [0, 1], fusion, False), "adapter": fold_adapter(stack, 8, 1)}
    block = AdapterLayerBlock(stack, "silu", [folded.get(task, fold_nothing(stack, 8))], ln_before)
    with torch.no_grad():
        out, _ = block(mm, bias, a, ln, torch.tensor([0]))
        plain, _ = PlainBlock()(mm, bias, a, ln, torch.tensor([0]))
        want = {
            "fusion": lambda: plain_fusion(f, a, ln, stack, "silu", fusion, False, ln_before)[0],
            "adapter": lambda: plain_adapter(f, a, ln, stack[1], "silu", ln_before),
            "nothing": lambda: ln(f + a),
        }[task]()
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    torch.testing.assert_close(plain, ln(f + a), atol=TOL, rtol=0)
    if task != "nothing":
        assert (want - ln(f + a)).abs().max() > 1e-2  # the adapters change the output: not a vacuous comparison


def test_block_needs_adapters_and_tasks():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="at least one adapter and one task"):
        AdapterLayerBlock([_adapter(gen, 4)], "relu", [])


@LN_BEFORE
def test_tasks_share_one_stack(ln_before):
    """Several tasks in one block (fusions over different subsets, a single adapter, nothing): each task index
    gives exactly what that task alone gives."""
    gen = torch.Generator().manual_seed(11)
    stack = [_adapter(gen, r) for r in (8, 4, 8)]
    fusions = [_fusion(gen, True, True, True), _fusion(gen, True, False, False)]
    ln = _layer_norm(gen)
    f, a = _inputs(gen)
    tasks = [
        fold_fusion(stack, 8, [0, 1, 2], fusions[0], False),
        fold_fusion(stack, 8, [2, 0], fusions[1], True),
        fold_adapter(stack, 8, 1),
        fold_nothing(stack, 8),
    ]
    block = AdapterLayerBlock(stack, "gelu", tasks, ln_before)
    with torch.no_grad():
        want = [
            plain_fusion(f, a, ln, stack, "gelu", fusions[0], False, ln_before)[0],
            plain_fusion(f, a, ln, [stack[2], stack[0]], "gelu", fusions[1], True, ln_before)[0],
            plain_adapter(f, a, ln, stack[1], "gelu", ln_before),
            ln(f + a),
        ]
    for t, ref in enumerate(want):
        out, s = _run(block, f, a, ln, task=t)
        torch.testing.assert_close(out, ref, atol=TOL, rtol=0, msg=f"task {t}")
    _, s = _run(block, f, a, ln, task=3)
    assert torch.all(s == 0)  # nothing mixed, nothing reported
    _, s = _run(block, f, a, ln, task=2)
    assert torch.all(s[..., 1] == 1) and torch.all(s[..., [0, 2]] == 0)
    assert not torch.equal(want[0], want[1])


@LN_BEFORE
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("r", [1, 8, 16])
def test_adapter_block_equals_plain(act, r, ln_before):
    gen = torch.Generator().manual_seed(r)
    adapter = _adapter(gen, r)
    ln = _layer_norm(gen)
    f, a = _inputs(gen)
    out, s = _run(AdapterLayerBlock([adapter], act, [fold_adapter([adapter], r, 0)], ln_before), f, a, ln)
    with torch.no_grad():
        ref = plain_adapter(f, a, ln, adapter, act, ln_before)
    assert torch.all(s == 1)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
    assert (ref - ln(f + a)).abs().max() > 1e-2  # the adapter changes the output: the comparison is not vacuous


# --- the assembled model -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(built_st):
    return build_model(load_spec(built_st.spec))


def _texts():
    return [(s, None) for s in SENTENCES] + list(PAIRS)


def _encode(tok, texts, padding):
    firsts = [t[0] for t in texts]
    seconds = [t[1] for t in texts]
    if all(s is None for s in seconds):
        return tok(firsts, padding=padding, return_tensors="pt")
    return tok(firsts, seconds, padding=padding, return_tensors="pt")


def _forward(model, batch, task):
    kind = TASKS[task][0]
    with torch.no_grad():
        out = model.classify(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], task=task,
                    return_fusion_activations=kind == "fusion")  # fmt: skip
    return out if kind == "fusion" else (out, None)


@pytest.mark.parametrize("task", list(TASKS))
def test_batched_equals_one_by_one(built_st, model, task):
    """Padding must not leak into real tokens: each text alone, unpadded, gives what it gets in a padded batch."""
    tok = built_st.tokenizer
    texts = _texts()
    singles = _encode(tok, texts[: len(SENTENCES)], padding=True)
    pairs = _encode(tok, texts[len(SENTENCES) :], padding=True)
    for batch, group in ((singles, texts[: len(SENTENCES)]), (pairs, texts[len(SENTENCES) :])):
        assert (batch["attention_mask"] == 0).any()  # the batch really is padded
        logits, acts = _forward(model, batch, task)
        for i, text in enumerate(group):
            alone = _encode(tok, [text], padding=False)
            one_logits, one_acts = _forward(model, alone, task)
            torch.testing.assert_close(logits[i : i + 1], one_logits, atol=TOL, rtol=0, msg=f"{task}: text {i}")
            if acts is not None:  # fusion weights of the real tokens agree too
                n_tokens = alone["input_ids"].shape[1]
                torch.testing.assert_close(acts[i : i + 1, :, :n_tokens], one_acts, atol=TOL, rtol=0)


def _snapshot(model):
    """Every tensor the model holds (non-persistent buffers included) and every plain attribute of every
    module, such as a temperature that AdapterHub anneals in forward."""
    tensors = {f"param:{k}": v.detach().clone() for k, v in model.named_parameters()}
    tensors |= {f"buffer:{k}": v.detach().clone() for k, v in model.named_buffers()}
    tensors |= {f"state:{k}": v.detach().clone() for k, v in model.state_dict().items()}
    scalars = {
        (name, attr): value
        for name, mod in model.named_modules()
        for attr, value in vars(mod).items()
        if isinstance(value, (bool, int, float, str, type(None)))
    }
    return tensors, scalars


def test_forward_changes_no_state(built_st, model):
    tok = built_st.tokenizer
    batch = _encode(tok, _texts()[: len(SENTENCES)], padding=True)
    inputs_before = {k: v.clone() for k, v in batch.items()}
    tensors_before, scalars_before = _snapshot(model)

    for task in TASKS:
        first = _forward(model, batch, task)
        second = _forward(model, batch, task)
        assert torch.equal(first[0], second[0]), task
        if first[1] is not None:
            assert torch.equal(first[1], second[1]), task

    tensors_after, scalars_after = _snapshot(model)
    assert tensors_after.keys() == tensors_before.keys()
    changed = [k for k in tensors_before if not torch.equal(tensors_before[k], tensors_after[k])]
    assert not changed, f"forward changed {changed}"
    assert scalars_after == scalars_before
    assert not model.training
    assert all(torch.equal(batch[k], inputs_before[k]) for k in inputs_before)  # inputs are not edited in place


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_side_block_of_a_houlsby_model_equals_plain(arch_models, arch):
    """At the attention-side site of a real model (AdapterHub's Houlsby adapters and fusion, as saved): the block fed
    the attention projection, its bias, the layer input and the attention LayerNorm gives the plain equations on
    f = that projection's output and a = the layer input, with the adapters reading f (no LayerNorm before)."""
    from fusionserve.export.backbone import attention_bias
    from fusionserve.export.checkpoint import Site, load_adapter, load_fusion

    built = arch_models(arch, "double_seq_bn")
    spec = load_spec(built.spec)
    model = build_model(spec)
    adapters = {n: load_adapter(p) for n, p in spec.adapters.items()}
    fusion = load_fusion(spec.tasks["dyn"].fusion)
    batch = built.tokenizer([p[0] for p in PAIRS], [p[1] for p in PAIRS], padding=True, return_tensors="pt")
    bb, task_id = model.backbone, torch.tensor([model.task_index["dyn"]])
    with torch.no_grad():
        h = bb.embed(batch["input_ids"], batch.get("token_type_ids"))  # the first layer's input
        bias = attention_bias(batch["attention_mask"], h.dtype)
        for layer in range(bb.n_layers):
            site = Site(layer, "attention")
            dense, ln = bb.attention_output(layer)
            mm = torch.nn.functional.linear(bb.context(layer, h, bias), dense.weight)
            out, s = model.blocks[site.index](mm, dense.bias, h, ln, task_id)
            present = [n for n in fusion.adapter_names if site in adapters[n].sites]
            want, s_ref = plain_fusion(mm + dense.bias, h, ln, [adapters[n].sites[site] for n in present], "swish",
                                       fusion.sites[site], ln_before=False)  # fmt: skip
            block = model.blocks[site.index]
            assert isinstance(block, AdapterLayerBlock) and not block.ln_before and block.act_name == "swish"
            torch.testing.assert_close(out, want, atol=TOL, rtol=0, msg=str(site))
            columns = [model.stacks[model.sites.index(site)].index(n) for n in present]
            torch.testing.assert_close(s[..., columns], s_ref, atol=TOL, rtol=0)
            assert (want - ln(mm + dense.bias + h)).abs().max() > 1e-2  # the adapters change the output here
            h, _ = model.blocks[site.index + 1](  # on to the next layer through the FFN-side site
                torch.nn.functional.linear(bb.intermediate(layer, out), bb.ffn_output(layer)[0].weight),
                bb.ffn_output(layer)[0].bias, out, bb.ffn_output(layer)[1], task_id,
            )  # fmt: skip
