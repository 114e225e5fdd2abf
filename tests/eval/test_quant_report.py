"""``tessera quant-report`` on the tiny random Llama: each row's KL, top-1 and perplexity against a float64
computation written here on the same models' logits, bytes per weight, the packed GGUF row, the JSON and plot the
command writes, and the inputs it refuses."""

from __future__ import annotations

import datetime
import json

import numpy as np
import pytest
import torch

from tessera.cli import main
from tessera.eval.corpus import write_corpus
from tessera.eval.divergence import ReferenceLogits, kl_top1
from tessera.eval.perplexity import perplexity
from tessera.eval.quant_formats import RowSpec, parse_formats, parse_kv_formats
from tessera.eval.quant_report import quant_report
from tessera.eval.weight_bytes import weight_bytes
from tessera.models import load_model
from tessera.models.requantize import requantize_model
from tests.eval.tiny import CTX, sample_text, tiny_gguf

CHUNKS = 3
TEXT = sample_text(CTX * 6)

ROW_KEYS = {"name", "weights", "kv_cache", "paged_kv", "ppl", "stderr", "nll", "kl_mean", "kl_p99", "kl_max", "top1",
            "n_scored", "bytes_per_weight", "matrix_bytes", "matrix_params", "model_bytes", "held", "decode_tok_s",
            "decode_runs", "decode_others_busy", "build_seconds", "eval_seconds"}


#: the float64 oracle backend: the figures are checked, not the kernels, which it needs no time to compile
BACKEND = "reference"


@pytest.fixture(scope="module")
def report(tiny):
    """Every weight format but gguf (the tiny model is a Hugging Face directory) and two KV rows, no decode timing."""
    return quant_report(tiny[0], TEXT, ctx=CTX, chunks=CHUNKS, kv_formats=["int8", "bf16:int8"], decode_tokens=0,
                        backend=BACKEND)


def float64_kl(reference: torch.Tensor, logits: torch.Tensor) -> np.ndarray:
    """KL(P_ref || P) per row, written out in NumPy float64."""
    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    ref, own = log_softmax(reference.double().numpy()), log_softmax(logits.double().numpy())
    return (np.exp(ref) * (ref - own)).sum(axis=-1)


def scored_logits(model, kv_cache_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits at the scored positions of the report's windows (the tiny tokenizer adds no BOS) and the targets."""
    from tessera.eval.cache_logits import CacheLogits

    ids = torch.tensor(model.tokenizer.encode(TEXT).ids[: CHUNKS * CTX]).view(CHUNKS, CTX)
    window_logits = model.logits if kv_cache_dtype is None else CacheLogits(model, kv_cache_dtype)
    # one window per forward pass, as the report runs them (a batch of windows takes other kernel paths)
    logits = torch.cat([window_logits(ids[i: i + 1]) for i in range(CHUNKS)])
    first = CTX // 2
    return logits[:, first: CTX - 1].reshape(-1, logits.shape[-1]), ids[:, first + 1:].reshape(-1)


def test_rows_in_order_and_the_reference_row(report):
    assert [r.name for r in report.rows] == ["fp32", "fp32 + int8 KV", "bf16", "bf16 + int8 KV", "int8", "int4",
                                             "int4_min", "fp8_e4m3"]
    ref = report.row("fp32")
    assert ref.kl_mean == 0.0 and ref.kl_p99 == 0.0 and ref.kl_max == 0.0 and ref.top1 == 1.0
    assert (ref.kv_cache, ref.paged_kv) == ("fp32", False)
    assert (report.row("bf16 + int8 KV").kv_cache, report.row("bf16 + int8 KV").paged_kv) == ("int8", True)
    assert report.n_chunks == CHUNKS and report.n_scored == CHUNKS * (CTX - 1 - CTX // 2) == ref.n_scored
    assert all(r.decode_tok_s is None and r.decode_runs == [] for r in report.rows)


def test_kl_top1_and_ppl_equal_a_float64_computation_on_the_same_logits(tiny, report):
    reference = load_model(tiny[0], keep_quantized=False, backend=BACKEND)
    ref_logits, targets = scored_logits(reference)
    for name, model, kv in (("int8", requantize_model(reference, "int8", 32, tables="all", search_scales=True), None),
                            ("fp8_e4m3", requantize_model(reference, "fp8_e4m3", None, tables="all"), None),
                            ("fp32 + int8 KV", reference, "int8")):
        logits, _ = scored_logits(model, kv)
        kl = float64_kl(ref_logits, logits)
        row = report.row(name)
        assert kl.mean() > 0
        assert row.kl_mean == pytest.approx(kl.mean(), rel=1e-9, abs=1e-15)
        assert row.kl_p99 == pytest.approx(np.percentile(kl, 99), rel=1e-9, abs=1e-15)
        assert row.kl_max == pytest.approx(kl.max(), rel=1e-9, abs=1e-15)
        assert row.top1 == float((ref_logits.argmax(-1) == logits.argmax(-1)).double().mean())
        # perplexity: the same figure `tessera perplexity` gives on the same model and windows
        assert row.ppl == pytest.approx(perplexity(model, TEXT, ctx=CTX, max_chunks=CHUNKS, kv_cache_dtype=kv).ppl,
                                        rel=1e-12)
        nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="none")
        assert row.nll == pytest.approx(float(nll.mean()), rel=1e-12)


def test_kl_top1_edge_cases():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 50, generator=gen) * 8  # > ROWS rows: the row blocks are joined in order
    b = a + torch.randn(300, 50, generator=gen) * 0.5
    kl, top1 = kl_top1(a, b)
    assert kl.dtype == torch.float64 and kl.shape == (300,) and (kl > 0).all()
    np.testing.assert_allclose(kl.numpy(), float64_kl(a, b), rtol=1e-10, atol=1e-15)
    assert torch.equal(top1, a.argmax(-1) == b.argmax(-1))
    same, agree = kl_top1(a, a.clone())
    assert (same == 0).all() and agree.all()
    shifted, _ = kl_top1(a, a + 3.0)  # a constant shift is the same distribution
    assert shifted.abs().max() < 1e-12
    with pytest.raises(ValueError, match="must both be"):
        kl_top1(a, b[:, :10])


