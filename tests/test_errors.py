"""Bad specs and bad checkpoints give typed errors (SpecError / CheckpointError) that name the file or folder and,
for refused configurations, the field and its value. Every case starts from a copy of folders AdapterHub saved
and tampers with one thing."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from fusionserve.errors import CheckpointError, SpecError
from fusionserve.export.model import build_model
from fusionserve.export.spec import load_spec
from tests.adapterhub_models import SENTENCES

WEIGHT_FILES = {
    "adapter": ("adapter.safetensors", "pytorch_adapter.bin"),
    "fusion": ("model_adapter_fusion.safetensors", "pytorch_model_adapter_fusion.bin"),
    "head": ("model_head.safetensors", "pytorch_model_head.bin"),
}
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


# --- helpers -------------------------------------------------------------------------------------------------


def _copy(src_spec: Path, dst: Path) -> Path:
    shutil.copytree(src_spec.parent, dst)
    return dst.resolve()  # load_spec resolves paths, so messages hold resolved ones


@pytest.fixture
def root(built_st, tmp_path) -> Path:
    """A private copy of a safetensors build, free to tamper with."""
    return _copy(built_st.spec, tmp_path / "model")


@pytest.fixture
def any_root(built, tmp_path) -> Path:
    """A private copy of a build in each weight format (safetensors and .bin), for tests that edit weights."""
    return _copy(built.spec, tmp_path / "model")


def _all_of(*parts: object) -> str:
    """A regex that matches when every part occurs in the message, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(p))})" for p in parts)


def _build(root: Path):
    return build_model(load_spec(root / "model.yaml"))


def _edit_spec(root: Path, edit) -> Path:
    path = root / "model.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def _set_config(path: Path, **fields) -> None:
    _edit_json(path, lambda d: d["config"].update(fields))


def _weight_path(folder: Path, kind: str) -> Path:
    st, pt = (folder / name for name in WEIGHT_FILES[kind])
    return st if st.is_file() else pt


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)


def _save_weights(path: Path, state: dict[str, torch.Tensor]) -> None:
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)


def _edit_weights(folder: Path, kind: str, edit) -> Path:
    """Rewrite a folder's weight file in its own format after ``edit(state)``; returns the file."""
    path = _weight_path(folder, kind)
    state = _load_weights(path)
    edit(state)
    _save_weights(path, state)
    return path


def _key(state: dict[str, torch.Tensor], suffix: str) -> str:
    (key,) = [k for k in state if k.endswith(suffix)]
    return key


# --- the spec file -------------------------------------------------------------------------------------------


def test_spec_not_found(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match=_all_of("not found", path)):
        load_spec(path)


def test_spec_is_a_folder(tmp_path):
    with pytest.raises(SpecError, match=_all_of("cannot read spec file", tmp_path)):
        load_spec(tmp_path)


@pytest.mark.parametrize(("text", "got"), [("- base\n- tasks\n", "list"), ("just a string\n", "str"), ("", "NoneType")])
def test_spec_not_a_mapping(tmp_path, text, got):
    path = tmp_path / "model.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=_all_of(path, "must be a mapping", got)):
        load_spec(path)


def test_spec_invalid_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("base_model: base\ntasks: {rte: [unclosed\n")
    with pytest.raises(SpecError, match=_all_of(path, "is not valid YAML")):
        load_spec(path)


def test_spec_invalid_json(tmp_path):
    path = tmp_path / "model.json"
    path.write_text('{"base_model": "base",}')
    with pytest.raises(SpecError, match=_all_of(path, "is not valid JSON")):
        load_spec(path)


def test_spec_unknown_top_level_key(root):
    path = _edit_spec(root, lambda d: d.update(heads={"x": "heads/rte"}))
    with pytest.raises(SpecError, match=_all_of(path, "unknown key(s) ['heads']", "allowed")):
        load_spec(path)


@pytest.mark.parametrize("key", ["base_model", "tasks"])
def test_spec_missing_required_key(root, key):
    path = _edit_spec(root, lambda d: d.pop(key))
    with pytest.raises(SpecError, match=_all_of(path, f"missing required key '{key}'")):
        load_spec(path)


