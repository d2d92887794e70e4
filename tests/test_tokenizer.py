import json

import pytest

from voicechat.checkpoint import CheckpointError
from voicechat.tokenizer import TextTokenizer, decode_pieces, is_special_piece, load_rnnt_pieces
from voicechat.synthetic import build_tokenizer, rnnt_vocabulary


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return TextTokenizer(tiny_checkpoint / "tokenizer.json")


def test_round_trip(tok):
    text = "What is the capital of France? Paris, of course — déjà vu!"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    assert tok.decode(ids) == text


def test_special_ids_and_skipping(tok):
    assert tok.vocab_size == 384
    assert tok.id_to_token(1) == "<s>" and tok.id_to_token(2) == "</s>" and tok.id_to_token(12) == "<pad>"
    ids = [12, 1] + tok.encode("hello") + [11, 2]
    assert tok.decode(ids, skip={12, 11, 1, 2}) == "hello"
    assert "<s>" in tok.decode(ids, skip={12})  # other specials are kept


def test_exactly_256_single_character_tokens(tok):
    singles = tok.single_character_tokens()
    assert len(singles) == 256
    assert [i for i, _ in singles] == sorted(i for i, _ in singles)


def test_full_size_vocabulary_builds():
    big = build_tokenizer(131072)
    assert big.get_vocab_size() == 131072
    assert sum(1 for t in big.get_vocab() if len(t) == 1) == 256


def test_rnnt_pieces_from_config_or_file(tmp_path, tiny_checkpoint):
    pieces = rnnt_vocabulary(40)
    assert load_rnnt_pieces(tmp_path, pieces, 40) == pieces
    assert load_rnnt_pieces(tiny_checkpoint, None, 40) == pieces  # rnnt_tokenizer/vocab.json
    (tmp_path / "rnnt_tokenizer").mkdir()
    (tmp_path / "rnnt_tokenizer" / "vocab.json").write_text(json.dumps(pieces))
    assert load_rnnt_pieces(tmp_path, None, 40) == pieces
    with pytest.raises(CheckpointError, match="39 pieces"):
        load_rnnt_pieces(tmp_path, pieces[:39], 40)
    with pytest.raises(CheckpointError, match="no RNNT vocabulary"):
        load_rnnt_pieces(tmp_path / "nowhere", None, 40)


def test_piece_decoding():
    pieces = ["<unk>", "<en-US>", "▁what", "▁is", "▁the", "▁cap", "ital", "<pad>", "</s>", "<s>", "<fr-FR>", "?"]
    assert decode_pieces([1, 2, 3, 4, 5, 6, 11, 0, 7, 8, 9, 10], pieces) == "what is the capital?"
    assert decode_pieces([], pieces) == ""
    assert is_special_piece("<zh-Hans>") and is_special_piece("<eng-US>")
    assert not is_special_piece("<b>") and not is_special_piece("▁<en")


def test_bad_tokenizer_file(tmp_path):
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        TextTokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a readable tokenizer.json"):
        TextTokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").write_bytes(b'{"version": "\xff"}')
    with pytest.raises(CheckpointError, match=f"{tmp_path}/tokenizer.json: not a readable tokenizer.json"):
        TextTokenizer(tmp_path / "tokenizer.json")


def test_text_that_is_not_unicode_is_a_value_error_not_a_type_error(tok):
    """A lone surrogate (a byte that was not UTF-8, as sys.argv carries it, or one from an API
    caller) cannot be tokenized: a TextError (a ValueError) saying where, not tokenizers'
    `TypeError: TextInputSequence must be str`."""
    from voicechat.tokenizer import TextError

    for text, where in (("\udcff", "character 0"), ("Be concise.\ud800", "character 11")):
        with pytest.raises(TextError, match=f"not valid Unicode text.*{where}"):
            tok.encode(text)
    with pytest.raises(TextError, match="must be a str, got bytes"):
        tok.encode(b"Be concise.")
    assert issubclass(TextError, ValueError)


@pytest.mark.parametrize("content,needle", [
    (b"\xff\xfe[]", "not a readable JSON vocabulary"),
    (json.dumps({"a": "x", "b": 1}).encode(), "expected piece -> integer id"),
    (json.dumps({"a": 0, "b": 0}).encode(), "ids are not 0..1, each once"),
    (json.dumps(["a", None]).encode(), "expected a list of piece strings"),
])
def test_bad_rnnt_vocabulary_files_name_the_file(tmp_path, content, needle):
    (tmp_path / "rnnt_tokenizer").mkdir()
    path = tmp_path / "rnnt_tokenizer" / "vocab.json"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=needle) as info:
        load_rnnt_pieces(tmp_path, None, 2)
    assert str(info.value).startswith(str(path))