def test_bytes_per_weight(report, tiny):
    b = {r.name: r.bytes_per_weight for r in report.rows}
    assert b["int4"] < b["int4_min"] < b["int8"] < b["bf16"] < b["fp32"]
    assert b["fp8_e4m3"] < b["int8"]
    assert b["fp32"] == 4.0 and b["bf16"] == 2.0
    assert b["int8"] == 1 + 4 / 32  # codes, a float32 scale per 32
    assert b["int4"] == 0.5 + (4 + 1) / 32  # two codes a byte, a float32 scale and a uint8 zero point per 32
    assert b["int4_min"] == 0.5 + (4 + 4) / 32  # a float32 scale and min per 32
    assert b["fp32 + int8 KV"] == 4.0  # a KV row holds its model's weights
    ref, int8 = report.row("fp32"), report.row("int8")
    # every matrix (the projections and both untied tables) is held in the format
    assert int8.held == {"int8/32": ref.matrix_params} and ref.held == {"fp32": ref.matrix_params}
    assert report.row("fp8_e4m3").held == {"fp8_e4m3/channel": ref.matrix_params}
    model = tiny[1]
    assert ref.model_bytes == sum(w.numel() * w.element_size() for w in model.weights.values())


def test_gguf_row_holds_the_files_packed_types(tmp_path):
    path = tiny_gguf(tmp_path)
    got = quant_report(path, TEXT, ctx=CTX, chunks=2, formats=["gguf", "int4"], kv_formats="none",
                       decode_tokens=0, backend=BACKEND)
    assert [r.name for r in got.rows] == ["fp32", "int4", "gguf"]
    gguf = got.row("gguf")
    assert set(gguf.held) == {"Q4_0", "Q8_0"}  # the projections and the tied table, as the file stores them
    assert gguf.bytes_per_weight < 1.0625 and gguf.kl_mean >= 0 and 0 <= gguf.top1 <= 1
    int4 = got.row("int4")
    # tied: one packed table serves the lookups and the logits, counted once
    assert int4.held == {"int4/32": got.row("fp32").matrix_params}
    tied = load_model(path, keep_quantized=False, backend=BACKEND)
    assert "lm_head" not in requantize_model(tied, "int4", 32, tables="all").weights
    draft = requantize_model(tied, "int4", 32, tables="output")  # the self-draft's choice: lookups stay float
    assert draft.weights["embed"] is tied.weights["embed"] and type(draft.weights["lm_head"]).__name__ == \
        "QuantizedWeight"
    assert weight_bytes(draft).held == {"fp32": tied.weights["embed"].numel(),
                                        "int4/32": weight_bytes(tied).matrix_params}


