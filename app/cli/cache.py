"""`kvforge cache stats|clear`: the persisted KV tier on disk (<data dir>/kv/<fingerprint>/<xx>/<hash>.kv)
and its index in the store (core/kv/sql_index.py), per model fingerprint.

A SQLite index that does not exist yet is never created here: it is read as empty (so `stats` on a
wrong --data-dir or --db says "no index" instead of leaving a database behind). Clearing removes the
index rows first, then the files, like the engine's own eviction: a crash in between leaves orphan
files (swept at the engine's next start), never an index row naming a missing file. Clearing while a
server uses the directory is safe but wasteful: a block it still expects is recomputed (and logged)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

REMOVE_BATCH = 500  # index rows per delete statement (SQLite caps the parameters of one statement)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # removed meanwhile (an engine evicting): it no longer counts
        return 0


def _locations(args: argparse.Namespace) -> tuple[Path, str]:
    """The data directory and store URL, resolved exactly as the engine resolves them."""
    from kvforge.core.config import EngineConfig

    config = EngineConfig(data_dir=args.data_dir, db_url=args.db)
    return config.resolved_data_dir(), config.resolved_db_url()


def _open_index(url: str):
    """The KV index of the store (the caller closes it), or None where the URL names a SQLite file that does
    not exist (nothing is created)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from kvforge.core.kv.sql_index import SQLKVIndex

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        if not Path(parsed.database).expanduser().exists():
            return None
    try:
        return SQLKVIndex.open(url)
    except SQLAlchemyError as exc:  # a server that is down, a wrong password: one line, no traceback
        raise ValueError(f"cannot open the store {_display_url(url)}: {exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0]}") from None


def _display_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _fingerprint(text: str) -> bytes:
    try:
        fp = bytes.fromhex(text)
    except ValueError:
        fp = b""
    if len(fp) != 16:
        raise ValueError(f"--fingerprint must be 32 hex digits (as `kvforge cache stats` prints them), got {text!r}")
    return fp


def _disk_files(kv_dir: Path) -> dict[str, list[Path]]:
    """Regular files under the KV directory, by their top-level folder (a fingerprint's hex)."""
    by_dir: dict[str, list[Path]] = {}
    if kv_dir.is_dir():
        for root, _dirs, files in os.walk(kv_dir):
            for name in files:
                path = Path(root) / name
                top = path.relative_to(kv_dir).parts[0] if path.parent != kv_dir else ""
                by_dir.setdefault(top, []).append(path)
    return by_dir


def collect_stats(data_dir: Path, url: str) -> dict:
    kv_dir = data_dir / "kv"
    index = _open_index(url)
    totals: dict[bytes, tuple[int, int]] = {}
    indexed: set[str] = set()
    if index is not None:
        with index:
            totals = index.totals()
            for fp in totals:
                indexed.update(e.file for e in index.entries(fp))
    disk = _disk_files(kv_dir)
    on_disk = {p.relative_to(kv_dir).as_posix() for paths in disk.values() for p in paths}
    by_hex = {fp.hex(): value for fp, value in totals.items()}
    models = []
    for fp_hex in sorted(by_hex.keys() | {d for d in disk if d}):  # indexed, or a folder on disk
        blocks, nbytes = by_hex.get(fp_hex, (0, 0))
        files = disk.get(fp_hex, [])
        models.append({"fingerprint": fp_hex, "blocks": blocks, "bytes": nbytes, "files": len(files),
                       "file_bytes": sum(_size(p) for p in files)})
    return {
        "data_dir": str(data_dir), "kv_dir": str(kv_dir), "kv_dir_exists": kv_dir.is_dir(),
        "db": _display_url(url), "db_exists": index is not None,
        "models": models,
        "total": {"blocks": sum(m["blocks"] for m in models), "bytes": sum(m["bytes"] for m in models)},
        "index_rows": sum(n for n, _ in totals.values()),
        "files_on_disk": len(on_disk),
        "bytes_on_disk": sum(m["file_bytes"] for m in models) + sum(_size(p) for p in disk.get("", [])),
        "orphan_files": len(on_disk - indexed),  # on disk, not in the index (the engine sweeps them at start)
        "missing_files": len(indexed - on_disk),  # in the index, not on disk (recomputed when needed)
    }


