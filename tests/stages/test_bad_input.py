"""The bad-input catalogue: every mistake a user can make gets one clear line and changes nothing.

Data loss first: wherever `--out` points, the user's files stay byte-identical. Then what is read back
is verified (manifests, payload sha256s, allocations and scores against the model and budget), then each
unclear error of the issue. CLI cases run `evoesap.cli.main` in-process and check the one line on stderr.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from tiny_artifacts import CACHE, CALIBRATE, PRUNE

from evoesap.cli import main
from evoesap.errors import ArtifactError, ConfigError, DataError, ModelError
from evoesap.machine import runtime
from evoesap.stages.cache_logits import run_cache_logits
from evoesap.stages.prune import run_prune
from evoesap.store import artifacts, identity


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or `path` itself) with its bytes: equal snapshots mean nothing was touched."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def cli(capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in-process; (exit code, the last line on stderr)."""
    code = main(["--quiet", *args])
    lines = capsys.readouterr().err.strip().splitlines()
    return code, lines[-1] if lines else ""


def one_clear_line(code: int, line: str, *words: str) -> None:
    assert code == 1 and line.startswith("error: "), line
    for word in words:
        assert word in line, (word, line)


def stage_commands(world: dict[str, str], out: str) -> dict[str, list[str]]:
    """A valid command line of every publishing stage, writing to `out`."""
    return {
        "calibrate": ["calibrate", "--model", world["model"], "--data", world["calibration"], "--samples", "8", "--out", out],
        "cache-logits": ["cache-logits", "--model", world["model"], "--data", world["search"], "--samples", "4", "--out", out],
        "search": [
            "search",
            "--model",
            world["model"],
            "--scores",
            world["scores"],
            "--cache",
            world["cache"],
            "--sparsity",
            "0.5",
            "--population",
            "4",
            "--elites",
            "1",
            "--generations",
            "1",
            "--out",
            out,
        ],
        "prune": ["prune", "--model", world["model"], "--scores", world["scores"], "--sparsity", "0.5", "--out", out],
        "evaluate": ["evaluate", "--model", world["pruned"], "--tasks", world["tasks"], "--limit", "1", "--out", out],
        "report": ["report", "--runs", world["evaluated"], "--out", out],
    }


@pytest.fixture
def no_model_loading(monkeypatch):
    """Refusals must come before any work: loading a model fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(runtime, "load_model", refuse)
    from evoesap import moe

    monkeypatch.setattr(moe, "load_pruned", refuse)


@pytest.fixture
def user_files(tmp_path):
    """A directory of the user's files (not an artifact), with a nested one and a regular file beside it."""
    home = tmp_path / "user"
    (home / "notes").mkdir(parents=True)
    (home / "thesis.tex").write_text("\\section{Results}\n")
    (home / "notes" / "todo.txt").write_bytes(b"\x00\x01binary\xff")
    (tmp_path / "data.bin").write_bytes(b"precious bytes")
    return home


STAGES = ["calibrate", "cache-logits", "search", "prune", "evaluate", "report"]


# ------------------------------------------------------------------------ data loss


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("out", [".", "", "./"])
def test_out_dot_or_empty_is_refused_and_the_working_directory_is_untouched(
    stage, out, tiny_artifacts, user_files, capsys, monkeypatch, no_model_loading
):
    monkeypatch.chdir(user_files)
    before = snapshot(user_files)
    code, line = cli(capsys, *stage_commands(tiny_artifacts, out)[stage])
    one_clear_line(code, line, "--out")
    assert snapshot(user_files) == before


@pytest.mark.parametrize("stage", STAGES)
def test_out_an_existing_non_artifact_directory_is_refused_and_kept_byte_identical(
    stage, tiny_artifacts, user_files, capsys, no_model_loading
):
    before = snapshot(user_files)
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(user_files))[stage])
    one_clear_line(code, line, str(user_files), "not an evoesap artifact", "thesis.tex")
    assert snapshot(user_files) == before
    assert sorted(p.name for p in user_files.parent.iterdir()) == ["data.bin", "user"]  # nothing left beside it


@pytest.mark.parametrize("stage", STAGES)
def test_out_an_existing_file_is_refused_and_not_displaced(stage, tiny_artifacts, user_files, capsys, no_model_loading):
    target = user_files.parent / "data.bin"
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(target))[stage])
    one_clear_line(code, line, "existing file")
    assert target.read_bytes() == b"precious bytes"
    assert sorted(p.name for p in user_files.parent.iterdir()) == ["data.bin", "user"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["through a file", "filesystem root"])
def test_out_through_a_file_or_at_the_root_is_refused_before_any_work(
    stage, kind, tiny_artifacts, user_files, capsys, no_model_loading
):
    out = str(user_files.parent / "data.bin" / "sub") if kind == "through a file" else "/"
    root_before = sorted(p.name for p in Path("/").iterdir())
    code, line = cli(capsys, *stage_commands(tiny_artifacts, out)[stage])
    one_clear_line(code, line, "--out")
    assert sorted(p.name for p in Path("/").iterdir()) == root_before  # no /..partial-* left in the root
    assert (user_files.parent / "data.bin").read_bytes() == b"precious bytes"


