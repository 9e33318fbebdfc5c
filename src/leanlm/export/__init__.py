"""Writing leanlm models in the formats other engines run: GGUF for llama.cpp (`to_gguf`) and compressed-tensors
for transformers and vLLM (`to_compressed_tensors`)."""

from leanlm.export.to_compressed_tensors import export_compressed_tensors
from leanlm.export.to_gguf import FILE_TYPES, export_gguf

__all__ = ["FILE_TYPES", "export_compressed_tensors", "export_gguf"]
