"""Evaluation: perplexity with the papers' protocol and zero-shot tasks as lm-evaluation-harness defines them."""

from leanlm.evaluation.evaluate import ALL_TASKS, ZERO_SHOT_TASKS, EvalSettings, evaluate
from leanlm.evaluation.loglikelihood import Request, Score, encode_pair, score_requests
from leanlm.evaluation.perplexity import PerplexityResult, perplexity
from leanlm.evaluation.tasks import TASKS

__all__ = [
    "ALL_TASKS",
    "ZERO_SHOT_TASKS",
    "EvalSettings",
    "evaluate",
    "Request",
    "Score",
    "encode_pair",
    "score_requests",
    "PerplexityResult",
    "perplexity",
    "TASKS",
]
