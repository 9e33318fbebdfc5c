"""Training: LoRA / QLoRA fine-tuning and its data, and pre-training small LMs from scratch with their own BPE
tokenizer (the sink-token study); the optimizer is leanlm.optim's AdamW."""

from leanlm.training.data import batch_indices, pack_blocks, read_documents, split_documents, training_blocks
from leanlm.training.finetune import FinetuneSettings, block_perplexity, finetune
from leanlm.training.pretrain import PretrainSettings, pretrain
from leanlm.training.tokenizer import as_transformers_tokenizer, train_bpe_tokenizer

__all__ = [
    "batch_indices",
    "pack_blocks",
    "read_documents",
    "split_documents",
    "training_blocks",
    "FinetuneSettings",
    "block_perplexity",
    "finetune",
    "PretrainSettings",
    "pretrain",
    "as_transformers_tokenizer",
    "train_bpe_tokenizer",
]
