"""Can a hub model id be loaded? Answered in about a second, before torch and transformers load.

transformers, given a hub id that is neither a local directory nor in the local Hugging Face cache,
retries its downloads for ~30 s when the hub cannot be reached, then fails with a message about
connections. So a hub id is checked first: found in the cache -> fine (transformers reads it
there); HF_HUB_OFFLINE set -> it cannot be downloaded, say so at once; else one metadata request
with a short timeout tells "does not exist" from "cannot reach the hub". Only huggingface_hub is
imported here (light), so the CLI can call this right after reading the config.
"""

from __future__ import annotations

from pathlib import Path

from rlvr.errors import ConfigError

HUB_TIMEOUT_S = 10.0


def looks_like_hub_id(name: str) -> bool:
    """`org/name` that is not a path on this machine."""
    if Path(name).expanduser().exists():
        return False
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def check_hub_model(name: str) -> None:
    """Raise a one-line ConfigError when hub id `name` cannot be loaded; return when it can (or
    when only the download itself can tell, e.g. the hub answered with a server error)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"model '{name}' is not a local directory and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set, so it cannot be downloaded"
        )
    from huggingface_hub import model_info
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ConfigError(
            f"model '{name}' is gated on the Hugging Face hub: accept its terms on the model "
            "page and log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"model '{name}' does not exist on the Hugging Face hub (or is private and you are "
            "not logged in), and it is not a local directory"
        ) from None
    except HfHubHTTPError:
        return  # the hub answered oddly: let the download try and report
    except Exception as err:  # connection errors: their types depend on the HTTP client
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"model '{name}' is not in the local Hugging Face cache and the hub cannot be "
            f"reached ({first}); download it while online, or give a local directory"
        ) from None
