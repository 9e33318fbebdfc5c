"""transformers loads leanlm checkpoints: AutoModelForCausalLM's from_pretrained, after `import leanlm`.

A checkpoint's config.json carries `quantization_config = {"quant_method": "leanlm", "format_version": 1,
"record": <leanlm_quant.json>}`. transformers finds the method through its registries
(`register_quantization_config`, `register_quantizer`); the quantizer puts leanlm's modules in place of the
linears the record names (on the meta device) before the weights load, so the checkpoint's tensors fill them as
they fill any module, and then derives what the methods derive rather than store (`after_load`). `save_pretrained`
writes a directory that loads back the same. Registration happens when transformers is imported, or at once if
it already is (`leanlm.__init__`), so `import leanlm` stays light.
"""

from __future__ import annotations

from pathlib import Path

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from leanlm.storage import FORMAT_VERSION
from leanlm.storage import TRANSFORMERS_METHOD as METHOD
from leanlm.storage import transformers_quantization_config as quantization_config


class LeanLMQuantizationConfig(QuantizationConfigMixin):
    def __init__(self, record: dict | None = None, format_version: int = FORMAT_VERSION, **kwargs):
        self.quant_method = METHOD
        self.record = record if record is not None else {}
        self.format_version = format_version

    def to_dict(self) -> dict:
        return quantization_config(self.record)


class LeanLMHfQuantizer(HfQuantizer):
    """Pre-quantized leanlm checkpoints only (leanlm quantizes; transformers loads)."""

    requires_calibration = True

    def validate_environment(self, *args, **kwargs):
        from leanlm.methods.checkpoint import check_record

        version = self.quantization_config.format_version
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"this leanlm checkpoint is format {version!r}; this leanlm reads format {FORMAT_VERSION} and older: "
                "upgrade leanlm"
            )
        check_record(self.quantization_config.record, "config.json quantization_config.record")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        from leanlm.methods.checkpoint import check_weights_files, rebuilt_modules, retie_embeddings

        record = self.quantization_config.record
        for name, module in rebuilt_modules(model, record["modules"], "config.json quantization_config").items():
            model.set_submodule(name, module, strict=False)
        if checkpoint_files:  # tensors that disagree with the record are one line, before any is read
            retie_embeddings(model)  # as the load will: a tied head is stored once
            check_weights_files([Path(f) for f in checkpoint_files], model, table_dtype=None)

    def _process_model_after_weight_loading(self, model, **kwargs):
        from leanlm.methods.quantize import after_load
        from leanlm.nn import use_gemv_

        after_load(model, self.quantization_config.record, Path(model.config.name_or_path))
        use_gemv_(model)
        return model

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return True


def register() -> None:
    """Make `quant_method: leanlm` known to transformers (once)."""
    if METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(METHOD)(LeanLMQuantizationConfig)
    if METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(METHOD)(LeanLMHfQuantizer)
