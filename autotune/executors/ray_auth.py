"""Ray's token authentication for the clusters autotune starts or joins (docs/security.md).

What Ray 2.60 does (ray/_private/worker.py `init`, ray/_private/authentication/authentication_token_setup.py):
- A new local cluster (`ray.init(address="local")`) turns token authentication on unless `RAY_AUTH_MODE` says
  otherwise; without a token it writes a fresh one to ~/.ray/auth_token with the default file mode
  (measured: `ls -l ~/.ray/auth_token` after a first ray.init: -rw-r--r--, readable by every local user).
- A client joining a cluster by explicit address sends a token only when `RAY_AUTH_MODE=token`; Ray
  never turns that on by itself for an explicit address, so a local token is not sent to an arbitrary server.
- The token comes from `RAY_AUTH_TOKEN`, else the file `RAY_AUTH_TOKEN_PATH` names, else ~/.ray/auth_token
  (measured: `AuthenticationTokenLoader.instance().get_raw_token()` with each combination set).
- The cluster's servers listen on every interface whatever the node address (measured: `ss -ltnp` shows
  gcs_server, raylet and workers on `*:PORT`); ray.init replaces a loopback `_node_ip_address` with the
  machine's address (ray/_private/services.py `resolve_ip_for_localhost`). So the token is the only lock.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

MODE_VAR = "RAY_AUTH_MODE"
_warned_join = False


def token_file() -> Path | None:
    """The file Ray reads the token from; None when `RAY_AUTH_TOKEN` holds the token itself."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()


def secure_local_cluster() -> Path | None:
    """Before ray.init starts a local cluster: token mode on, and a token file only its owner can read.

    Returns the token file (None: the token is in `RAY_AUTH_TOKEN`). The local cluster listens on every
    interface, so an environment that switches authentication off is overridden, with a warning, not obeyed.
    """
    mode = os.environ.get(MODE_VAR)
    if mode is not None and mode.lower() != "token":
        print(
            f"warning: {MODE_VAR}={mode} ignored: the local Ray cluster autotune starts listens on every "
            f"network interface, and without a token anyone who can reach this machine could run code "
            f"through it as the user running autotune. It uses Ray's token authentication "
            f"(docs/security.md).",
            file=sys.stderr,
        )
    os.environ[MODE_VAR] = "token"
    path = token_file()
    if path is not None:
        _owner_only_token(path)
    # Ray caches its config (the auth mode) and the token it loaded once per process: reload both, or a
    # process whose first Ray call saw another mode or token would start a cluster its own driver cannot join.
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    return path


def _owner_only_token(path: Path) -> None:
    """A token at `path` readable by its owner only: created 0600, or an existing one of ours tightened."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        # O_EXCL: never follow or overwrite what another process put there first; 0600 from the start,
        # so there is no moment when the token is readable by others (a chmod after Ray wrote it would leave one).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        st = path.stat()
        if st.st_mode & 0o077:
            if st.st_uid != os.geteuid():
                print(
                    f"warning: the Ray token {path} is readable by other users (mode {st.st_mode & 0o777:o}) and "
                    f"not yours to change: whoever reads it can run code on the clusters that use it.",
                    file=sys.stderr,
                )
                return
            path.chmod(0o600)
            print(
                f"warning: the Ray token {path} was readable by other users (mode {st.st_mode & 0o777:o}); "
                f"made it 0600: whoever reads it can run code on the clusters that use it.",
                file=sys.stderr,
            )
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # as Ray's own generator: 256 random bits, hex


def warn_if_joining_without_token(address: str) -> None:
    """Before joining the cluster at `address` with authentication switched off in the environment: once
    per process, say what that exposes.

    That cluster's own authentication decides who may connect; autotune neither weakens nor changes it.
    """
    global _warned_join
    if _warned_join or os.environ.get(MODE_VAR, "").lower() != "disabled":
        return
    _warned_join = True
    print(
        f"warning: {MODE_VAR}=disabled: autotune joins the Ray cluster at {address} without a token. That "
        f"works only if the cluster runs without authentication, and then anyone who can reach its address "
        f"can run any code on its nodes as the user who started Ray there, and read what the trials read. "
        f"Start the cluster with token authentication and join it with {MODE_VAR}=token (docs/security.md).",
        file=sys.stderr,
    )
