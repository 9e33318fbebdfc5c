import torch
from tiny import tiny_model

from leanlm.nn.softmax_one import SOFTMAX_ONE, softmax_one


def test_softmax_one_is_softmax_with_an_extra_zero_logit_and_stays_finite():
    scores = torch.tensor([[1.0, -2.0, 0.5], [800.0, 790.0, -1e9]])
    with_zero = torch.softmax(torch.cat([scores[:1], torch.zeros(1, 1)], dim=1), dim=1)[:, :3]
    torch.testing.assert_close(softmax_one(scores)[:1], with_zero)
    large = softmax_one(scores)[1]
    assert torch.isfinite(large).all() and abs(large.sum().item() - 1) < 1e-6  # huge logits: the zero logit vanishes
    assert softmax_one(torch.full((1, 4), -50.0)).sum() < 1e-20  # all-low logits: the mass goes nowhere


def test_a_model_runs_with_softmax_one_attention_and_returns_its_weights():
    model = tiny_model("llama")
    model.config._attn_implementation = SOFTMAX_ONE
    ids = torch.randint(0, 128, (2, 9))
    output = model(input_ids=ids, output_attentions=True)
    assert torch.isfinite(output.logits).all()
    rows = output.attentions[0].sum(dim=-1)
    assert (rows < 1).all() and (rows > 0).all()  # each query keeps some mass off the tokens
