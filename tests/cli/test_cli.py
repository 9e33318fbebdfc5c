import json

import pytest

from leanlm.cli.main import main


def test_eval_writes_the_contract_json(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["eval", str(tiny_llama_dir), "--tasks", "wikitext2,piqa,winogrande", "--limit", "2",
                 "--max-tokens", "256", "--seq-len", "64", "--json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["model"] == str(tiny_llama_dir)
    wikitext = payload["results"]["wikitext2"]
    assert {"perplexity", "tokens", "tokens_per_second"} <= set(wikitext) and wikitext["tokens"] == 4 * 63
    assert {"acc", "acc_norm", "n"} <= set(payload["results"]["piqa"]) and payload["results"]["piqa"]["n"] == 2
    assert {"acc", "n"} <= set(payload["results"]["winogrande"])
    assert payload["weights_bytes"] > 0 and payload["seconds"] > 0
    printed = capsys.readouterr().out
    assert "wikitext2" in printed and "perplexity" in printed and "zero-shot average" in printed


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "no-such-model"], "neither a registered model"),
        (["eval", "smollm2-135m", "--tasks", "mmlu"], "unknown task(s) mmlu"),
        (["eval", "smollm2-135m", "--limit", "0"], "expected a positive number"),
        (["eval", "smollm2-135m", "--seq-len", "abc"], "expected a whole number"),
    ],
)
def test_bad_input_gets_a_one_line_error(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_seq_len_larger_than_the_text_is_explained(tiny_llama_dir, capsys):
    assert main(["eval", str(tiny_llama_dir), "--max-tokens", "100", "--seq-len", "2048"]) == 2
    assert "do not fill one window" in capsys.readouterr().err
