"""log P(continuation | context) for zero-shot tasks, encoded exactly as lm-evaluation-harness does.

Each request runs on its own (batch size 1): per-tensor activation quantizers compute their scale over the
whole input, so padding a request into a batch with others would change its score. On this CPU the cost per
token barely depends on the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from leanlm.errors import ConfigError
from leanlm.evaluation.tokens import bos_prefix, encode, max_input_length


@dataclass(frozen=True)
class Request:
    context: str
    continuation: str


@dataclass(frozen=True)
class Score:
    loglikelihood: float
    is_greedy: bool  # every continuation token is the model's argmax
    tokens: int  # continuation tokens scored


def encode_pair(tokenizer, request: Request) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids). Trailing spaces of the context move to the continuation, and the
    continuation ids are the tail of the jointly encoded string, so a token spanning the boundary is not
    split differently from how the model would see the full text."""
    context, continuation = request.context, request.continuation
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    context_ids = encode(tokenizer, context)
    return context_ids, whole[len(context_ids) :]


def score_requests(model, tokenizer, requests: list[Request], desc: str = "scoring") -> list[Score]:
    prefix = bos_prefix(tokenizer)
    limit = max_input_length(model)
    scores = []
    for request in tqdm(requests, desc=desc, unit="req", leave=False):
        context_ids, continuation_ids = encode_pair(tokenizer, request)
        if not prefix and not context_ids:
            raise ConfigError(f"{desc}: a request has an empty context and the model has no BOS token")
        if not continuation_ids:
            raise ConfigError(f"{desc}: a request has an empty continuation: {request.continuation!r}")
        if len(continuation_ids) > limit:
            raise ConfigError(
                f"{desc}: a continuation of {len(continuation_ids)} tokens does not fit the "
                f"model's context of {limit} tokens"
            )
        scores.append(score_tokens(model, prefix + context_ids, continuation_ids, limit))
    return scores


def score_tokens(model, context_ids: list[int], continuation_ids: list[int], limit: int) -> Score:
    """log P(continuation_ids | context_ids), of the last `limit` + 1 tokens (like lm-evaluation-harness: the final
    one is only predicted)."""
    ids = (context_ids + continuation_ids)[-(limit + 1) :]
    n = len(continuation_ids)
    with torch.inference_mode():
        logits = _last_logits(model, torch.tensor([ids[:-1]]), n)
        log_probs = F.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(continuation_ids)
        token_log_probs = log_probs.gather(1, target[:, None]).squeeze(1)
        greedy = bool((log_probs.argmax(-1) == target).all())
    return Score(token_log_probs.sum().item(), greedy, n)


def _last_logits(model, inputs: torch.Tensor, n: int) -> torch.Tensor:
    """Logits of the last `n` positions; the lm_head is run on those alone where the model allows it."""
    try:
        logits = model(input_ids=inputs, use_cache=False, logits_to_keep=n).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(input_ids=inputs, use_cache=False).logits
    return logits[0, -n:]
