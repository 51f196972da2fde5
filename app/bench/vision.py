"""`kvforge bench vision`: a picture's first turn and the next turn about it, kvforge against HF transformers and
llama.cpp (its mtmd library, through llama-cpp-python's chat handler), each engine in a process of its own
(vision_worker.py), one after another, on the same model and picture.

The model: by default random weights of SmolVLM-256M's shape (vision_shapes.py), served by kvforge and HF from its
safetensors checkpoint and by llama.cpp and `kvforge-gguf` from llama.cpp's GGUF pair; `--model DIR` measures
another vision checkpoint (kvforge and HF), `--gguf FILE` a GGUF with its mmproj beside it (kvforge-gguf and
llama.cpp). Each engine answers one token to the picture and a question, then one token to the next turn (the
answer and a follow-up after it): the first turn is the tower's and the prefill's time, the next turn what an engine
keeps of the picture (kvforge: its prefix cache and the tower's rows; HF: nothing; llama.cpp's chat handler: its
last prompt's text, and the picture read again). The table gives each turn's seconds and the ratio to kvforge's,
with the CPU named."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvforge.app.bench.arguments import as_command
from kvforge.app.bench.peer_engines import add_peer_options, find_peer, last_lines, say

WORKER = Path(__file__).with_name("vision_worker.py")
ENGINES = ("kvforge", "kvforge-gguf", "hf", "llama.cpp")
QUESTION, ANSWER, FOLLOW_UP = "What is in this picture?", "A picture of coloured noise.", "And its colours?"
TIMEOUT_S = 3600  # one engine's two turns (an AVX2 CPU's fp32 tower over 13 tiles takes minutes)


def add_parser(bench_sub) -> argparse.ArgumentParser:
    parser = bench_sub.add_parser("vision", help="a picture's first turn and the next turn about it: kvforge against "
                                                 "HF transformers and llama.cpp")
    parser.add_argument("--model", default=None, help="a vision checkpoint directory (default: random weights of "
                                                      "SmolVLM-256M's shape, written once)")
    parser.add_argument("--gguf", default=None, help="a GGUF with its mmproj-*.gguf beside it (default: the shape's "
                                                     "pair; with --model: none)")
    parser.add_argument("--picture", default=None, help="the picture (default: random 1024 x 768 pixels)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="kvforge's and HF's dtype (default: float32; llama.cpp runs the files' own types)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated (default: {','.join(ENGINES)})")
    parser.add_argument("--threads", type=int, default=2, help="each engine's threads (default: 2)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    add_peer_options(parser, ("llama",), "run kvforge and HF only")
    parser.set_defaults(func=as_command(run_vision))
    return parser


def run_vision(args: argparse.Namespace) -> list[dict]:
    from kvforge.app.bench.probe import cpu_name
    from kvforge.app.bench.real_shapes import shapes_dir
    from kvforge.app.bench.vision_shapes import random_picture, smolvlm_shape
    from kvforge.core.gguf_mmproj import projector_for

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise ValueError(f"--engines: unknown {', '.join(unknown) or 'none given'} (known: {', '.join(ENGINES)})")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    checkpoint, gguf = (Path(args.model) if args.model else None), (Path(args.gguf) if args.gguf else None)
    if checkpoint is None and gguf is None:
        checkpoint, gguf, _ = smolvlm_shape(shapes_dir(), log=lambda text: say(text, "vision"))
    mmproj = projector_for(gguf) if gguf is not None else None
    if gguf is not None and mmproj is None:
        raise ValueError(f"--gguf: no mmproj-*.gguf beside {gguf} that fits it")
    picture = Path(args.picture) if args.picture else random_picture(shapes_dir() / "picture-1024x768.png")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-vision-") as scratch:
        worker = Path(scratch) / WORKER.name
        shutil.copyfile(WORKER, worker)  # run from its own directory: nothing of the package on a peer's sys.path
        for engine in engines:
            rows.append(_run_engine(engine, args, worker, checkpoint, gguf, mmproj, picture))
    report = {"cpu": cpu_name(), "threads": args.threads, "dtype": args.dtype, "picture": str(picture),
              "rows": rows}
    print(_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return rows


def _run_engine(engine: str, args, worker: Path, checkpoint: Path | None, gguf: Path | None, mmproj: Path | None,
                picture: Path) -> dict:
    row = {"engine": engine}
    python, why = sys.executable, None
    model = gguf if engine in ("kvforge-gguf", "llama.cpp") else checkpoint
    if model is None:
        why = "no GGUF pair (--gguf)" if engine in ("kvforge-gguf", "llama.cpp") else "no checkpoint (--model)"
    elif engine == "llama.cpp":
        python, why = find_peer("llama", args)
    if why is not None:
        say(f"{engine}: skipped ({why})", "vision")
        return row | {"status": "skipped", "why": why}
    job = {"kind": {"kvforge-gguf": "kvforge"}.get(engine, engine), "model": str(model),
           "mmproj": str(mmproj) if mmproj else None, "picture": str(picture), "dtype": args.dtype,
           "threads": args.threads, "question": QUESTION, "answer": ANSWER, "follow_up": FOLLOW_UP}
    say(f"{engine}: running", "vision")
    done = subprocess.run([python, str(worker), json.dumps(job)], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=worker.parent)
    if done.returncode != 0:
        return row | {"status": "failed", "why": last_lines(done.stderr, 5) or f"exit code {done.returncode}"}
    return row | {"status": "ok"} | json.loads(done.stdout.strip().splitlines()[-1])


def _table(report: dict) -> str:
    ours = next((r for r in report["rows"] if r["engine"] == "kvforge" and r["status"] == "ok"),
                next((r for r in report["rows"] if r["status"] == "ok" and r["engine"].startswith("kvforge")), None))
    lines = [f"CPU: {report['cpu']}; {report['threads']} threads; kvforge / HF in {report['dtype']}",
             f"{'engine':<14} {'load s':>7} {'turn 1 s':>9} {'tokens':>7} {'x kvforge':>10} "
             f"{'turn 2 s':>9} {'tokens':>7} {'cached':>7} {'x kvforge':>10}"]
    for row in report["rows"]:
        if row["status"] != "ok":
            lines.append(f"{row['engine']:<14} {row['status']}: {row['why']}")
            continue
        first, second = row["turns"]
        ratios = [f"{turn['seconds'] / mine['seconds']:.2f}" if ours else "-"
                  for turn, mine in zip(row["turns"], ours["turns"] if ours else row["turns"])]
        cached = "-" if second["cached_tokens"] is None else str(second["cached_tokens"])
        lines.append(f"{row['engine']:<14} {row['load_s']:>7.1f} {first['seconds']:>9.2f} {first['prompt_tokens']:>7} "
                     f"{ratios[0]:>10} {second['seconds']:>9.2f} {second['prompt_tokens']:>7} {cached:>7} "
                     f"{ratios[1]:>10}")
    lines.append("x kvforge: the engine's seconds over kvforge's (from its checkpoint); above 1, kvforge is faster")
    return "\n".join(lines)
