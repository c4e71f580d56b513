"""llama.cpp's build and server command lines, and the GGUF conversions' (nothing is built,
downloaded or converted here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.harness import gguf_models, llamacpp


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_llama_server_gets_our_cpu_budget_and_no_prompt_ram_cache() -> None:
    argv = llamacpp.server_command(Path("/b/llama-server"), Path("/m/x.gguf"), 8123, 32)
    assert argv[0] == "/b/llama-server" and _flag(argv, "--model") == "/m/x.gguf"
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("127.0.0.1", "8123")
    assert _flag(argv, "--threads") == _flag(argv, "--threads-batch") == "2"
    assert _flag(argv, "--parallel") == "32"
    # every slot holds a 32-token prompt and its 64 outputs
    assert int(_flag(argv, "--ctx-size")) >= 32 * (32 + 64)
    assert "--cont-batching" in argv and _flag(argv, "--cache-ram") == "0"
    assert _flag(argv, "--poll") == "0"  # idle workers sleep: they share 2 cores with the client


def test_the_build_is_native_offline_and_only_the_two_binaries() -> None:
    configure = llamacpp.configure_command()
    assert _flag(configure, "-S") == str(llamacpp.SOURCES)
    for flag in ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"):
        assert flag in configure
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure  # no download from Hugging Face
    # ggml's AMX matmul segfaults on these VMs: native less AMX, in C and C++
    for lang in ("C", "CXX"):
        assert f"-DCMAKE_{lang}_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in configure
    build = llamacpp.build_command()
    assert _flag(build, "-j") == "2"
    assert build[build.index("--target") + 1 :] == ["llama-server", "llama-quantize"]
    assert llamacpp.binary("llama-server").parent == llamacpp.BUILD / "bin"
    download = llamacpp.download_command(Path("/c"))
    assert download[-1] == "llama-cpp-python==0.3.36"
    assert _flag(download, "--no-binary") == ":all:" and "--no-deps" in download


def test_conversions_use_the_vendored_converter_and_quantizer() -> None:
    convert = gguf_models.convert_command(Path("/hf"), Path("/o/f16.gguf"))
    assert convert[1] == str(llamacpp.SOURCES / "convert_hf_to_gguf.py")
    assert convert[2] == "/hf" and _flag(convert, "--outtype") == "f16"
    assert _flag(convert, "--outfile") == "/o/f16.gguf"
    quantize = gguf_models.quantize_command(Path("/q"), Path("/f16"), Path("/out"), "Q4_K_M")
    assert quantize == ["/q", "/f16", "/out", "Q4_K_M", "2"]
    with pytest.raises(ValueError, match="Q8_0"):
        gguf_models.ensure_gguf("Q5_0", [])
