"""Credentials in URIs: kept out of everything a run records or shows.

A URI can carry a secret in its user info (``https://user:token@mlflow.example.com``). Whatever the
run is given as a parameter is stored for good: Prefect keeps a flow run's parameters in its database
and shows them in its UI, and MLflow prints its tracking URI ("View run ... at: <uri>/#/..."). So a
secret travels only in the environment, never in a URI that is passed on:

- an http(s) tracking URI's user info goes into MLflow's own settings (MLFLOW_TRACKING_USERNAME /
  MLFLOW_TRACKING_PASSWORD, which its REST client sends as HTTP basic auth on every request, ranks
  included: a local Ray's workers inherit the driver's environment) and the URI goes on without it;
- user info that cannot be moved (a database URI's password) is refused, naming where it belongs;
- every URI shown or logged goes through `redacted`.
"""

import os
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

from dmd2.config import ConfigError

USERNAME_SETTING, PASSWORD_SETTING = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"
URI_SETTING = "MLFLOW_TRACKING_URI"
WHERE_CREDENTIALS_GO = (
    "put credentials in the environment of the process that runs the flow (a work pool's job variables for a "
    "deployment), never in a URI: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
    "for an MLflow server, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE for S3, the database's own "
    "settings (e.g. PGPASSWORD or ~/.pgpass) for a database")


def has_user_info(uri: str) -> bool:
    """Whether ``uri`` names a user (and maybe a password) before its host: ``scheme://user[:secret]@host``."""
    return "@" in urlsplit(uri).netloc


def redacted(uri: str) -> str:
    """``uri`` without the user info (``https://user:token@host`` -> ``https://***@host``), fit to show."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + _host(parts)))


def _host(parts: SplitResult) -> str:
    """The netloc after its user info: ``host[:port]``."""
    return parts.netloc.rsplit("@", 1)[-1]


def refuse_user_info(uri: str | None, option: str) -> None:
    """A ``ConfigError`` naming ``option`` if ``uri`` carries user info (its value is never echoed)."""
    if uri and has_user_info(uri):
        raise ConfigError(f"{option} {redacted(uri)} carries credentials, which Prefect stores and shows with a "
                          f"flow run's parameters: {WHERE_CREDENTIALS_GO}")


def move_credentials_to_environment(uri: str) -> str:
    """``uri`` without its user info, which becomes MLflow's credential settings of this process.

    Only an http(s) URI's user info can move (``user:password``, percent-decoded, into
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, replacing any set before); if
    $MLFLOW_TRACKING_URI held ``uri``, it is set to the URI without them too, so MLflow's own
    default has no secret either. Any other URI is returned as it is.
    """
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri
    if not parts.username or parts.password is None:
        raise ConfigError(f"tracking URI {redacted(uri)}: give its user info as user:password (HTTP basic auth), or "
                          "none and set MLFLOW_TRACKING_TOKEN for a bearer token")
    os.environ[USERNAME_SETTING] = unquote(parts.username)
    os.environ[PASSWORD_SETTING] = unquote(parts.password)
    bare = urlunsplit(parts._replace(netloc=_host(parts)))
    if os.environ.get(URI_SETTING) == uri:
        os.environ[URI_SETTING] = bare
    return bare


def uri_to_pass_on(uri: str | None, option: str) -> str | None:
    """``uri`` fit to become a flow parameter: an http(s) URI's credentials moved into this process's
    environment (`move_credentials_to_environment`), any other user info refused (`refuse_user_info`)."""
    if uri is None:
        return None
    bare = move_credentials_to_environment(uri)
    refuse_user_info(bare, option)
    return bare
