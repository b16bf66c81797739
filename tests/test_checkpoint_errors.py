"""Bad checkpoints give typed errors (CheckpointError, or SpecError where the spec is at fault) that name the file or
folder: checkpoints that do not fit together; missing, extra, misshapen and unreadable weights (both formats); a bad
base model. Every case starts from a copy of folders AdapterHub saved (the ``root`` and ``any_root`` fixtures in
conftest.py) and tampers with one thing."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusionserve.errors import CheckpointError, SpecError
from fusionserve.export.head import MAX_LABELS
from tests.checkpoint_helpers import (
    WEIGHT_FILES,
    _all_of,
    _build,
    _edit_json,
    _edit_spec,
    _edit_weights,
    _key,
    _set_config,
    _weight_path,
)

CONFIG_FILES = {"adapter": "adapter_config.json", "fusion": "adapter_fusion_config.json", "head": "head_config.json"}
# The folder of each kind that build_model reads first, so a fault planted there is the one reported.
FOLDERS = {"adapter": "adapters/alpha", "fusion": "fusions/rte", "head": "heads/rte"}

# Tampered files are untrusted input: a pickle in a .bin must never run code. _evil records it if it does.
CODE_RAN: list[str] = []


def _evil(note: str) -> str:
    CODE_RAN.append(note)
    return note


class Evil:
    def __reduce__(self):
        return (_evil, ("unpickled",))


# --- how the checkpoints fit together -----------------------------------------------------------------------


def test_fusion_names_adapter_the_spec_lacks(root):
    def drop_gamma(d):
        del d["adapters"]["gamma"]

    _edit_spec(root, drop_gamma)
    with pytest.raises(SpecError, match=_all_of(root / "fusions/rte", "'rte'", "['gamma']", "spec adapters: alpha, beta")):
        _build(root)


def test_hidden_size_in_config_disagrees_with_weights(root):
    """The config says 64, the weights (and the base) are 32: the message must carry both numbers."""
    folder = root / "adapters/alpha"
    _edit_json(folder / "adapter_config.json", lambda d: d.update(hidden_size=64))
    with pytest.raises(CheckpointError, match=_all_of(folder)) as info:
        _build(root)
    rest = str(info.value).replace(str(folder), "")  # the numbers must be in the text, not just in the tmp path
    assert "32" in rest and "64" in rest, rest


def test_adapter_for_another_base_model(root):
    """Config and weights agree on hidden 64, the base has 32: an adapter trained on another model."""
    folder = root / "adapters/alpha"
    _edit_json(folder / "adapter_config.json", lambda d: d.update(hidden_size=64))

    def widen(state):
        gen = torch.Generator().manual_seed(0)
        for k, v in state.items():
            state[k] = torch.randn([64 if s == 32 else s for s in v.shape], generator=gen)

    _edit_weights(folder, "adapter", widen)
    with pytest.raises(CheckpointError, match=_all_of(folder, "hidden_size 64", "hidden_size 32")):
        _build(root)


def test_fused_adapters_with_different_activations(root):
    _set_config(root / "adapters/gamma/adapter_config.json", non_linearity="gelu")
    with pytest.raises(CheckpointError, match=_all_of(root / "model.yaml", "non_linearity", "gamma=gelu", "alpha=relu")):
        _build(root)


def test_fusion_missing_a_layer(root):
    """Layer 1 holds adapters alpha and gamma, so the fusion must have weights there."""

    def drop_layer_1(state):
        for k in [k for k in state if ".layer.1." in k]:
            del state[k]

    _edit_weights(root / "fusions/rte", "fusion", drop_layer_1)
    with pytest.raises(CheckpointError, match=_all_of(root / "fusions/rte", "missing fusion weights for layer 1")):
        _build(root)


def test_adapter_weights_for_a_layer_the_base_lacks(root):
    def move_layer_2_to_5(state):
        for k in [k for k in state if ".layer.2." in k]:
            state[k.replace(".layer.2.", ".layer.5.")] = state.pop(k)

    _edit_weights(root / "adapters/alpha", "adapter", move_layer_2_to_5)
    with pytest.raises(CheckpointError, match=_all_of(root / "adapters/alpha", "layer(s) [5]", "3 layers")):
        _build(root)


def test_adapter_missing_a_whole_layer(root):
    def drop_layer_0(state):
        for k in [k for k in state if ".layer.0." in k]:
            del state[k]

    _edit_weights(root / "adapters/alpha", "adapter", drop_layer_0)
    try:
        _build(root)
    except CheckpointError as exc:
        assert str(root / "adapters/alpha") in str(exc)
    else:
        raise AssertionError("served alpha without layer 0 although its leave_out is empty")


# --- missing, extra, misshapen and unreadable weights (both formats) -----------------------------------------


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_missing_config_file(root, kind):
    folder = root / FOLDERS[kind]
    (folder / CONFIG_FILES[kind]).unlink()
    with pytest.raises(CheckpointError, match=_all_of(folder, f"missing {CONFIG_FILES[kind]}")):
        _build(root)


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_missing_weight_file(any_root, kind):
    folder = any_root / FOLDERS[kind]
    _weight_path(folder, kind).unlink()
    st, pt = WEIGHT_FILES[kind]
    with pytest.raises(CheckpointError, match=_all_of(folder, "no weights", st, pt)):
        _build(any_root)


@pytest.mark.parametrize(
    ("kind", "suffix", "what"),
    [
        ("adapter", "layer.0.output.adapters.alpha.adapter_up.bias", "layer 0 output: adapter_up.bias"),
        ("adapter", "layer.2.output.adapters.alpha.adapter_down.0.weight", "layer 2 output: adapter_down.0.weight"),
        ("fusion", "layer.1.output.adapter_fusion_layer.alpha,beta,gamma.key.weight", "layer 1 output: key.weight"),
        ("fusion", "layer.0.output.adapter_fusion_layer.alpha,beta,gamma.value.weight", "layer 0 output: value.weight"),
        ("head", "heads.rte.1.bias", "head module 1: bias"),
        ("head", "heads.rte.4.weight", "head module 4: weight"),
    ],
)
def test_missing_tensor(any_root, kind, suffix, what):
    folder = any_root / FOLDERS[kind]
    _edit_weights(folder, kind, lambda state: state.pop(_key(state, suffix)))
    with pytest.raises(CheckpointError, match=_all_of(folder, f"missing weight for {what}")):
        _build(any_root)


@pytest.mark.parametrize(
    ("kind", "suffix", "shape", "what"),
    [
        ("adapter", "layer.0.output.adapters.alpha.adapter_down.0.bias", (7,), "layer 0 output adapter_down.0.bias"),
        ("adapter", "layer.1.output.adapters.alpha.adapter_up.weight", (32, 9), "layer 1 output adapter_up.weight"),
        ("fusion", "layer.2.output.adapter_fusion_layer.alpha,beta,gamma.query.weight", (32, 31), "layer 2 output query.weight"),
        ("head", "heads.rte.4.weight", (4, 32), "heads.4.weight"),
    ],
)
def test_wrong_tensor_shape(any_root, kind, suffix, shape, what):
    folder = any_root / FOLDERS[kind]

    def reshape(state):
        key = _key(state, suffix)
        state[key] = torch.zeros(shape)

    _edit_weights(folder, kind, reshape)
    with pytest.raises(CheckpointError, match=_all_of(folder, f"'{what}' has shape {shape}")):
        _build(any_root)


@pytest.mark.parametrize("kind", list(FOLDERS))
def test_unexpected_tensor(any_root, kind):
    folder = any_root / FOLDERS[kind]
    _edit_weights(folder, kind, lambda state: state.update({"bert.pooler.dense.weight": torch.zeros(32, 32)}))
    with pytest.raises(CheckpointError, match=_all_of(folder, "unexpected weight 'bert.pooler.dense.weight'")):
        _build(any_root)


def test_fusion_weights_under_another_fusion_name(root):
    folder = root / "fusions/rte"

    def rename(state):
        for k in list(state):
            state[k.replace("alpha,beta,gamma", "alpha,beta")] = state.pop(k)

    _edit_weights(folder, "fusion", rename)
    with pytest.raises(CheckpointError, match=_all_of(folder, "belongs to fusion 'alpha,beta'", "'alpha,beta,gamma'")):
        _build(root)


def test_fusion_weights_the_flags_do_not_use(root):
    _set_config(root / "fusions/rte/adapter_fusion_config.json", value=False)
    with pytest.raises(CheckpointError, match=_all_of(root / "fusions/rte", "['value.weight']", "do not use")):
        _build(root)


def test_corrupt_weight_file(root):
    path = root / "adapters/alpha/adapter.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=_all_of("cannot read weights from", path)):
        _build(root)


def _replace_with_bin(folder: Path, obj: object) -> Path:
    (folder / "adapter.safetensors").unlink()
    path = folder / "pytorch_adapter.bin"
    torch.save(obj, path)
    return path


@pytest.mark.parametrize("make", [lambda key: {key: Evil()}, lambda key: {key: torch.zeros(1), "extra": Evil()}])
def test_pickled_code_in_bin_is_refused_without_running(root, make):
    folder = root / "adapters/alpha"
    key = next(iter(load_file(str(folder / "adapter.safetensors"))))
    path = _replace_with_bin(folder, make(key))
    CODE_RAN.clear()
    with pytest.raises(CheckpointError, match=_all_of("refused to load", path)):
        _build(root)
    assert not CODE_RAN  # torch.load(weights_only=True) refused the global before calling it


def test_bin_that_is_not_a_state_dict(root):
    path = _replace_with_bin(root / "adapters/alpha", [torch.zeros(8, 32)])
    with pytest.raises(CheckpointError, match=_all_of(path, "expected a state dict, got list")):
        _build(root)


@pytest.mark.parametrize("entry", ["value", "key"])
def test_bin_with_a_non_tensor_entry(root, entry):
    """weights_only=True lets plain Python values (and keys) through; they must still be refused by name."""
    folder = root / "adapters/alpha"
    state = load_file(str(folder / "adapter.safetensors"))
    key = _key(state, "layer.0.output.adapters.alpha.adapter_down.0.weight")
    if entry == "value":
        path, shown = _replace_with_bin(folder, {**state, key: 3}), (repr(key), "int")
    else:
        path, shown = _replace_with_bin(folder, {**state, 0: state[key]}), ("key 0", "weight name")
    with pytest.raises(CheckpointError, match=_all_of(path, *shown)):
        _build(root)


# --- the base model ---------------------------------------------------------------------------------------


def test_base_model_without_weights(root):
    (root / "base/model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=_all_of(root / "base", "cannot load the base model weights")):
        _build(root)


def test_base_model_missing_a_tensor(root):
    path = root / "base/model.safetensors"
    state = load_file(str(path))
    key = _key(state, "encoder.layer.1.output.LayerNorm.weight")
    del state[key]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=_all_of(root / "base", "missing", "encoder.layer.1.output.LayerNorm.weight")):
        _build(root)


def test_base_model_of_an_unsupported_architecture(root):
    _edit_json(root / "base/config.json", lambda d: d.update(model_type="gpt2"))
    supported = "supported: bert, roberta, xlm-roberta, distilbert"
    with pytest.raises(CheckpointError, match=_all_of(root / "base/config.json", "'model_type' = 'gpt2'", supported)):
        _build(root)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("position_embedding_type", "relative_key", "only 'absolute'"),
        ("is_decoder", True, "only encoders (is_decoder false)"),
        ("add_cross_attention", True, "only encoders (add_cross_attention false)"),
    ],
)
def test_base_model_config_refused_with_file_field_value_and_what_is_allowed(root, field, value, allowed):
    _edit_json(root / "base/config.json", lambda d: d.update({field: value}))
    with pytest.raises(CheckpointError, match=_all_of(root / "base/config.json", f"field '{field}' = {value!r}", allowed)):
        _build(root)


def test_a_head_over_the_label_limit_is_refused(root):
    """Every task's logits are padded to the widest head's labels: one head of 10^6 labels took 45 s and 4.7 GB."""
    folder = root / "heads/head_only"
    weights = load_file(folder / "model_head.safetensors")
    n = MAX_LABELS + 1
    weights["heads.head_only.4.weight"], weights["heads.head_only.4.bias"] = torch.zeros(n, 32), torch.zeros(n)
    save_file(weights, folder / "model_head.safetensors")  # a real head of that width: it loads on the old code
    _set_config(folder / "head_config.json", num_labels=n, label2id=None)
    with pytest.raises(CheckpointError, match=_all_of(folder / "head_config.json", "100,001 is over the limit of 100,000")):
        _build(root)