@pytest.mark.parametrize("which", ["model", "scores"])
def test_prune_output_equal_to_an_input_is_refused_and_the_input_kept(which, tiny_artifacts, tmp_path, capsys, no_model_loading):
    model, scores = tmp_path / "model", tmp_path / "scores"
    shutil.copytree(tiny_artifacts["model"], model)
    shutil.copytree(tiny_artifacts["scores"], scores)
    target = {"model": model, "scores": scores}[which]
    before = snapshot(target)
    code, line = cli(capsys, "prune", "--model", str(model), "--scores", str(scores), "--sparsity", "0.5", "--out", str(target))
    one_clear_line(code, line, f"input {which}")
    assert snapshot(target) == before


def test_output_inside_or_around_an_input_is_refused(tiny_artifacts, tmp_path):
    model = tmp_path / "ckpt"
    shutil.copytree(tiny_artifacts["model"], model)
    for out, relation in ((model / "pruned", "lies inside"), (tmp_path, "holds")):
        with pytest.raises(ConfigError, match=relation):
            run_prune(str(model), tiny_artifacts["scores"], PRUNE, str(out))


def test_an_earlier_output_of_another_stage_is_refused(tiny_artifacts, tmp_path, capsys, no_model_loading):
    other = tmp_path / "cache-copy"
    shutil.copytree(tiny_artifacts["cache"], other)
    before = snapshot(other)
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(other))["calibrate"])
    one_clear_line(code, line, "'cache-logits' artifact", "not a calibrate output")
    assert snapshot(other) == before


# ------------------------------------------------------------------------ verify what is read back


def tampered(src: str, dest: Path, name: str, change) -> str:
    """A copy of the artifact at `src` with `name` rewritten by `change(bytes) -> bytes` and the manifest's
    sha256 updated, so only the content checks (not the hash check) can catch it."""
    shutil.copytree(src, dest)
    path = dest / name
    path.write_bytes(change(path.read_bytes()))
    manifest = json.loads((dest / artifacts.MANIFEST).read_text())
    manifest["files"][name] = artifacts.sha256_file(path)
    (dest / artifacts.MANIFEST).write_text(artifacts.seal(manifest))  # a consistent manifest: a forger's
    return str(dest)


def edit_json(edit):
    def change(raw: bytes) -> bytes:
        doc = json.loads(raw)
        edit(doc)
        return json.dumps(doc).encode()

    return change


def edit_parquet(edit):
    def change(raw: bytes) -> bytes:
        import io

        frame = edit(pd.read_parquet(io.BytesIO(raw)))
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        return buffer.getvalue()

    return change


def _move_one(doc):  # budget no longer met: one expert fewer in layer 0
    doc["removal_counts"][0] -= 1
    doc["pruned"]["0"] = doc["pruned"]["0"][:-1]


def _list_disagrees(doc):  # counts meet the budget, but layer 0's list is one short
    doc["pruned"]["0"] = doc["pruned"]["0"][:-1]


def _missing_layer(doc):
    del doc["pruned"]["1"]


@pytest.mark.parametrize(
    "edit, message",
    [(_move_one, "not the budget"), (_list_disagrees, "removal count"), (_missing_layer, "pruned lists for MoE layers")],
    ids=["budget-not-met", "counts-disagree-with-lists", "missing-layer"],
)
def test_prune_and_esap_refuse_an_allocation_that_does_not_fit_the_model_and_budget(
    edit, message, tiny_artifacts, tmp_path, capsys, no_model_loading
):
    bad = tampered(tiny_artifacts["search_out"], tmp_path / "search", "allocation.json", edit_json(edit))
    out = tmp_path / "pruned"
    with pytest.raises(ArtifactError, match=message):
        run_prune(tiny_artifacts["model"], tiny_artifacts["scores"], PRUNE, str(out), allocation=bad)
    assert not out.exists()
    code, line = cli(capsys, "esap", "--model", tiny_artifacts["model"], "--cache", tiny_artifacts["cache"], "--allocation", bad)
    one_clear_line(code, line, message, "rebuild it with `evoesap search`")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f[~((f["layer"] == 0) & (f["expert"] == 3))], "no row for expert(s) [3]"),
        (
            lambda f: f.assign(reap=np.where((f["layer"] == 1) & (f["expert"] == 2), np.nan, f["reap"])),
            "reap of layer 1 expert 2 is nan",
        ),
    ],
    ids=["missing-expert-row", "nan-score"],
)
def test_scores_with_a_missing_expert_or_a_non_finite_score_are_refused(
    edit, message, tiny_artifacts, tmp_path, capsys, no_model_loading
):
    bad = tampered(tiny_artifacts["scores"], tmp_path / "scores", "scores.parquet", edit_parquet(edit))
    code, line = cli(
        capsys, "prune", "--model", tiny_artifacts["model"], "--scores", bad, "--sparsity", "0.5", "--out", str(tmp_path / "out")
    )
    one_clear_line(code, line, message, "rebuild it with `evoesap calibrate`")
    assert not (tmp_path / "out").exists()


