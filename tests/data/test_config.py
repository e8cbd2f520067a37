import pytest
import yaml
from pydantic import ValidationError

from longtrain.data import DataConfig, TokenizerConfig

RECIPE = """
data:
  source: stdlib
  path: null
  name: null
  split: train
  text_field: text
  min_doc_tokens: 4096
  valid: null
tokenizer:
  path: null
  vocab_size: 8192
"""


def test_the_documented_recipe_section_parses_to_the_defaults():
    r = yaml.safe_load(RECIPE)
    assert DataConfig(**r["data"]) == DataConfig() and TokenizerConfig(**r["tokenizer"]) == TokenizerConfig()
    assert DataConfig(valid=0.05).valid == 0.05 and DataConfig(valid="held/out").valid == "held/out"


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"source": "files"}, "needs data.path"),
        ({"source": "hub"}, "needs data.name"),
        ({"source": "web"}, "source"),
        ({"min_doc_tokens": 0}, "min_doc_tokens"),
        ({"valid": 1.0}, r"\(0, 1\)"),
        ({"valid": ""}, "valid"),
        ({"texts_field": "body"}, "texts_field"),
    ],
)
def test_bad_data_sections_name_the_problem(data, problem):
    with pytest.raises(ValidationError, match=problem):
        DataConfig(**data)


def test_tiny_vocabularies_are_refused():
    with pytest.raises(ValidationError, match="vocab_size"):
        TokenizerConfig(vocab_size=100)
