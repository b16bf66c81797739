"""Bad spec files give a typed SpecError that names the file and what is wrong in it; a spec in JSON works as one in
YAML does. Cases that need a model start from a copy of folders AdapterHub saved (the ``root`` fixture in
conftest.py) and tamper with one thing."""

import json

import pytest
import torch
import yaml

from fusionserve.errors import CheckpointError, SpecError
from fusionserve.export.build import build_model
from fusionserve.export.spec import MAX_TASKS, load_spec
from tests.adapterhub_models import SENTENCES
from tests.checkpoint_helpers import _all_of, _build, _edit_spec


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


def test_a_symlink_loop_as_a_folder_is_a_spec_error(root):
    (root / "loop_a").symlink_to(root / "loop_b")
    (root / "loop_b").symlink_to(root / "loop_a")
    path = _edit_spec(root, lambda d: d["adapters"].update(alpha="loop_a"))
    with pytest.raises(SpecError, match=_all_of(path, "adapters.alpha = 'loop_a' cannot be followed: a symlink loop")):
        load_spec(path)


def test_a_spec_over_the_task_limit_is_refused_before_anything_loads(root):
    def many(data):
        head = data["tasks"]["head_only"]["head"]
        data["tasks"] = {f"t{i}": {"head": head} for i in range(MAX_TASKS + 1)}

    path = _edit_spec(root, many)
    with pytest.raises(SpecError, match=_all_of(path, "'tasks' has 1,001 tasks; one artifact serves at most 1,000")):
        load_spec(path)
