"""Training on top of the quantized modules: LoRA / QLoRA fine-tuning and its data (the optimizer is
leanlm.optim's AdamW)."""

from leanlm.training.data import pack_blocks, read_documents, split_documents
from leanlm.training.finetune import FinetuneSettings, block_perplexity, finetune

__all__ = ["pack_blocks", "read_documents", "split_documents", "FinetuneSettings", "block_perplexity", "finetune"]
