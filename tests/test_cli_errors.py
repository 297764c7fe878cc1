"""Expected failures of `openk3 CMD` are one `openk3 CMD: error: ...` line and exit code 2, never a
traceback (OSError, deeply nested JSON, a folder where config.json goes, a device this machine lacks);
`OPENK3_DEBUG=1` shows the traceback; a bug keeps its traceback. Also `--dtype` spellings and `--version`.

In process (`openk3.__main__.main` with capsys), plus a few real subprocesses.
"""

from __future__ import annotations

import errno
import importlib.metadata
import os
import subprocess
import sys

import pytest
import torch

import openk3
from openk3.__main__ import build_parser, main
from openk3.tokenizer import Tokenizer

DEEP = "[" * 100_000 + "]" * 100_000  # past Python's recursion limit in json's decoder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("errors") / "ckpt"
    openk3.save(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), path, dtype=torch.float32)
    Tokenizer({bytes([b]): b for b in range(256)}).save(str(path))  # 256 bytes + 256 specials = 512
    return path


def one_error_line(capsys, argv: list[str], command: str) -> str:
    """Run `openk3 *argv`; assert exit code 2, nothing on stdout, one `openk3 COMMAND: error:` line on
    stderr; return that line."""
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
    assert lines[0].startswith(f"openk3 {command}: error: "), err
    return lines[0]


# ---- JSON and config files -----------------------------------------------------------------------

def test_config_json_that_is_a_folder_is_named(tmp_path, capsys):
    folder = tmp_path / "config.json"
    folder.mkdir()
    line = one_error_line(capsys, ["info", "--config", str(folder)], "info")
    assert line.endswith(f"{folder}: cannot read (Is a directory)")


def test_deeply_nested_json_in_a_file_is_a_value_error(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    line = one_error_line(capsys, ["info", "--config", str(deep)], "info")
    assert line.endswith(f"{deep}: JSON nested too deeply to parse")


def test_deeply_nested_tools_file(tmp_path, capsys, ckpt):
    deep = tmp_path / "tools.json"
    deep.write_text(DEEP)
    line = one_error_line(capsys, ["chat", "--model", str(ckpt), "--tools", str(deep)], "chat")
    assert line.endswith(f"{deep}: JSON nested too deeply to parse")


def test_deeply_nested_request_and_tokenizer_config_and_override(tmp_path, capsys, monkeypatch):
    import io

    from openk3.chat.xtml import render
    from openk3.plan.models import parse_overrides
    from openk3.tokenizer.special import parse_tokenizer_config

    monkeypatch.setattr("sys.stdin", io.StringIO(DEEP))
    line = one_error_line(capsys, ["template"], "template")
    assert line.endswith("the request on stdin: JSON nested too deeply to parse")
    with pytest.raises(ValueError, match="tokenizer_config.json: JSON nested too deeply"):
        parse_tokenizer_config(DEEP, 256)
    with pytest.raises(ValueError, match="override 'num_experts': value nested too deeply"):
        parse_overrides([f"num_experts={DEEP}"])
    # a model-written (or client-sent) arguments string that is too deep stays the raw string, as malformed
    # JSON arguments do: rendering never raises a RecursionError
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    segs = render({"messages": [{"role": "user", "content": "x"},
                                {"role": "assistant", "content": "", "tool_calls": [call]}]})
    assert any(DEEP in s.text for s in segs)


def test_read_json_names_the_file_for_every_bad_content(tmp_path):
    from openk3.fsutil import parse_json, read_json

    bad = tmp_path / "bad.json"
    for content, needle in ((b"{", "not valid JSON"), (b'{"a": "\xff"}', "not UTF-8 text"),
                            (DEEP.encode(), "nested too deeply")):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=needle) as e:
            read_json(bad)
        assert str(e.value).startswith(f"{bad}: ")
    with pytest.raises(FileNotFoundError):  # kept: callers tell "missing" from "broken"
        read_json(tmp_path / "missing.json")
    assert parse_json('{"a": [1]}', "x") == {"a": [1]}
    with pytest.raises(ValueError, match="^the request on stdin: JSON nested too deeply"):
        parse_json(DEEP, "the request on stdin")


