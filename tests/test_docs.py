"""The result tables of the README and the documentation are what the code prints from the committed JSON, so a
table cannot drift from its data: the showcase's table, and every table each benchmark script's `--report` prints.
Every table of a documentation page is one of those, except on the pages that hold no results."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from leanlm.showcase import showcase_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
# Pages whose tables are reference, not results (extras, papers, where each fact lives, the models).
NO_RESULTS = {"getting-started.md", "references.md", "design.md", "models.md"}
# Each script in benchmarks/ and the result files the documentation quotes its tables from.
REPORTED = {
    "attention": ["attention"],
    "baseline": ["baseline_smollm2-135m", "baseline_qwen2.5-coder-1.5b"],
    "cushion": ["cushion_smollm2-135m"],
    "cushion_ablation": ["cushion_ablation_smollm2-135m"],
    "compute_dtype": ["compute_dtype_smollm2-135m"],
    "decode": [
        "decode_smollm2-135m",
        "decode_gemma3-270m",
        "decode_qwen2.5-coder-1.5b",
        "decode_smollm2-135m_xeon-amx",
        "decode_gemma3-270m_xeon-amx",
        "decode_smollm2-135m_3bit",
        "decode_llama3-8b-shape",
        "decode_smollm2-135m_gptq-prefill",
        "decode_smollm2-135m_prefetch",
    ],
    "gguf_conversion": ["gguf_conversion_smollm2-135m", "gguf_conversion_qwen2.5-coder-1.5b"],
    "gguf_llama_cpp": [
        "gguf_llama_cpp_smollm2-135m",
        "gguf_llama_cpp_gemma3-270m",
        "gguf_llama_cpp_qwen2.5-coder-1.5b",
        "gguf_llama_cpp_smollm2-135m_windows0",
        "gguf_llama_cpp_gemma3-270m_windows0",
    ],
    "export_compressed_tensors": ["compressed_tensors_smollm2-135m", "compressed_tensors_smollm2-135m_windows0"],
    "gptq_spqr": ["gptq_spqr_smollm2-135m", "gptq_spqr_gemma3-270m", "gptq_spqr_qwen2.5-coder-1.5b"],
    "kbit_speed": ["kbit_speed"],
    "kbit_sweep": ["kbit_sweep_smollm2-135m", "kbit_sweep_gemma3-270m"],
    "llm_int8": ["llm_int8"],
    "methods": ["methods_qwen2.5-coder-1.5b"],
    "out_of_core": ["out_of_core_llama3-8b-shape"],
    "plan_accuracy": [
        "plan_accuracy_smollm2-135m",
        "plan_accuracy_qwen2.5-coder-1.5b",
        "plan_accuracy_llama3-8b-shape",
    ],
    "qlora": ["qlora_smollm2-135m", "qlora_gemma3-270m"],
    "resident_memory": ["resident_memory_smollm2-135m"],
    "serve": ["serve_smollm2-135m", "serve_qwen2.5-coder-1.5b"],
    "sink_pretraining": ["sink_pretraining"],
    "streaming": ["streaming_smollm2-135m"],
    "structured_output": ["structured_output"],
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
PAGES = {page.relative_to(DOCS).as_posix(): page.read_text() for page in sorted(DOCS.rglob("*.md"))}
DOCUMENTED = "\n\n".join(_normalized(text) for text in PAGES.values())


def _module(script: str):
    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _showcase_table(result: str = "showcase_smollm2-135m") -> str:
    return showcase_table(json.loads((RESULTS / f"{result}.json").read_text()))


def _report_tables(script: str, result: str) -> list[str]:
    return _tables(_module(script).report(json.loads((RESULTS / f"{result}.json").read_text())))


def test_the_showcase_table_is_the_committed_run():
    table = _normalized(_showcase_table())
    assert table in README
    assert table in _normalized(PAGES["results/showcase.md"])
    assert _normalized(_showcase_table("showcase_smollm2-135m_xeon-amx")) in _normalized(PAGES["results/showcase.md"])


def test_every_benchmark_script_is_checked():
    assert sorted(path.stem for path in (ROOT / "benchmarks").glob("*.py")) == sorted(REPORTED)


@pytest.mark.parametrize("script, result", [(s, r) for s, results in REPORTED.items() for r in results])
def test_the_documented_tables_are_the_scripts_report(script, result):
    tables = _report_tables(script, result)
    assert tables, f"{script}'s report of {result}.json prints no table"
    missing = [table.splitlines()[2] for table in tables if _normalized(table) not in DOCUMENTED]
    assert not missing, f"documented tables that differ from the report (first row shown): {missing}"


def test_every_results_table_in_the_documentation_comes_from_a_report():
    printed = [_normalized(_showcase_table(r)) for r in ("showcase_smollm2-135m", "showcase_smollm2-135m_xeon-amx")]
    printed += [
        _normalized(t) for script, results in REPORTED.items() for r in results for t in _report_tables(script, r)
    ]
    stray = [
        f"{name}: {table.splitlines()[0][:80]}"
        for name, text in PAGES.items()
        if name not in NO_RESULTS
        for table in _tables(text)
        if not any(_normalized(table) in report for report in printed)
    ]
    assert not stray, f"tables no report prints: {stray}"
