"""Concurrent publishes of one output, with the interleavings forced by hooks (no sleeps, no timing).

Identical publishes (a KFP retry racing its first try, two team runs of one step) all succeed and leave one
intact artifact; a different artifact published while a run worked is refused without touching either.
The same protocol under real concurrency, 200 rounds: `benchmarks/publish_race.py`.
"""

import os
import threading
import time
from pathlib import Path

import fsspec
import pytest

from evoesap.errors import ArtifactError, ConfigError
from evoesap.store import artifacts


def publish(out: str, payload: str, params: dict | None = None, before_publish=None) -> artifacts.Manifest:
    with artifacts.stage_output(out, "demo", params or {"payload": payload}, {}, before_publish=before_publish) as staging:
        (staging / "x.txt").write_text(payload)
    return artifacts.read_manifest(out)


def payload_of(out: str) -> str:
    manifest = artifacts.verify(out, "demo")
    return artifacts.read_payload(out, "x.txt", manifest).decode()


def test_a_look_at_the_output_while_another_run_swaps_it_sees_the_settled_artifact(tmp_path, monkeypatch):
    """The directory is there when looked up and gone (renamed aside by a publish) when listed: that is a
    publish in its instant of swapping, to be read again, not an error."""
    out = tmp_path / "art"
    first = publish(str(out), "one")
    aside = tmp_path / ".art.old-swap"
    real_ls = fsspec.implementations.local.LocalFileSystem.ls
    swaps = []

    def ls_mid_swap(self, path, *args, **kwargs):
        if Path(self._strip_protocol(path)) == out and not swaps:
            swaps.append(1)
            os.replace(out, aside)  # the other publish renames the old artifact aside...
            try:
                return real_ls(self, path, *args, **kwargs)
            finally:
                os.replace(aside, out)  # ...and its new one in
        return real_ls(self, path, *args, **kwargs)

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "ls", ls_mid_swap)
    seen = artifacts.preflight(str(out), "demo", {})
    assert swaps == [1]
    assert seen == f"artifact:{artifacts.manifest_sha256(str(out))}"
    assert artifacts.read_manifest(str(out)) == first


def run_beside(out: str, payload: str):
    """Start run B publishing `payload` at `out`: its preflight looks at the output now and it stages its artifact,
    then waits until `fire()` is called to publish it. `fire()` returns once B has finished or waits for the output's
    swap lock (which the hooked publish holds); returns the thread's outcome holder."""
    outcome = {}
    staged, go, settled = threading.Event(), threading.Event(), threading.Event()
    real_flock = artifacts.fcntl.flock
    worker = []

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except BlockingIOError:
            if worker and threading.current_thread() is worker[0] and go.is_set():
                settled.set()  # B waits for the lock the hooked publish holds
            raise

    def wait_to_publish(staging, manifest):
        staged.set()
        assert go.wait(60), "B was never fired"

    def body():
        try:
            outcome["manifest"] = publish(out, payload, before_publish=wait_to_publish)
        except Exception as exc:  # noqa: BLE001 - asserted by the caller
            outcome["error"] = exc
        staged.set()
        settled.set()

    thread = threading.Thread(target=body)
    worker.append(thread)
    outcome["thread"] = thread
    thread.start()
    assert staged.wait(60), "B did not stage its artifact"

    def fire():
        go.set()
        assert settled.wait(60), "the concurrent publish neither finished nor waited"

    return outcome, flock, fire


