"""A damaged safetensors file is named in the error, so a user knows which download to repeat."""

from __future__ import annotations

import pytest
import transformers

from tessera.models import load_model
from tessera.models.hf import CheckpointError


@pytest.mark.parametrize("content", [
    b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": broken!!}",  # a header that is not JSON
    b"\x01",  # shorter than the 8-byte header length
    b"\xff" * 8 + b"{}",  # a header length far past the end of the file
])
def test_bad_safetensors_header_names_the_file(tmp_path, content):
    transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match="is not a readable safetensors file") as err:
        load_model(tmp_path)
    assert str(bad) in str(err.value) and "download or export it again" in str(err.value)