def test_spec_without_tasks(root):
    path = _edit_spec(root, lambda d: d.update(tasks={}))
    with pytest.raises(SpecError, match=_all_of(path, "'tasks' is empty")):
        load_spec(path)


def test_task_without_head(root):
    path = _edit_spec(root, lambda d: d["tasks"]["rte"].pop("head"))
    with pytest.raises(SpecError, match=_all_of(path, "tasks.rte", "'head'")):
        load_spec(path)


def test_task_with_unknown_key(root):
    path = _edit_spec(root, lambda d: d["tasks"]["rte"].update(labels="heads/rte"))
    with pytest.raises(SpecError, match=_all_of(path, "tasks.rte", "['labels']")):
        load_spec(path)


def test_task_with_fusion_and_adapter(root):
    path = _edit_spec(root, lambda d: d["tasks"]["rte"].update(adapter="alpha"))
    with pytest.raises(SpecError, match=_all_of(path, "'rte'", "'fusion' or 'adapter', not both")):
        load_spec(path)


def test_task_names_adapter_not_in_spec(root):
    path = _edit_spec(root, lambda d: d["tasks"]["alpha_only"].update(adapter="delta"))
    with pytest.raises(SpecError, match=_all_of(path, "'alpha_only'", "'delta'", "known adapters: alpha, beta, gamma")):
        load_spec(path)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("base_model", "no_such_base"),
        ("adapters.alpha", "adapters/alpha/adapter_config.json"),  # exists, but is a file
        ("tasks.rte.head", "heads/missing"),
    ],
)
def test_path_that_is_not_a_folder(root, where, value):
    def point_elsewhere(data):
        *parents, last = where.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value

    path = _edit_spec(root, point_elsewhere)
    with pytest.raises(SpecError, match=_all_of(path, f"{where} = '{value}' is not a folder")):
        load_spec(path)


def test_folder_without_the_checkpoint_it_should_hold(root):
    """A real folder with the wrong content passes the spec check; the checkpoint reader names what is missing."""
    _edit_spec(root, lambda d: d["tasks"]["rte"].update(fusion="fusions"))
    with pytest.raises(CheckpointError, match=_all_of(root / "fusions", "missing adapter_fusion_config.json")):
        _build(root)


def test_json_spec_with_the_same_keys_works(built_st, root):
    data = yaml.safe_load((root / "model.yaml").read_text())
    (root / "model.json").write_text(json.dumps(data))
    from_json = build_model(load_spec(root / "model.json"))
    from_yaml = _build(root)
    assert from_json.task_infos == from_yaml.task_infos
    batch = built_st.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        for task in from_yaml.task_infos:
            got = from_json.classify(batch["input_ids"], batch["attention_mask"], task=task)
            assert torch.equal(got, from_yaml.classify(batch["input_ids"], batch["attention_mask"], task=task)), task


def test_unknown_task_at_forward(built_st):
    model = build_model(load_spec(built_st.spec))
    batch = built_st.tokenizer(SENTENCES[:1], return_tensors="pt")
    with pytest.raises(SpecError, match=_all_of("unknown task 'sentiment'", "rte", "head_only")):
        model.classify(batch["input_ids"], batch["attention_mask"], task="sentiment")
    with pytest.raises(SpecError, match=_all_of("'alpha_only'", "no fusion")):
        model.classify(batch["input_ids"], batch["attention_mask"], task="alpha_only", return_fusion_activations=True)


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
        ("adapter", "layer.0.output.adapters.alpha.adapter_up.bias", "layer 0: adapter_up.bias"),
        ("adapter", "layer.2.output.adapters.alpha.adapter_down.0.weight", "layer 2: adapter_down.0.weight"),
        ("fusion", "layer.1.output.adapter_fusion_layer.alpha,beta,gamma.key.weight", "layer 1: key.weight"),
        ("fusion", "layer.0.output.adapter_fusion_layer.alpha,beta,gamma.value.weight", "layer 0: value.weight"),
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
        ("adapter", "layer.0.output.adapters.alpha.adapter_down.0.bias", (7,), "layer 0 adapter_down.0.bias"),
        ("adapter", "layer.1.output.adapters.alpha.adapter_up.weight", (32, 9), "layer 1 adapter_up.weight"),
        ("fusion", "layer.2.output.adapter_fusion_layer.alpha,beta,gamma.query.weight", (32, 31), "layer 2 query.weight"),
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


