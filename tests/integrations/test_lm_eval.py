"""lm-evaluation-harness runs leanlm models: `--model leanlm` for anything leanlm loads, and `--model hf` for a leanlm
checkpoint (through transformers' `from_pretrained`). lm-eval's own task definitions (the YAMLs it ships, prompts
and all) run on leanlm's shipped copies of the six data sets, and every request's log-likelihood equals what
`leanlm eval` computes for it."""

import json
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from tiny import save_tiny_llama

import leanlm.methods as m
from leanlm import data
from leanlm.errors import ConfigError
from leanlm.evaluation.loglikelihood import score_requests, score_tokens
from leanlm.evaluation.tasks import TASKS
from leanlm.evaluation.tokens import encode, max_input_length
from leanlm.integrations.lm_eval import LeanLM
from leanlm.methods import load_any
from leanlm.models.registry import DEFAULT_MODEL

ITEMS = 50
HF_ITEMS = 20  # transformers' own forward, one request at a time, is slower
LM_EVAL_TASKS = Path(lm_eval.__file__).parent / "tasks"


def _arc(subset):
    records = []
    for item in data.arc_items(subset):
        labels = [chr(ord("A") + i) for i in range(len(item.choices))]
        records.append(
            {
                "question": item.question,
                "choices": {"text": list(item.choices), "label": labels},
                "answerKey": labels[item.label],
            }
        )
    return records


def _hellaswag():
    records = []
    for item in data.hellaswag_items():
        label, context = item.context.split(": ", 1)
        records.append(
            {
                "activity_label": label,
                "ctx_a": context,
                "ctx_b": "",
                "endings": list(item.endings),
                "label": str(item.label),
            }
        )
    return records


# leanlm's task -> (lm-eval's task file, the split it evaluates, leanlm's data in the Hugging Face data set's fields)
OFFLINE = {
    "lambada": ("lambada/lambada_openai.yaml", "test", lambda: [{"text": t} for t in data.lambada_test_texts()]),
    "piqa": (
        "piqa/piqa.yaml",
        "validation",
        lambda: [
            {"goal": i.goal, "sol1": i.solutions[0], "sol2": i.solutions[1], "label": i.label}
            for i in data.piqa_items()
        ],
    ),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", _hellaswag),
    "arc_easy": ("arc/arc_easy.yaml", "test", lambda: _arc("easy")),
    "arc_challenge": ("arc/arc_challenge.yaml", "test", lambda: _arc("challenge")),
    "winogrande": (
        "winogrande/default.yaml",
        "validation",
        lambda: [
            {"sentence": i.sentence, "option1": i.options[0], "option2": i.options[1], "answer": str(i.label + 1)}
            for i in data.winogrande_items()
        ],
    ),
}


