"""Training on top of the quantized modules: LoRA / QLoRA fine-tuning, its data and its optimizer."""

from leanlm.training.data import pack_blocks, read_documents, split_documents
from leanlm.training.finetune import FinetuneSettings, block_perplexity, finetune
from leanlm.training.optimizers import AdamW

__all__ = ["pack_blocks", "read_documents", "split_documents", "FinetuneSettings", "block_perplexity", "finetune",
           "AdamW"]
