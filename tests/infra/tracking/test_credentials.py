"""infra/tracking/credentials.py: URIs lose their user info before they are passed on or shown. The
end-to-end check (nothing of a planted secret anywhere a run records) is tests/reliability/test_secrets.py."""

import os

import pytest

from dmd2.config import ConfigError
from infra.tracking.credentials import redacted, refuse_user_info, uri_to_pass_on

SETTINGS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


@pytest.fixture
def clean_settings(monkeypatch):
    for name in SETTINGS:
        monkeypatch.setenv(name, "")  # restored after the test, whatever the code sets
        monkeypatch.delenv(name)


@pytest.mark.parametrize("uri, shown", [
    ("https://user:s3cret@mlflow.example.com:8443/prefix", "https://***@mlflow.example.com:8443/prefix"),
    ("s3://AKIA:s3cret@bucket/runs", "s3://***@bucket/runs"),
    ("http://a@b:c@host/x", "http://***@host/x"),  # the host is after the last '@'
    ("sqlite:///home/me@corp/mlflow.db", "sqlite:///home/me@corp/mlflow.db"),  # an '@' in a path is no user info
    ("file:///data/artifacts", "file:///data/artifacts"),
])
def test_redacted_hides_the_user_info_only(uri, shown):
    assert redacted(uri) == shown


def test_an_http_uris_credentials_move_into_mlflows_settings(clean_settings):
    uri = "https://me%40corp:p%3As@mlflow.example.com/"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    assert uri_to_pass_on(uri, "--tracking-uri") == "https://mlflow.example.com/"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "me@corp" and os.environ["MLFLOW_TRACKING_PASSWORD"] == "p:s"
    assert os.environ["MLFLOW_TRACKING_URI"] == "https://mlflow.example.com/"
    assert uri_to_pass_on(None, "--tracking-uri") is None


@pytest.mark.parametrize("uri, fix", [
    ("postgresql://me:s3cret@db.example.com/mlflow", "PGPASSWORD"),  # a database's password cannot move
    ("https://s3cret@mlflow.example.com", "MLFLOW_TRACKING_TOKEN"),  # no user:password to send as basic auth
])
def test_credentials_that_cannot_move_are_refused_unechoed(uri, fix, clean_settings):
    with pytest.raises(ConfigError, match=fix) as info:
        uri_to_pass_on(uri, "--tracking-uri")
    assert "s3cret" not in str(info.value) and "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_a_parameter_with_user_info_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"store_uri s3://\*\*\*@bucket/runs carries credentials.*AWS_PROFILE"):
        refuse_user_info("s3://AKIA:s3cret@bucket/runs", "store_uri")
    refuse_user_info("s3://bucket/runs", "store_uri")
    refuse_user_info(None, "store_uri")
