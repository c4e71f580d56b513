"""``--speculative-config`` mistakes: exit 2 naming the flag, before anything is spawned.

Bad JSON, an unknown method or field, a missing ``num_speculative_tokens``, lookup bounds out
of order, a draft model with another vocabulary or tokenizer, with sliding-window and full
layers mixed, for a vision-language target or a target at pp > 1 are refused (and with
``--async-scheduling``, as is that flag at pp > 1); a well formed
n-gram config, and a draft model sharing the target's tokenizer, reach spawning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.families import gemma2
from tests.model_shards.config.test_vlm import TEXT, VISION
from tests.server.cli.spawn_guard import Spawned, error_line, run_cli
from tests.server.cli.test_cli_validation import SERVE, _model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = _model(root / "target")
    other_vocab = _model(root / "other-vocab", vocab_size=300)
    other_tokenizer = _model(root / "other-tokenizer")
    (other_tokenizer / "tokenizer.json").write_text(
        json.dumps({**json.loads((target / "tokenizer.json").read_text()), "truncation": None})
        + " "
    )
    same = _model(root / "same")
    return {"target": target, "vocab": other_vocab, "tok": other_tokenizer, "same": same}


CASES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method 'medusa'"),
    ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "'num_speculative_tokens' must be"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "unknown field"),
    (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
        '"prompt_lookup_max": 2}',
        "prompt_lookup_min 5 exceeds",
    ),
    ('{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}', "disable"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs 'model'"),
    ('{"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}', "must be 1"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("config", "words"), CASES)
def test_bad_config_exits_2(
    dirs: dict[str, Path],
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    config: str,
    words: str,
) -> None:
    argv = [*SERVE, "--model", str(dirs["target"]), "--speculative-config", config]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    line = error_line(err)
    assert "--speculative-config" in line and words in line, err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("draft", "words"),
    [
        ("vocab", "vocabulary of 300 tokens"),
        ("tok", "another tokenizer"),
        ("missing", "no such file"),
    ],
)
def test_bad_draft_model_refused(
    dirs: dict[str, Path],
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    draft: str,
    words: str,
) -> None:
    path = str(dirs.get(draft, "/nonexistent/draft"))
    config = json.dumps({"model": path, "num_speculative_tokens": 2})
    assert run_cli([*SERVE, "--model", str(dirs["target"]), "--speculative-config", config]) == 2
    line = error_line(capsys.readouterr().err)
    assert "--speculative-config" in line and words in line, line


@pytest.mark.timeout(60)
def test_good_ngram_config_reaches_spawning(dirs: dict[str, Path], no_spawning: None) -> None:
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(dirs["target"]), "--speculative-config", NGRAM])


@pytest.mark.timeout(60)
def test_windowed_draft_and_vision_target_refused(
    dirs: dict[str, Path],
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    gemma = {**gemma2.config(vocab_size=400).to_dict(), "architectures": ["Gemma2ForCausalLM"]}
    windowed = _model(tmp_path / "gemma2", base=gemma)
    llava = {
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": {**TEXT, "vocab_size": 400},
        "vision_config": VISION,
        "image_token_index": 399,
    }
    vision_target = _model(tmp_path / "llava", base=llava)
    for target, draft, words in (
        (dirs["target"], windowed, "one KV group"),
        (vision_target, dirs["same"], "text-only targets"),
    ):
        config = json.dumps({"model": str(draft), "num_speculative_tokens": 2})
        assert run_cli([*SERVE, "--model", str(target), "--speculative-config", config]) == 2
        line = error_line(capsys.readouterr().err)
        assert "--speculative-config" in line and words in line, line


@pytest.mark.timeout(60)
def test_draft_model_with_pipeline_stages_refused(
    dirs: dict[str, Path], no_spawning: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = json.dumps({"model": str(dirs["same"]), "num_speculative_tokens": 2})
    argv = [*SERVE, "--model", str(dirs["target"]), "-pp", "2", "--speculative-config", config]
    assert run_cli(argv) == 2
    line = error_line(capsys.readouterr().err)
    assert "--speculative-config" in line and "--pipeline-parallel-size 1" in line, line


@pytest.mark.timeout(60)
def test_good_draft_config_reaches_spawning(dirs: dict[str, Path], no_spawning: None) -> None:
    config = json.dumps({"model": str(dirs["same"]), "num_speculative_tokens": 2})
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(dirs["target"]), "--speculative-config", config])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--speculative-config", NGRAM], "cannot be combined with --speculative-config"),
        (["-pp", "2"], "needs -pp 1"),
    ],
)
def test_async_scheduling_refused_where_it_cannot_run(
    dirs: dict[str, Path],
    no_spawning: None,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    words: str,
) -> None:
    argv = [*SERVE, "--model", str(dirs["target"]), "--async-scheduling", *extra]
    assert run_cli(argv) == 2
    line = error_line(capsys.readouterr().err)
    assert "--async-scheduling" in line and words in line, line


@pytest.mark.timeout(60)
def test_async_scheduling_reaches_spawning(dirs: dict[str, Path], no_spawning: None) -> None:
    with pytest.raises(Spawned):
        run_cli([*SERVE, "--model", str(dirs["target"]), "--async-scheduling"])
