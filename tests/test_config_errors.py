"""Refused adapter, fusion and head configurations: the CheckpointError names the config file, the field and its
value. Every case starts from a copy of folders AdapterHub saved (the ``root`` fixture in conftest.py) and changes
one field of one config file."""

import pytest

from fusionserve.errors import CheckpointError
from tests.checkpoint_helpers import _all_of, _build, _edit_json, _set_config


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


def test_adapter_places_must_match_the_weights(root):
    """mh_adapter / output_adapter say where the adapter sits; weights elsewhere, or none where it says, are errors."""
    path = root / "adapters/alpha/adapter_config.json"
    _set_config(path, mh_adapter=True)  # a seq_bn adapter has no weights after the attention block
    with pytest.raises(CheckpointError, match=_all_of(root / "adapters/alpha", "no weights for layer 0 attention", "leave_out")):
        _build(root)
    _set_config(path, mh_adapter=False, output_adapter=False)
    with pytest.raises(CheckpointError, match=_all_of(path, "'config.mh_adapter' and 'config.output_adapter' are both false")):
        _build(root)
    _set_config(path, mh_adapter=True, output_adapter=False)
    with pytest.raises(
        CheckpointError, match=_all_of(root / "adapters/alpha", "after the FFN", "'config.output_adapter' is false")
    ):
        _build(root)
    _set_config(path, mh_adapter="yes")
    with pytest.raises(CheckpointError, match=_all_of(path, "field 'config.mh_adapter' = 'yes'", "true or false")):
        _build(root)


def test_adapters_at_one_site_must_agree_on_the_layer_norm_before(root):
    """One block computes a site: its adapters all read LN(f + a) (seq_bn) or all read f (double_seq_bn)."""
    _set_config(root / "adapters/gamma/adapter_config.json", original_ln_before=False)
    with pytest.raises(
        CheckpointError, match=_all_of(root / "model.yaml", "layer 0 output", "original_ln_before", "gamma=False", "alpha=True")
    ):
        _build(root)


@pytest.mark.parametrize(
    "config", ["adapters/alpha/adapter_config.json", "fusions/rte/adapter_fusion_config.json", "heads/rte/head_config.json"]
)
def test_checkpoint_saved_on_another_architecture(root, config):
    _edit_json(root / config, lambda d: d.update(model_type="roberta"))
    folder = (root / config).parent
    with pytest.raises(CheckpointError, match=_all_of(folder, "field 'model_type' = 'roberta'", "'bert'")):
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


def test_a_head_type_whose_head_takes_none_of_these_fields(root):
    """A classification head's config relabelled 'tagging' keeps fields AdapterHub's tagging head does not take: they
    are refused by name (every head kind is read since issue 35; test_head_kinds.py has the unknown kinds)."""
    path = root / "heads/rte/head_config.json"
    _set_config(path, head_type="tagging")
    with pytest.raises(CheckpointError, match=_all_of(path, "unknown config field(s) ['bias', 'use_pooler']", "tagging head")):
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