# ---- OSError ------------------------------------------------------------------------------------

def test_a_file_where_a_folder_goes(tmp_path, capsys, ckpt):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    line = one_error_line(capsys, ["convert", str(ckpt), str(blocker / "out")], "convert")
    assert line.endswith(f"({blocker} is a file, not a folder)")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_disk_full_read_only_or_denied_is_one_line(tmp_path, capsys, ckpt, monkeypatch, code):
    """What the OS says when the write fails (simulated: the tests run as root, where nothing is denied)."""
    import openk3.checkpoint

    dst = tmp_path / "out"

    def failing_save(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(dst / "model.safetensors"))

    monkeypatch.setattr(openk3.checkpoint, "save", failing_save)
    line = one_error_line(capsys, ["convert", str(ckpt), str(dst)], "convert")
    assert line == f"openk3 convert: error: {dst / 'model.safetensors'}: {os.strerror(code)}"


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_during_convert_names_the_folder_and_what_is_kept(tmp_path, capsys, ckpt, monkeypatch, existing):
    """A write to a full disk raises OSError(ENOSPC) naming no file: the error names DST and what is left."""
    from openk3.checkpoint import files

    dst = tmp_path / "out"
    if existing:
        assert main(["convert", str(ckpt), str(dst)]) == 0
        capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())

    def full(fh, t):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files, "write_tensor", full)
    line = one_error_line(capsys, ["convert", str(ckpt), str(dst)], "convert")
    kept = "the folder is as it was" if existing else "nothing was created there"
    assert line == (f"openk3 convert: error: {dst}: {os.strerror(errno.ENOSPC)} (writing a checkpoint; its partial "
                    f"copy was removed and {kept})")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---- sampling and length flags ------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("--temperature", "inf"), ("--temperature", "nan"),
                                         ("--temperature", "-1"), ("--repetition-penalty", "inf"),
                                         ("--top-p", "nan"), ("--min-p", "inf")])
def test_non_finite_or_negative_sampling_values_are_refused_before_loading(capsys, ckpt, flag, value, monkeypatch):
    import openk3.commands.generate as generate

    monkeypatch.setattr(generate, "build_llm", lambda args: pytest.fail("the model was loaded"))
    line = one_error_line(capsys, ["generate", "--model", str(ckpt), "--prompt", "x", flag, value], "generate")
    field = flag.removeprefix("--").replace("-", "_")
    assert f"SamplingParams.{field} must be" in line and line.endswith(f"got {float(value)!r}")


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "rl", "distill"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_max_model_len_below_one_is_a_usage_error(capsys, command, value):
    """0 once meant "the model's default" silently; it is refused naming the flag and the value."""
    argv = {"generate": ["generate", "-m", "M", "-p", "x"], "chat": ["chat", "-m", "M"],
            "eval": ["eval", "--models", "a=M", "--out", "O"],
            "rl": ["rl", "--model", "M", "--domain", "general", "--effort", "low", "--out", "O"],
            "distill": ["distill", "--student", "M", "--teachers", "T", "--out", "O"]}[command]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--max-model-len", value])
    assert e.value.code == 2
    assert f"argument --max-model-len: must be >= 1, got {value}" in capsys.readouterr().err


# ---- chat requests: the field, never a traceback -------------------------------------------------

def _deep_object(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("request_text, field", [
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": 1}]}',
     "messages[1].tool_calls must be a list of tool calls, got int"),
    ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}]}',
     "messages[0].tool_calls[0].function.name must be a string, got 1"),
    ('{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", '
     f'"parameters": {_deep_object(600)}}}}}]}}', "tools[0].function.parameters.a.a.a.a...: nested more than 128"),
    ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
     f'{{"name": "s", "schema": {_deep_object(600)}}}}}}}', "response_format.json_schema.schema.a.a.a.a.a...: nested"),
])
def test_template_on_a_malformed_request_names_the_file_and_field(tmp_path, capsys, request_text, field):
    path = tmp_path / "request.json"
    path.write_text(request_text)
    line = one_error_line(capsys, ["template", "--input", str(path)], "template")
    assert line.startswith(f"openk3 template: error: {path}: {field}")


