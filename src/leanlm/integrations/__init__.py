"""leanlm inside other tools: transformers' quantizer API (`from_pretrained` of a leanlm checkpoint), PEFT's LoRA
over leanlm's k-bit layers, and lm-evaluation-harness' model registry (`--model leanlm`).

`AFTER_IMPORT` names, for each tool, the module whose import makes leanlm register with it (`leanlm.__init__`
runs the hook then, or at once if the module is imported already). The hooks stay light: lm-eval's gets a
placeholder that imports `leanlm.integrations.lm_eval` only when a run asks for the model.
"""

from __future__ import annotations

LM_EVAL_MODEL = "leanlm"


def register_with_transformers() -> None:
    from leanlm.integrations.transformers import register

    register()


def register_with_peft() -> None:
    from leanlm.integrations.peft import register

    register()


def register_with_lm_eval() -> None:
    import lm_eval.models  # noqa: F401  (lm-eval's own models first: its registry fills itself only while empty)
    from lm_eval.api.registry import model_registry

    if LM_EVAL_MODEL not in model_registry:
        model_registry.register(LM_EVAL_MODEL, target="leanlm.integrations.lm_eval:LeanLM")


AFTER_IMPORT = {
    "transformers": register_with_transformers,
    "peft": register_with_peft,
    "lm_eval.api.registry": register_with_lm_eval,
}
