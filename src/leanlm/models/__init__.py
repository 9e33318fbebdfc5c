"""Model families (architecture tables), the registry of offline models, and loading."""

from leanlm.models.architectures import (
    FAMILY_FACTS,
    ArchitectureTable,
    LinearFeeds,
    NormFeeds,
    architecture_for,
    decoder_blocks,
    iter_quantizable_linears,
)
from leanlm.models.loading import (
    INTERACTIVE_LOADING,
    LoadedModel,
    LoadSettings,
    cache_root,
    compute_dtype,
    dtype_name,
    load_model,
    load_tokenizer,
)
from leanlm.models.registry import DEFAULT_MODEL, REGISTRY, RegisteredModel

__all__ = [
    "ArchitectureTable",
    "LinearFeeds",
    "NormFeeds",
    "FAMILY_FACTS",
    "architecture_for",
    "decoder_blocks",
    "iter_quantizable_linears",
    "INTERACTIVE_LOADING",
    "LoadedModel",
    "LoadSettings",
    "compute_dtype",
    "dtype_name",
    "cache_root",
    "load_model",
    "load_tokenizer",
    "DEFAULT_MODEL",
    "REGISTRY",
    "RegisteredModel",
]
