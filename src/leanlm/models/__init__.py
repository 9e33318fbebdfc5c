"""Model families (architecture tables), the registry of offline models, and loading."""

from leanlm.models.architectures import (
    TABLES,
    ArchitectureTable,
    LinearFeeds,
    NormFeeds,
    architecture_for,
    decoder_blocks,
    iter_quantizable_linears,
    supported_model_types,
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
    "TABLES",
    "architecture_for",
    "decoder_blocks",
    "iter_quantizable_linears",
    "supported_model_types",
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