# --- refused configurations: the message names the file, the field and the value ----------------------------


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("architecture", "lora", "'lora'"),
        ("architecture", "prefix_tuning", "'prefix_tuning'"),
        ("use_gating", True, "True"),
        ("phm_layer", True, "True"),
        ("is_parallel", True, "True"),
        ("ln_before", True, "True"),
        ("ln_after", True, "True"),
        ("mh_adapter", True, "True"),
        ("output_adapter", False, "False"),
        ("original_ln_after", False, "False"),
        ("residual_before_ln", False, "False"),
        ("residual_before_ln", "post_add", "'post_add'"),
        ("inv_adapter", "nice", "'nice'"),
        ("scaling", "learned", "'learned'"),
        ("scaling", "channel", "'channel'"),
        ("non_linearity", "weird", "'weird'"),
    ],
)
def test_unsupported_adapter_config(root, field, value, shown):
    path = root / "adapters/alpha/adapter_config.json"
    _set_config(path, **{field: value})
    with pytest.raises(CheckpointError, match=_all_of(path, f"field 'config.{field}' = {shown}", "not supported")):
        _build(root)


def test_adapter_config_unknown_field(root):
    path = root / "adapters/alpha/adapter_config.json"
    _set_config(path, rank=8)
    with pytest.raises(CheckpointError, match=_all_of(path, "unknown config field(s) ['rank']")):
        _build(root)


def test_adapter_config_missing_field(root):
    path = root / "adapters/alpha/adapter_config.json"
    _edit_json(path, lambda d: d["config"].pop("residual_before_ln"))
    with pytest.raises(CheckpointError, match=_all_of(path, "field 'config.residual_before_ln' is missing")):
        _build(root)


def test_fusion_residual_before(root):
    path = root / "fusions/rte/adapter_fusion_config.json"
    _set_config(path, residual_before=True)
    with pytest.raises(CheckpointError, match=_all_of(path, "field 'config.residual_before' = True", "not supported")):
        _build(root)


@pytest.mark.parametrize(("flag", "value"), [("query", "yes"), ("query_before_ln", 1), ("key", None)])
def test_fusion_flag_that_is_not_a_bool(root, flag, value):
    path = root / "fusions/rte/adapter_fusion_config.json"
    _set_config(path, **{flag: value})
    with pytest.raises(CheckpointError, match=_all_of(path, f"field 'config.{flag}' = {value!r}", "true or false")):
        _build(root)


def test_head_type_tagging(root):
    path = root / "heads/rte/head_config.json"
    _set_config(path, head_type="tagging")
    with pytest.raises(CheckpointError, match=_all_of(path, "field 'config.head_type' = 'tagging'", "'classification'")):
        _build(root)


@pytest.mark.parametrize(
    "label2id",
    [
        {"entailment": 0, "neutral": 1, "contradiction": 3},  # a gap
        {"entailment": 0, "neutral": 0, "contradiction": 1},  # an id twice
        {"entailment": 0, "neutral": 1},  # too few for num_labels = 3
        {"entailment": "0", "neutral": "1", "contradiction": "2"},  # not integers
    ],
)
def test_head_label2id_not_0_to_n_minus_1(root, label2id):
    path = root / "heads/rte/head_config.json"
    _set_config(path, label2id=label2id)
    with pytest.raises(CheckpointError, match=_all_of(path, f"field 'config.label2id' = {label2id!r}", "0..2")):
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


def test_base_model_that_is_not_bert(root):
    _edit_json(root / "base/config.json", lambda d: d.update(model_type="roberta"))
    with pytest.raises(CheckpointError, match=_all_of(root / "base", "'model_type' = 'roberta'", "'bert'")):
        _build(root)
