"""Property: whatever bytes or JSON a checkpoint directory holds, loading it returns a model or raises a
LeanLMError (one clear line in the CLI), never another exception."""

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leanlm.errors import LeanLMError
from leanlm.methods import QUANT_FILE, W8A8Config, load_any, quantize_, save_quantized
from leanlm.methods.checkpoint import WEIGHTS_FILE
from leanlm.methods.quantize import method_names
from leanlm.nn import QUANTIZED_MODULES

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=16,
)
ARG_NAMES = (
    "in_features",
    "out_features",
    "bias",
    "activation",
    "static",
    "outlier_threshold",
    "asymmetric",
    "kv_channels",
    "bits",
    "block_size",
    "dtype",
    "group_size",
    "outliers",
    "permuted",
    "proxy_dims",
)
MODULE_NAMES = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.0.self_attn.bmm_quantizer",
    "lm_head",
    "model.layers.9.mlp.up_proj",
    "",
    "model.norm.weight",
    "model..layers",
)
plausible_records = st.fixed_dictionaries(
    {
        "method": st.sampled_from((*method_names(), "cushion+smoothquant", "smoothquant+gptq", "awq")),
        "modules": st.dictionaries(
            st.sampled_from(MODULE_NAMES),
            st.fixed_dictionaries(
                {
                    "class": st.sampled_from((*QUANTIZED_MODULES, "Int3Linear")),
                    "args": st.dictionaries(
                        st.sampled_from(ARG_NAMES),
                        st.integers(-3, 300) | st.booleans() | st.sampled_from(["per_tensor", "nf", None]),
                    ),
                }
            ),
            max_size=3,
        ),
    }
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_tokenizer):
    from tiny import save_tiny_llama

    from leanlm.models import load_model

    loaded = load_model(save_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_tokenizer))
    record = quantize_(loaded.model, W8A8Config(level="O2"))
    return save_quantized(loaded, loaded.model, record, tmp_path_factory.mktemp("ckpt") / "q")


def _loads_or_refuses(directory):
    try:
        load_any(directory)
    except LeanLMError:
        pass


@FUZZ
@given(record=json_values | plausible_records | st.binary(max_size=300))
def test_any_record_loads_or_is_refused(checkpoint, tmp_path_factory, record):
    directory = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(checkpoint, directory, dirs_exist_ok=True)
    data = record if isinstance(record, bytes) else json.dumps(record).encode()
    (directory / QUANT_FILE).write_bytes(data)
    _loads_or_refuses(directory)


@FUZZ
@given(
    cut=st.integers(0, 10**6),
    flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=6),
    garbage=st.binary(max_size=64),
)
def test_damaged_weights_load_or_are_refused(checkpoint, tmp_path_factory, cut, flips, garbage):
    directory = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(checkpoint, directory, dirs_exist_ok=True)
    data = bytearray((checkpoint / WEIGHTS_FILE).read_bytes())
    for position, value in flips:
        data[position % len(data)] = value
    (directory / WEIGHTS_FILE).write_bytes(bytes(data[: cut % (len(data) + 1)]) + garbage)
    _loads_or_refuses(directory)
    # The float loader reads the same directory when the record is gone: the same holds.
    (directory / QUANT_FILE).unlink()
    _loads_or_refuses(directory)