@pytest.mark.parametrize("identical", [True, False])
def test_a_publish_between_another_runs_check_and_its_swap(tmp_path, monkeypatch, identical):
    """Run B, whose preflight saw the earlier artifact, publishes in the instant after run A checked the output and
    before A swaps: without one lock over check and swap, both succeed and A's artifact silently replaces B's."""
    out = tmp_path / "art"
    publish(str(out), "earlier")
    b_payload = "A" if identical else "B"
    outcome, flock, fire = run_beside(str(out), b_payload)
    monkeypatch.setattr(artifacts.fcntl, "flock", flock)
    real_replace = os.replace
    fired = []

    def replace(src, dst, *args, **kwargs):  # A renames the earlier artifact aside: its check is done
        if Path(src) == out and not fired:
            fired.append(1)
            fire()
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(artifacts.os, "replace", replace)
    a = publish(str(out), "A")
    outcome["thread"].join(60)
    assert fired == [1]
    assert payload_of(str(out)) == "A"
    assert artifacts.read_manifest(str(out)) == a
    if identical:
        assert "error" not in outcome, outcome.get("error")
        assert outcome["manifest"] == a  # B left A's identical artifact in place
        assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    else:
        error = outcome["error"]
        assert isinstance(error, ArtifactError) and "changed while this run worked" in str(error)
        kept = Path(str(error).rsplit("kept at ", 1)[1])
        assert (kept / "x.txt").read_text() == "B"  # B's artifact is kept, not lost


def test_a_remote_publish_waits_out_an_identical_one_under_way_and_refuses_a_different_one(s3, monkeypatch):
    """On an object store the lease (publishing.json, created only where none exists) is the lock."""
    _, fs, bucket = s3
    out = f"s3://{bucket}/runs/art"
    publish(out, "A")
    key = artifacts.read_manifest(out).cache_key
    lease = f"{bucket}/runs/art/{artifacts.PUBLISHING}"
    record = b'{"stage": "demo", "key": "%s", "token": "other", "files": ["x.txt"]}' % key.encode()

    def other_run_publishing(staging, manifest):  # another run takes the lease after this one's preflight
        fs.pipe_file(lease, record)

    with pytest.raises(ArtifactError, match="another demo run is publishing there"):
        publish(out, "B", before_publish=other_run_publishing)
    assert payload_of_leased(fs, bucket) == "A"
    fs.rm(lease)  # the other run is done

    real_sleep, waits = time.sleep, []

    def sleep(seconds):  # this run waits for the identical one, which then finishes
        if threading.current_thread() is threading.main_thread() and not waits:
            waits.append(seconds)
            fs.rm(lease)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    assert publish(out, "A", before_publish=lambda staging, manifest: fs.pipe_file(lease, record)).cache_key == key
    assert waits  # it did wait
    assert payload_of(out) == "A"
    assert sorted(fs.find(f"{bucket}/runs/art")) == [f"{bucket}/runs/art/{n}" for n in (artifacts.MANIFEST, "x.txt")]


def payload_of_leased(fs, bucket) -> str:
    return fs.cat(f"{bucket}/runs/art/x.txt").decode()


def test_a_published_artifact_gets_the_umask_not_0700(tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "art"
        publish(str(out), "readable")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "x.txt").stat().st_mode & 0o777 == 0o644
    assert (out / artifacts.MANIFEST).stat().st_mode & 0o777 == 0o644


class Killed(Exception):
    """The process ended at this instant (kill -9, SIGTERM). An Exception, not a BaseException, as fsspec's event loop
    passes only those on; the publish turns it into its one-line error, with no write in between."""


_WRITES = {"put_object", "delete_object", "delete_objects", "copy_object", "create_multipart_upload", "upload_part"}


def interrupted_at(monkeypatch, write: int) -> list[str]:
    """Make the S3 client end the run just before its `write`-th write (0: the first); returns the writes done."""
    import s3fs

    done: list[str] = []
    real_call = s3fs.S3FileSystem._call_s3

    async def call(self, method, *args, **kwargs):
        if method in _WRITES:
            if len(done) == write:
                raise Killed
            done.append(method)
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    return done


