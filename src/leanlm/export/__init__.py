"""Writing leanlm models in the formats other engines run: GGUF for llama.cpp (`to_gguf`)."""

from leanlm.export.to_gguf import FILE_TYPES, export_gguf

__all__ = ["FILE_TYPES", "export_gguf"]
