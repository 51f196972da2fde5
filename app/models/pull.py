"""Downloading a model from the Hugging Face Hub into the models directory, through `huggingface_hub` (its HTTP
client, authentication from HF_TOKEN, HF_ENDPOINT for a mirror): `kvforge pull` and Ollama's `/api/pull`.

    owner/name               a checkpoint: its safetensors weights, config and tokenizer files -> <models dir>/name/
    owner/name:Q4_K_M        one GGUF file of the repository, chosen by its quantization tag -> <models dir>/<file>
    hf.co/owner/name[:tag]   the same, as Ollama names Hub models

Only safetensors and GGUF weights are fetched (never pickle checkpoints: .bin, .pt, .pth, .ckpt). Files go to a
temporary folder in the models directory and are moved into place when all have arrived, so a failed or interrupted
pull leaves nothing half-written where the server looks for models. Progress is reported file by file. Offline (no
route to the Hub), one error that says so.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# what a checkpoint directory needs besides its weights: config, generation defaults, tokenizer, chat template
CHECKPOINT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer.model", "*.txt", "*.jinja",
                    "*.tiktoken")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


class PullError(ValueError):
    """A pull that cannot be done; the message says why and what to do."""


@dataclass(frozen=True)
class PullRequest:
    repo_id: str
    tag: str | None  # a GGUF quantization tag (Q4_K_M), or None for the safetensors checkpoint


@dataclass
class PullProgress:
    status: str  # Ollama's status line: "pulling manifest", "pulling <file>", "verifying", "success"
    file: str | None = None
    digest: str | None = None  # "sha256:<hex>" of an LFS file, as the Hub lists it
    total: int | None = None  # the file's bytes
    completed: int | None = None  # of which downloaded


def parse_name(name: str) -> PullRequest:
    """`owner/name`, `owner/name:TAG`, with or without Ollama's `hf.co/` (or `huggingface.co/`) prefix."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    bare = re.sub(r"^(https://)?(hf\.co|huggingface\.co)/", "", name.strip())
    repo_id, _, tag = bare.partition(":")
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        raise PullError(f"{name!r} is not a Hugging Face Hub model id: owner/name, optionally :QUANT for one GGUF file "
                        "(e.g. HuggingFaceTB/SmolLM2-135M-Instruct or bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M)")
    try:  # the Hub's own rules besides (no '.' or '-' at an end, no '--', no '.git' ending): its client refuses these
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PullError(f"{name!r} is not a Hugging Face Hub model id: {exc}") from None
    if tag.lower() == "latest":  # Ollama's clients add it
        tag = ""
    return PullRequest(repo_id, tag or None)


