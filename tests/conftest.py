import pytest
from transformers import AutoTokenizer

from leanlm.models.loading import _cached_float_checkpoint
from leanlm.models.registry import DEFAULT_MODEL, REGISTRY, gguf_path_of


@pytest.fixture(scope="session")
def default_checkpoint_dir():
    """The default model's cached float checkpoint (converted from its GGUF on first use)."""
    registered = REGISTRY[DEFAULT_MODEL]
    return _cached_float_checkpoint(gguf_path_of(registered), registered.sha256)


@pytest.fixture(scope="session")
def smollm2_tokenizer(default_checkpoint_dir):
    return AutoTokenizer.from_pretrained(default_checkpoint_dir, local_files_only=True)


@pytest.fixture
def counting_tokenizer(smollm2_tokenizer):
    """A copy of SmolLM2's tokenizer and the list of the lengths of the texts it has been called on."""
    import copy

    calls, tokenizer = [], copy.deepcopy(smollm2_tokenizer)
    original = type(tokenizer).__call__

    class Counting(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            calls.append(len(args[0]))
            return original(self, *args, **kwargs)

    tokenizer.__class__ = Counting
    return tokenizer, calls


@pytest.fixture
def tiny_llama_dir(tmp_path, smollm2_tokenizer):
    """A local HF model directory: a tiny random Llama with SmolLM2's tokenizer (so real text works)."""
    from tiny import save_tiny_llama

    return save_tiny_llama(tmp_path, smollm2_tokenizer)


DATA_BOUND = 2 << 30  # what a test of hostile files may add to the process's data segment


@pytest.fixture
def bounded_data():
    """For the test's duration, an allocation that would grow the process's data segment (heap and anonymous
    maps: RLIMIT_DATA) by more than DATA_BOUND fails, as MemoryError or torch's allocation error."""
    import resource
    from pathlib import Path

    held = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmData:")
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (held + DATA_BOUND, hard))
    yield
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
