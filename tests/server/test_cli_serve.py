"""``tessera serve``: the subcommand's options build a working server."""

from __future__ import annotations

import httpx2

from tessera.cli import _build_parser
from tessera.tools.serve import _exposed, make_server, model_name
from tests.server.conftest import run_uvicorn


def test_defaults_are_safe():
    args = _build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.max_queue > 0 and args.max_body_bytes > 0
    assert not _exposed("127.0.0.1") and not _exposed("::1") and not _exposed("localhost") and _exposed("0.0.0.0")


def test_serve_builds_a_working_server(tiny_dir, monkeypatch):
    monkeypatch.delenv("TESSERA_API_KEY", raising=False)
    args = _build_parser().parse_args([
        "serve", "--model", str(tiny_dir), "--port", "0", "--api-key", "k", "--max-num-seqs", "4",
        "--page-size", "4", "--num-pages", "64", "--max-tokens-limit", "32", "--log-level", "warning"])
    server = make_server(args)
    assert model_name(tiny_dir) == tiny_dir.name
    with run_uvicorn(server) as url:
        headers = {"Authorization": "Bearer k"}
        assert httpx2.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"] == tiny_dir.name
        ok = httpx2.post(f"{url}/v1/completions", headers=headers, json={"prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2
        assert httpx2.post(f"{url}/v1/completions", headers=headers,
                           json={"prompt": "hi", "max_tokens": 33}).status_code == 400
        assert httpx2.post(f"{url}/v1/completions", json={"prompt": "hi"}).status_code == 401
