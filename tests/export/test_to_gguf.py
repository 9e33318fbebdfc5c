"""GGUF export: a float model written as F32 holds exactly the tensors (names, shapes, values) of the GGUF it came
from, de-quantized, with its metadata; Q8_0 is llama.cpp's own rounding of those values; a checkpoint on the
symmetric grid in groups of 32 is written as its own Q4_0 / Q8_0 blocks, value for value; every other stored form
is refused with the reason, before anything is written."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from leanlm.cli.main import main
from leanlm.errors import ConfigError
from leanlm.export import export_gguf
from leanlm.export.to_gguf import _gguf_order, gguf_blocks, source_gguf
from leanlm.formats.gptq import SolverSettings, solve
from leanlm.methods.checkpoint import load_any, load_quantized
from leanlm.nn import KbitLinear, SpQRLinear


def _solved_module(bits=4, seed=0, **settings):
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(seed))
    options = {
        "bits": bits,
        "group_size": 32,
        "act_order": False,
        "error_feedback": False,
        "grid": "symmetric",
        **settings,
    }
    settings = SolverSettings(**options)
    inputs = torch.randn(256, 96, generator=torch.Generator().manual_seed(seed + 1)) * torch.linspace(0.1, 2, 96)
    hessian = inputs.T @ inputs / 256 if settings.error_feedback else None  # act-order really permutes
    return SpQRLinear.from_solved(solve(weight, hessian, settings), settings, None)


@pytest.mark.parametrize(
    "bits, block_type, settings",
    [
        (4, "Q4_0", {}),
        (8, "Q8_0", {}),
        (4, "Q4_0", {"error_feedback": True, "act_order": True, "static_groups": True}),  # GPTQ, act-order
        (4, "Q4_0", {"error_feedback": True, "act_order": True, "static_groups": True, "scale_search": True}),
    ],
    ids=["q4_0", "q8_0", "gptq-act-order-static-groups", "gptq-scale-search"],
)
def test_symmetric_groups_of_32_are_gguf_blocks_value_for_value(bits, block_type, settings):
    module = _solved_module(bits, **settings)
    blocks, kind = gguf_blocks(module)
    assert kind.name == block_type
    assert blocks.shape == (48, 3 * gguf.GGML_QUANT_SIZES[kind][1])  # 18 bytes per Q4_0 block, 34 per Q8_0
    assert np.array_equal(dequantize(blocks, kind), module.dequantized_weight().numpy())


@pytest.mark.parametrize(
    "settings, reason",
    [
        ({"grid": "minmax"}, "--grid symmetric"),
        ({"group_size": 16}, "a block is 32 columns, not 16"),
        ({"group_size": 32, "bits": 3}, "--bits 4 or 8"),
        ({"error_feedback": True, "act_order": True}, "--static-groups or --no-act-order"),
        ({"grid": "minmax", "statistic_bits": 3, "outlier_threshold": 0.2}, "quantized statistics and outliers"),
    ],
)
def test_forms_without_an_exact_block_type_are_refused_with_the_reason(settings, reason):
    with pytest.raises(ConfigError, match=reason):
        gguf_blocks(_solved_module(**settings))


def test_k_bit_codebooks_are_refused():
    with pytest.raises(ConfigError, match="--method rtn or gptq"):
        gguf_blocks(KbitLinear(64, 32, bias=False))


def test_q_and_k_rows_move_whole_so_their_blocks_move_with_them():
    module = _solved_module()
    blocks, kind = gguf_blocks(module)
    expected = _gguf_order(module.dequantized_weight().numpy(), heads=4)
    assert np.array_equal(dequantize(_gguf_order(blocks, heads=4), kind), expected)


@pytest.mark.slow
def test_the_default_model_exports_to_its_own_gguf_layout_bit_for_bit(tmp_path):
    source = gguf.GGUFReader(source_gguf("smollm2-135m"))
    result = export_gguf("smollm2-135m", tmp_path / "f32.gguf", "f32")
    exported = gguf.GGUFReader(result["path"])
    assert result["tensors"] == len(source.tensors) == 272
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "llama.rope.freq_base"):
        assert exported.fields[key].contents() == source.fields[key].contents()
    by_name = {tensor.name: tensor for tensor in exported.tensors}
    for tensor in source.tensors:  # q and k back in llama.cpp's rotary order, every value as the source stored it
        ours = by_name[tensor.name]
        assert ours.shape.tolist() == tensor.shape.tolist()
        assert np.array_equal(dequantize(ours.data, ours.tensor_type), dequantize(tensor.data, tensor.tensor_type))

    q8 = gguf.GGUFReader(export_gguf("smollm2-135m", tmp_path / "q8.gguf", "q8_0")["path"])
    floats = {tensor.name: dequantize(tensor.data, tensor.tensor_type) for tensor in exported.tensors}
    for tensor in q8.tensors:
        expected = (
            floats[tensor.name]
            if tensor.tensor_type == gguf.GGMLQuantizationType.F32
            else dequantize(
                quantize(floats[tensor.name], gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
            )
        )
        assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), expected)
    assert q8.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


@pytest.mark.slow
def test_a_symmetric_rtn_checkpoint_exports_as_q4_0_blocks_equal_to_its_weights(tmp_path, capsys):
    checkpoint, out = tmp_path / "rtn", tmp_path / "rtn.gguf"
    assert (
        main(
            [
                "quantize",
                "smollm2-135m",
                "--method",
                "rtn",
                "--grid",
                "symmetric",
                "--group-size",
                "32",
                "--out",
                str(checkpoint),
            ]
        )
        == 0
    )
    assert main(["export", str(checkpoint), "--format", "gguf", "--out", str(out)]) == 0
    assert "Q4_0" in capsys.readouterr().out
    loaded, _ = load_quantized(checkpoint)
    config = loaded.model.config
    exported = {tensor.name: tensor for tensor in gguf.GGUFReader(out).tensors}
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    assert gguf.GGUFReader(out).fields["tokenizer.chat_template"].contents()
    checked = 0
    for index, block in enumerate(loaded.model.model.layers):
        for path, name, heads in (
            ("self_attn.q_proj", "attn_q", config.num_attention_heads),
            ("self_attn.k_proj", "attn_k", config.num_key_value_heads),
            ("self_attn.v_proj", "attn_v", None),
            ("mlp.down_proj", "ffn_down", None),
        ):
            tensor = exported[f"blk.{index}.{name}.weight"]
            assert tensor.tensor_type == gguf.GGMLQuantizationType.Q4_0
            expected = block.get_submodule(path).dequantized_weight().numpy()
            expected = _gguf_order(expected, heads) if heads else expected
            assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), expected)
            checked += 1
    assert checked == 4 * config.num_hidden_layers
    assert exported["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # --type f32 by default


def test_a_transformers_model_gets_its_metadata_from_its_config_and_tokenizer(tiny_llama_dir, tmp_path, capsys):
    """A model that never was a GGUF (a transformers directory with SmolLM2's tokenizer) is written with the
    tokenizer llama.cpp's converter writes for it (the same tokens, types and merges as SmolLM2's own GGUF), its
    hyper-parameters, and its weights value for value."""
    out = tmp_path / "m.gguf"
    assert main(["export", str(tiny_llama_dir), "--format", "gguf", "--out", str(out)]) == 0
    exported = gguf.GGUFReader(out)
    fields = {key: field.contents() for key, field in exported.fields.items()}
    smollm2 = gguf.GGUFReader(source_gguf("smollm2-135m")).fields
    for key in (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.chat_template",
    ):
        assert fields[key] == smollm2[key].contents(), key
    assert fields["tokenizer.ggml.pre"] == "gpt-2"  # SmolLM2's tokenizer.json: plain byte-level, GPT-2's pattern
    model = load_any(str(tiny_llama_dir)).model
    config = model.config
    assert (
        fields["llama.block_count"],
        fields["llama.embedding_length"],
        fields["llama.feed_forward_length"],
        fields["llama.attention.head_count"],
        fields["llama.attention.head_count_kv"],
        fields["llama.rope.dimension_count"],
    ) == (2, 64, 128, 4, 2, 16)
    assert fields["llama.context_length"] == config.max_position_embeddings
    tensors = {tensor.name: dequantize(tensor.data, tensor.tensor_type) for tensor in exported.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    assert np.array_equal(tensors["token_embd.weight"], model.model.embed_tokens.weight.detach().numpy())
    q = model.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    assert np.array_equal(tensors["blk.1.attn_q.weight"], _gguf_order(q, config.num_attention_heads))
    assert "written from the config and tokenizer" in capsys.readouterr().out


def test_metadata_without_a_source_gguf_is_refused_where_the_config_does_not_carry_it(tmp_path, capsys):
    from tiny import tiny_model

    source = tmp_path / "gemma"
    tiny_model("gemma3_text").save_pretrained(source)
    assert main(["export", str(source), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    assert "metadata only from the GGUF the model came from" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))


def _with_rope_scaling(directory):
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (directory / "config.json").write_text(json.dumps(config))


def _with_word_level_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for old in directory.glob("*token*"):
        old.unlink()
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(directory)


@pytest.mark.parametrize(
    "change, reason",
    [
        (_with_rope_scaling, "rope type 'llama3': llama.cpp reads its frequencies from a rope_freqs tensor"),
        (_with_word_level_tokenizer, "a tokenizer only for byte-level BPE (GPT-2's kind); this model's is WordLevel"),
    ],
)
def test_what_the_metadata_cannot_describe_is_refused_before_the_weights_load(
    tiny_llama_dir, tmp_path, capsys, monkeypatch, change, reason
):
    """Rope scaling (a rope_freqs tensor this export does not write) and tokenizers other than byte-level BPE
    are refused in one line naming them, before a weight is read, and nothing is left behind."""
    change(tiny_llama_dir)
    monkeypatch.setattr("leanlm.methods.checkpoint.load_any", lambda *a, **k: pytest.fail("the weights were loaded"))
    assert main(["export", str(tiny_llama_dir), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    assert reason in capsys.readouterr().err
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial*"))


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from tiny import byte_tokenizer, save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("byte"), byte_tokenizer())


def test_export_never_writes_over_its_input_or_an_existing_file_without_force(byte_model, tmp_path, monkeypatch):
    import leanlm.methods.checkpoint

    out = tmp_path / "model.gguf"
    export_gguf(byte_model, out)
    first = out.read_bytes()

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(leanlm.methods.checkpoint, "load_any", never)
    with pytest.raises(ConfigError, match="exists; choose a new path, or add --force"):
        export_gguf(byte_model, out)
    for own in (
        out,
        byte_model / "model.safetensors",
        byte_model / "config.json",
    ):  # the source file, or in its directory
        source = out if own == out else byte_model
        with pytest.raises(ConfigError, match="would write over the model it is made from"):
            export_gguf(source, own, force=True)
    with pytest.raises(ConfigError, match="is a directory"):
        export_gguf(byte_model, tmp_path)
    assert out.read_bytes() == first and not list(tmp_path.glob(".*partial*"))
    monkeypatch.undo()
    assert export_gguf(byte_model, out, "f16", force=True)["bytes"] < len(first)  # replaced, on request


def test_a_killed_export_leaves_nothing_and_the_next_removes_a_dead_runs_staging(byte_model, tmp_path, monkeypatch):
    import gguf as gguf_package

    out = tmp_path / "model.gguf"
    dead = tmp_path / ".model.gguf.partial-999999999"  # a pid no process has
    dead.write_bytes(b"half a file")

    def killed(self, tensor):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_package.GGUFWriter, "write_tensor_data", killed)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(byte_model, out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []
    monkeypatch.undo()
    dead.write_bytes(b"half a file")
    export_gguf(byte_model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


# One linear per GGUF type leanlm writes (the others Q4_K): q / k / v / o of the first block, its MLP, the second's
# MLP, q and k.
_TYPE_MAP = {
    "0.self_attn.q_proj": "q2_k",
    "0.self_attn.k_proj": "q3_k",
    "0.self_attn.v_proj": "q5_k",
    "0.self_attn.o_proj": "q6_k",
    "0.mlp.gate_proj": "q4_0",
    "0.mlp.up_proj": "q4_1",
    "0.mlp.down_proj": "q5_0",
    "1.mlp.gate_proj": "q5_1",
    "1.mlp.up_proj": "q8_0",
    "1.self_attn.q_proj": "iq4_nl",
    "1.self_attn.k_proj": "iq4_xs",
}


def test_a_gguf_block_type_checkpoint_is_written_as_its_own_blocks(tmp_path, capsys):
    """A 256-wide Llama with every linear given a type (`--tensor-type`): each block tensor of the file has that
    type and de-quantizes, through `gguf`, to the weight the checkpoint computes with."""
    from tiny import byte_tokenizer, tiny_model

    source = tmp_path / "tiny"
    tiny_model("llama", vocab_size=258, width=256).save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    checkpoint, out = tmp_path / "q", tmp_path / "q.gguf"
    types = [f"^{path.replace('.', '[.]')}$={name}" for path, name in _TYPE_MAP.items()]
    arguments = ["quantize", str(source), "--method", "rtn", "--gguf-type", "q4_k"]
    assert main([*arguments, *(f"--tensor-type={t}" for t in types), "--out", str(checkpoint)]) == 0
    assert main(["export", str(checkpoint), "--format", "gguf", "--out", str(out)]) == 0
    assert "IQ4_NL / IQ4_XS / Q2_K / Q3_K / Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0" in (
        capsys.readouterr().out
    )
    exported = {tensor.name: tensor for tensor in gguf.GGUFReader(out).tensors}
    loaded, _ = load_quantized(checkpoint)
    config = loaded.model.config
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for index, block in enumerate(loaded.model.model.layers):
        for path, _ in block.named_modules():
            leaf = path.rpartition(".")[2]
            if leaf not in names:
                continue
            tensor = exported[f"blk.{index}.{names[leaf]}.weight"]
            assert tensor.tensor_type.name == _TYPE_MAP.get(f"{index}.{path}", "q4_k").upper()
            expected = block.get_submodule(path).dequantized_weight().numpy()
            expected = _gguf_order(expected, heads[leaf]) if leaf in heads else expected
            assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), expected)


@pytest.mark.parametrize("tied", [False, True])
def test_the_embedding_and_head_take_the_block_types_asked_for_rounded_to_nearest(tmp_path, capsys, tied):
    """`--token-embedding-type` / `--output-tensor-type`: the tables are written as blocks of those types (a row
    no whole number of a K-quant's blocks takes llama.cpp's fallback), de-quantizing to the weights rounded by
    `table_blocks`, leanlm's RTN fit for that type; a tied head is the embedding, so it takes no type of its own."""
    from tiny import byte_tokenizer, tiny_model

    from leanlm.export.to_gguf import table_blocks
    from leanlm.formats.gguf_blocks import BLOCK_TYPES
    from leanlm.formats.gguf_blocks import dequantize as blocks_dequantized

    source = tmp_path / "tiny"
    model = tiny_model("llama", vocab_size=258, width=256)
    model.config.tie_word_embeddings = tied
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(torch.randn(258, 256, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(source)
    byte_tokenizer().save_pretrained(source)
    out = tmp_path / "t.gguf"
    flags = ["--token-embedding-type", "q4_k"] + ([] if tied else ["--output-tensor-type", "q6_k"])
    assert main(["export", str(source), "--format", "gguf", "--out", str(out), *flags]) == 0
    said = capsys.readouterr().out
    assert "token_embd as Q4_K" in said and ("output as" not in said if tied else "output as Q6_K" in said)
    exported = {tensor.name: tensor for tensor in gguf.GGUFReader(out).tensors}
    loaded = load_any(str(source)).model
    tables = {"token_embd": (loaded.model.embed_tokens.weight, "q4_k")}
    if tied:
        assert "output.weight" not in exported
    else:
        tables["output"] = (loaded.lm_head.weight, "q6_k")
    for name, (weight, kind) in tables.items():
        tensor = exported[f"{name}.weight"]
        blocks, written = table_blocks(weight, kind)
        assert tensor.tensor_type.name == written.name.upper() == kind.upper()
        rounded = blocks_dequantized(BLOCK_TYPES[kind], torch.from_numpy(blocks), weight.shape[1]).numpy()
        assert np.array_equal(dequantize(tensor.data, tensor.tensor_type), rounded)
        error = np.abs(rounded - weight.detach().numpy()).max()
        assert 0 < error < 0.2 * np.abs(weight.detach().numpy()).max()
    assert table_blocks(torch.randn(4, 96), "q4_k")[1].name == "q5_0"  # 96 columns: Q4_K's fallback
    if tied:
        with pytest.raises(ConfigError, match="tied"):
            export_gguf(str(source), tmp_path / "u.gguf", output_tensor_type="q6_k")
    with pytest.raises(ConfigError, match="choose from"):
        export_gguf(str(source), tmp_path / "v.gguf", token_embedding_type="q7_k")
    assert not (tmp_path / "u.gguf").exists() and not (tmp_path / "v.gguf").exists()


def test_an_output_type_for_a_tied_gguf_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from leanlm.methods import checkpoint

    monkeypatch.setattr(checkpoint, "load_any", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="tied"):
        export_gguf("smollm2-135m", tmp_path / "t.gguf", output_tensor_type="q6_k")
    assert not (tmp_path / "t.gguf").exists()
