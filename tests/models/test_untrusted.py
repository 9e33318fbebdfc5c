"""A model directory from a stranger: its code never runs, no path in it leads out of it, and its headers are
held against its config before anything is allocated. Each case is one line naming the file and the problem."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tiny import byte_tokenizer, save_tiny_llama

from leanlm.errors import LeanLMError
from leanlm.models import load_model
from leanlm.models.untrusted import INDEX_FILE, WEIGHTS_FILE

SRC = Path(__file__).parents[2] / "src" / "leanlm"
EVIL = "open({marker!r}, 'w').write('ran')\nfrom transformers import LlamaConfig, LlamaForCausalLM\n" + (
    "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\nclass EvilModel(LlamaForCausalLM):\n    pass\n"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), byte_tokenizer())


def _copy(model_dir, tmp_path, name="model"):
    return Path(shutil.copytree(model_dir, tmp_path / name))


def _edit_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


def _refused(source, message: str) -> None:
    with pytest.raises(LeanLMError, match=message) as raised:
        load_model(source)
    assert "\n" not in str(raised.value)


def test_no_call_into_transformers_can_run_a_models_code():
    """Every read of a user's directory goes through `leanlm.models.untrusted`, which passes
    trust_remote_code=False; nothing else in the package calls transformers' loaders."""
    direct = re.compile(r"\.(from_pretrained|from_config)\(")
    offenders = [
        f"{path.relative_to(SRC)}:{number}"
        for path in SRC.rglob("*.py")
        if path.name != "untrusted.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if direct.search(line)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_auto_map_code_never_runs_even_when_a_terminal_answers_yes(model_dir, tmp_path, where):
    evil = _copy(model_dir, tmp_path)
    marker = tmp_path / "ran"
    (evil / "evil.py").write_text(EVIL.format(marker=str(marker)))
    if where == "config":
        _edit_json(
            evil / "config.json",
            lambda c: c.update(
                model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
            ),
        )
    else:
        _edit_json(
            evil / "tokenizer_config.json",
            lambda c: c.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTok", None]}),
        )
    done = subprocess.run(
        [sys.executable, "-m", "leanlm.cli.main", "eval", str(evil), "--tasks", "wikitext2", "--max-tokens", "256"],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not marker.exists()
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("leanlm: error: ")
    assert "never runs code" in done.stderr or "EvilTokenizer" in done.stderr


@pytest.mark.parametrize("name", ["../elsewhere/x.safetensors", "ABSOLUTE"])
def test_an_index_map_naming_a_file_outside_the_model_is_refused(model_dir, tmp_path, name):
    outside = _copy(model_dir, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "x.safetensors"
    shutil.move(outside / WEIGHTS_FILE, target)
    with safe_open(str(target), "pt") as handle:
        names = list(handle.keys())
    name = str(target) if name == "ABSOLUTE" else name
    (outside / INDEX_FILE).write_text(json.dumps({"weight_map": dict.fromkeys(names, name)}))
    _refused(outside, "lies outside the model's directory")


def test_a_symlink_out_of_the_model_is_refused_but_a_hugging_face_cache_entry_loads(model_dir, tmp_path):
    linked = _copy(model_dir, tmp_path)
    (tmp_path / "secret.json").write_text("{}")
    (linked / "tokenizer_config.json").unlink()
    (linked / "tokenizer_config.json").symlink_to(tmp_path / "secret.json")
    _refused(linked, "tokenizer_config.json.*lies outside the model's directory")

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    blobs = tmp_path / "hub" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        shutil.copy(file, blobs / file.name)
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    assert load_model(snapshot).model.config.num_hidden_layers == 2


def test_a_config_claiming_more_layers_than_its_weights_hold_is_refused_before_building_them(model_dir, tmp_path):
    many = _copy(model_dir, tmp_path)
    _edit_json(many / "config.json", lambda c: c.update(num_hidden_layers=100_000))
    _refused(many, "config.json says 100000 layers, but the weights hold tensors of 2")


def test_weights_missing_a_block_are_named_not_left_random(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    lacking = _copy(model_dir, tmp_path)
    tensors = load_file(str(lacking / WEIGHTS_FILE))
    save_file({k: v for k, v in tensors.items() if ".layers.1.mlp." not in k}, str(lacking / WEIGHTS_FILE))
    _refused(lacking, r"lack 3 of the model's tensors \(model.layers.1.mlp")


@pytest.mark.parametrize("dtype", ["I32", "U32"])
def test_a_float_tensor_relabelled_as_integers_is_refused_on_its_header(model_dir, tmp_path, dtype):
    relabelled = _copy(model_dir, tmp_path)
    data = bytearray((relabelled / WEIGHTS_FILE).read_bytes())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["model.embed_tokens.weight"]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    assert len(text) == size
    data[8 : 8 + size] = text
    (relabelled / WEIGHTS_FILE).write_bytes(bytes(data))
    _refused(relabelled, f"model.embed_tokens.weight is stored as {dtype}, not a float type")


def test_a_record_pointing_at_itself_is_followed_once(model_dir, tmp_path):
    from leanlm.export.to_gguf import export_gguf, source_gguf
    from leanlm.methods import load_any, quantize_, save_quantized
    from leanlm.methods.kbit import KbitConfig

    loaded = load_any(model_dir)
    checkpoint = save_quantized(loaded, loaded.model, quantize_(loaded.model, KbitConfig()), tmp_path / "q")
    _edit_json(checkpoint / "leanlm_quant.json", lambda r: r.update(source_model=str(checkpoint)))
    assert source_gguf(checkpoint) is None
    with pytest.raises(LeanLMError, match="codebook"):  # refused for what it holds, not after endless recursion
        export_gguf(checkpoint, tmp_path / "out.gguf")


def test_a_quantized_checkpoint_naming_code_of_its_own_is_refused_without_running_it(model_dir, tmp_path):
    from leanlm.methods import load_any, quantize_, save_quantized
    from leanlm.methods.kbit import KbitConfig

    loaded = load_any(model_dir)
    checkpoint = save_quantized(loaded, loaded.model, quantize_(loaded.model, KbitConfig()), tmp_path / "q")
    marker = tmp_path / "ran"
    (checkpoint / "evil.py").write_text(EVIL.format(marker=str(marker)))
    _edit_json(
        checkpoint / "config.json",
        lambda c: c.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"}),
    )
    with pytest.raises(LeanLMError, match="never runs code from a model"):
        load_any(checkpoint)
    assert not marker.exists()


safetensors_values = st.one_of(
    st.sampled_from(["F32", "I32", "F16", "BOOL", "XX", None, "", "../x"]),
    st.lists(st.integers(-3, 2**40), max_size=3),
    st.integers(-(2**63), 2**64),
)


@pytest.mark.timeout(600)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 100), st.sampled_from(["dtype", "shape", "data_offsets", "name"]), safetensors_values),
        min_size=1,
        max_size=3,
    ),
    index=st.none()
    | st.dictionaries(
        st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "x"]),
        st.sampled_from(["model.safetensors", "../model.safetensors", "/etc/hostname", "", ".", "missing.safetensors"])
        | st.integers()
        | st.none(),
        max_size=3,
    ),
)
def test_any_header_or_index_edit_loads_or_is_refused_cleanly(model_dir, tmp_path_factory, bounded_data, edits, index):
    """Edits of a real safetensors header (a tensor's dtype, shape, offsets or name) and index maps of any
    content: loading gives the model or a LeanLMError, never another exception or an allocation beyond
    `bounded_data`'s bound."""
    directory = _copy(model_dir, tmp_path_factory.mktemp("edited"))
    data = (directory / WEIGHTS_FILE).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    names = [name for name in header if name != "__metadata__"]
    for position, field, value in edits:
        name = names[position % len(names)]
        if field == "name":
            header[str(value)] = header.pop(name)
            names = [n for n in header if n != "__metadata__"]
        else:
            header[name][field] = value
    text = json.dumps(header).encode()
    (directory / WEIGHTS_FILE).write_bytes(len(text).to_bytes(8, "little") + text + data[8 + size :])
    if index is not None:
        (directory / INDEX_FILE).write_text(json.dumps({"weight_map": index}))
    try:
        loaded = load_model(directory)
    except LeanLMError as error:
        assert "\n" not in str(error)
    else:
        assert loaded.model.config.num_hidden_layers == 2
