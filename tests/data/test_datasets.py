"""Prompt datasets: the generated tasks as one kind, example files shuffled per epoch with the
batch of a step a pure function of (seed, step), and the held-out sets."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from tests.data import bpe
from trace_jax import data, tasks
from trace_jax.data import FileDataset, FileLayout, HFTokenizer, SyntheticDataset

N_EXAMPLES = 10


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("files") / "train.jsonl"
    rows = [
        {"question": f"what is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}
        for i in range(N_EXAMPLES)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def dataset(train_file):
    return FileDataset(train_file, FileLayout(solution_field="answer", answer_extractor="gsm8k"))


def _ids(examples) -> list[int]:
    """Which file line each example is."""
    return [int(e.metadata["source"].rsplit(":", 1)[1]) - 1 for e in examples]


def test_each_epoch_is_a_fresh_permutation_of_the_file(dataset):
    # 3 examples a step: steps 0..9 cover epochs 0, 1, 2 (30 positions).
    positions = [i for s in range(10) for i in _ids(dataset.step_examples(seed=3, step=s, n=3))]
    epochs = [positions[e * N_EXAMPLES : (e + 1) * N_EXAMPLES] for e in range(3)]
    for e, epoch in enumerate(epochs):
        assert sorted(epoch) == list(range(N_EXAMPLES)), e  # every example once per epoch
        assert epoch == dataset.order(3, e).tolist()
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled each epoch
    assert epochs[0] != list(range(N_EXAMPLES))  # shuffled at all


def test_a_step_is_a_pure_function_of_seed_and_step(dataset, train_file):
    layout = dataset.layout
    fresh = FileDataset(train_file, layout)  # a resumed run's dataset, built again
    for step in (0, 7, 123):
        assert fresh.step_examples(5, step, 4) == dataset.step_examples(5, step, 4)
    # Step 7 of a run seeded 5 is the same whether the steps before it ran or not.
    uninterrupted = [dataset.step_examples(5, s, 4) for s in range(8)]
    assert fresh.step_examples(5, 7, 4) == uninterrupted[7]
    # The stream (SFT) is the same sequence, and other seeds give other orders.
    flat = [e for batch in uninterrupted for e in batch]
    assert list(itertools.islice(fresh.stream(5), len(flat))) == flat
    assert _ids(dataset.step_examples(6, 0, N_EXAMPLES)) != _ids(flat[:N_EXAMPLES])


def test_widths_with_the_char_tokenizer(dataset):
    char = data.load_tokenizer("char")
    assert dataset.prompt_width(char) == 1 + max(len(e.question) for e in dataset.examples)
    with pytest.raises(ValueError, match=r"'\\n' at position 5 of '0\+0=0"):
        dataset.sft_row_length(char)  # GSM8K solutions hold characters it cannot spell


def test_widths_with_a_hf_tokenizer(dataset, tmp_path):
    tok = HFTokenizer.load(bpe.write_tokenizer_dir(tmp_path))
    prompts = [len(tok.prompt_ids(e.question)) for e in dataset.examples]
    rows = [
        p + len(tok.encode(e.solution)) + 1 for p, e in zip(prompts, dataset.examples, strict=True)
    ]
    assert dataset.prompt_width(tok) == max(prompts)
    assert dataset.sft_row_length(tok) == max(rows)
    no_solutions = FileDataset(dataset.path, FileLayout(answer_extractor="gsm8k"))
    with pytest.raises(ValueError, match=r"SFT needs worked solutions.*tasks\.solution_field"):
        no_solutions.sft_row_length(tok)


def test_the_synthetic_dataset_is_the_generated_tasks():
    ds = data.make_dataset("synthetic", kinds=("arithmetic", "program"), levels=(1, 2))
    assert ds == SyntheticDataset(("arithmetic", "program"), (1, 2))
    stream = tasks.train_stream(4 * 1_000_003 + 2, tasks=("arithmetic", "program"), levels=(1, 2))
    assert ds.step_examples(4, 2, 5) == list(itertools.islice(stream, 5))
    assert list(itertools.islice(ds.stream(4), 3)) == list(
        itertools.islice(tasks.train_stream(4, tasks=("arithmetic", "program"), levels=(1, 2)), 3)
    )
    char = data.load_tokenizer("char")
    lengths = [len(char.prompt_ids(p.question)) for p in itertools.islice(ds.stream(0), 500)]
    assert max(lengths) <= ds.prompt_width(char)
    # A problem is an example: question, answer, solution, metadata.
    p = ds.step_examples(0, 0, 1)[0]
    assert p.question == p.prompt
    assert p.metadata == {"task": p.task.value, "difficulty": p.difficulty}
    with pytest.raises(ValueError, match=r"unknown dataset kind 'hub'; expected one of"):
        data.make_dataset("hub")


def test_held_out_sets(train_file, dataset):
    split = tasks.SPLIT_NAMES[0]
    sets = data.held_out_sets([split], [train_file], dataset.layout, size=3)
    assert list(sets) == [split, "train"]
    assert sets[split] == tasks.eval_split(split)[:3]
    assert sets["train"] == list(dataset.examples[:3])  # file order, not shuffled
    with pytest.raises(ValueError, match="two held-out sets are named 'train'"):
        data.held_out_sets([], [train_file, train_file], dataset.layout, size=3)


def test_permutations_depend_only_on_size_seed_and_epoch(dataset):
    a = dataset.order(1, 2)
    assert a.dtype.kind == "i" and np.array_equal(a, dataset.order(1, 2))
    assert not np.array_equal(a, dataset.order(2, 2))
