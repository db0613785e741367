"""Example files: the GSM8K / MATH / DAPO-Math layouts in JSONL and Parquet, answer extractors,
and errors that name the file, line and field."""

from __future__ import annotations

import json

import pyarrow
import pyarrow.parquet
import pytest

from trace_jax import data
from trace_jax.data import FileLayout, TextExample, read_examples

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "A farm sells 1,200 eggs twice. Total?", "answer": "2*1200=2400\n#### 2,400"},
]
MATH = [
    {
        "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
        "solution": "Add: $\\boxed{\\frac{3}{4}}$, not $\\boxed{1}$... so \\boxed{\\frac{3}{4}}.",
    }
]
DAPO = [
    {
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Compute 6*7."},
        ],
        "reward_model": {"ground_truth": 42, "style": "rule"},
    }
]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_gsm8k_layout(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    layout = FileLayout(solution_field="answer", answer_extractor="gsm8k")
    got = read_examples(path, layout)
    assert got == (
        TextExample(
            question=GSM8K[0]["question"],
            answer="7",
            solution="3+4=7\n#### 7",
            metadata={"source": f"{path}:1"},
        ),
        TextExample(
            question=GSM8K[1]["question"],
            answer="2400",  # thousands separators dropped
            solution="2*1200=2400\n#### 2,400",
            metadata={"source": f"{path}:2"},
        ),
    )


def test_math_layout_takes_the_last_boxed_answer(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", MATH)
    layout = FileLayout(
        question_field="problem",
        answer_field="solution",
        solution_field="solution",
        answer_extractor="boxed",
    )
    (example,) = read_examples(path, layout)
    assert example.answer == "\\frac{3}{4}"  # nested braces balanced
    assert example.solution == MATH[0]["solution"]
    assert data.last_boxed("\\fbox{x} and \\boxed {y}") == "y"
    assert data.last_boxed("\\boxed{unclosed") is None
    assert data.last_boxed("no box") is None


def test_dapo_layout_nested_fields_and_chat_messages(tmp_path):
    path = write_jsonl(tmp_path / "dapo.jsonl", DAPO)
    layout = FileLayout(question_field="prompt", answer_field="reward_model.ground_truth")
    (example,) = read_examples(path, layout)
    assert (example.question, example.answer, example.solution) == ("Compute 6*7.", "42", None)


def test_parquet_reads_as_jsonl_does(tmp_path):
    path = str(tmp_path / "dapo.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(DAPO * 2), path)
    layout = FileLayout(question_field="prompt", answer_field="reward_model.ground_truth")
    got = read_examples(path, layout)
    assert [(e.question, e.answer) for e in got] == [("Compute 6*7.", "42")] * 2
    assert got[1].metadata == {"source": f"{path}:row 2"}


@pytest.mark.parametrize(
    ("lines", "layout", "message"),
    [
        (['{"question": "q"}'], FileLayout(), r"bad\.jsonl:1: missing field 'answer' \("),
        (
            ['{"question": "q", "answer": "1"}', '{"question": "q", "rm": {}}'],
            FileLayout(answer_field="rm.truth"),
            r"bad\.jsonl:1: missing field 'rm\.truth' \(the record has \['answer', 'question'\]",
        ),
        (
            ['{"question": "q", "rm": {"x": 1}}'],
            FileLayout(answer_field="rm.truth"),
            r":1: missing field 'rm\.truth' \(rm has \['x'\]\)",
        ),
        (
            ['{"question": "q", "answer": "1"}', "", "{not json"],
            FileLayout(),
            r"bad\.jsonl:3: not a JSON record",
        ),
        (["[1, 2]"], FileLayout(), r":1: expected a JSON object, got list"),
        (['{"question": "  ", "answer": "1"}'], FileLayout(), r":1: field 'question' is empty"),
        (['{"question": "q", "answer": [1]}'], FileLayout(), r"field 'answer' must be text"),
        (
            ['{"question": "q", "answer": "no hashes"}'],
            FileLayout(answer_extractor="gsm8k"),
            r":1: field 'answer' gives no answer with the 'gsm8k' extractor",
        ),
        (
            ['{"question": [{"role": "system", "content": "x"}], "answer": "1"}'],
            FileLayout(),
            r"field 'question' holds no user message",
        ),
        ([""], FileLayout(), r"bad\.jsonl holds no examples"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path, lines, layout, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        read_examples(str(path), layout)


def test_paths_and_layouts_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"must be a \.jsonl or \.parquet file, got 'x\.csv'"):
        data.check_examples_path("x.csv")
    with pytest.raises(ValueError, match="names no file"):
        read_examples(str(tmp_path / "missing.jsonl"), FileLayout())
    with pytest.raises(ValueError, match=r"answer_extractor must be one of .*'regex'"):
        FileLayout(answer_extractor="regex")
    with pytest.raises(ValueError, match="question_field must name a field"):
        FileLayout(question_field="")


def test_a_changed_file_is_read_again(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    write_jsonl(path, GSM8K[:1])
    layout = FileLayout(answer_extractor="gsm8k")
    assert len(read_examples(str(path), layout)) == 1
    write_jsonl(path, GSM8K)
    assert [e.answer for e in read_examples(str(path), layout)] == ["7", "2400"]
