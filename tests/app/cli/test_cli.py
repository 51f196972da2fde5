"""The `kvforge` command line on the embedded model: what loads a model or prints a reply runs as a real
subprocess; refusals of arguments and settings, and the plugin listing, run through main() in the test process
(one interpreter start each saved; one refusal, the missing model, still runs as a subprocess to show that a
refusal's stderr is one line from the interpreter's start)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

QUESTION = "What is the capital of France? Answer briefly."


def run_cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("KVFORGE_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "kvforge.app.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def run_main(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """`kvforge ARGS` through main() in this process: (exit code, stdout, stderr)."""
    from kvforge.app.cli import main

    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        code = main(list(args))
    finally:
        torch.set_num_threads(threads)  # an engine that got as far as setting the process's threads
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module", autouse=True)
def _model_converted(embedded_path):
    """The GGUF conversion happens once, before the subprocesses start."""


def test_generate_chat_answers():
    result = run_cli("generate", QUESTION, "--chat", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_raw_completion_respects_max_tokens():
    result = run_cli("generate", "The capital of France is", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    assert 0 < len(result.stdout.strip()) < 40


def test_chat_streams_replies_and_keeps_history():
    script = f"{QUESTION}\nAnd of Italy? One word.\n/exit\n"
    result = run_cli("chat", "--temperature", "0", "--max-tokens", "24", stdin=script)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Rome" in result.stdout  # the second question only makes sense with the first in the history


def test_missing_model_is_one_line_error_without_traceback():
    result = run_cli("generate", "hi", "--model", "nobody/does-not-exist")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nobody/does-not-exist" in lines[0]


def test_invalid_sampling_value_names_the_field(capsys, monkeypatch):
    code, _, err = run_main(capsys, monkeypatch, "generate", "hi", "--temperature", "-1")
    assert code == 2
    assert "temperature" in err and "Traceback" not in err


def test_plugins_lists_builtin_dense_method(capsys, monkeypatch):
    code, out, err = run_main(capsys, monkeypatch, "plugins")
    assert code == 0, err
    assert "kvforge.quant:" in out and "none" in out
    assert "[cpu / cuda]" in out  # the devices the method runs on
    decoding = out.split("kvforge.decoding:")[1]  # the decoding plugins, with their options
    assert "ngram" in decoding and "draft" in decoding
    assert "max_n: integer, default 4" in decoding and "k: integer, default 4" in decoding


def test_generate_with_ngram_decoding_gives_the_same_greedy_text():
    prompt = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    plain = run_cli("generate", prompt, "--chat", "--max-tokens", "16")
    spec = run_cli("generate", prompt, "--chat", "--max-tokens", "16", "--decoding", "ngram",
                   "--decoding-options", '{"k": 3, "min_n": 1}')
    assert plain.returncode == 0, plain.stderr
    assert spec.returncode == 0, spec.stderr
    assert "fox" in plain.stdout and spec.stdout == plain.stdout


@pytest.mark.parametrize("args, fragment", [
    (("--decoding", "ngram", "--decoding-options", '{"k": 0}'), "'k'"),
    (("--decoding", "ngram", "--decoding-options", '{"lookahead": 2}'), "'lookahead'"),
    (("--decoding", "ngram", "--decoding-options", "{k: 2}"), "--decoding-options is not valid JSON"),
    (("--decoding-options", '{"k": 2}'), "without a decoding plugin"),
    (("--decoding", "medusa"), "unknown kvforge.decoding plugin 'medusa'"),
])
def test_bad_decoding_plugin_or_option_is_one_line_error(args, fragment, capsys, monkeypatch):
    code, _, err = run_main(capsys, monkeypatch, "generate", "hi", *args)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], err


@pytest.mark.parametrize("command", [("serve",), ("generate", "hi"), ("chat",)])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_tp_below_one_is_refused_naming_the_flag(command, value, capsys):
    """Refused as the arguments are parsed, before anything loads."""
    from kvforge.app.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--tp", value])
    assert exc.value.code == 2
    assert "argument --tp" in capsys.readouterr().err


def test_tp_in_the_settings_file_below_one_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from kvforge.app.cli import main

    for name in ("KVFORGE_TP", "KVFORGE_CONFIG", "KVFORGE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "kvforge.toml"
    config.write_text("[serve]\ntp = 0\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--tp" in err and "must be an integer >= 1, got 0" in err and "Traceback" not in err


def test_tp_is_in_the_help_of_serve_generate_and_chat(monkeypatch, capsys):
    from kvforge.app.cli import build_parser

    monkeypatch.setenv("COLUMNS", "300")  # one line per option: no wrapping inside the help text
    for command in ("serve", "generate", "chat"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        out = capsys.readouterr().out
        assert "--tp N" in out and "tensor-parallel ranks: N processes" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_flags_without_a_gpu_are_one_clear_error(capsys, monkeypatch):
    """--device cuda / --kernels triton on a CPU-only machine: one error line naming what is missing, exit 2."""
    for flags, fragment in ((("--device", "cuda"), "device 'cuda' is not available"),
                            (("--kernels", "triton"), "kernels='triton' needs triton and a CUDA device")):
        code, _, err = run_main(capsys, monkeypatch, "generate", "hi", "--max-tokens", "2", *flags)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and fragment in lines[0], err


def test_gpu_settings_reach_the_engine(tmp_path, monkeypatch):
    """Flags, then KVFORGE_<NAME>, then the settings file: the GPU keys resolve like every other setting."""
    from kvforge.app.cli import build_parser
    from kvforge.app.settings import resolve

    for name in ("KVFORGE_CONFIG", "KVFORGE_DEVICE", "KVFORGE_KERNELS", "KVFORGE_ENFORCE_EAGER",
                 "KVFORGE_GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "kvforge.toml"
    config.write_text('[serve]\ndevice = "cuda:1"\ngpu_memory_utilization = 0.5\nenforce_eager = true\n')
    settings = resolve(build_parser().parse_args(["serve", "--config", str(config), "--kernels", "torch"]),
                       environ={"KVFORGE_GPU_MEMORY_UTILIZATION": "0.7"})
    assert (settings.device, settings.gpu_memory_utilization, settings.kernels, settings.enforce_eager,
            settings.kv_cache_gb) == ("cuda:1", 0.7, "torch", True, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--kernels", "cuda"])


@pytest.mark.parametrize("command", [("generate", "hi"), ("chat",)])
def test_kv_cache_dtype_reaches_the_engine_of_generate_and_chat(command, capsys, monkeypatch):
    """--kv-cache-dtype is an engine flag of generate and chat as of serve: the engine is built with it (a stand-in
    engine stops there, before any model loads); a type it does not know is refused with the choices."""
    import kvforge.core.engine

    def recording_engine(config, **_):
        raise ValueError(f"engine built with kv_cache_dtype={config.kv_cache_dtype}")  # main: one line, exit 2

    monkeypatch.setattr(kvforge.core.engine, "LLMEngine", recording_engine)
    code, _, err = run_main(capsys, monkeypatch, *command, "--kv-cache-dtype", "q4")
    assert code == 2 and "engine built with kv_cache_dtype=q4" in err, err
    code, _, err = run_main(capsys, monkeypatch, *command)
    assert code == 2 and "engine built with kv_cache_dtype=auto" in err, err
    with pytest.raises(SystemExit):
        run_main(capsys, monkeypatch, *command, "--kv-cache-dtype", "int4")
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_context_overflow_resolves_like_every_setting_and_takes_its_choices_only(tmp_path, monkeypatch):
    """--context-overflow (a chat longer than its context: truncate or error): flag > KVFORGE_CONTEXT_OVERFLOW >
    the settings file > truncate; a value off its choices is refused wherever it comes from."""
    from kvforge.app.cli import build_parser
    from kvforge.app.settings import resolve

    for name in ("KVFORGE_CONFIG", "KVFORGE_CONTEXT_OVERFLOW"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "kvforge.toml"
    config.write_text('context_overflow = "error"\n')
    parse = build_parser().parse_args
    assert resolve(parse(["serve"]), environ={}).context_overflow == "truncate"
    assert resolve(parse(["serve", "--config", str(config)]), environ={}).context_overflow == "error"
    assert resolve(parse(["serve", "--config", str(config), "--context-overflow", "truncate"]),
                   environ={}).context_overflow == "truncate"
    with pytest.raises(ValueError, match="context_overflow: must be one of truncate, error"):
        resolve(parse(["serve"]), environ={"KVFORGE_CONTEXT_OVERFLOW": "shift"})
    with pytest.raises(SystemExit):
        parse(["serve", "--context-overflow", "shift"])


def test_bench_latency_prints_ratios_against_hf_for_each_tensor_parallel_rank_count(capsys, monkeypatch):
    """One run with --tp 1,2: the HF fp32 row, then a kvforge row per rank count, each with its decode ratio
    against HF measured in this run (the plain run, without --tp, is its first kvforge row)."""
    result = run_cli("bench", "latency", "--prompt-tokens", "16", "--decode-tokens", "4", "--repeats", "1",
                     "--dtypes", "float32", "--tp", "1,2")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("HF", "kvforge"))]
    assert rows[0][0] == "HF"
    assert [row[:3] for row in rows[1:]] == [["kvforge", "float32", rows[1][2]], ["kvforge", "tp", "2"]]
    assert all(row[-1].endswith("x") for row in rows[1:])  # ratios against HF fp32, measured in this run
    code, _, err = run_main(capsys, monkeypatch, "bench", "latency", "--tp", "1,two")
    assert code == 2 and "--tp must be rank counts" in err


def test_serve_refuses_a_public_address_without_an_api_key():
    result = run_cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "refusing to bind 0.0.0.0 without an API key" in result.stderr and "KVFORGE_API_KEY" in result.stderr
