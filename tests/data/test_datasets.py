import shutil

import pytest
import torch

from leanlm import data
from leanlm.errors import ConfigError, DataError


def test_sizes_match_the_data_readme():
    assert len(data.wikitext2_test_text()) == 1_294_336
    assert len(data.piqa_items()) == 1838
    assert len(data.hellaswag_items()) == 10042
    assert len(data.arc_items("easy")) == 2376
    assert len(data.arc_items("challenge")) == 1170
    assert len(data.winogrande_items()) == 1267
    assert len(data.lambada_test_texts()) == 5153


def test_records_are_parsed_into_the_right_fields():
    arc = data.arc_items("easy")[0]
    assert arc.question.startswith("Which statement best explains why photosynthesis")
    assert arc.choices[arc.label] == "Sunlight is the source of energy for nearly all ecosystems."
    hellaswag = data.hellaswag_items()[0]
    assert hellaswag.context == "Roof shingle removal: A man is sitting on a roof. he"
    assert hellaswag.label == 3 and hellaswag.endings[3] == "starts pulling up roofing on a roof."
    winogrande = data.winogrande_items()[0]
    assert winogrande.options == ("Sarah", "Maria") and winogrande.label == 1
    assert data.piqa_items()[0].label == 0
    assert data.ptb_text().startswith("no it was n't black monday but while")


def test_every_label_is_a_valid_choice():
    assert all(0 <= i.label < 2 for i in data.piqa_items())
    assert all(0 <= i.label < 4 for i in data.hellaswag_items())
    assert all(0 <= i.label < len(i.choices) for i in data.arc_items("challenge"))
    assert all(i.label in (0, 1) for i in data.winogrande_items())


def test_a_corrupt_file_fails_its_checksum(tmp_path, monkeypatch):
    copy = tmp_path / "data"
    shutil.copytree(data.data_root(), copy)
    target = copy / "piqa" / "dev-labels.lst"
    target.chmod(0o644)
    target.write_text("1\n" + target.read_text())
    monkeypatch.setenv("LEANLM_DATA", str(copy))
    with pytest.raises(DataError, match="dev-labels.lst fails its checksum"):
        data.piqa_items()


def test_missing_data_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANLM_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="nowhere"):
        data.wikitext2_test_text()


def test_calibration_windows_are_random_slices_of_the_text(smollm2_tokenizer):
    batches = data.calibration_batches(smollm2_tokenizer, n_samples=4, seq_len=64, seed=1)
    assert batches.shape == (4, 64) and batches.dtype == torch.long
    assert torch.equal(batches, data.calibration_batches(smollm2_tokenizer, n_samples=4, seq_len=64, seed=1))
    assert not torch.equal(batches, data.calibration_batches(smollm2_tokenizer, n_samples=4, seq_len=64, seed=2))
    stream = smollm2_tokenizer(data.plain_text("lambada-dev"))["input_ids"]
    text = " ".join(map(str, stream))
    assert " ".join(map(str, batches[0].tolist())) in text


def test_calibration_rejects_bad_sizes(smollm2_tokenizer):
    with pytest.raises(ConfigError, match="n_samples"):
        data.calibration_batches(smollm2_tokenizer, n_samples=0)
