"""The cache file: round trip, and every way a file is ignored (with one warning, never an exception)."""

from __future__ import annotations

import json
import warnings

import pytest

from tessera import tuning
from tessera.tuning import cache, registry, search
from tessera.tuning.fingerprint import cache_sizes, digest, fingerprint, parse_size


def _write(data) -> None:
    path = registry.current_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _valid(chosen=4):
    return {"schema": cache.SCHEMA, "fingerprint": fingerprint(), "entries": {"toy": {"*": {"chosen": chosen}}}}


def test_round_trip(toy, tmp_path):
    toy(times={1: [1.0], 2: [2.0], 4: [3.0]})
    search.tune(search.plan(["toy"]), quick=True)
    path = tmp_path / "cache" / "tuning" / f"{digest()}.json"
    assert path == registry.current_path() and path.is_file()
    data = json.loads(path.read_text())
    assert data["schema"] == cache.SCHEMA and data["fingerprint"] == fingerprint()
    entry = data["entries"]["toy"]["*"]
    assert entry["chosen"] == 1 and entry["default"] == 2 and entry["measured_at"]
    assert {c["value"]: c["seconds"] for c in entry["candidates"]} == {1: 1.0, 2: 2.0, 4: 3.0}
    tuning.reset()  # a new process: read from the file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.tuned("toy") == 1
        assert tuning.lookup("toy")[1] == "tuned"
    assert not list(path.parent.glob(".*"))  # the temporary file was renamed, not left behind


def test_other_entries_survive_a_partial_run(toy):
    toy("toy", times={1: [1.0], 2: [2.0]})
    toy("other", times={1: [2.0], 2: [1.0]}, default=1)
    search.tune(search.plan(["toy", "other"]), quick=True)
    search.tune(search.plan(["toy"]), quick=True)
    tuning.reset()
    assert json.loads(registry.current_path().read_text())["entries"].keys() == {"toy", "other"}
    assert (tuning.tuned("toy"), tuning.tuned("other")) == (1, 2)


@pytest.mark.parametrize("content, why", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON list"),
    ({"schema": 999, "entries": {}}, "schema is 999"),
    ({"schema": cache.SCHEMA, "fingerprint": {**fingerprint(), "cpu_model": "Other CPU"},
      "entries": {"toy": {"*": {"chosen": 4}}}}, "another machine"),
    ({"schema": cache.SCHEMA, "fingerprint": fingerprint(), "entries": {"toy": [1]}}, "entries"),
], ids=["corrupt", "not-an-object", "schema", "foreign-fingerprint", "bad-entries"])
def test_bad_file_is_ignored_with_one_warning(toy, content, why):
    toy()
    _write(content)
    with pytest.warns(RuntimeWarning) as caught:
        assert tuning.tuned("toy") == 2  # the default
        assert tuning.tuned("toy") == 2
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert str(registry.current_path()) in messages[0] and why in messages[0]


def test_foreign_fingerprint_names_the_difference(toy):
    toy()
    _write({**_valid(), "fingerprint": {**fingerprint(), "logical_cores": 96}})
    with pytest.warns(RuntimeWarning, match="logical_cores: 96 there"):
        assert tuning.tuned("toy") == 2


def test_entry_of_the_wrong_type_is_ignored(toy):
    toy()
    _write(_valid(chosen="four"))
    with pytest.warns(RuntimeWarning, match="not a int"):
        assert tuning.tuned("toy") == 2


def test_unwritable_cache_dir_keeps_results_in_memory(toy, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(blocker))
    tuning.reset()
    toy(times={1: [1.0], 2: [2.0], 4: [3.0]})
    with pytest.warns(RuntimeWarning, match="could not write the tuning cache"):
        search.tune(search.plan(["toy"]), quick=True)
    assert tuning.tuned("toy") == 1  # this process still uses the result


def test_clear(toy):
    toy(times={1: [1.0], 2: [2.0], 4: [3.0]})
    search.tune(search.plan(["toy"]), quick=True)
    assert cache.clear(registry.current_path()) and not cache.clear(registry.current_path())


def test_fingerprint_is_stable_and_describes_the_caches():
    fp = fingerprint()
    assert set(fp) == {"cpu_model", "isa", "logical_cores", "caches"} and fp["logical_cores"] >= 1
    assert set(fp["caches"]) == {"L1d", "L2", "L3"}
    assert digest() == digest(json.loads(json.dumps(fp))) and len(digest()) == 16
    assert digest({**fp, "logical_cores": fp["logical_cores"] + 1}) != digest()


def test_cache_sizes_from_sysfs(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                             (3, "Unified", "105M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert cache_sizes(tmp_path) == {"L1d": 48 << 10, "L2": 2 << 20, "L3": 105 << 20}
    assert parse_size("garbage") is None and parse_size("0K") is None
