"""leanlm: make large language models cheap to run, stream and fine-tune on the hardware people have.

The package is layered; each layer only uses the ones before it:
  data, models      shipped data sets; architecture tables, the offline model registry and loading
  evaluation, bench perplexity and zero-shot tasks; honest timing and memory measurement
  showcase, cli     every method side by side; the `leanlm` command
"""

import os

# No code path may reach a model or dataset hub: set before transformers / huggingface_hub read them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import logging  # noqa: E402

# transformers imports torchao (a benchmark peer) whenever it is installed; its CUDA-only extensions fail to
# load on this CPU and say so, and torch warns about its enums. None of it concerns a CPU run of leanlm.
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from leanlm.errors import (  # noqa: E402
    ConfigError,
    CorruptModelError,
    DataError,
    LeanLMError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
)

__version__ = "0.1.0"


def _register_with_tools() -> None:
    """Make leanlm known to the tools of `leanlm.integrations.AFTER_IMPORT` (transformers' `from_pretrained`,
    lm-eval's `--model leanlm`): now for those imported already, else once they are, so that `import leanlm`
    itself stays light."""
    import importlib.abc
    import importlib.util
    import sys

    from leanlm.integrations import AFTER_IMPORT

    def run(name: str) -> None:
        try:
            AFTER_IMPORT[name]()
        except Exception as error:  # never let leanlm break importing another tool
            logging.getLogger(__name__).debug("not registered with %s: %s", name, error)

    waiting = {name for name in AFTER_IMPORT if name not in sys.modules}
    for name in AFTER_IMPORT.keys() - waiting:
        run(name)
    if not waiting:
        return

    class AfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in waiting:
                return None
            waiting.discard(name)
            if not waiting:
                sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                run(name)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, AfterImport())


_register_with_tools()


def __getattr__(name: str):
    """`leanlm.quantize_`, `leanlm.Calibration` and the method configs, imported on first use: `import leanlm`
    alone stays light (no torch)."""
    if name in _METHOD_API:
        import leanlm.methods

        return getattr(leanlm.methods, name)
    raise AttributeError(f"module 'leanlm' has no attribute {name!r}")


_METHOD_API = (
    "quantize_",
    "Calibration",
    "QuantRecord",
    "KbitConfig",
    "RTNConfig",
    "GPTQConfig",
    "SpQRConfig",
    "W8A8Config",
    "SmoothQuantConfig",
    "LLMInt8Config",
    "CushionConfig",
)

__all__ = [
    "ConfigError",
    "CorruptModelError",
    "DataError",
    "LeanLMError",
    "ModelNotFoundError",
    "UnsupportedArchitectureError",
    "__version__",
    *_METHOD_API,
]