def test_an_artifact_of_another_stage_is_refused_as_a_cache(tiny_artifacts, tmp_path, capsys, no_model_loading):
    relabelled = tmp_path / "cache"
    shutil.copytree(tiny_artifacts["cache"], relabelled)
    manifest = json.loads((relabelled / artifacts.MANIFEST).read_text())
    (relabelled / artifacts.MANIFEST).write_text(artifacts.seal({**manifest, "stage": "calibrate"}))
    for cache in (tiny_artifacts["scores"], str(relabelled)):
        code, line = cli(
            capsys,
            "search",
            "--model",
            tiny_artifacts["model"],
            "--scores",
            tiny_artifacts["scores"],
            "--cache",
            cache,
            "--sparsity",
            "0.5",
            "--out",
            str(tmp_path / "s"),
        )
        one_clear_line(code, line, "'calibrate' artifact, not 'cache-logits'")


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[]",
        '{"stage": 3}',
        '{"stage": "calibrate", "params": {}, "inputs": {}, "files": {"scores.parquet": "abc"}, "cache_key": "k"}',
    ],
)
def test_a_malformed_manifest_gives_one_line_naming_the_artifact_and_the_rebuild(
    text, tiny_artifacts, tmp_path, capsys, no_model_loading
):
    scores = tmp_path / "scores"
    shutil.copytree(tiny_artifacts["scores"], scores)
    (scores / artifacts.MANIFEST).write_text(text)
    code, line = cli(
        capsys,
        "prune",
        "--model",
        tiny_artifacts["model"],
        "--scores",
        str(scores),
        "--sparsity",
        "0.5",
        "--out",
        str(tmp_path / "out"),
    )
    one_clear_line(code, line, str(scores), "malformed", "rebuild it with `evoesap calibrate`")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_truncated_or_bit_flipped_cache_shard_is_caught_by_its_sha256(damage, tiny_artifacts, tmp_path, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(tiny_artifacts["cache"], cache)
    shard = sorted(cache.rglob("part-*.parquet"))[0]
    raw = bytearray(shard.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    code, line = cli(capsys, "esap", "--model", tiny_artifacts["model"], "--cache", str(cache))
    one_clear_line(code, line, shard.relative_to(cache).as_posix(), "sha256", "rebuild it with `evoesap cache-logits`")


def test_a_damaged_payload_is_never_reused_and_is_made_again(tiny_artifacts, tmp_path):
    from evoesap import steps

    out = tmp_path / "scores"
    shutil.copytree(tiny_artifacts["scores"], out)
    (out / "scores.parquet").write_bytes(b"PAR1 truncated")
    inputs = {"model": tiny_artifacts["model"], "data": tiny_artifacts["calibration"]}
    manifest = steps.run_stage("calibrate", inputs, CALIBRATE, str(out))
    assert artifacts.verify(str(out), "calibrate") == manifest


def test_cache_shard_names_cannot_leave_the_artifact(tiny_artifacts, tmp_path, capsys):
    outside = tmp_path / "other" / "positions"
    outside.mkdir(parents=True)
    shard = sorted(Path(tiny_artifacts["cache"]).rglob("part-*.parquet"))[0]
    shutil.copy(shard, outside / "part-00000.parquet")

    def escape(doc):
        doc["shards"] = ["../other/positions/part-00000.parquet"]

    bad = tampered(tiny_artifacts["cache"], tmp_path / "cache", "cache.json", edit_json(escape))
    code, line = cli(capsys, "esap", "--model", tiny_artifacts["model"], "--cache", bad)
    one_clear_line(code, line, "cache.json is malformed", "not allowed", "rebuild it with `evoesap cache-logits`")


# ------------------------------------------------------------------------ one clear line for bad input


def test_a_missing_model_directory_is_named_and_never_sent_to_the_hub(tiny_artifacts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(identity, "resolve_revision", lambda *a: pytest.fail("a missing path went to the hub"))
    for model in (str(tmp_path / "no-such-model"), "no-such-model", "./runs/model"):
        code, line = cli(
            capsys, "calibrate", "--model", model, "--data", tiny_artifacts["calibration"], "--out", str(tmp_path / "o")
        )
        one_clear_line(code, line, model, "does not exist")


def test_a_data_row_missing_the_field_is_named_with_its_row(tiny_artifacts, tmp_path, capsys):
    rows = [json.loads(line) for line in Path(tiny_artifacts["calibration"]).read_text().splitlines()]
    rows[3] = {"prompt": "where are the messages?"}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, line = cli(
        capsys,
        "calibrate",
        "--model",
        tiny_artifacts["model"],
        "--data",
        str(data),
        "--samples",
        str(len(rows)),
        "--out",
        str(tmp_path / "o"),
    )
    one_clear_line(code, line, f"{data} row 3 has no field 'messages'")


def test_non_utf8_data_names_the_file_and_line(tiny_artifacts, tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    good = Path(tiny_artifacts["calibration"]).read_bytes().splitlines(keepends=True)
    data.write_bytes(b"".join(good[:4]) + '{"messages": [{"role": "user", "content": "caf\u00e9"}]}\n'.encode("latin-1"))
    code, line = cli(capsys, "calibrate", "--model", tiny_artifacts["model"], "--data", str(data), "--out", str(tmp_path / "o"))
    one_clear_line(code, line, str(data), "line 5", "not UTF-8")


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_malformed_json_names_the_file_and_the_right_line(suffix, tiny_artifacts, tmp_path, capsys):
    rows = [json.loads(line) for line in Path(tiny_artifacts["calibration"]).read_text().splitlines()][:1] * 20
    data = tmp_path / f"broken.{suffix}"
    if suffix == "jsonl":
        data.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"messages": [}\n')
    else:
        data.write_text("[\n" + "".join(json.dumps(r) + ",\n" for r in rows[:19]) + "{oops}\n]\n")  # line 1 is "["
    code, line = cli(capsys, "calibrate", "--model", tiny_artifacts["model"], "--data", str(data), "--out", str(tmp_path / "o"))
    one_clear_line(code, line, str(data), "line 21", "not valid JSON")


def test_cache_logits_refuses_a_tokenizer_larger_than_the_embedding(tiny_artifacts, tmp_path):
    from evoesap import moe
    from evoesap.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    small = tmp_path / "small-vocab"
    moe.tiny_model("olmoe", seed=3, vocab_size=len(tok) - 8).save_pretrained(small)
    tok.save_pretrained(small)
    with pytest.raises(DataError, match="tokenizer has .* tokens but the model's embedding has"):
        run_cache_logits(str(small), tiny_artifacts["search"], CACHE, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_cache_logits_refuses_a_dense_model(tiny_artifacts, tmp_path, no_model_loading):
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = tmp_path / "dense"
    config = LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(dense)
    with pytest.raises(ModelError, match="not a supported MoE family"):
        run_cache_logits(str(dense), tiny_artifacts["search"], CACHE, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


# ------------------------------------------------------------------------ credentials, strict configs


def test_credentials_in_a_uri_are_refused_and_never_reach_errors_or_logs(tiny_artifacts, tmp_path, capsys, caplog):
    secret_data = "http://alice:s3cr3t@127.0.0.1:9/calibration.jsonl"
    code = main(["calibrate", "--model", tiny_artifacts["model"], "--data", secret_data, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1 and "s3cr3t" not in err and "'http://127.0.0.1:9/calibration.jsonl' has credentials inside it" in err
    assert "s3cr3t" not in caplog.text
    # redaction stays, as defence in depth, for whatever reaches a record or a log another way
    assert artifacts.redact(f"moved {secret_data} and s3://k:v@b/x") == "moved http://127.0.0.1:9/calibration.jsonl and s3://b/x"


@pytest.mark.parametrize("option", ["--data", "--out"])
def test_credentials_inside_an_object_store_uri_are_refused_without_showing_them(option, tiny_artifacts, tmp_path, capsys):
    args = {"--data": tiny_artifacts["calibration"], "--out": str(tmp_path / "o")}
    args[option] = "s3://AKIAEXAMPLE:s3cr3tvalue@bkt/x.jsonl"
    code, line = cli(capsys, "calibrate", "--model", tiny_artifacts["model"], "--data", args["--data"], "--out", args["--out"])
    one_clear_line(code, line, "has credentials inside it", "s3://bkt/x.jsonl")
    assert "s3cr3tvalue" not in line and "AKIAEXAMPLE" not in line


@pytest.mark.parametrize("value", [2.7, True, "3"])
def test_pipeline_yaml_refuses_non_integers_for_integer_parameters(value, tmp_path):
    from evoesap.pipeline.config import load_config

    config = {"model": "m", "calibration_data": "c.jsonl", "search_data": "s.jsonl", "search": {"generations": value}}
    with pytest.raises(ConfigError, match="generations"):
        load_config(config)
    assert load_config({**config, "search": {"generations": 2.0}}).search == {"generations": 2.0}  # whole floats pass
    with pytest.raises(ConfigError, match="retries"):
        load_config({**config, "search": {}, "retries": value})


# ------------------------------------------------------------------------ friction a new user meets


def test_default_samples_use_a_smaller_file_whole_with_a_warning_an_explicit_larger_ask_is_refused(tiny_artifacts, caplog):
    from evoesap.stages.calibrate import CalibrateParams

    rows = len(Path(tiny_artifacts["calibration"]).read_text().splitlines())
    _, tokenized = runtime.tokenized_samples(
        tiny_artifacts["model"], tiny_artifacts["calibration"], CalibrateParams(max_length=64)
    )
    assert sorted(s.sample_id for s in tokenized) == list(range(rows))
    assert f"has {rows} rows, fewer than the default of 1024 samples" in caplog.text
    for asked in (rows + 1, CalibrateParams.DEFAULT_SAMPLES):  # given, even equal to the default: refused
        with pytest.raises(DataError, match=f"asked for {asked} samples"):
            runtime.tokenized_samples(tiny_artifacts["model"], tiny_artifacts["calibration"], CalibrateParams(samples=asked))


def test_evaluate_refuses_the_search_cache_as_held_out(tiny_artifacts, tmp_path, capsys, no_model_loading):
    for extra in ([], ["--allocation", tiny_artifacts["search_out"]]):
        code, line = cli(
            capsys,
            "evaluate",
            "--model",
            tiny_artifacts["pruned"],
            "--tasks",
            tiny_artifacts["tasks"],
            "--teacher-cache",
            tiny_artifacts["cache"],
            *extra,
            "--out",
            str(tmp_path / "e"),
        )
        one_clear_line(code, line, "the cache the search", "not held out")


def test_lm_eval_asks_git_quietly_outside_a_checkout(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator

    from evoesap.evaluation.lmeval import _quiet_git_hash

    monkeypatch.chdir(tmp_path)
    with _quiet_git_hash():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_quiet_silences_the_bars_of_transformers_and_the_hub(monkeypatch):
    import huggingface_hub.utils
    import transformers

    from evoesap import progress

    monkeypatch.setattr(progress, "_quiet", False)
    try:
        progress.set_quiet(True)
        assert not transformers.utils.logging.is_progress_bar_enabled()
        assert huggingface_hub.utils.are_progress_bars_disabled()
        assert progress.progress(range(3)).disable
    finally:
        transformers.utils.logging.enable_progress_bar()
        transformers.utils.logging.set_verbosity_warning()
        huggingface_hub.utils.enable_progress_bars()


# ------------------------------------------------------------------------ data loss, second round


@pytest.mark.parametrize("stage", STAGES)
def test_out_through_a_symlink_and_dotdot_is_checked_and_published_at_the_same_place(
    stage, tiny_artifacts, tmp_path, capsys, monkeypatch
):
    """`L/../x` is the parent of L's target (as the kernel resolves it): the check and the publish both use it,
    so the user's `x` beside L is never touched."""
    (tmp_path / "elsewhere" / "dir").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "elsewhere" / "dir")
    (tmp_path / "userdir" / "sub").mkdir(parents=True)
    (tmp_path / "userdir" / "notes.txt").write_text("precious\n")
    (tmp_path / "userdir" / "sub" / "data.csv").write_text("1,2\n")
    before = snapshot(tmp_path / "userdir")
    monkeypatch.chdir(tmp_path)
    code, line = cli(capsys, *stage_commands(tiny_artifacts, "L/../userdir")[stage])
    assert code == 0, line
    assert snapshot(tmp_path / "userdir") == before
    assert artifacts.read_manifest(str(tmp_path / "elsewhere" / "userdir"), stage).stage == stage


def test_prune_out_through_a_symlink_and_dotdot_never_replaces_the_input_model(tiny_artifacts, tmp_path, capsys, monkeypatch):
    (tmp_path / "elsewhere" / "dir").mkdir(parents=True)
    (tmp_path / "L").symlink_to(tmp_path / "elsewhere" / "dir")
    model = tmp_path / "m"
    shutil.copytree(tiny_artifacts["model"], model)
    before = snapshot(model)
    monkeypatch.chdir(tmp_path)
    code, line = cli(
        capsys, "prune", "--model", "m", "--scores", tiny_artifacts["scores"], "--sparsity", "0.5", "--out", "L/../m"
    )
    assert code == 0, line
    assert snapshot(model) == before
    assert (tmp_path / "elsewhere" / "m" / artifacts.MANIFEST).is_file()


def test_a_user_file_inside_an_earlier_artifact_of_the_same_stage_is_refused_and_kept(
    tiny_artifacts, tmp_path, capsys, no_model_loading
):
    earlier = tmp_path / "c"
    shutil.copytree(tiny_artifacts["scores"], earlier)
    (earlier / "NOTES.md").write_text("n\n")
    before = snapshot(earlier)
    code, line = cli(
        capsys,
        "calibrate",
        "--model",
        tiny_artifacts["model"],
        "--data",
        tiny_artifacts["calibration"],
        "--samples",
        "8",
        "--seed",
        "3",
        "--out",
        str(earlier),
    )
    one_clear_line(code, line, "NOTES.md", "not part of the calibrate artifact", "move them out")
    assert snapshot(earlier) == before


@pytest.mark.parametrize("intruder", ["user file", "another run"])
def test_out_changed_while_the_stage_worked_is_not_replaced_and_the_new_artifact_is_kept(
    intruder, tiny_artifacts, tmp_path, monkeypatch
):
    """The output is checked again just before the swap: what appeared there meanwhile (a user's file, another
    run's artifact) stays as it is, and this run's artifact is kept aside under a name the error gives."""
    from evoesap import steps

    out = tmp_path / "out"
    real_publish = artifacts._publish

    def meanwhile(staging, out_uri, manifest, expected):
        if intruder == "user file":
            out.mkdir()
            (out / "notes.txt").write_text("mine\n")
        else:
            monkeypatch.setattr(artifacts, "_publish", real_publish)
            steps.run_stage(
                "calibrate",
                {"model": tiny_artifacts["model"], "data": tiny_artifacts["calibration"]},
                steps.make_params("calibrate", {"samples": 8, "max_length": 128, "seed": 5}),
                str(out),
            )
            monkeypatch.setattr(artifacts, "_publish", meanwhile)
        return real_publish(staging, out_uri, manifest, expected)

    monkeypatch.setattr(artifacts, "_publish", meanwhile)
    before = None
    with pytest.raises(ArtifactError, match="changed while this run worked") as caught:
        steps.run_stage(
            "calibrate",
            {"model": tiny_artifacts["model"], "data": tiny_artifacts["calibration"]},
            steps.make_params("calibrate", {"samples": 8, "max_length": 128, "seed": 9}),
            str(out),
        )
    if intruder == "user file":
        assert snapshot(out) == {"notes.txt": b"mine\n"}
    else:
        before = artifacts.verify(str(out), "calibrate")
        assert before.params["seed"] == 5
    kept = Path(str(caught.value).rsplit("kept at ", 1)[1])
    assert artifacts.verify(str(kept), "calibrate").params["seed"] == 9


def test_a_half_published_model_is_not_accepted_as_an_input(tiny_artifacts, tmp_path, capsys, no_model_loading):
    """A prefix left by an interrupted upload (publishing.json, no manifest) is not a model."""
    half = tmp_path / "half"
    shutil.copytree(tiny_artifacts["pruned"], half)
    (half / artifacts.MANIFEST).unlink()
    (half / artifacts.PUBLISHING).write_text(json.dumps({"stage": "prune", "files": ["config.json"]}))
    for args in (
        ["calibrate", "--model", str(half), "--data", tiny_artifacts["calibration"], "--samples", "8"],
        ["evaluate", "--model", str(half), "--tasks", tiny_artifacts["tasks"], "--limit", "1"],
    ):
        code, line = cli(capsys, *args, "--out", str(tmp_path / args[0]))
        one_clear_line(code, line, str(half), "not a finished artifact", "evoesap prune")


def test_a_mount_point_or_a_read_only_place_is_refused_before_any_work(
    tiny_artifacts, tmp_path, capsys, monkeypatch, no_model_loading
):
    mount = tmp_path / "mnt"
    mount.mkdir()
    monkeypatch.setattr(artifacts.os.path, "ismount", lambda p: str(p) == str(mount))
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(mount))["calibrate"])
    one_clear_line(code, line, "mount point", "inside it")
    monkeypatch.setattr(artifacts.os, "access", lambda p, mode: not str(p).startswith(str(tmp_path / "ro")))
    (tmp_path / "ro").mkdir()
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(tmp_path / "ro" / "out"))["calibrate"])
    one_clear_line(code, line, "not writable", "choose another --out")


def test_ctrl_c_exits_130_with_a_message_and_publishes_nothing(tiny_artifacts, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "load_model", interrupted)
    out = tmp_path / "out"
    code = main(["--quiet", *stage_commands(tiny_artifacts, str(out))["calibrate"]])
    assert code == 130
    assert "interrupted" in capsys.readouterr().err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("option", ["compile -o", "run --log"])
def test_pipeline_commands_never_write_over_the_config_or_a_user_file(option, tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("name: mine\nmodel: m\n")
    user = tmp_path / "notes.txt"
    user.write_text("precious\n")
    verb, flag = option.split()
    for target, words in ((config, ("is the input",)), (user, ("did not write",)), (tmp_path, ("is a directory",))):
        code, line = cli(capsys, "pipeline", verb, str(config), flag, str(target))
        one_clear_line(code, line, flag, *words)
    assert config.read_text() == "name: mine\nmodel: m\n" and user.read_text() == "precious\n"


def test_pipeline_compile_replaces_its_own_spec(tmp_path, capsys):
    from evoesap.pipeline.config import load_config
    from evoesap.pipeline.dag import compile_pipeline

    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "demo.yaml")
    spec = tmp_path / "pipeline.yaml"
    first = compile_pipeline(config, spec).read_text()
    assert compile_pipeline(config, spec).read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipeline.yaml"]


# ------------------------------------------------------------------------ bounds, special files, clear lines


@pytest.fixture
def no_hang():
    """Fail a read that blocks (a FIFO without a writer) or never ends (/dev/zero) instead of hanging the suite."""
    import signal

    def hung(signum, frame):
        raise TimeoutError("the stage read a special file instead of refusing it")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def distinct_allocations(model: str, sparsity: float) -> int:
    """The feasible allocations of a uniform-top-k model, counted by brute force (not by allocation.FeasibleSet)."""
    import itertools

    config = json.loads((Path(model) / "config.json").read_text())
    layers, n, k = config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]
    budget = round(sparsity * n * layers)
    return sum(1 for r in itertools.product(range(n - k + 1), repeat=layers) if sum(r) == budget)


BEYOND_INT64 = str(10**30)


@pytest.mark.parametrize(
    "stage, option, value, words",
    [
        ("search", "--population", BEYOND_INT64, ("population", "64-bit")),
        ("search", "--generations", BEYOND_INT64, ("generations", "64-bit")),
        ("search", "--generations", str(10**12), ("history rows", "GiB of host memory", "lower --generations")),
        ("search", "--batch-size", BEYOND_INT64, ("batch_size", "64-bit")),
        ("search", "--max-transfer", str(10**12), ("max_transfer 1000000000000", "32 routed experts", "--max-transfer 32")),
        ("search", "--max-steps", str(10**12), ("max_steps 1000000000000", "32 routed experts", "--max-steps 32")),
        ("calibrate", "--samples", BEYOND_INT64, ("samples", "64-bit")),
        ("calibrate", "--max-length", BEYOND_INT64, ("max_length", "64-bit")),
        ("cache-logits", "--batch-size", BEYOND_INT64, ("batch_size", "64-bit")),
        ("calibrate", "--seed", "-1", ("seed must be a non-negative integer", "-1")),
        ("cache-logits", "--seed", "-1", ("seed must be a non-negative integer",)),
        ("search", "--seed", "-1", ("seed must be a non-negative integer",)),
    ],
)
def test_sizes_that_cannot_be_meant_are_refused_in_one_line_before_any_work(
    stage, option, value, words, tiny_artifacts, tmp_path, capsys, no_model_loading
):
    command = [a for a in stage_commands(tiny_artifacts, str(tmp_path / "out"))[stage]]
    if option in command:
        command[command.index(option) + 1] = value
    else:
        command += [option, value]
    code, line = cli(capsys, *command)
    one_clear_line(code, line, *words)
    assert not (tmp_path / "out").exists()


def test_a_population_no_machine_could_hold_is_refused_and_one_beyond_the_space_runs(
    tiny_artifacts, tmp_path, capsys, no_model_loading
):
    """Beyond the distinct allocations a population only repeats them (the search warns and runs, as on the
    quick demo world); one whose history cannot fit in memory is refused before anything loads."""
    from evoesap.machine import bounds
    from evoesap.stages.search import SearchParams

    distinct = distinct_allocations(tiny_artifacts["model"], 0.5)
    command = stage_commands(tiny_artifacts, str(tmp_path / "out"))["search"]
    command[command.index("--population") + 1] = str(10**15)
    code, line = cli(capsys, *command)
    one_clear_line(code, line, f"population {10**15}", "history rows", "lower --generations")
    bounds.check_search(
        SearchParams(sparsity=0.5, population=distinct + 5, generations=50, max_transfer=32, max_steps=32),
        [8] * 4,
        distinct,
        free_host=1 << 40,
    )


@pytest.mark.parametrize("stage", ["calibrate", "cache-logits", "search", "evaluate"])
@pytest.mark.parametrize(
    "device, gpus, words",
    [
        ("cuda", 0, ("device 'cuda'", "no GPU", "--device cpu")),
        ("cuda:7", 0, ("device 'cuda:7'", "no GPU")),
        ("cuda:7", 2, ("device 'cuda:7'", "2 GPU(s), cuda:0..cuda:1")),
        ("gpu0", 0, ("device 'gpu0' is not a device",)),
    ],
)
def test_a_device_this_machine_lacks_is_refused_before_any_work(
    stage, device, gpus, words, tiny_artifacts, tmp_path, capsys, monkeypatch, no_model_loading
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(tmp_path / "out"))[stage], "--device", device)
    one_clear_line(code, line, *words)
    assert not (tmp_path / "out").exists()


def test_a_visible_gpu_is_accepted(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:1"):
        runtime.check_device(device)


@pytest.mark.parametrize("kind", ["fifo", "directory", "empty directory", "device", "symlink to /dev/zero"])
def test_data_that_is_not_a_regular_file_is_refused_without_reading_it(
    kind, tiny_artifacts, tmp_path, capsys, no_hang, no_model_loading
):
    import os

    data = tmp_path / ("rows" if kind == "empty directory" else "rows.jsonl")  # a directory of data files is a dataset
    if kind == "fifo":
        os.mkfifo(data)
    elif kind in ("directory", "empty directory"):
        data.mkdir()
    elif kind == "device":
        data = Path("/dev/zero")
    else:
        data.symlink_to("/dev/zero")
    code, line = cli(capsys, "calibrate", "--model", tiny_artifacts["model"], "--data", str(data), "--out", str(tmp_path / "o"))
    expected = {
        "fifo": ("a FIFO",),
        "directory": ("is a directory", "jsonl file"),
        "device": ("a character device",),
        "empty directory": ("cannot load", "doesn't contain any data files"),
        "symlink to /dev/zero": ("a character device", "a symlink to /dev/zero"),
    }[kind]
    one_clear_line(code, line, str(data), *expected)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["artifact payload", "model file"])
def test_a_symlink_to_dev_zero_inside_an_input_is_refused_without_hashing_it(
    where, tiny_artifacts, tmp_path, capsys, no_hang, no_model_loading
):
    model, scores = tmp_path / "model", tmp_path / "scores"
    shutil.copytree(tiny_artifacts["model"], model)
    shutil.copytree(tiny_artifacts["scores"], scores)
    target = scores / "scores.parquet" if where == "artifact payload" else model / "tokenizer.json"
    target.unlink()
    target.symlink_to("/dev/zero")
    code, line = cli(
        capsys, "prune", "--model", str(model), "--scores", str(scores), "--sparsity", "0.5", "--out", str(tmp_path / "o")
    )
    one_clear_line(code, line, str(target), "a character device", "never read")
    if where == "artifact payload":
        assert "rebuild it with `evoesap calibrate`" in line


def test_a_manifest_that_is_a_directory_is_named_as_input_and_as_output(tiny_artifacts, tmp_path, capsys, no_model_loading):
    for name in ("scores", "out"):
        shutil.copytree(tiny_artifacts["scores"], tmp_path / name)
        (tmp_path / name / artifacts.MANIFEST).unlink()
        (tmp_path / name / artifacts.MANIFEST).mkdir()
    code, line = cli(
        capsys,
        "prune",
        "--model",
        tiny_artifacts["model"],
        "--scores",
        str(tmp_path / "scores"),
        "--sparsity",
        "0.5",
        "--out",
        str(tmp_path / "o"),
    )
    one_clear_line(
        code, line, str(tmp_path / "scores" / artifacts.MANIFEST), "not a regular file", "rebuild it with `evoesap calibrate`"
    )
    before = snapshot(tmp_path / "out")
    code, line = cli(capsys, *stage_commands(tiny_artifacts, str(tmp_path / "out"))["calibrate"])
    one_clear_line(code, line, "--out", "malformed manifest", "choose another --out")
    assert snapshot(tmp_path / "out") == before


def _truncate_data(model: Path) -> None:
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])


