"""lm-evaluation-harness runs leanlm models: `--model leanlm --model_args pretrained=SOURCE[,dtype=..,head=..]`.

SOURCE is anything leanlm loads: a registry name, a Hugging Face directory, a .gguf file or a leanlm checkpoint
(`leanlm.methods.checkpoint.load_any`). Log-likelihoods come from leanlm's own scorer, one request at a time
(`leanlm.evaluation.loglikelihood`), so a task scores in lm-eval what it scores in `leanlm eval`; rolling
log-likelihoods use lm-eval's own windows; generation is greedy, through the fused decode step wherever the model
allows it (`leanlm.decoding.fused_decoder_problem`).

The class registers with lm-eval's model registry once lm_eval is imported after `import leanlm` (lazily: nothing
loads until a run asks for it). From a shell, `python -m leanlm.integrations.lm_eval ARGS` is lm-eval's own
command with leanlm registered.
"""

from __future__ import annotations

from leanlm.errors import ConfigError, MissingExtraError, missing_extra

try:
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ModuleNotFoundError as error:
    if __name__ != "__main__" or missing_extra(error) != "lm-eval":
        raise
    import sys

    print(
        f"leanlm: error: {MissingExtraError('python -m leanlm.integrations.lm_eval', 'lm_eval', 'lm-eval')}",
        file=sys.stderr,
    )
    raise SystemExit(2) from None
from leanlm.integrations import register_with_lm_eval


class LeanLM(LM):
    """An lm-eval model backed by any model leanlm loads."""

    def __init__(
        self,
        pretrained: str | None = None,
        dtype: str = "float32",
        head: str = "float",
        adapter: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        device: str | None = "cpu",
        **unknown,
    ) -> None:
        super().__init__()
        from leanlm.methods.checkpoint import load_any
        from leanlm.models.registry import DEFAULT_MODEL

        if unknown:
            raise ConfigError(
                f"lm-eval model_args: unknown {', '.join(sorted(unknown))}; leanlm takes pretrained, dtype, head, adapter"
            )
        if device not in (None, "cpu"):
            raise ConfigError(f"lm-eval --device {device}: leanlm runs on the CPU")
        # batch_size is accepted and not used: each request runs alone, as in `leanlm eval` (a per-tensor
        # activation scale would otherwise depend on the other requests padded into its batch).
        self.loaded = load_any(pretrained or DEFAULT_MODEL, dtype, head, adapter)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer

    @property
    def tokenizer_name(self) -> str:
        return self.loaded.name.replace("/", "__")

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from leanlm.evaluation.loglikelihood import Request, score_requests

        scores = score_requests(self.model, self.tokenizer, [Request(*r.args) for r in requests], desc="lm-eval")
        return [(score.loglikelihood, score.is_greedy) for score in scores]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from leanlm.evaluation.loglikelihood import score_tokens
        from leanlm.evaluation.tokens import encode, max_input_length

        limit = max_input_length(self.model)
        prefix = self.tokenizer.bos_token_id
        if prefix is None:
            prefix = self.tokenizer.eos_token_id
        totals = []
        for request in requests:
            windows = get_rolling_token_windows(
                token_list=encode(self.tokenizer, request.args[0]),
                prefix_token=prefix,
                max_seq_len=limit,
                context_len=1,
            )
            totals.append(sum(score_tokens(self.model, *make_disjoint_window(w), limit).loglikelihood for w in windows))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from leanlm.chat import stop_token_ids
        from leanlm.decoding import fused_decoder_problem, greedy_stream
        from leanlm.evaluation.tokens import bos_prefix, encode, max_input_length

        fused = fused_decoder_problem(self.model) is None
        stops, limit, answers = stop_token_ids(self.tokenizer), max_input_length(self.model), []
        for request in requests:
            context, settings = request.args
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(settings.get("max_gen_toks", 256))
            if settings.get("do_sample"):
                raise ConfigError("lm-eval: leanlm's model decodes greedily; this task asks to sample (do_sample)")
            if budget >= limit:
                raise ConfigError(f"lm-eval: max_gen_toks {budget} leaves no room in a context of {limit} tokens")
            prompt = (bos_prefix(self.tokenizer) + encode(self.tokenizer, context))[-(limit - budget) :]
            tokens, text = [], ""
            for token in greedy_stream(self.model, prompt, budget, fused):
                if token in stops:
                    break
                tokens.append(token)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                cut = min((text.find(stop) for stop in until if stop in text), default=-1)
                if cut >= 0:
                    text = text[:cut]
                    break
            answers.append(text)
        return answers


def main() -> None:
    """lm-eval's command line with leanlm's model registered."""
    from lm_eval.__main__ import cli_evaluate

    register_with_lm_eval()
    cli_evaluate()


if __name__ == "__main__":
    main()