@pytest.fixture(scope="module")
def tiny_smollm2(tmp_path_factory, smollm2_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def offline_tasks(tmp_path_factory):
    """lm-eval's own task files, each reading the first ITEMS documents of leanlm's copy as a local JSON data set."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (task_file, split, records) in OFFLINE.items():
        rows = root / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in records()[:ITEMS]))
        config = {
            "include": str(LM_EVAL_TASKS / task_file),
            "task": f"offline_{name}",
            "tag": [],
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(rows)}},
            **{f"{which}_split": None for which in ("training", "validation", "test")},
            f"{split}_split": split,
        }
        (root / f"{name}.yaml").write_text(json.dumps(config))
    return TaskManager(include_path=str(root), include_defaults=True)


def _lm_eval_scores(model, offline_tasks, items, **kwargs) -> dict[str, list[float]]:
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=[f"offline_{name}" for name in OFFLINE],
        task_manager=offline_tasks,
        log_samples=True,
        limit=items,
        bootstrap_iters=0,
        **kwargs,
    )
    scores = {}
    for name in OFFLINE:
        samples = sorted(results["samples"][f"offline_{name}"], key=lambda s: s["doc_id"])
        scores[name] = [float(resp[0][0]) for sample in samples for resp in sample["resps"]]
    return scores


def _leanlm_scores(loaded, items) -> dict[str, list[float]]:
    scores = {}
    for name in OFFLINE:
        requests = [r for doc in TASKS[name].load_docs()[:items] for r in doc.requests]
        scores[name] = [s.loglikelihood for s in score_requests(loaded.model, loaded.tokenizer, requests)]
    return scores


def _check_equal(source, offline_tasks, items, paths=("leanlm", "hf"), hf_items=HF_ITEMS):
    ours = _leanlm_scores(load_any(source), items)
    runs = {}
    if "leanlm" in paths:
        runs["leanlm"] = _lm_eval_scores("leanlm", offline_tasks, items, model_args=f"pretrained={source}")
    if "hf" in paths:
        runs["hf"] = _lm_eval_scores(
            "hf", offline_tasks, hf_items, model_args=f"pretrained={source},dtype=float32", batch_size=1, device="cpu"
        )
    for model, theirs in runs.items():
        for name in OFFLINE:
            assert len(ours[name]) >= len(theirs[name]) >= min(items, hf_items), (model, name)
            worst = max(abs(a - b) for a, b in zip(theirs[name], ours[name]))
            assert worst <= 1e-4, f"--model {model}, {name}: largest difference {worst}"


def _nf4_checkpoint(source, directory) -> Path:
    loaded = load_any(source)
    return m.save_quantized(loaded, loaded.model, m.quantize_(loaded.model, m.KbitConfig()), directory)


def test_import_leanlm_registers_the_model_whichever_comes_first():
    assert get_model("leanlm") is LeanLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are all still there
    code = "import lm_eval.api.registry as r, leanlm; print(r.get_model('leanlm').__name__, 'hf' in r.model_registry)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.split() == ["LeanLM", "True"]


def test_the_command_without_lm_eval_is_one_line_naming_the_extra():
    code = (
        "import sys, runpy; sys.modules['lm_eval'] = None; "
        "runpy.run_module('leanlm.integrations.lm_eval', run_name='__main__')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert 'needs lm_eval, which is not installed: pip install "leanlm[lm-eval]"' in run.stderr


def test_unknown_model_args_and_devices_are_one_line():
    with pytest.raises(ConfigError, match="unknown temperature"):
        LeanLM(pretrained="x", temperature=1)
    with pytest.raises(ConfigError, match="runs on the CPU"):
        LeanLM(pretrained="x", device="cuda")


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "nf4-dq"])
def test_the_six_tasks_score_as_leanlm_eval_does(offline_tasks, tiny_smollm2, tmp_path, quantized):
    """ITEMS documents of every task, lm-eval's prompts on leanlm's data: a random model with SmolLM2's tokenizer
    (what the prompts become is the model's tokenizer's business), float and NF4 + DQ; the NF4 checkpoint also
    through `--model hf`."""
    source = _nf4_checkpoint(tiny_smollm2, tmp_path / "nf4") if quantized else tiny_smollm2
    _check_equal(source, offline_tasks, ITEMS, paths=("leanlm", "hf") if quantized else ("leanlm",))


@pytest.mark.slow
def test_smollm2_scores_as_leanlm_eval_does(offline_tasks):
    """The real SmolLM2 on the first documents of every task through `--model leanlm` (the tiny model's tests above
    run NF4 + DQ and `--model hf` too)."""
    _check_equal(DEFAULT_MODEL, offline_tasks, 3, paths=("leanlm",))


@pytest.mark.slow
def test_generation_and_rolling_loglikelihood(tmp_path):
    """generate_until stops at the task's stop strings (through the fused decode step), and a rolling
    log-likelihood over lm-eval's windows equals the sum of leanlm's scores of the same windows."""
    from lm_eval.api.instance import Instance

    model = LeanLM(pretrained=DEFAULT_MODEL)
    request = Instance("generate_until", {}, ("The capital of France is", {"until": ["."], "max_gen_toks": 24}), 0)
    (text,) = model.generate_until([request])
    assert text and "." not in text
    longer = Instance(
        "generate_until", {}, ("The capital of France is", {"until": ["\n\n\n\n"], "max_gen_toks": 24}), 0
    )
    assert model.generate_until([longer])[0].startswith(text)

    document = data.wikitext2_test_text()[:3000]  # one window: every token scored after the prefix token
    (total,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)])
    tokens, prefix = encode(model.tokenizer, document), model.tokenizer.bos_token_id
    assert len(tokens) < max_input_length(model.model)
    assert total == pytest.approx(
        score_tokens(model.model, [prefix], tokens, max_input_length(model.model)).loglikelihood
    )