def test_cli_writes_table_json_and_plot(tiny, tmp_path, capsys):
    text = write_corpus(TEXT, tmp_path / "text.txt")
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    assert main(["quant-report", str(text), "--model", str(tiny[0]), "--ctx", str(CTX), "--chunks", "2",
                 "--formats", "int8,int4", "--kv-formats", "none", "--decode-tokens", "4", "--decode-repeats", "1",
                 "--json", str(out), "--plot", str(png), "--backend", BACKEND]) == 0
    printed = capsys.readouterr().out
    assert "quant report" in printed and "int4" in printed and "bytes/weight" in printed
    record = json.loads(out.read_text())
    assert datetime.date.fromisoformat(record["date"])
    assert {"rows", "model", "ctx", "n_chunks", "n_scored", "n_tokens", "add_bos", "group_size", "decode_tokens",
            "decode_repeats", "prompt_tokens", "reference", "reference_bytes", "text", "settings", "seconds",
            "others_busy", "machine"} <= set(record)
    assert record["reference"] == "fp32" and record["ctx"] == CTX and record["n_chunks"] == 2
    assert [r["name"] for r in record["rows"]] == ["fp32", "int8", "int4"]
    assert all(set(r) == ROW_KEYS for r in record["rows"])
    assert all(r["decode_tok_s"] > 0 and len(r["decode_runs"]) == 1 for r in record["rows"])
    assert {"cpu_model", "num_cores", "libraries"} <= set(record["machine"])
    assert record["settings"]["formats"] == ["int8,int4"] and "kernel_variants" in record["settings"]
    assert record["text"]["file"] == str(text) and len(record["text"]["sha256"]) == 64
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_names_are_parsed_and_checked():
    assert parse_formats(["int4,int8", "int4"], source_is_gguf=False) == ["fp32", "int8", "int4"]
    assert parse_formats(None, source_is_gguf=True)[-1] == "gguf"
    assert "gguf" not in parse_formats(None, source_is_gguf=False)
    assert parse_kv_formats(["int8", "bf16:bf16,bf16:int8"], False) == [
        RowSpec("fp32", "int8"), RowSpec("bf16", "bf16"), RowSpec("bf16", "int8")]
    assert parse_kv_formats("none", False) == [] and len(parse_kv_formats(None, False)) == 4
    for bad, match in ((["int3"], "unknown weight format"), (["gguf"], "not a .gguf file")):
        with pytest.raises(ValueError, match=match):
            parse_formats(bad, source_is_gguf=False)
    for bad, match in (("bf16:fp32", "unquantized pages hold bf16"), ("int8:bf16", "unquantized pages hold fp32"),
                       ("fp32:int4", "KV part must be one of"), ("q4:int8", "unknown weight format")):
        with pytest.raises(ValueError, match=match):
            parse_kv_formats([bad], False)


def test_bad_inputs_are_one_line_errors(tiny, tmp_path, capsys):
    directory = str(tiny[0])
    text = str(write_corpus(TEXT, tmp_path / "text.txt"))
    cases = [
        (["--formats", "int3"], "unknown weight format(s) ['int3']"),
        (["--formats", "gguf"], "not a .gguf file"),
        (["--kv-formats", "bf16:fp32"], "unquantized pages hold bf16"),
        (["--group-size", "16"], "group_size must be one of [32, 64, 128]"),
        (["--chunks", "0"], "chunks must be an int >= 1"),
        (["--decode-tokens", "1"], "decode_tokens must be 0"),
        (["--ctx", "2"], "ctx must be an int >= 3"),
        (["--ctx", str(len(TEXT))], "exceeds the model's"),
        (["--json", str(tmp_path / "missing" / "r.json")], "its directory does not exist"),
    ]
    for extra, message in cases:
        assert main(["quant-report", text, "--model", directory, "--ctx", str(CTX), *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert main(["quant-report", "--model", directory]) == 2
    assert "pass a text FILE or --corpus NAME" in capsys.readouterr().err
    assert main(["quant-report", text, "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf does not exist" in capsys.readouterr().err
    short = str(write_corpus("abc", tmp_path / "short.txt"))
    assert main(["quant-report", short, "--model", directory, "--ctx", str(CTX)]) == 2
    assert f"needs at least {2 * CTX} tokens" in capsys.readouterr().err
    with pytest.raises(TypeError, match="exactly one of text and token_ids"):
        quant_report(tiny[0], TEXT, token_ids=[1, 2, 3])


def test_reference_logits_spill_to_a_file_exactly():
    values = torch.randn(3, 5, 7)
    with ReferenceLogits(3, 5, 7, memory_limit=0) as stored:
        assert stored.spilled
        for i in range(3):
            stored.put(i, values[i])
        assert all(torch.equal(stored.get(i), values[i]) for i in range(3))
    with ReferenceLogits(3, 5, 7) as kept:
        kept.put(1, values[1])
        assert not kept.spilled and torch.equal(kept.get(1), values[1])