def test_template_input_that_is_not_utf8_is_named(tmp_path, capsys, monkeypatch):
    import io

    path = tmp_path / "request.json"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "\xff"}]}')
    line = one_error_line(capsys, ["template", "--input", str(path)], "template")
    assert line == f"openk3 template: error: {path}: not UTF-8 text (byte 0xff at offset 43: invalid start byte)"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes())))
    line = one_error_line(capsys, ["template"], "template")
    assert line.startswith("openk3 template: error: the request on stdin: not UTF-8 text (byte 0xff")


# ---- devices ------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cuda_without_cuda(capsys, ckpt, monkeypatch, command):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    argv = [command, "--model", str(ckpt), "--device", "cuda", "--threads", "1"]
    line = one_error_line(capsys, argv + (["--prompt", "x"] if command == "generate" else []), command)
    assert "device 'cuda': CUDA is not available here" in line


# ---- debug and bugs -----------------------------------------------------------------------------

def test_openk3_debug_shows_the_traceback(tmp_path, monkeypatch):
    folder = tmp_path / "config.json"
    folder.mkdir()
    monkeypatch.setenv("OPENK3_DEBUG", "1")
    with pytest.raises(ValueError, match="Is a directory"):
        main(["info", "--config", str(folder)])


def test_a_bug_keeps_its_traceback(monkeypatch):
    import openk3.commands.info

    def buggy(args):
        raise TypeError("a bug")

    monkeypatch.setattr(openk3.commands.info, "main", buggy)
    with pytest.raises(TypeError, match="a bug"):
        main(["info"])


def _cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openk3", *argv], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.slow(seconds=3)  # two interpreters that import torch: ~20 s on a busy 2-core machine
def test_subprocess_one_line_then_traceback_with_debug(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    r = _cli("info", "--config", str(deep))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"openk3 info: error: {deep}: JSON nested too deeply to parse\n"
    r = _cli("info", "--config", str(deep), env={"OPENK3_DEBUG": "1"})
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.rstrip().endswith(f"ValueError: {deep}: JSON nested too deeply to parse")


# ---- --dtype and --version ----------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "chat", "convert"])
def test_dtype_spellings_everywhere(command):
    """`--dtype` takes every `resolve_dtype` spelling; "auto" is None (the command decides)."""
    base = {"generate": ["generate", "-m", "M"], "chat": ["chat", "-m", "M"], "convert": ["convert", "S", "D"]}
    parser = build_parser()
    for spelling, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", torch.float32),
                            ("float32", torch.float32), ("auto", None)):
        assert parser.parse_args([*base[command], "--dtype", spelling]).dtype == dtype


def test_unknown_dtype_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", "M", "--dtype", "fp8"])
    assert e.value.code == 2
    assert "argument --dtype: unknown dtype 'fp8'" in capsys.readouterr().err


def test_convert_dtype_float32_and_auto(tmp_path, capsys, ckpt):
    """convert --dtype float32 writes float32; --dtype auto keeps what SRC stores."""
    from openk3.infer.llm import stored_dtype

    assert main(["convert", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert stored_dtype(tmp_path / "bf16") == torch.bfloat16
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "auto"), "--dtype", "auto"]) == 0
    assert stored_dtype(tmp_path / "auto") == torch.bfloat16
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert stored_dtype(tmp_path / "fp32") == torch.float32
    assert capsys.readouterr().out.splitlines()[-1].endswith(", float32")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"openk3 {importlib.metadata.version('openk3')}\n"
    assert _cli("--version").stdout == f"openk3 {openk3.__version__}\n"  # the same as the source tree's


def test_a_loss_gone_non_finite_is_one_line(capsys, monkeypatch):
    """The run loop stops a run whose loss is NaN or inf (`FloatingPointError`, tests/test_loop.py); the command
    says so in one line, its last checkpoint intact."""
    import openk3.commands.rl as rl_command

    def diverged(args):
        raise FloatingPointError("loss is nan at step 3")

    monkeypatch.setattr(rl_command, "main", diverged)
    line = one_error_line(capsys, ["rl", "--model", "m", "--domain", "general", "--effort", "low", "--out", "o"], "rl")
    assert line == "openk3 rl: error: loss is nan at step 3"
