"""`evoesap.network`: credentials refused in URLs, what servers echo scrubbed, replies decoded whatever their bytes,
and an overall deadline that a server dripping bytes cannot outlast."""

from __future__ import annotations

import base64
import time
import urllib.request

import pytest
from recording_http import dripping

from evoesap import network
from evoesap.errors import ConfigError
from evoesap.store import artifacts, identity

SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"  # an AWS secret key's shape: '/' and '+' inside


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAIOSFODNN7EXAMPLE:s3cr3tvalue@bucket/x",
        f"s3://AKIAIOSFODNN7EXAMPLE:{SECRET}@bucket/x",  # a secret holding '/' is still a password, not a path
        "http://alice:s3cr3tvalue@127.0.0.1:9/calibration.jsonl",
        "https://s3cr3tvalue@github.example.org/data.jsonl",  # a token as the user
        "https://bucket.s3.amazonaws.com/x.jsonl?X-Amz-Credential=AKIA%2F&X-Amz-Signature=s3cr3tvalue",
        "https://acct.blob.core.windows.net/c/x.jsonl?sv=2022&sig=s3cr3tvalue",
        "abfs://container:s3cr3tvalue@account.dfs.core.windows.net/x",
    ],
)
def test_a_url_with_credentials_is_refused_in_one_line_that_shows_none_and_names_the_ways_to_give_them(url):
    for refuse in (
        lambda: network.refuse_credentials(url, "--data"),
        lambda: artifacts.split(url),
        lambda: identity.identify(url),
    ):
        with pytest.raises(ConfigError) as raised:
            refuse()
        line = str(raised.value)
        assert "\n" not in line and "s3cr3tvalue" not in line and SECRET not in line and "AKIAIOSFODNN7EXAMPLE:" not in line
        assert "credentials inside it" in line and "docs/guides/kubeflow-secrets.md" in line
        assert "environment" in line and "fsspec's configuration" in line and "Kubernetes secret" in line


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/data@v2.jsonl",  # a port, then '@' in the path
        "s3://bucket/runs/model@main/config.json",
        "abfs://container@account.dfs.core.windows.net/x",  # Azure's address form: container@account
        "org/name@main",
        "/data/x.jsonl",
    ],
)
def test_a_url_without_credentials_is_kept_whole(url):
    network.refuse_credentials(url, "--data")
    assert network.redact(url) == url and not network.has_credentials(url)


def test_scrub_removes_every_credential_a_server_echoes_and_keeps_the_words_around_them():
    basic = base64.b64encode(b"user:hunter2").decode()
    echo = (
        f'HTTP 401 Unauthorized: {{"headers": {{"Authorization": "Basic {basic}", "Host": "hub"}}}}; '
        f"{{'Proxy-Authorization': 'Bearer abcdefgh12345678'}}; token Bearer abcdefgh12345678 hf_AbCdEfGhIjKlMnOpQrStUv "
        "key AKIAIOSFODNN7EXAMPLE at s3://AKIAIOSFODNN7EXAMPLE:s3cr3tvalue@bucket/x "
        "https://b.s3.amazonaws.com/x?X-Amz-Security-Token=FwoGZXIv&X-Amz-Signature=0123abcd&part=2; Basic authentication failed"
    )
    scrubbed = network.scrub(echo)
    for secret in (basic, "hunter2", "abcdefgh12345678", "hf_AbCdEfGhIjKlMnOpQrStUv", "AKIAIOSFODNN7EXAMPLE", "s3cr3tvalue",
                   "FwoGZXIv", "0123abcd"):  # fmt: skip
        assert secret not in scrubbed, (secret, scrubbed)
    assert scrubbed.startswith("HTTP 401 Unauthorized:") and '"Host": "hub"' in scrubbed
    assert "s3://bucket/x" in scrubbed and "part=2" in scrubbed and "Basic authentication failed" in scrubbed
    raw = network.scrub(f"you sent:\r\nAuthorization: Basic {basic}\r\nUser-Agent: x\r\n")
    assert basic not in raw and "User-Agent: x" in raw
    assert "my-token-value" not in network.scrub("the server said my-token-value", "my-token-value")


def test_a_reply_that_is_not_utf8_is_decoded_with_replacements_never_raised():
    assert network.decode(b"\xff\xfe refused \xc3") == "\ufffd\ufffd refused \ufffd"
    assert network.reply_line(b"line one\r\n\xffline two Authorization: Bearer abcdefgh12345678") == (
        "line one \ufffdline two Authorization: ***"
    )


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan", "inf"])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused(value, monkeypatch):
    monkeypatch.setenv("EVOESAP_X_DEADLINE_S", value)
    with pytest.raises(ConfigError, match=f"EVOESAP_X_DEADLINE_S='{value}' is not a positive number of seconds"):
        network.deadline_s("EVOESAP_X_DEADLINE_S", 5.0)


def test_a_server_dripping_one_byte_at_a_time_ends_at_the_overall_deadline_not_never():
    with dripping() as url:

        def read(stop):
            with urllib.request.urlopen(url + "/healthz", timeout=5) as response:  # each read gets a byte in time
                return response.read()

        start = time.monotonic()
        with pytest.raises(network.DeadlineExceeded) as raised:
            network.call(read, seconds=0.5, what=f"the health check at http://user:pw@{url[7:]}", knob="EVOESAP_X_DEADLINE_S")
        elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 3, elapsed
    line = str(raised.value)
    assert line == (
        f"the health check at {url} did not finish within 0.5 s (the server is stalled or too slow): check it, or set "
        "EVOESAP_X_DEADLINE_S to allow longer"
    )


def test_a_call_within_its_deadline_returns_its_value_and_raises_its_own_error():
    assert network.call(lambda stop: 42, seconds=5, what="x", knob="K") == 42
    with pytest.raises(KeyError, match="own"):
        network.call(lambda stop: {}["own"], seconds=5, what="x", knob="K")
