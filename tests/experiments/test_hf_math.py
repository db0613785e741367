"""`configs/hf_math.py`: `experiments.main` on the shipped tiny Hugging Face checkpoint, BPE
tokenizer and JSONL files end to end (math_verify rewards, guidance through the store, evaluation
on the held-out file); the `model.hf_dir` setting (checked at load, recorded, the policy's
initial weights, `rl.init_from` winning); the shipped example is what its script writes."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import pathlib

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from configs import hf_math
from experiments import main as rl_entry
from trace_jax import data
from trace_jax.models import init_model
from trace_jax.models.hf_checkpoint import model_to_hf_tensors
from trace_jax.rl import workers
from trace_jax.rl.checkpoint import save_params
from trace_jax.rl.config_dict import ConfigError
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.metrics_log import read_rows
from trace_jax.rl.sharding import experiment_mesh
from trace_jax.rl.workers import init_policy

ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"


def small_run_config():
    """`configs/hf_math.py` cut to 2 steps of 2 prompts x 2 samples of 8 new tokens, evaluated
    once on 2 held-out problems."""
    cd = hf_math.get_config()
    cd.rl.update(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=8, eval_every=2)
    cd.rl.mismatch_every = 0  # each measuring step compiles another forward
    cd.eval.update(problems_per_split=2, max_new_tokens=8)
    return cd


def test_the_config_runs_end_to_end_with_math_verify_rewards(tmp_path, monkeypatch):
    scores, reads = [], []
    score, read = data.MathVerifier.score, workers.read_guidance

    def spy_score(self, example, response):
        scores.append(out := score(self, example, response))
        return out

    def spy_read(store, run_id, step, micro_batch, **kw):
        reads.append((run_id, step, micro_batch))
        return read(store, run_id, step, micro_batch, **kw)

    monkeypatch.setattr(data.MathVerifier, "score", spy_score)
    monkeypatch.setattr(workers, "read_guidance", spy_read)
    workdir = tmp_path / "rl"
    history = rl_entry.run(small_run_config(), str(workdir))

    rows = read_rows(str(workdir / "rl_metrics.jsonl"))
    assert [r["step"] for r in rows] == [r["step"] for r in history] == [0, 1]
    # Each step's reward is the mean of math_verify's verdicts on its 4 rollouts (the training
    # steps score first, the evaluation's 2 problems after them).
    assert len(scores) == 2 * 4 + 2
    for step, row in enumerate(rows):
        verdicts = [s.reward(0.0) for s in scores[4 * step : 4 * step + 4]]
        assert row["reward"] == pytest.approx(np.mean(verdicts))
        assert np.isfinite(row["loss"]) and row["time_guidance_read_s"] >= 0.0
    # TRACE's guidance of each step went through the store and was read back (consumed).
    assert reads == [("trace_nvfp4", 0, 0), ("trace_nvfp4", 1, 0)]
    (evaluation,) = read_rows(str(workdir / "rl_eval.jsonl"))
    assert set(evaluation) == {"step", "generated_arith_eval"}
    assert evaluation["generated_arith_eval"] == np.mean([s.reward(0.0) for s in scores[8:]])
    record = json.loads((workdir / "rl_config.json").read_text())
    assert record["model.hf_dir"] == str(EXAMPLES / "hf_tiny")
    assert record["tasks.verifier"] == "math" and record["model.vocab_size"] == 512
    assert (workdir / "rl_curves.png").exists()


def _config(**model) -> ExperimentConfig:
    cd = hf_math.get_config()
    cd.model.update(model)
    return ExperimentConfig.from_config_dict(cd)


def test_the_policy_starts_from_the_checkpoint_sharded_on_the_mesh():
    config = _config()
    assert (config.model.n_layers, config.model.vocab_size) == (2, 512)
    shipped = load_file(str(EXAMPLES / "hf_tiny" / "model.safetensors"))
    for mesh in (None, experiment_mesh(2, 4)):
        policy = init_policy(config, mesh)
        loaded = model_to_hf_tensors(policy)
        assert sorted(loaded) == sorted(shipped)
        for key, value in shipped.items():
            np.testing.assert_array_equal(loaded[key], value.astype(np.float32), err_msg=key)
    # On the 2 x 4 mesh each device holds 2 of the 8 experts.
    w_gate = policy.layers[0].moe.w_gate.get_value()
    assert w_gate.sharding.spec == P("expert") and w_gate.addressable_shards[0].data.shape[0] == 2


def test_init_from_wins_over_hf_dir(tmp_path):
    config = _config()
    sft = init_model(config.model, seed=7)  # stands in for an SFT checkpoint of this model
    save_params(sft, str(tmp_path / "sft"))
    cd = hf_math.get_config()
    cd.rl.init_from = str(tmp_path / "sft")
    policy = init_policy(ExperimentConfig.from_config_dict(cd), None)
    want, got = model_to_hf_tensors(sft), model_to_hf_tensors(policy)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_bad_hf_dir_settings_are_refused_naming_them(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cases = [
        ({"hf_dir": str(tmp_path / "none")}, r"model\.hf_dir must be a directory holding"),
        ({"hf_dir": str(tmp_path)}, r"model\.hf_dir must be .*holding \['config\.json'\]"),
        ({"n_layers": 1}, r"model\.n_layers must be None with hf_dir .*got 1"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message):
            _config(**model)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"model\.hf_dir gives no model: .*lacks required keys"):
        _config(hf_dir=str(tmp_path))


def test_a_tokenizer_larger_than_the_checkpoint_is_refused_before_loading(tmp_path):
    cd = hf_math.get_config()
    cd.tasks.tokenizer_dir = str(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((EXAMPLES / "hf_tiny" / name).read_bytes())
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab["added_tokens"].append({**vocab["added_tokens"][-1], "id": 512, "content": "<|x|>"})
    (tmp_path / "tokenizer.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=r"has 513 ids but the model's vocabulary holds 512"):
        init_policy(ExperimentConfig.from_config_dict(cd), None)


def test_the_shipped_example_is_what_its_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_hf_example", ROOT / "scripts" / "make_tiny_hf_example.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write_example(str(tmp_path), seed=0)
    for sub in ("data", "hf_tiny"):
        names = sorted(p.name for p in (tmp_path / sub).iterdir())
        assert names == sorted(p.name for p in (EXAMPLES / sub).iterdir())
        _, differ, errors = filecmp.cmpfiles(tmp_path / sub, EXAMPLES / sub, names, shallow=False)
        assert not differ and not errors, f"rerun scripts/make_tiny_hf_example.py: {differ}"
    train = data.read_examples(
        str(EXAMPLES / "data" / "generated_arith_train.jsonl"),
        data.FileLayout(answer_extractor="gsm8k", solution_field="answer"),
    )
    assert len(train) == script.TRAIN_PROBLEMS
    for example in train:  # every reference answer is the worked solution's result
        work = example.solution.split(",")[0]
        assert eval(work.split("=")[0]) == int(example.answer) == int(work.split("=")[1])
