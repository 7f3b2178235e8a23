"""A Hugging Face Hub id's config.json, and nothing else of the repository: never weights, never code.

The file goes through huggingface_hub, into the cache transformers uses (HF_HOME, HF_HUB_CACHE), so a config read
once is there offline (HF_HUB_OFFLINE=1) and for every sweep child. A copy in the cache is used as it is; the
Hub is asked only for an id not yet in it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from gcbench.errors import GcbenchError, quiet_logger

LOCAL_HINT = "or pass a local config.json (--model path/to/config.json)"


def hub_config_file(model_id: str) -> Path:
    """The cached path of `owner/name[@revision]`'s config.json, fetched first when it is not in the cache."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    repo_id, _, revision = model_id.partition("@")
    fetch = lambda offline: huggingface_hub.hf_hub_download(  # noqa: E731
        repo_id, "config.json", revision=revision or None, local_files_only=offline)
    try:
        return Path(fetch(offline=True))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, FileNotFoundError):
        pass
    except errors.HFValidationError as e:
        raise GcbenchError(f"--model {model_id!r} is not a Hub id: {e}") from None
    except OSError as e:  # a cache or token path that cannot be read (HOME=/dev/null, HF_HOME a file)
        raise GcbenchError(f"{model_id}: the Hugging Face cache cannot be read ({e.strerror or e}: "
                           f"{str(e.filename)[:200]!r}); set HF_HOME to a folder, {LOCAL_HINT}") from None
    if constants.HF_HUB_OFFLINE:
        raise GcbenchError(f"{model_id}: its config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
                           f"fetch it once online, {LOCAL_HINT}")
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    proxied = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    try:
        if not proxied:  # behind a proxy the host need not resolve here
            socket.getaddrinfo(host, 443)  # no network fails here at once, not after the client's five retries
    except OSError:
        raise GcbenchError(f"{model_id}: the Hugging Face Hub ({host}) cannot be reached and its config.json is not "
                           f"in the cache; connect once, {LOCAL_HINT}") from None
    try:
        with quiet_logger("huggingface_hub"):  # it logs each retry; the one line says it all
            return Path(fetch(offline=False))
    except errors.LocalEntryNotFoundError:  # the client's name for a timeout, a refused connection, a 5xx
        raise GcbenchError(f"{model_id}: the Hugging Face Hub ({host}) did not answer and its config.json is not in "
                           f"the cache; try again, {LOCAL_HINT}") from None
    except errors.GatedRepoError:
        raise GcbenchError(f"{model_id} is gated on the Hub: accept its terms there and log in (hf auth login), "
                           f"{LOCAL_HINT}") from None
    except errors.RepositoryNotFoundError:
        raise GcbenchError(f"no model {repo_id!r} on the Hugging Face Hub (or it is private: log in with hf auth "
                           f"login); check the id, {LOCAL_HINT}") from None
    except errors.RevisionNotFoundError:
        raise GcbenchError(f"{repo_id} has no revision {revision!r} on the Hub") from None
    except (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
        raise GcbenchError(f"{model_id} has no config.json on the Hub; {LOCAL_HINT}") from None
    except (OSError, errors.HfHubHTTPError) as e:  # connection refused or reset, timeouts, HTTP errors
        raise GcbenchError(f"{model_id}: cannot fetch its config.json from the Hub ({' '.join(str(e).split())[:200]}"
                           f"); {LOCAL_HINT}") from None