@pytest.mark.parametrize("earlier", [None, "earlier"])
def test_an_identical_remote_publish_finishes_one_killed_at_any_write(s3, monkeypatch, earlier):
    """A publish ended at each of its writes in turn (the lease only, some files, the manifest without the lease's
    release): the identical run made next finishes it, with one intact artifact and no lease left."""
    _, fs, bucket = s3
    writes = None
    for write in range(100):
        out = f"s3://{bucket}/killed-{earlier}-{write}"
        if earlier:  # an earlier artifact with a file the new one has not: the re-run removes it
            with artifacts.stage_output(out, "demo", {"payload": earlier}, {}) as staging:
                (staging / "x.txt").write_text(earlier)
                (staging / "only-earlier.txt").write_text(earlier)
        with monkeypatch.context() as patch:
            done = interrupted_at(patch, write)
            try:
                publish(out, "A")
            except ArtifactError as exc:
                assert "Killed" in str(exc), exc
            else:
                writes = len(done)
                break
        assert publish(out, "A") == artifacts.verify(out, "demo")
        assert payload_of(out) == "A"
        root = split_root(out)
        assert sorted(fs.find(root)) == [f"{root}/{n}" for n in (artifacts.MANIFEST, "x.txt")]
    assert writes is not None and write == writes >= 3  # every write of a whole publish was a place it ended


def split_root(uri: str) -> str:
    return artifacts.split(uri)[1].rstrip("/")


@pytest.mark.parametrize("write", [1, 3])
def test_an_unfinished_upload_of_other_parameters_is_refused_before_work_and_left_as_it_is(s3, monkeypatch, write):
    """Whether its run was stopped or is still uploading cannot be told: a run of other parameters does not take it
    over (that would mix two artifacts if it is alive), it says what to do."""
    _, fs, bucket = s3
    out = f"s3://{bucket}/unfinished-{write}"
    with monkeypatch.context() as patch:
        interrupted_at(patch, write)
        with pytest.raises(ArtifactError, match="Killed"):
            publish(out, "A")
    root = split_root(out)
    left = {p: fs.cat_file(p) for p in fs.find(root)}
    worked = []
    refused = pytest.raises(ConfigError, match=r"holds an unfinished upload of another demo run .*delete .*publishing\.json")
    with refused, artifacts.stage_output(out, "demo", {"payload": "B"}, {}) as staging:
        worked.append(1)
        (staging / "x.txt").write_text("B")
    assert worked == [] and {p: fs.cat_file(p) for p in fs.find(root)} == left
    fs.rm(f"{root}/{artifacts.PUBLISHING}")  # what the error says to do when no run is publishing there
    publish(out, "B")
    assert payload_of(out) == "B"


def test_a_publish_leaves_the_lease_an_identical_run_took_over_from_it(s3, monkeypatch):
    """The identical run that took the lease over publishes under it: the first run, ending, does not remove it."""
    import s3fs

    _, fs, bucket = s3
    out = f"s3://{bucket}/taken"
    root = split_root(out)
    real_call = s3fs.S3FileSystem._call_s3
    other = {}

    async def call(self, method, *args, **kwargs):
        if method == "put_object" and kwargs.get("Key", "").endswith("/x.txt") and not other:
            record = (await self._cat_file(f"{root}/{artifacts.PUBLISHING}")).replace(b'"token": "', b'"token": "other-')
            other["lease"] = record
            await self._pipe_file(f"{root}/{artifacts.PUBLISHING}", record)  # the identical run's takeover
        return await real_call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call)
    with artifacts.stage_output(out, "demo", {"payload": "A"}, {}) as staging:
        (staging / "x.txt").write_text("A")
    assert fs.cat_file(f"{root}/{artifacts.PUBLISHING}") == other["lease"]


