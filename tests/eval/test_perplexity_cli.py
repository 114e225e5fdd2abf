"""``tessera perplexity`` through ``tessera.cli.main``, and the texts it reads (a file as llama-perplexity reads it,
the pydoc corpus)."""

from __future__ import annotations

import json

import pytest

from tessera.cli import main
from tessera.eval.corpus import corpus_fingerprint, pydoc_corpus, read_text, write_corpus
from tests.eval.tiny import CTX, sample_text


def test_cli_prints_running_values_and_the_final_line(tiny, tmp_path, capsys):
    directory, model, _ = tiny
    text = sample_text(CTX * 6)
    path = write_corpus(text + "\n", tmp_path / "text.txt")  # the trailing newline is dropped, as llama.cpp does
    out = tmp_path / "ppl.json"
    assert main(["perplexity", str(path), "--model", str(directory), "--ctx", str(CTX), "--chunks", "3",
                 "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    record = json.loads(out.read_text())
    result = record["result"]
    assert result["n_chunks"] == 3 and result["ctx"] == CTX and len(result["running"]) == 3
    assert result["n_tokens"] == len(model.tokenizer.encode(text).ids)
    assert lines[0] == ",".join(f"[{r['chunks']}]{r['ppl']:.4f}" for r in result["running"])
    assert lines[1] == f"Final estimate: PPL = {result['ppl']:.4f} +/- {result['stderr']:.5f}"
    assert record["text"] == {"file": str(path), "corpus": None, **corpus_fingerprint(text)}
    assert record["model"] == str(directory) and record["settings"]["chunks"] == 3


def test_cli_errors_are_one_line(tiny, tmp_path, capsys):
    directory = tiny[0]
    short = write_corpus("abc", tmp_path / "short.txt")
    assert main(["perplexity", str(short), "--model", str(directory), "--ctx", str(CTX)]) == 2
    assert f"needs at least {2 * CTX} tokens" in capsys.readouterr().err
    assert main(["perplexity", "--model", str(directory)]) == 2
    assert "pass a text FILE or --corpus NAME" in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt is not a file" in capsys.readouterr().err
    assert main(["perplexity", "--write-corpus", str(tmp_path / "c.txt")]) == 2
    assert "--write-corpus needs --corpus" in capsys.readouterr().err


def test_write_corpus_gives_the_bytes_both_tools_read(tmp_path, capsys):
    path = tmp_path / "pydoc.txt"
    assert main(["perplexity", "--corpus", "pydoc", "--write-corpus", str(path)]) == 0
    text = pydoc_corpus()
    assert path.read_bytes() == text.encode("utf-8") and read_text(path) == text
    assert len(text) > 300_000 and not text.endswith("\n") and "assert" in text


def test_read_text_drops_one_trailing_newline_and_wants_utf8(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("é\n\n".encode())
    assert read_text(path) == "é\n"
    path.write_bytes(b"ok\r\n")
    assert read_text(path) == "ok\r"  # bytes as they are: llama.cpp reads the file without newline translation
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        read_text(path)