def choose_files(request: PullRequest, files: dict[str, int]) -> list[str]:
    """The repository files to fetch, from its {path: size} listing; PullError when it has nothing kvforge loads."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if request.tag is not None:
        tagged = [f for f in ggufs if re.search(rf"(?<![A-Za-z0-9]){re.escape(request.tag)}(?![A-Za-z0-9])", f, re.I)]
        if len(tagged) != 1:
            found = "none" if not tagged else ", ".join(tagged)
            raise PullError(f"{request.repo_id}: {len(tagged)} GGUF files match {request.tag!r} ({found}); its GGUF "
                            f"files: {', '.join(ggufs) or 'none'}")
        return tagged
    if any(f.endswith(".safetensors") for f in files):
        return sorted(f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in CHECKPOINT_FILES))
    if ggufs:
        raise PullError(f"{request.repo_id} holds GGUF files only: name one by its quantization tag, e.g. "
                        f"{request.repo_id}:Q4_K_M (its files: {', '.join(ggufs)})")
    raise PullError(f"{request.repo_id} has no safetensors or GGUF weights (pickle checkpoints such as .bin are never "
                    "loaded)")


def destination(request: PullRequest, files: list[str], models_dir: Path) -> Path:
    if request.tag is not None:
        return models_dir / Path(files[0]).name
    return models_dir / request.repo_id.split("/")[1]


def pull(name: str, models_dir: Path, revision: str | None = None,
         on_progress: Callable[[PullProgress], None] = lambda progress: None) -> Path:
    """Download `name` into `models_dir`; returns where it landed (a checkpoint directory or a GGUF file). An
    existing model of that name is left as it is (PullError)."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    request = parse_name(name)
    models_dir = models_dir.expanduser().resolve()
    models_dir.mkdir(parents=True, exist_ok=True)
    on_progress(PullProgress("pulling manifest"))
    try:
        info = HfApi().model_info(request.repo_id, revision=revision, files_metadata=True)
        files = {s.rfilename: s.size or 0 for s in info.siblings or []}
        digests = {s.rfilename: f"sha256:{s.lfs.sha256}" for s in info.siblings or [] if s.lfs is not None}
        chosen = choose_files(request, files)
        target = destination(request, chosen, models_dir)
        if target.exists():
            raise PullError(f"{target.name} is already in the models directory ({target}); remove it to pull it again")
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=models_dir) as staging:
            for filename in chosen:
                size, digest = files[filename], digests.get(filename)
                on_progress(PullProgress(f"pulling {filename}", filename, digest, size, 0))
                hf_hub_download(request.repo_id, filename, revision=info.sha, local_dir=staging)
                on_progress(PullProgress(f"pulling {filename}", filename, digest, size, size))
            on_progress(PullProgress("verifying"))
            fetched = Path(staging) / chosen[0] if request.tag is not None else Path(staging)
            if request.tag is None:
                shutil.rmtree(fetched / ".cache", ignore_errors=True)  # huggingface_hub's download metadata
                os.chmod(fetched, 0o755)  # a TemporaryDirectory is created private to its owner
            os.replace(fetched, target)
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as exc:
        raise PullError(f"{request.repo_id}: {type(exc).__name__}: {str(exc).splitlines()[0]} (a private or gated "
                        "model needs HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        raise PullError(f"the Hugging Face Hub refused {request.repo_id}: {str(exc).splitlines()[0]}") from None
    except HFValidationError as exc:  # e.g. a --revision the client refuses
        raise PullError(f"{request.repo_id}: {exc}") from None
    except PullError:
        raise
    except Exception as exc:  # no route to the Hub: DNS, connection, proxy, TLS
        if not _network_error(exc):
            raise
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        raise PullError(f"cannot reach the Hugging Face Hub at {endpoint} ({type(exc).__name__}: {exc}): this machine "
                        f"looks offline. Download {request.repo_id} elsewhere and copy it into {models_dir}") from None
    on_progress(PullProgress("success"))
    return target


def _network_error(exc: BaseException) -> bool:
    """A connection-level failure, whichever HTTP client huggingface_hub uses (its exception names say so)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ("ConnectError", "ConnectTimeout", "NetworkError", "TransportError", "ConnectionError",
                            "OfflineModeIsEnabled", "LocalEntryNotFoundError", "ProxyError", "SSLError"):
            return True
    return isinstance(exc, OSError)


def add_parser(sub) -> None:
    parser = sub.add_parser("pull", help="download a model from the Hugging Face Hub into the models directory",
                            description="owner/name fetches a checkpoint's safetensors, config and tokenizer; "
                            "owner/name:Q4_K_M one GGUF file by its quantization tag. Needs internet access "
                            "(HF_TOKEN for gated models).")
    parser.add_argument("name", help="the Hub model id, e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
    parser.add_argument("--models-dir", default=None, help="where to put it (default: $KVFORGE_MODELS_DIR)")
    parser.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    parser.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    models_dir = args.models_dir or os.environ.get("KVFORGE_MODELS_DIR")
    if not models_dir:
        raise PullError("no models directory: pass --models-dir or set KVFORGE_MODELS_DIR")

    def show(progress: PullProgress) -> None:
        if progress.file is None or progress.completed:
            size = f" ({progress.total / 1e6:.1f} MB)" if progress.total else ""
            print(f"{progress.status}{size}", file=sys.stderr, flush=True)

    target = pull(args.name, Path(models_dir), args.revision, show)
    print(target)
    return 0