def test_a_copy_pushed_onto_an_unfinished_upload_of_other_parameters_is_refused_and_kept(s3, monkeypatch, tmp_path):
    """publish's --to: the same rule where the copy's lease meets the other upload's."""
    _, fs, bucket = s3
    to = f"s3://{bucket}/pushed"
    with monkeypatch.context() as patch:
        interrupted_at(patch, 1)
        with pytest.raises(ArtifactError, match="Killed"):
            publish(to, "A")
    left = {p: fs.cat_file(p) for p in fs.find(split_root(to))}
    local = tmp_path / "b"
    manifest = publish(str(local), "B")
    seen = artifacts.preflight(to, "demo", {})
    with pytest.raises(ArtifactError, match=r"--to .* unfinished upload of another demo run.*kept at") as caught:
        artifacts.publish_copy(local, to, manifest, seen, "--to")
    assert {p: fs.cat_file(p) for p in fs.find(split_root(to))} == left
    assert (Path(str(caught.value).rsplit("kept at ", 1)[1]) / "x.txt").read_text() == "B"


# The steps of one look at a local output (preflight's, `occupant`), each a call made at the output or its manifest:
# the step, the calls that make it (whichever the code uses) and the path they are made at, relative to the output.
LOOK_STEPS = {
    "kind of the output": (("info",), ""),
    "listing": (("ls",), ""),
    "kind of the manifest": (("isfile", "info"), artifacts.MANIFEST),
    "manifest read": (("read_bytes",), artifacts.MANIFEST),
    "files walked": (("walk",), ""),
}


def at_step(monkeypatch, out: Path, step: str, before, after) -> list:
    """Call `before()` just before this thread's look makes `step` (its first call there) and `after()` once it is made;
    returns a list that holds 1 once it was."""
    names, rel = LOOK_STEPS[step]
    at = out / rel if rel else out
    looker, fired = threading.current_thread(), []

    def hooked(real, generator=False):
        def call(*args, **kwargs):
            path = next((a for a in args if isinstance(a, (str, os.PathLike))), None)
            fire = (
                threading.current_thread() is looker
                and not fired
                and path is not None
                and Path(str(path).removeprefix("file://")) == at
            )
            if fire:
                fired.append(1)
                before()
            try:
                result = real(*args, **kwargs)
                return iter(list(result)) if generator else result  # os.walk's work is done while it is iterated
            finally:
                if fire:
                    after()

        return call

    local = fsspec.implementations.local.LocalFileSystem
    for name in names:
        if name == "read_bytes":
            monkeypatch.setattr(artifacts, "read_bytes", hooked(artifacts.read_bytes))
        elif name == "walk":
            monkeypatch.setattr(artifacts.os, "walk", hooked(os.walk, generator=True))
        else:
            real = getattr(local, name)
            monkeypatch.setattr(local, name, lambda self, *a, real=real, **k: hooked(real)(self, *a, **k))
    return fired


def build_new(place: Path) -> Path:
    """A different artifact from the earlier one, with a file the earlier one has not."""
    with artifacts.stage_output(str(place), "demo", {"payload": "new"}, {}) as staging:
        (staging / "x.txt").write_text("new")
        (staging / "y.txt").write_text("only in the new artifact")
    return place


