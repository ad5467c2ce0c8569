"""Where a model name points: a directory, a bundled demo model, or a Hugging Face Hub id.

Hub ids (`Qwen/Qwen3-0.6B`) resolve as `vllm serve` resolves them, through
`huggingface_hub.snapshot_download`: the cache under `HF_HOME` (or `--download-dir`),
`HF_HUB_OFFLINE=1` to use only what is cached, `--revision` for a branch, tag or
commit, and huggingface_hub's progress bars while files download. Only what the engine
reads is fetched (configs, safetensors, tokenizer files), never `.bin` or `.gguf` copies.
"""

from __future__ import annotations

import difflib
import os
import re

BUNDLED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "demo_models")
HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "tokenizer*",
]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def bundled_models() -> dict[str, str]:
    """Bundled demo model names -> their directories (what lm-eval and co. take as a path)."""
    return {
        name: os.path.join(BUNDLED_DIR, name)
        for name in sorted(os.listdir(BUNDLED_DIR))
        if os.path.isfile(os.path.join(BUNDLED_DIR, name, "config.json"))
    }


def resolve_model_path(
    name: str,
    revision: str | None = None,
    download_dir: str | None = None,
    need_config: bool = True,
) -> str:
    """The local directory for `name`; ValueError saying what to do when there is none.
    `need_config=False` for tokenizer directories (they hold no config.json)."""
    if os.path.isdir(name):
        if need_config and not os.path.isfile(os.path.join(name, "config.json")):
            raise ValueError(
                f"{name!r} is a directory without config.json, so not a HF checkpoint; "
                "point at the directory that holds config.json and *.safetensors"
            )
        return name
    bundled = bundled_models()
    if name in bundled:
        return bundled[name]
    if _HUB_ID.match(name) and not os.path.exists(name):
        return download(name, revision, download_dir)
    hint = difflib.get_close_matches(name, list(bundled), n=1)
    suggestion = f"did you mean {hint[0]!r}? " if hint else ""
    raise ValueError(
        f"model {name!r} is neither a directory, a bundled model ({', '.join(bundled)}) "
        f"nor a Hugging Face Hub id (org/name); {suggestion}`minivllm models` lists the bundled ones"
    )


def download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    """The snapshot directory of `repo_id` at `revision`, downloaded unless cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=HUB_PATTERNS,
        )
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        where = download_dir or constants.HF_HUB_CACHE
        raise ValueError(
            f"{repo_id!r} at revision {revision or 'main'} is not in the cache at {where} and "
            f"cannot be downloaded{offline}; download it once online, or pass a local directory"
        ) from None
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise ValueError(
            f"the Hub has no accessible repository {repo_id!r} ({type(e).__name__}); check "
            "the name, or log in (HF_TOKEN) for a gated or private one"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{repo_id!r} has no revision {revision!r}") from None
