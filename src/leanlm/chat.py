"""A multi-round chat that never runs out of context (Xiao's thesis section 4.4.3): every turn is appended to one
StreamingLLM cache, so the conversation can go on for ever at a constant cost per token; what scrolls out of
the window is forgotten, the attention sinks (the first tokens: the chat template's system prompt) stay.

Each turn feeds only the text the chat template adds since the previous turn, in chunks no longer than the
window, then decodes token by token, handing each new piece of text to a callback as soon as it is known.

Where the model allows it (`leanlm.decoding.fused_decoder_problem`), the conversation runs through the fused C++
decode step with its own sink cache: the first prompt is read by transformers' forward (a batched prefill), every
later token, the later turns' included, by the fused step, one call per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from leanlm.decoding import FusedDecoder, read_in_chunks
from leanlm.errors import ConfigError
from leanlm.evaluation.tokens import encode
from leanlm.methods.streaming import StreamingConfig, sink_cache
from leanlm.settings import check_seed, option


@dataclass(frozen=True)
class ChatSettings:
    streaming: StreamingConfig = option(
        StreamingConfig(sinks=4, window=2000), "the cache (the reference chat demo's sizes)", cli=False
    )
    max_new_tokens: int = option(256, "tokens an answer may take at most")
    temperature: float = option(0.0, "sampling temperature; 0 = greedy")
    seed: int = option(0, "seed of the sampling")
    fused: bool = option(
        True,
        "decode through leanlm's fused C++ step where the model allows it (else through transformers' forward)",
        flag="--no-fused",
        off="decode through transformers' forward",
    )

    def __post_init__(self):
        check_seed(self.seed)
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be 0 or more, got {self.temperature}")


class StreamingChat:
    def __init__(self, model, tokenizer, settings: ChatSettings = ChatSettings()):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError("this model's tokenizer has no chat template; `leanlm chat` needs an instruct model")
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.fused = FusedDecoder.build(model, streaming=settings.streaming) if settings.fused else None
        self.cache = sink_cache(model, settings.streaming) if self.fused is None else None
        self.messages: list[dict] = []
        self.fed_text = ""  # everything the cache has read so far, as text
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.stop_ids = stop_token_ids(tokenizer)

    def reply(self, user_text: str, on_text: Callable[[str], None] = lambda piece: None) -> str:
        self.messages.append({"role": "user", "content": user_text})
        rendered = self.tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        # Chat templates only append, so the new turn is a suffix of the rendering; if one ever rewrites earlier
        # turns, the rendering of this turn alone is fed instead.
        if rendered.startswith(self.fed_text):
            new_text = rendered[len(self.fed_text) :]
        else:
            new_text = self.tokenizer.apply_chat_template(
                self.messages[-1:], tokenize=False, add_generation_prompt=True
            )
        logits = self._feed(encode(self.tokenizer, new_text))
        self.fed_text = rendered
        generated: list[int] = []
        shown = ""
        with torch.inference_mode():
            for _ in range(self.settings.max_new_tokens):
                token = self._pick(logits)
                if token in self.stop_ids:
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                    on_text(text[len(shown) :])
                    shown = text
                logits = self._feed([token])
        answer = self.tokenizer.decode(generated, skip_special_tokens=True)
        if answer != shown:
            on_text(answer[len(shown) :])
        self.messages.append({"role": "assistant", "content": answer})
        self.fed_text += answer
        return answer

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Read `ids` into the cache in chunks that fit the window; the last position's logits."""
        if not ids:
            raise ConfigError("the chat template produced no tokens for this turn")
        if self.fused is not None:  # the first prompt as a batched prefill, the rest a token per call
            return self.fused.prefill(ids) if self.fused.cache is None else self.fused.read(ids)
        return read_in_chunks(self.model, self.cache, ids, self.settings.streaming.window)

    def _pick(self, logits: torch.Tensor) -> int:
        return sample_token(logits, self.settings.temperature, 1.0, self.generator)


def stop_token_ids(tokenizer) -> set[int]:
    """End of sequence, and the end-of-turn tokens of the common chat templates."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return {i for i in ids if isinstance(i, int)}


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat template's rendering of `messages` (and `tools`, for a template that takes them), ending with the
    assistant's turn opened, as token ids, each message's content read as plain text: the spelling of a special
    token inside a message (`<|im_start|>system`) stays text, so a message can never open a turn of another role.
    The template is rendered with a placeholder for each content; the template's own text around them is
    tokenized as usual, the contents with special tokens split."""
    marks = [f"\x00{index}\x00" if message["content"] else "" for index, message in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(
        [{**message, "content": mark} for message, mark in zip(messages, marks, strict=True)],
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    ids, rest = [], rendered
    for message, mark in zip(messages, marks, strict=True):
        if not mark:
            continue
        before, found, rest = rest.partition(mark)
        if not found:
            raise ConfigError("this chat template rewrites message text, so a message cannot be kept apart from it")
        ids += encode(tokenizer, before)
        ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + encode(tokenizer, rest)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature), cut to the nucleus (the smallest
    set of most likely tokens holding `top_p` of the mass) when top_p < 1."""
    if temperature < torch.finfo(torch.float64).tiny:  # 0, or too small to divide by: the limit is greedy
        return int(logits.argmax())
    # In float64 and shifted so that the largest logit is 0 before the division: a temperature so small that a
    # logit over it overflows still gives 0 for the most likely token and -inf for the rest, never inf - inf.
    logits = logits.double()
    probabilities = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probabilities, order = probabilities.sort(descending=True)
        outside = sorted_probabilities.cumsum(0) - sorted_probabilities >= top_p
        sorted_probabilities[outside] = 0.0
        probabilities = torch.zeros_like(probabilities).scatter_(0, order, sorted_probabilities)
    return int(torch.multinomial(probabilities, 1, generator=generator))
