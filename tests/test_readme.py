"""The README's result tables are what the code prints from the committed JSON, so a table cannot drift from its
data: the showcase's table, and every table each benchmark script's `--report` prints."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from leanlm.showcase import showcase_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Each script in benchmarks/ and the result files the README quotes its tables from.
REPORTED = {
    "baseline": ["baseline_smollm2-135m"],
    "cushion": ["cushion_smollm2-135m"],
    "cushion_ablation": ["cushion_ablation_smollm2-135m"],
    "compute_dtype": ["compute_dtype_smollm2-135m"],
    "decode": ["decode_smollm2-135m", "decode_gemma3-270m", "decode_smollm2-135m_xeon-amx",
               "decode_gemma3-270m_xeon-amx", "decode_smollm2-135m_3bit", "decode_llama3-8b-shape",
               "decode_smollm2-135m_gptq-prefill", "decode_smollm2-135m_prefetch"],
    "gguf_llama_cpp": ["gguf_llama_cpp_smollm2-135m", "gguf_llama_cpp_gemma3-270m",
                       "gguf_llama_cpp_smollm2-135m_windows0", "gguf_llama_cpp_gemma3-270m_windows0"],
    "export_compressed_tensors": ["compressed_tensors_smollm2-135m", "compressed_tensors_smollm2-135m_windows0"],
    "gptq_spqr": ["gptq_spqr_smollm2-135m", "gptq_spqr_gemma3-270m"],
    "kbit_speed": ["kbit_speed"],
    "kbit_sweep": ["kbit_sweep_smollm2-135m", "kbit_sweep_gemma3-270m"],
    "llm_int8": ["llm_int8"],
    "out_of_core": ["out_of_core_llama3-8b-shape"],
    "qlora": ["qlora_smollm2-135m", "qlora_gemma3-270m"],
    "resident_memory": ["resident_memory_smollm2-135m"],
    "serve": ["serve_smollm2-135m_xeon-amx"],
    "sink_pretraining": ["sink_pretraining"],
    "streaming": ["streaming_smollm2-135m"],
    "swarm": ["swarm"],
    "w8a8_accuracy": ["w8a8_accuracy_smollm2-135m"],
    "w8a8_speed": ["w8a8_speed"],
}


def _normalized(text: str) -> str:
    """Markdown tables compare cell by cell: column padding, rule length and bold marks are not content."""
    lines = (re.sub(r"-{3,}", "---", line.replace("**", "")) for line in text.splitlines())
    return "\n".join(re.sub(r"\s+", " ", line).strip() for line in lines)


def _tables(text: str) -> list[str]:
    tables, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append("\n".join(current))
            current = []
    return tables


README = _normalized((ROOT / "README.md").read_text())


def test_the_showcase_table_is_the_committed_run():
    table = showcase_table(json.loads((RESULTS / "showcase_smollm2-135m.json").read_text()))
    assert _normalized(table) in README


def test_every_benchmark_script_is_checked():
    assert sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py")) == sorted(REPORTED)


@pytest.mark.parametrize("script, result", [(s, r) for s, results in REPORTED.items() for r in results])
def test_the_readme_tables_are_the_scripts_report(script, result):
    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tables = _tables(module.report(json.loads((RESULTS / f"{result}.json").read_text())))
    assert tables, f"{script}'s report of {result}.json prints no table"
    missing = [table.splitlines()[2] for table in tables if _normalized(table) not in README]
    assert not missing, f"README tables that differ from the report (first row shown): {missing}"