@pytest.mark.parametrize("mid", [True, False], ids=["between-its-renames", "whole"])
@pytest.mark.parametrize("step", sorted(LOOK_STEPS))
def test_a_look_at_the_output_never_sees_part_of_another_runs_swap(tmp_path, monkeypatch, step, mid):
    """Another run publishes a different artifact at `step` of a look at the output: in the instant between its two
    renames (the earlier artifact aside, the new one not yet in) or whole. The look sees one artifact whole, the earlier
    or the new: never no artifact (or a vanished or malformed manifest) where an artifact was all along, nor one
    artifact's manifest with the other's files."""
    out = Path(os.path.realpath(tmp_path)) / "art"
    publish(str(out), "earlier")
    earlier = f"artifact:{artifacts.manifest_sha256(str(out))}"
    other: dict = {}
    settled, resume, done = threading.Event(), threading.Event(), threading.Event()

    def publish_other() -> None:
        try:
            build_new(out)
        except Exception as exc:  # noqa: BLE001 - asserted below
            other["error"] = exc
        done.set()
        settled.set()

    def in_other(fn, real):
        def call(*args, **kwargs):
            return (fn if threading.current_thread() is other.get("thread") else real)(*args, **kwargs)

        return call

    real_rename, real_flock = os.rename, artifacts.fcntl.flock

    def rename(src, dst, *args, **kwargs):  # B's second rename: its new artifact in
        if mid and Path(dst) == out:
            settled.set()
            assert resume.wait(60)
        return real_rename(src, dst, *args, **kwargs)

    def flock(fd, op):
        try:
            return real_flock(fd, op)
        except BlockingIOError:
            other["waits"] = True  # for a lock the look holds
            settled.set()
            raise

    monkeypatch.setattr(artifacts.os, "rename", in_other(rename, real_rename))
    monkeypatch.setattr(artifacts.fcntl, "flock", in_other(flock, real_flock))

    def before():  # B publishes now, up to its pause between the renames, its end, or the look's lock
        other["thread"] = threading.Thread(target=publish_other)
        other["thread"].start()
        assert settled.wait(60), "the other run neither paused, finished nor waited"

    def after():
        if mid and not done.is_set() and not other.get("waits"):
            resume.set()  # the step was made between B's renames: B finishes before the look goes on
            assert done.wait(60)

    fired = at_step(monkeypatch, out, step, before, after)
    seen = artifacts.preflight(str(out), "demo", {})
    monkeypatch.undo()
    resume.set()
    assert fired == [1], f"the look made no {step}"
    other["thread"].join(60)
    assert "error" not in other, other.get("error")
    new = f"artifact:{artifacts.manifest_sha256(str(out))}"
    assert seen in (earlier, new)
    assert payload_of(str(out)) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("mid", [True, False], ids=["between-its-renames", "whole"])
@pytest.mark.parametrize("step", sorted(LOOK_STEPS))
def test_a_look_reads_again_what_a_writer_without_the_lock_changes_under_it(tmp_path, monkeypatch, step, mid):
    """A writer that takes no lock (an object store's publish is one; so is any other tool) replaces the artifact at
    `step` of a look: the look sees a state the location was in (the earlier artifact, nothing in the instant between
    the renames, the new one), never a manifest that vanished or changed taken for a malformed one, nor one artifact's
    manifest with the other's files."""
    root = Path(os.path.realpath(tmp_path))
    out, aside = root / "art", root / "aside"
    publish(str(out), "earlier")
    earlier = f"artifact:{artifacts.manifest_sha256(str(out))}"
    new_place = build_new(root / "built" / "art")
    new = f"artifact:{artifacts.manifest_sha256(str(new_place))}"

    def before():
        os.replace(out, aside)
        if not mid:
            os.replace(new_place, out)

    def after():
        if mid:
            os.replace(new_place, out)

    fired = at_step(monkeypatch, out, step, before, after)
    seen = artifacts.preflight(str(out), "demo", {})
    monkeypatch.undo()
    assert fired == [1], f"the look made no {step}"
    assert seen in (earlier, new, "absent") and (seen != "absent" or (mid and step == "kind of the output"))
    assert payload_of(str(out)) == "new"


@pytest.mark.parametrize("name", [artifacts.MANIFEST, artifacts.PUBLISHING])
def test_a_link_to_nothing_at_the_output_is_refused_at_once_not_read_again_as_a_publish_moving_it(tmp_path, monkeypatch, name):
    """It is listed and reads as missing, as a file a publish just moved would, but it stays so: no look again."""
    out = tmp_path / "art"
    out.mkdir()
    (out / name).symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail("the look waited for a link to nothing to settle"))
    with pytest.raises(ConfigError, match="malformed manifest" if name == artifacts.MANIFEST else r"not an evoesap artifact"):
        artifacts.preflight(str(out), "demo", {})
