"""Fine-tuning data: a plain-text file (one document per non-empty line) or JSONL records, rendered to token
ids, split into train and held-out documents, and packed into fixed-length blocks.

JSONL records may hold `{"text": ...}`, chat `{"messages": [{"role", "content"}, ...]}`, or instruction data
`{"instruction", "input"?, "output"}` (Alpaca style, turned into a user/assistant exchange). Conversations go
through the tokenizer's chat template where it has one, so the model is tuned on the format it is used with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from leanlm.errors import DataError
from leanlm.evaluation.tokens import bos_prefix, encode

Document = str | list[dict]  # plain text, or a conversation
# A document is tokenized whole, and a tokenizer's working memory is many times its text: longer ones are
# refused, with the line, before any is tokenized.
MAX_DOCUMENT_CHARS = 1 << 20


def read_documents(path: str | os.PathLike) -> list[Document]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"fine-tuning data {path} does not exist or is not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise DataError(
            f"fine-tuning data {path} is not UTF-8 text (invalid byte at offset {error.start}); give "
            "plain text or JSONL"
        ) from None
    except OSError as error:
        raise DataError(f"fine-tuning data {path} cannot be read: {error.strerror or error}") from None
    if any("\x00" in line for line in lines):
        raise DataError(f"fine-tuning data {path} holds NUL bytes: it is a binary file, not text or JSONL")
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_DOCUMENT_CHARS:
            raise DataError(
                f"fine-tuning data {path}:{number} is {len(line):,} characters long; a line is one document, of at "
                f"most {MAX_DOCUMENT_CHARS:,}: break the text into lines (paragraphs)"
            )
    if path.suffix != ".jsonl":
        documents = [line.strip() for line in lines if line.strip()]
    else:
        documents = [_record_document(line, path, number) for number, line in enumerate(lines, 1) if line.strip()]
    if not documents:
        raise DataError(f"fine-tuning data {path} holds no documents")
    return documents


def _record_document(line: str, path: Path, number: int) -> Document:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise DataError(f"{path}:{number} is not valid JSON: {error}") from None
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        messages = record.get("messages")
        if (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            return messages
        if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
            context = record.get("input")
            prompt = record["instruction"] + (f"\n\n{context}" if isinstance(context, str) and context else "")
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    raise DataError(
        f"{path}:{number}: expected a record with 'text', 'messages' (role/content list) or "
        f"'instruction' + 'output'; got {line[:80]!r}"
    )


def document_ids(tokenizer, document: Document) -> list[int]:
    """Token ids of one document, ended by the end-of-sequence token so packed documents stay apart."""
    if isinstance(document, str):
        ids = bos_prefix(tokenizer) + encode(tokenizer, document)
    elif tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(document, tokenize=True, return_dict=False)
    else:
        ids = bos_prefix(tokenizer) + encode(tokenizer, "".join(f"{m['role']}: {m['content']}\n" for m in document))
    return [*ids, tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else list(ids)


def split_documents(
    documents: list[Document], held_out_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """(train, held-out): a seeded shuffle, at least one document on each side."""
    if len(documents) < 2:
        raise DataError(f"need at least 2 documents for a train/held-out split, got {len(documents)}")
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(len(documents) - 1, max(1, round(held_out_fraction * len(documents))))
    return [documents[i] for i in order[held:]], [documents[i] for i in order[:held]]


def pack_blocks(tokenizer, documents: list[Document], seq_len: int) -> torch.Tensor:
    """(blocks, seq_len) token ids: the documents' ids concatenated and cut; the last partial block is dropped."""
    stream = [token for document in documents for token in document_ids(tokenizer, document)]
    count = len(stream) // seq_len
    return torch.tensor(stream[: count * seq_len], dtype=torch.long).reshape(count, seq_len)


def training_blocks(
    tokenizer, documents: list[Document], seq_len: int, held_out_fraction: float, seed: int, max_eval_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(training blocks, held-out blocks) of `seq_len` tokens; refuses data that fills no block on either side."""
    train_docs, held_docs = split_documents(documents, held_out_fraction, seed)
    train_blocks = pack_blocks(tokenizer, train_docs, seq_len)
    eval_blocks = pack_blocks(tokenizer, held_docs, seq_len)[:max_eval_blocks]
    if len(train_blocks) == 0 or len(eval_blocks) == 0:
        raise DataError(
            f"the data fill {len(train_blocks)} training and {len(eval_blocks)} held-out blocks of "
            f"{seq_len} tokens (seq_len); give more text or a shorter seq_len"
        )
    return train_blocks, eval_blocks


def batch_indices(step: int, batch_size: int, blocks: int, seed: int) -> torch.Tensor:
    """The blocks of training step `step`: every epoch is a seeded permutation of the blocks, so the batch is a
    pure function of (seed, step) and a resumed run sees exactly the batches of an uninterrupted one."""
    samples = range(step * batch_size, (step + 1) * batch_size)
    orders = {
        epoch: torch.randperm(blocks, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for epoch in {sample // blocks for sample in samples}
    }
    return torch.stack([orders[s // blocks][s % blocks] for s in samples])
