"""The zero-shot scoring matches lm-evaluation-harness' definitions exactly, on real items."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_model

from leanlm import data
from leanlm.errors import ConfigError
from leanlm.evaluation import Request, Score, encode_pair, score_requests
from leanlm.evaluation.tasks import (
    TASKS,
    aggregate,
    arc_doc,
    doc_metrics,
    hellaswag_doc,
    hellaswag_preprocess,
    lambada_doc,
    piqa_doc,
    winogrande_doc,
)


def test_prompt_formats_are_the_harness_ones():
    arc = arc_doc(data.arc_items("easy")[0])
    assert arc.requests[0].context == (
        "Question: Which statement best explains why photosynthesis is the foundation of most food webs?\nAnswer:"
    )
    assert arc.requests[0].continuation == " Sunlight is the source of energy for nearly all ecosystems."
    assert arc.gold == 0 and len(arc.requests) == 4

    piqa = piqa_doc(data.piqa_items()[0])
    assert piqa.requests[1].context == "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"
    assert piqa.requests[1].continuation.startswith(" Provide the guinea pig with a cage full of a few inches")

    hellaswag = hellaswag_doc(data.hellaswag_items()[0])
    assert hellaswag.requests[3].context == "Roof shingle removal: A man is sitting on a roof. he"
    assert hellaswag.requests[3].continuation == " starts pulling up roofing on a roof."

    winogrande = winogrande_doc(data.winogrande_items()[0])
    assert [r.context for r in winogrande.requests] == [
        "Sarah was a much better surgeon than Maria so Sarah",
        "Sarah was a much better surgeon than Maria so Maria",
    ]
    assert {r.continuation for r in winogrande.requests} == {" always got the easier cases."}

    lambada = lambada_doc("He looked at the door and said hello to Harlin")
    assert lambada.requests == (Request("He looked at the door and said hello to", " Harlin"),)


def test_hellaswag_cleanup_of_wikihow_artefacts():
    assert hellaswag_preprocess(" How to  cook [title] Boil water. [step] Add salt. ") == (
        "How to cook. Boil water. Add salt."
    )


def test_acc_and_acc_norm_definitions():
    doc = arc_doc(data.arc_items("easy")[0])  # gold is choice 0, the longest (59 characters)
    assert doc.choice_lengths == (59, 54, 50, 43)
    # Choice 1 wins on total log-likelihood; choice 0 wins per character (-22/59 > -21/54).
    scores = [Score(ll, False, 3) for ll in (-22.0, -21.0, -40.0, -40.0)]
    assert doc_metrics(doc, scores) == {"acc": 0.0, "acc_norm": 1.0}


def test_lambada_accuracy_is_the_greedy_flag_and_perplexity_the_mean():
    doc = lambada_doc("a b c")
    per_doc = [doc_metrics(doc, [Score(-1.0, True, 1)]), doc_metrics(doc, [Score(-3.0, False, 2)])]
    result = aggregate(TASKS["lambada"], per_doc)
    assert result == {"n": 2, "acc": 0.5, "perplexity": pytest.approx(math.exp(2.0))}


def test_trailing_context_space_moves_to_the_continuation(smollm2_tokenizer):
    with_space = encode_pair(smollm2_tokenizer, Request("Question: 2+2\nAnswer: ", "4"))
    without = encode_pair(smollm2_tokenizer, Request("Question: 2+2\nAnswer:", " 4"))
    assert with_space == without
    context, continuation = without
    assert smollm2_tokenizer.decode(continuation) == " 4"


def test_scores_equal_a_brute_force_forward(smollm2_tokenizer):
    """Scores of real items equal sum(log_softmax) over the continuation, computed independently."""
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer), seed=3)
    docs = [
        arc_doc(data.arc_items("challenge")[0]),
        winogrande_doc(data.winogrande_items()[5]),
        lambada_doc(data.lambada_test_texts()[0]),
    ]
    requests = [r for d in docs for r in d.requests]
    scores = score_requests(model, smollm2_tokenizer, requests)
    for request, score in zip(requests, scores):
        context = smollm2_tokenizer(request.context, add_special_tokens=False)["input_ids"]
        whole = smollm2_tokenizer(request.context + request.continuation, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([whole])
        with torch.inference_mode():
            log_probs = F.log_softmax(model(ids).logits[0].float(), -1)
        positions = range(len(context) - 1, len(whole) - 1)
        expected = sum(log_probs[p, whole[p + 1]].item() for p in positions)
        greedy = all(log_probs[p].argmax().item() == whole[p + 1] for p in positions)
        assert score.loglikelihood == pytest.approx(expected, abs=1e-4)
        assert score.is_greedy == greedy and score.tokens == len(whole) - len(context)


def test_a_continuation_longer_than_the_context_window_is_a_clear_error(smollm2_tokenizer):
    model = tiny_model("llama", vocab_size=len(smollm2_tokenizer))
    model.config.max_position_embeddings = 8
    with pytest.raises(ConfigError, match="a continuation of 1[0-9] tokens does not fit the model's context of 8"):
        score_requests(model, smollm2_tokenizer, [Request("Say:", " one two three four five six seven eight nine ten")])
