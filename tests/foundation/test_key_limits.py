"""``KEY_LIMITS`` (inference.quota_limits): a bad value stops start-up with one line
naming the setting and what is wrong; a good one gives each key its limits (its own
entry over ``*``; admin keys only an entry naming them)."""

from __future__ import annotations

import pytest

from inference.quota_limits import NONE, Limits, limits_for, parse_key_limits
from millm_site.config import ConfigError, load_config
from tests.conftest import manage

BAD = [
    ("{not json", "must be a JSON object"),
    ("[1, 2]", "must be a JSON object"),
    ('{"*": 60}', "must be an object"),
    ('{"*": {"rpm": 0}}', "*.rpm must be a whole number from 1"),
    ('{"*": {"rpm": -5}}', "*.rpm must be a whole number from 1"),
    ('{"*": {"rpm": 1.5}}', "*.rpm must be a whole number from 1"),
    ('{"*": {"rpm": true}}', "*.rpm must be a whole number from 1"),
    ('{"*": {"rpm": "60"}}', "*.rpm must be a whole number from 1"),
    ('{"*": {"tpm": 1e30}}', "*.tpm must be a whole number from 1"),
    ('{"*": {"requests": 60}}', "unknown fields ['requests']"),
    ('{"bad label!": {"rpm": 1}}', "is neither '*' nor a key label"),
    ("[" * 100000 + "]" * 100000, "must be a JSON object"),
]


@pytest.mark.parametrize(("raw", "rule"), BAD, ids=[b[1][:24] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_value_is_refused_naming_the_setting(raw, rule):
    with pytest.raises(ConfigError) as info:
        load_config({"KEY_LIMITS": raw})
    assert info.value.name == "KEY_LIMITS" and rule in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_the_process_refuses_to_start_with_one_line(tmp_path):
    result = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), "KEY_LIMITS": '{"*": {"rpm": 0}}'})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("miLLM configuration error: KEY_LIMITS: "), result.stderr


def test_a_keys_limits_are_its_entry_over_the_default():
    table = parse_key_limits(
        '{"*": {"rpm": 60, "tpm": 1000, "concurrent": 4}, "alice": {"rpm": 600, "tpm": null}, "root": {"concurrent": 1}}'
    )
    assert limits_for(table, "alice", admin=False) == Limits(rpm=600, tpm=None, concurrent=4)
    assert limits_for(table, "bob", admin=False) == Limits(rpm=60, tpm=1000, concurrent=4)
    # admin keys: only an entry that names them, never the default
    assert limits_for(table, "root", admin=True) == Limits(concurrent=1)
    assert limits_for(table, "other-admin", admin=True) == NONE
    assert parse_key_limits("") == {} and parse_key_limits("  ") == {}
    assert load_config({})["KEY_LIMITS"] == ""
