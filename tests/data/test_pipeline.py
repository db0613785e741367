"""The data kinds wired into the RL pipeline: the `tasks` and `eval` settings are checked at load,
the defaults are the generated tasks exactly, and a Hugging Face tokenizer + JSONL dataset + math
verifier run through the same loop, guidance store and evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import tiny
from tests.data import bpe
from tests.rl.rollouts import loop_config_dict
from trace_jax import data, tasks
from trace_jax.rl.config_dict import ConfigError
from trace_jax.rl.evaluate import EvalSuite
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.sft import run_sft
from trace_jax.rl.workers import RolloutWorker, Trainer, group_problems


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A GSM8K-layout train / test pair and a BPE tokenizer small enough for the tiny model."""
    root = tmp_path_factory.mktemp("hf_math")
    for name, numbers in (("train", range(20)), ("test", range(20, 24))):
        rows = [
            {"question": f"what is {i} plus {i}?", "answer": f"{i} plus {i} is {s}.\n#### {s}"}
            for i, s in ((i, 2 * i) for i in numbers)
        ]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok_dir = bpe.write_tokenizer_dir(root / "tokenizer", byte_level=False, vocab_size=64)
    return {"train": str(root / "train.jsonl"), "test": str(root / "test.jsonl"), "tok": tok_dir}


def _hf_config_dict(files, **rl):
    cd = loop_config_dict(**{"steps": 1, "eval_every": 1, **rl})
    cd.tasks.update(
        dataset="file",
        train_file=files["train"],
        solution_field="answer",
        answer_extractor="gsm8k",
        tokenizer="hf",
        tokenizer_dir=files["tok"],
        verifier="math",
    )
    cd.eval.update(splits=(), files=(files["test"],), problems_per_split=2, max_new_tokens=8)
    return cd


BAD_SETTINGS = [
    ("tasks.dataset", "hub", r"tasks\.dataset must be one of \['file', 'synthetic'\], got 'hub'"),
    ("tasks.tokenizer", "sp", r"tasks\.tokenizer must be one of \['char', 'hf'\]"),
    ("tasks.verifier", "llm", r"tasks\.verifier must be one of \['math', 'synthetic'\]"),
    ("tasks.answer_extractor", "x", r"tasks\.answer_extractor must be one of \['boxed'"),
    ("tasks.train_file", "/nowhere/train.jsonl", r"tasks\.train_file names no file"),
    ("tasks.train_file", "train.csv", r"tasks\.train_file must be a \.jsonl or \.parquet"),
    ("tasks.question_field", "", r"tasks\.question_field must name a field"),
    ("tasks.tokenizer_dir", "/nowhere", r"tasks\.tokenizer_dir must be a directory holding"),
    ("tasks.verifier", "synthetic", r"tasks\.verifier must be 'math' for dataset 'file'"),
    ("eval.files", ("/nowhere/test.jsonl",), r"eval\.files names no file"),
    ("eval.files", (), r"eval\.splits and eval\.files name no held-out set"),
]


@pytest.mark.parametrize(("setting", "value", "message"), BAD_SETTINGS)
def test_bad_data_settings_are_refused_naming_them(files, setting, value, message):
    cd = _hf_config_dict(files)
    section, field = setting.split(".")
    cd[section][field] = value
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_config_dict(cd)


def test_held_out_set_names_must_differ(files):
    cd = _hf_config_dict(files)
    cd.eval.files = (files["test"], files["test"])
    with pytest.raises(ConfigError, match=r"eval\.splits and eval\.files must name distinct"):
        ExperimentConfig.from_config_dict(cd)


def test_the_defaults_are_the_generated_tasks():
    config = ExperimentConfig.from_config_dict(tiny.experiment_config())
    assert config.tasks.make_tokenizer() is tasks.TOKENIZER
    assert config.tasks.make_dataset() == data.SyntheticDataset(
        config.tasks.kinds, config.tasks.levels
    )
    assert isinstance(config.tasks.make_verifier(), data.SyntheticVerifier)
    suite = EvalSuite.from_config(config)
    assert suite.splits == config.eval.splits
    for name in suite.splits:
        assert suite.sets[name] == tasks.eval_split(name)[: config.eval.problems_per_split]
    worker = RolloutWorker(config, model=None, setup=None)
    assert (worker.sampling.stop_tokens, worker.sampling.pad_id) == ((tasks.EOS_ID,), tasks.PAD_ID)


def test_the_hf_settings_reach_every_part(files):
    config = ExperimentConfig.from_config_dict(_hf_config_dict(files))
    tok = data.HFTokenizer.load(files["tok"])
    worker = RolloutWorker(config, model=None, setup=None)
    assert worker.tokenizer is tok
    assert (worker.sampling.stop_tokens, worker.sampling.pad_id) == (tok.stop_ids, tok.pad_id)
    examples = group_problems(config, 0)
    assert len(examples) == 4 and examples[0] == examples[1]  # 2 prompts x group of 2
    assert worker.prompt_width == max(
        len(tok.prompt_ids(e.question))
        for e in data.read_examples(files["train"], config.tasks.layout())
    )
    suite = EvalSuite.from_config(config)
    assert suite.splits == config.eval.set_names == ("test",) and len(suite.sets["test"]) == 2
    assert isinstance(suite.verifier, data.MathVerifier)
    # SFT rows: the chat-templated prompt, the worked solution, EOS; the loss sees the last two.
    batch = data.encode_sft_batch(examples[:2], tokenizer=tok)
    row = np.concatenate(
        [tok.prompt_ids(examples[0].question), tok.encode(examples[0].solution), [tok.eos_id]]
    )
    np.testing.assert_array_equal(batch.tokens[0, : batch.lengths[0]], row)
    assert batch.target_mask[0].sum() == len(row) - len(tok.prompt_ids(examples[0].question))


def test_a_tokenizer_larger_than_the_model_is_refused(files, tmp_path):
    cd = _hf_config_dict(files)
    cd.tasks.tokenizer_dir = bpe.write_tokenizer_dir(tmp_path / "big", vocab_size=320)
    config = ExperimentConfig.from_config_dict(cd)
    want = r"has 320 ids but the model's vocabulary holds 64"
    for build in (
        lambda: RolloutWorker(config, model=None, setup=None),
        lambda: Trainer(config, model=None, setup=None),
        lambda: EvalSuite.from_config(config),
    ):
        with pytest.raises(ValueError, match=want):
            build()
    with pytest.raises(ValueError, match=want):
        run_sft(config, str(tmp_path / "sft"))
    assert not (tmp_path / "sft").exists()  # refused before the workdir is made


def test_sft_needs_worked_solutions(files, tmp_path):
    cd = _hf_config_dict(files)
    cd.tasks.solution_field = ""
    with pytest.raises(ValueError, match=r"SFT needs worked solutions.*tasks\.solution_field"):
        run_sft(ExperimentConfig.from_config_dict(cd), str(tmp_path / "sft"))