def _truncate_header(model: Path) -> None:
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])


def _no_weights(model: Path) -> None:
    (model / "model.safetensors").unlink()


def _index_without_shard(model: Path) -> None:
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _config_not_json(model: Path) -> None:
    (model / "config.json").write_text("{not json")


def _config_bad_value(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_experts": "many"}))


@pytest.mark.parametrize("stage", ["calibrate", "cache-logits", "search", "prune", "evaluate"])
@pytest.mark.parametrize(
    "damage, words",
    [
        (_truncate_data, ("model.safetensors is truncated", "its header needs")),
        (_truncate_header, ("model.safetensors is not a readable safetensors file",)),
        (_no_weights, ("has no model.safetensors", "weights are missing")),
        (_index_without_shard, ("lists model-00002-of-00002.safetensors, which is missing",)),
        (_config_not_json, ("config.json is not valid JSON",)),
        (_config_bad_value, ("config.json is not a valid transformers config", "num_experts", "many")),
    ],
    ids=["truncated", "truncated-header", "no-weights", "index-without-shard", "config-not-json", "config-bad-value"],
)
def test_a_broken_checkpoint_is_named_in_one_line_before_any_work(
    stage, damage, words, tiny_artifacts, tmp_path, capsys, no_model_loading
):
    model = tmp_path / "model"
    shutil.copytree(tiny_artifacts["pruned" if stage == "evaluate" else "model"], model)
    damage(model)
    world = {**tiny_artifacts, "model": str(model), "pruned": str(model)}
    code, line = cli(capsys, *stage_commands(world, str(tmp_path / "out"))[stage])
    one_clear_line(code, line, str(model), *words)
    assert not (tmp_path / "out").exists()


def test_an_intact_checkpoint_passes_the_check(tiny_artifacts):
    for model in (tiny_artifacts["model"], tiny_artifacts["pruned"]):
        runtime.check_checkpoint(model)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"resources": {"search": {"memory": "lots"}}}, ("resources.search.memory", "'lots' is not a memory quantity")),
        ({"resources": {"all": {"memory_request": "64 GB"}}}, ("resources.all.memory_request", "not a memory quantity")),
        ({"resources": {"prune": {"cpu": "many"}}}, ("resources.prune.cpu", "'many' is not a CPU quantity")),
        ({"storage_root": ""}, ("storage_root is empty", "working directory")),
        ({"storage_root": "  "}, ("storage_root is empty",)),
        ({"storage_root": "MODEL/runs"}, ("lies inside the model directory", "choose a storage_root outside it")),
        ({"storage_root": "MODEL"}, ("lies inside the model directory",)),
    ],
)
def test_pipeline_settings_that_cannot_work_are_refused_when_the_config_loads(change, words, tiny_artifacts, tmp_path, capsys):
    import yaml

    config = {
        "model": tiny_artifacts["model"],
        "calibration_data": tiny_artifacts["calibration"],
        "search_data": tiny_artifacts["search"],
        "storage_root": str(tmp_path / "runs"),
    }
    changed = {k: v.replace("MODEL", tiny_artifacts["model"]) if isinstance(v, str) else v for k, v in change.items()}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**config, **changed}))
    code, line = cli(capsys, "pipeline", "compile", str(path), "-o", str(tmp_path / "spec.yaml"))
    one_clear_line(code, line, *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]


def test_pipeline_compile_into_the_working_directory_is_refused(tmp_path, capsys, monkeypatch):
    config = Path(__file__).resolve().parents[2] / "examples" / "demo.yaml"
    monkeypatch.chdir(tmp_path)
    code, line = cli(capsys, "pipeline", "compile", str(config), "-o", ".")
    one_clear_line(code, line, "--output .", "is a directory")
    assert list(tmp_path.iterdir()) == []


def test_quantities_kfp_accepts_and_a_storage_root_beside_the_model_pass(tiny_artifacts, tmp_path):
    from evoesap.pipeline.config import load_config

    config = load_config(
        {
            "model": tiny_artifacts["model"],
            "calibration_data": tiny_artifacts["calibration"],
            "search_data": tiny_artifacts["search"],
            "storage_root": str(Path(tiny_artifacts["model"]).parent / "model-runs"),
            "resources": {"search": {"memory": "64Gi", "memory_request": "512M", "cpu": "500m", "cpu_request": "0.5"}},
        }
    )
    assert config.settings("search").memory == "64Gi"
