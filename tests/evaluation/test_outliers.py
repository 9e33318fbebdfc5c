import torch
from tiny import tiny_model, token_ids

from leanlm.evaluation.outliers import OutlierCriteria, analyze_outliers, block_input_magnitudes


def _batches():
    return token_ids(2, 32)


def test_a_planted_systematic_feature_is_found():
    model = tiny_model("llama", layers=4)
    for layer in model.model.layers:  # dimension 5 of every attention and FFN input becomes huge
        layer.input_layernorm.weight.data[5] = 80.0
        layer.post_attention_layernorm.weight.data[5] = 80.0
    report = analyze_outliers(model, _batches())
    assert report.outlier_dims == [5]
    assert report.layers_affected_pct == 100.0
    assert report.tokens_affected_pct > 50
    assert report.max_magnitude >= 6.0
    assert set(report.as_dict()) >= {"outlier_dims", "layers_affected_pct", "tokens_affected_pct", "max_magnitude"}


def test_a_feature_in_too_few_layers_is_not_an_outlier():
    model = tiny_model("llama", layers=4)
    model.model.layers[0].input_layernorm.weight.data[9] = 80.0  # 1 of 4 layers, but only in q/k/v's input
    strict = analyze_outliers(model, _batches(), OutlierCriteria(layers_fraction=0.5))
    assert 9 not in strict.outlier_dims
    assert 9 in analyze_outliers(model, _batches(), OutlierCriteria(layers_fraction=0.25)).outlier_dims


def test_block_input_magnitudes_are_ordered_per_block():
    model = tiny_model("llama")
    statistics = block_input_magnitudes(model, torch.randint(0, 128, (2, 16)), top=3)
    assert len(statistics) == model.config.num_hidden_layers
    for block in statistics:
        assert block["top"] == sorted(block["top"], reverse=True) and block["top1"] == block["top"][0]
        assert block["top1"] >= block["top10pct"] >= block["median"] >= 0
