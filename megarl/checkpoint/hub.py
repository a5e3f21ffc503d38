"""Model ids from the Hugging Face Hub (`Qwen/Qwen2.5-7B-Instruct`, `org/name@revision`) as local folders.

Wherever megarl takes a model path (`model.path`, the roles' `*.model.path`, `megarl convert SRC`), a string that is
not an existing folder and reads `org/name[@revision]` is fetched with `huggingface_hub.snapshot_download` into the
Hugging Face cache (`HF_HOME` / `HF_HUB_CACHE`), or taken from it with `HF_HUB_OFFLINE=1`, the usual setting on
clusters without network. Only what megarl reads is fetched: config, tokenizer and safetensors files (not .bin or
.pth copies, not README images). On a cluster the cache must be on the file system every node shares, as the run
folder is: the workers read the same path.
"""

from __future__ import annotations

from pathlib import Path

from megarl.config.paths import HUB_ID_RE
from megarl.errors import UserError

WEIGHT_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
"""Config, generation config, safetensors (and their index), tokenizer files of every kind, chat templates."""
CONFIG_FILES = ("*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
"""What planning needs: no weights."""


def is_hub_id(path: str) -> bool:
    """Whether `path` is read as a Hub model id: `org/name[@revision]` that is not an existing local path."""
    return HUB_ID_RE.match(path) is not None and not Path(path).exists()


def resolve_model_path(path: str, key: str, weights: bool = True) -> str:
    """`path` itself when it is a local path (existing or not: the caller reports a missing one), else the local
    snapshot folder of the Hub model it names. weights=False fetches config and tokenizer only (planning)."""
    match = HUB_ID_RE.match(path)
    if match is None or Path(path).exists():
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = match["repo"], match["revision"]
    where = f"{key}={path!r} is not a local folder ({Path(path).resolve()} does not exist), so it was read as a Hub id"
    try:
        folder = snapshot_download(
            repo, revision=revision, allow_patterns=list(WEIGHT_FILES if weights else CONFIG_FILES)
        )
    except LocalEntryNotFoundError as err:
        offline = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise UserError(
            f"{where}: {repo}{'@' + revision if revision else ''} is not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) and {offline}. Download it where there is network "
            f"(`huggingface-cli download {repo}`) with the same HF_HOME, or give a local folder ({_first_line(err)})"
        ) from None
    except GatedRepoError:
        raise UserError(f"{where}: {repo} is gated: accept its terms on huggingface.co and log in (HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise UserError(f"{where}: {repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: there is no model {repo!r} on the Hub (or it is private: set HF_TOKEN)") from None
    return folder


def localize_model_paths(config, weights: bool = True) -> None:
    """Every model path of a job config that names a Hub model becomes its local snapshot folder, in place:
    `model.path` and the roles' `model.path` (copies of `model.path` by default). A `model.path` that `model.init`
    builds is local by definition."""
    built = config.model.path if config.model.init is not None else None
    resolved: dict[str, str] = {}
    holders = [("model", config.model)] + [
        (f"{role}.model", getattr(config, role).model) for role in ("actor", "critic", "ref", "teacher", "reward_model")
    ]
    for key, holder in holders:
        if holder.path == built or not is_hub_id(holder.path):
            continue
        if holder.path not in resolved:
            resolved[holder.path] = resolve_model_path(holder.path, f"{key}.path", weights)
        holder.path = resolved[holder.path]


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__
