import pytest
import torch
from tiny import FAMILIES, tiny_model

from leanlm.training.loss import causal_lm_loss


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_loss_and_its_gradients_equal_transformers(family):
    model = tiny_model(family).train()
    if family == "gemma3_text":
        model.config.final_logit_softcapping = 30.0  # exercised: Gemma 2 / 3 configs may set it
    torch.manual_seed(1)
    batch = torch.randint(0, 128, (3, 17))
    torch.manual_seed(2)  # the same dropout masks (OPT, GPT-2) for both
    expected = model(input_ids=batch, labels=batch).loss
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(2)
    loss = causal_lm_loss(model, batch, chunk_positions=7)  # 48 positions: 7 chunks, the last one short
    loss.backward()
    assert torch.allclose(loss, expected, rtol=1e-6, atol=1e-6)
    for name, parameter in model.named_parameters():
        assert torch.allclose(parameter.grad, expected_grads[name], rtol=1e-4, atol=1e-6), name
    with torch.no_grad():
        model.eval()
        assert torch.allclose(
            causal_lm_loss(model, batch), model(input_ids=batch, labels=batch).loss, rtol=1e-6, atol=1e-6
        )


def test_chunks_are_sized_by_their_logits_bytes():
    from leanlm.training import loss as module

    model = tiny_model("llama").train()
    calls = []
    original = module._loss_sum
    module._loss_sum = lambda head, softcap, hidden, targets: (
        calls.append(len(targets)) or original(head, softcap, hidden, targets)
    )
    try:
        old = module.LOGITS_BYTES_PER_CHUNK
        module.LOGITS_BYTES_PER_CHUNK = 4 * 128 * 10  # ten positions of a 128-entry vocabulary
        with torch.no_grad():
            causal_lm_loss(model, torch.randint(0, 128, (2, 16)))
    finally:
        module._loss_sum, module.LOGITS_BYTES_PER_CHUNK = original, old
    assert calls == [10, 10, 10]