def _print_stats(s: dict) -> None:
    print(f"KV directory  {s['kv_dir']}" + ("" if s["kv_dir_exists"] else "  (does not exist)"))
    print(f"index         {s['db']}" + ("" if s["db_exists"] else "  (does not exist: nothing indexed)"))
    if not s["models"]:
        print("no persisted KV blocks")
    else:
        header = f"{'model fingerprint':<32}  {'blocks':>8}  {'size':>10}  {'files':>8}"
        print(header)
        print("-" * len(header))
        for m in s["models"]:
            print(f"{m['fingerprint']:<32}  {m['blocks']:>8}  {human_bytes(m['bytes']):>10}  {m['files']:>8}")
        print(f"{'total':<32}  {s['total']['blocks']:>8}  {human_bytes(s['total']['bytes']):>10}  "
              f"{s['files_on_disk']:>8}")
    print(f"files on disk {s['files_on_disk']} ({human_bytes(s['bytes_on_disk'])}), index rows {s['index_rows']}: "
          f"{s['orphan_files']} orphan files (not indexed), {s['missing_files']} rows whose file is missing")


def cmd_cache_stats(args: argparse.Namespace) -> int:
    data_dir, url = _locations(args)
    stats = collect_stats(data_dir, url)
    if args.json:
        print(json.dumps(stats))
    else:
        _print_stats(stats)
    return 0


def clear(data_dir: Path, url: str, fingerprint: bytes | None = None) -> dict:
    """Delete the index rows, then the KV files (and the directories left empty) of every model, or of one."""
    kv_dir = data_dir / "kv"
    index = _open_index(url)
    rows = nbytes = 0
    if index is not None:
        with index:
            totals = index.totals()
            if fingerprint is None:
                rows, nbytes = sum(n for n, _ in totals.values()), sum(b for _, b in totals.values())
                index.clear()
            else:
                rows, nbytes = totals.get(fingerprint, (0, 0))
                hashes = [e.hash for e in index.entries(fingerprint)]
                for i in range(0, len(hashes), REMOVE_BATCH):
                    index.remove(hashes[i:i + REMOVE_BATCH])
    root = kv_dir if fingerprint is None else kv_dir / fingerprint.hex()
    files = file_bytes = dirs = 0
    if root.is_dir():
        for current, subdirs, names in os.walk(root, topdown=False):
            for name in names:
                path = Path(current) / name
                if path.name.endswith((".kv", ".tmp")):  # a block, or a write cut short
                    size = _size(path)
                    try:
                        path.unlink()
                    except FileNotFoundError:  # removed meanwhile
                        continue
                    file_bytes += size
                    files += 1
            for name in subdirs:
                try:
                    (Path(current) / name).rmdir()
                    dirs += 1
                except OSError:  # not empty: something that is not ours
                    pass
        if root != kv_dir:
            try:
                root.rmdir()
                dirs += 1
            except OSError:
                pass
    return {"kv_dir": str(kv_dir), "db": _display_url(url),
            "fingerprint": fingerprint.hex() if fingerprint is not None else None,
            "index_rows": rows, "index_bytes": nbytes, "files": files, "file_bytes": file_bytes,
            "directories": dirs}


def cmd_cache_clear(args: argparse.Namespace) -> int:
    fingerprint = _fingerprint(args.fingerprint) if args.fingerprint is not None else None
    data_dir, url = _locations(args)
    result = clear(data_dir, url, fingerprint)
    if args.json:
        print(json.dumps(result))
        return 0
    what = f"model {result['fingerprint']}" if fingerprint is not None else "every model"
    print(f"cleared {what}: {result['index_rows']} index rows ({human_bytes(result['index_bytes'])}) from "
          f"{result['db']}; {result['files']} files ({human_bytes(result['file_bytes'])}) and "
          f"{result['directories']} empty directories from {result['kv_dir']}")
    return 0


def _location_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=None,
                        help="the data directory holding kv/ (default: the engine's, e.g. ~/.local/share/kvforge)")
    parser.add_argument("--db", default=None,
                        help="SQLAlchemy URL of the store (default: sqlite:///<data dir>/kvforge.db)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `cache` on the top-level `kvforge` subcommands."""
    cache = sub.add_parser("cache", help="the persisted KV cache on disk: stats, clear")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    stats = cache_sub.add_parser("stats", help="blocks and bytes per model fingerprint; files on disk vs index rows")
    _location_args(stats)
    stats.set_defaults(func=cmd_cache_stats)
    clear_parser = cache_sub.add_parser("clear", help="delete the persisted KV blocks (index rows and files)")
    _location_args(clear_parser)
    clear_parser.add_argument("--fingerprint", default=None, metavar="HEX",
                              help="only this model's blocks (the fingerprint `kvforge cache stats` prints)")
    clear_parser.set_defaults(func=cmd_cache_clear)
    return cache
