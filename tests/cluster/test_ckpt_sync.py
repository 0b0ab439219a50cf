"""Checkpoint upload with the real rclone binary (Debian package) and a `local` remote defined purely by
environment variables, as an S3 remote would be: uploads match, failures retry, count, log, never stop
training; SLURM's stop signal does not kill an upload; a stuck upload is abandoned at the deadline."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from rl_training.ckpt import upload as ckpt_sync
from rl_training.ckpt.store import COMPLETE, list_checkpoints
from rl_training.ckpt.upload import CheckpointSyncer, destination, upload
from rl_training.config.load import load_config, to_yaml
from rl_training.config.resolve import resolve_target
from rl_training.config.schema import ConfigError, SyncCfg
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, require_debian_packages, wait_until

SENTINEL = "SENTINEL-secret-0f9a2c"  # stands in for an S3 secret key: must never reach a file or a log


@pytest.fixture
def rclone_remote(monkeypatch, tmp_path) -> Path:
    """A remote named `testremote` of type local, configured only through the environment; returns its root."""
    require_debian_packages({"rclone": "rclone"})
    monkeypatch.setenv("RCLONE_CONFIG_TESTREMOTE_TYPE", "local")
    monkeypatch.setenv("RCLONE_CONFIG_TESTREMOTE_SECRET_ACCESS_KEY", SENTINEL)  # ignored by `local`, like a key
    monkeypatch.setenv("RCLONE_CONFIG", str(tmp_path / "no-rclone.conf"))  # no config file from the machine
    root = tmp_path / "bucket"
    root.mkdir()
    return root


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def fake_checkpoint(run_dir: Path, step: int, size: int = 1000) -> Path:
    ck = run_dir / "checkpoints" / f"step_{step:06d}"
    ck.mkdir(parents=True)
    (ck / "optimizer.pt").write_bytes(os.urandom(size))
    (ck / "COMPLETE").write_text("ok\n")
    return ck


def live_group_members(pgid: int, wait_s: float = 5.0) -> list[int]:
    """Processes of a process group that are not zombies (orphans are reaped by PID 1, not at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        live = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(int(stat.parent.name))
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def group_has(pgid: int, comm: str) -> bool:
    """Whether a live process named `comm` is in process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().split(" (", 1)[1].rsplit(")", 1)  # "pid (comm) state ppid pgrp ..."
        except (OSError, ValueError):
            continue
        fields = rest.split()
        if name == comm and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def tb_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


# ------------------------------------------------------------------------------------------ target
def test_target_from_config_or_environment(tmp_path):
    env = {"RL_SYNC_REMOTE": "s3", "RL_SYNC_BUCKET": "team-bucket", "RL_SYNC_PATH": "/rl/exps/"}
    cfg = SyncCfg()
    resolve_target(cfg, tmp_path, env)
    assert destination(cfg, "exp1") == "s3:team-bucket/rl/exps/exp1"
    cfg = SyncCfg(remote="r2", bucket="mine")  # the config wins over the environment
    resolve_target(cfg, tmp_path, env)
    assert destination(cfg, "exp1") == "r2:mine/rl/exps/exp1"
    cfg = SyncCfg()
    resolve_target(cfg, tmp_path, {})
    assert cfg.remote == "" and isinstance(rl_runner.make_syncer(cfg, "x", True), ckpt_sync.NullSyncer)
    with pytest.raises(ConfigError, match="sync.bucket/sync.path are set but sync.remote is empty"):
        resolve_target(SyncCfg(bucket="b"), tmp_path, {})
    # The resolved destination is what the run saves in its config.yaml.
    cfg = load_config(TESTCFG)
    resolve_target(cfg.sync, tmp_path, env)
    assert "remote: s3" in to_yaml(cfg) and "bucket: team-bucket" in to_yaml(cfg)


@pytest.mark.parametrize(
    "override",
    [
        f"sync.remote=:s3,access_key_id=AKIA,secret_access_key={SENTINEL}:",  # rclone's inline remote syntax
        f"sync.remote=s3,secret_access_key={SENTINEL}",
        f"sync.bucket=b:{SENTINEL}",
        'sync.path=x/$(touch /tmp/pwned)"',  # rclone-python hands the line to a shell
    ],
)
def test_credentials_or_shell_syntax_in_the_target_are_rejected_without_echo(override):
    with pytest.raises(ConfigError) as e:
        load_config(TESTCFG, [override])
    assert SENTINEL not in str(e.value) and "pwned" not in str(e.value)
    assert "RCLONE_CONFIG_<NAME>_*" in str(e.value) or "may not contain" in str(e.value)


def test_resolved_environment_values_are_checked_too(tmp_path):
    with pytest.raises(ConfigError, match="sync.remote must be the name of an rclone remote"):
        resolve_target(SyncCfg(), tmp_path, {"RL_SYNC_REMOTE": f":s3,secret_access_key={SENTINEL}:"})


# ------------------------------------------------------------------------------------- the runner
def test_run_uploads_every_checkpoint_and_its_logs(run_overrides, rclone_remote, tmp_path, capfd):
    over = [
        *run_overrides,
        "train.total_steps=4",
        "ckpt.every=1",
        "ckpt.keep_last=4",
        "sync.remote=testremote",
        f"sync.bucket={rclone_remote}",
        "sync.path=team/rl",
    ]
    assert rl_runner.main(["--cfg", TESTCFG, *over]) == 0
    out, err = capfd.readouterr()
    run_dir = tmp_path / "runs" / "testconfig"
    remote = rclone_remote / "team" / "rl" / "testconfig"
    for step, ck in list_checkpoints(run_dir):  # every checkpoint, byte for byte, with its marker
        assert files(remote / "checkpoints" / ck.name) == files(ck), step
        assert (remote / "checkpoints" / ck.name / COMPLETE).is_file()
    assert len(list_checkpoints(run_dir)) == 4
    # The run's logs follow at the end (after the logger closed, so they are complete).
    for name in ("config.yaml", "metrics.jsonl"):
        assert (remote / name).read_bytes() == (run_dir / name).read_bytes()
    assert files(remote / "tb") == files(run_dir / "tb")
    assert (
        "sync: 4 checkpoint(s) uploaded to testremote:" in out
        and "0 failed, 0 skipped; final pass: all 4 kept on the remote; run logs uploaded" in out
    )
    # Counters in every step's metrics (asynchronous: non-decreasing), and the drained final value in TB.
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]  # still one line per step
    ok = [m["sync/ckpt_uploads_ok"] for m in lines]
    assert ok == sorted(ok) and all(m["sync/ckpt_upload_failures"] == 0 for m in lines)
    assert tb_scalars(run_dir, "sync/ckpt_uploads_ok")[-1] == (4, 4.0)
    assert tb_scalars(run_dir, "sync/final_ckpts_ok") == [(4, 4.0)]  # the end-of-run pass, in TensorBoard only
    assert "final_ckpts_ok" not in (run_dir / "metrics.jsonl").read_text()
    assert tb_scalars(run_dir, "sync/last_uploaded_step")[-1] == (4, 4.0)
    assert tb_scalars(run_dir, "sync/ckpt_pending")[-1] == (4, 0.0)
    assert tb_scalars(run_dir, "sync/ckpt_upload_seconds")[-1][1] > 0
    # The credential in the environment reached neither a file nor a log.
    assert SENTINEL not in out + err
    for p in [*run_dir.rglob("*"), *rclone_remote.rglob("*")]:
        if p.is_file():
            assert SENTINEL.encode() not in p.read_bytes(), p


def test_failing_remote_retries_counts_and_training_still_finishes(run_overrides, rclone_remote, tmp_path, capfd):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file: nothing can be created below it, not even by root\n")
    over = [
        *run_overrides,
        "train.total_steps=3",
        "ckpt.every=1",
        "ckpt.keep_last=3",
        "sync.remote=testremote",
        f"sync.bucket={blocker}",
        "sync.retries=2",
        "sync.backoff_s=0.05",
    ]
    assert rl_runner.main(["--cfg", TESTCFG, *over]) == 0
    out, err = capfd.readouterr()
    run_dir = tmp_path / "runs" / "testconfig"
    assert [s for s, _ in list_checkpoints(run_dir)] == [1, 2, 3]  # all local checkpoints are there
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    for step in (1, 2, 3):
        assert f"sync: upload of step_00000{step} failed (attempt 1/3)" in err
        assert f"sync: upload of step_00000{step} failed (attempt 2/3)" in err
        assert f"sync: giving up on step_00000{step} after 3 attempts" in err
    assert "not a directory" in err  # rclone's own reason is in the log
    assert "retrying in 0.05 s" in err and "retrying in 0.1 s" in err  # exponential backoff
    assert tb_scalars(run_dir, "sync/ckpt_upload_failures")[-1] == (3, 3.0)
    assert tb_scalars(run_dir, "sync/ckpt_upload_retries")[-1] == (3, 8.0)  # 3 x 2, and the final pass's 2
    assert tb_scalars(run_dir, "sync/ckpt_uploads_ok")[-1] == (3, 0.0)
    assert tb_scalars(run_dir, "sync/final_ckpts_ok") == [(3, 0.0)]
    assert f"sync: giving up on {ckpt_sync.FINAL} after 3 attempts" in err
    assert "sync: 0 checkpoint(s) uploaded" in out and "3 failed, 0 skipped; final pass failed; run logs not" in out


def test_unknown_remote_fails_with_rclones_reason(rclone_remote, tmp_path, capfd):
    ck = fake_checkpoint(tmp_path / "run", 1)
    r = upload({"name": ck.name, "src": str(ck), "dst": "nosuchremote:b/run/checkpoints/step_000001"}, 1, 0.0)
    assert r == {"name": "step_000001", "ok": False, "attempts": 2}
    assert "didn't find section in config file" in capfd.readouterr().err


def test_retry_succeeds_once_the_remote_recovers(rclone_remote, tmp_path, monkeypatch, capfd):
    ck = fake_checkpoint(tmp_path / "run", 2)
    blocker = rclone_remote / "down"
    blocker.write_text("the remote is 'down' while this file blocks the path\n")
    waits = []

    def backoff(seconds):  # the remote comes back during the first backoff
        waits.append(seconds)
        if blocker.is_file():
            blocker.unlink()

    monkeypatch.setattr(ckpt_sync.time, "sleep", backoff)
    dst = f"testremote:{blocker}/run/checkpoints/{ck.name}"
    r = upload({"name": ck.name, "src": str(ck), "dst": dst}, retries=3, backoff_s=1.5)
    assert r["ok"] and r["attempts"] == 2 and waits == [1.5]
    assert files(blocker / "run" / "checkpoints" / ck.name) == files(ck)
    assert "failed (attempt 1/4)" in capfd.readouterr().err


def test_complete_marker_arrives_only_after_every_other_file(rclone_remote, tmp_path, monkeypatch, capfd):
    """One file of the checkpoint fails to upload: the files that did go up must not carry the COMPLETE marker
    (one parallel `rclone copy` would have sent it anyway); once the remote recovers, the retry sends it last."""
    ck = fake_checkpoint(tmp_path / "run", 4)
    (ck / "trainer_state.json").write_text('{"step": 4}\n')
    remote_ck = rclone_remote / "run" / "checkpoints" / ck.name
    # A non-empty directory where optimizer.pt must go: rclone cannot replace it, every other file lands.
    (remote_ck / "optimizer.pt").mkdir(parents=True)
    (remote_ck / "optimizer.pt" / "in-the-way").write_text("x\n")
    seen_during_backoff = []

    def backoff(seconds):  # the state of the remote after the failed attempt; then it recovers
        seen_during_backoff.append(sorted(p.name for p in remote_ck.iterdir()))
        shutil.rmtree(remote_ck / "optimizer.pt")

    monkeypatch.setattr(ckpt_sync.time, "sleep", backoff)
    r = upload({"name": ck.name, "src": str(ck), "dst": f"testremote:{remote_ck}"}, retries=1, backoff_s=0.0)
    # Attempt 1 copied trainer_state.json, failed on optimizer.pt and so never sent the marker.
    assert seen_during_backoff == [["optimizer.pt", "trainer_state.json"]]
    assert "is a directory" in capfd.readouterr().err
    assert r["ok"] and r["attempts"] == 2
    assert files(remote_ck) == files(ck) and (remote_ck / COMPLETE).read_text() == "ok\n"


def test_marker_name_is_the_checkpoints():
    assert ckpt_sync.COMPLETE == COMPLETE  # a copy: ckpt_sync must not import torch


def test_checkpoint_pruned_before_its_upload_is_skipped(rclone_remote, tmp_path, capfd):
    gone = tmp_path / "run" / "checkpoints" / "step_000003"
    r = upload({"name": gone.name, "src": str(gone), "dst": f"testremote:{rclone_remote}/x"}, 2, 0.0)
    assert r["skipped"] and not r["ok"]
    assert "step_000003 was deleted locally before it could be uploaded; skipped" in capfd.readouterr().err


# ------------------------------------------------------------------------------- helper process
def test_upload_survives_the_slurm_stop_signal(rclone_remote, tmp_path, monkeypatch):
    """SLURM sends the time-limit signal to every process of the job step: the upload must go on."""
    monkeypatch.setenv("RCLONE_BWLIMIT", "400k")  # rclone reads any flag from RCLONE_<FLAG>: a ~2 s upload
    run_dir = tmp_path / "run"
    ck = fake_checkpoint(run_dir, 5, size=800_000)
    syncer = CheckpointSyncer(SyncCfg(remote="testremote", bucket=str(rclone_remote), retries=0), "run")
    syncer.submit(ck)
    # the upload is under way (sh + rclone, by rclone-python)
    wait_until(lambda: group_has(syncer._proc.pid, "rclone"), "an rclone started", 30)
    assert syncer.metrics()["sync/ckpt_pending"] == 1
    os.killpg(syncer._proc.pid, signal.SIGUSR1)  # what `scancel --signal=USR1` does to the helper's processes
    m = syncer.drain(run_dir)
    syncer.finish(run_dir)
    assert m["sync/ckpt_uploads_ok"] == 1 and m["sync/ckpt_upload_failures"] == 0 and m["sync/ckpt_upload_retries"] == 0
    assert files(rclone_remote / "run" / "checkpoints" / ck.name) == files(ck)


@pytest.mark.parametrize(
    "timeouts, stopped, says",
    [
        ({"final_timeout_s": 1.5}, False, "sync.final_timeout_s=1.5"),
        ({"final_timeout_s": 1.5}, True, "sync.final_timeout_s=1.5"),  # stop_timeout_s (120) is longer
        ({"stop_timeout_s": 1.5}, True, "sync.stop_timeout_s=1.5"),  # final_timeout_s stays at 300
    ],
)
def test_final_timeout_abandons_a_stuck_upload(rclone_remote, tmp_path, monkeypatch, capfd, timeouts, stopped, says):
    monkeypatch.setenv("RCLONE_BWLIMIT", "20k")  # 2 MB at 20 kB/s: 100 s
    run_dir = tmp_path / "run"
    ck = fake_checkpoint(run_dir, 7, size=2_000_000)
    cfg = SyncCfg(remote="testremote", bucket=str(rclone_remote), retries=0, **timeouts)
    syncer = CheckpointSyncer(cfg, "run")
    syncer.submit(ck)
    t0 = time.monotonic()
    syncer.drain(run_dir, stopped=stopped)
    syncer.finish(run_dir)
    assert time.monotonic() - t0 < 15  # the deadline plus the TERM grace, not 100 s
    assert live_group_members(syncer._proc.pid) == []  # helper, sh and rclone are all gone
    assert f"upload(s) still running after {says}; abandoned" in capfd.readouterr().err
    assert syncer.metrics()["sync/ckpt_upload_failures"] == 1


def test_final_pass_uploads_checkpoints_whose_upload_gave_up(rclone_remote, tmp_path, capfd):
    """The remote is broken while the checkpoints are saved (each upload gives up) and works again at the end:
    the end-of-run pass puts every kept checkpoint there, and only those."""
    run_dir = tmp_path / "run"
    blocker = rclone_remote / "down"
    blocker.write_text("the remote is 'down' while this file blocks the path\n")
    syncer = CheckpointSyncer(SyncCfg(remote="testremote", bucket=str(blocker), retries=0), "run")
    cks = [fake_checkpoint(run_dir, step) for step in (1, 2)]
    for ck in cks:
        syncer.submit(ck)
    deadline = time.monotonic() + 30
    while syncer.metrics()["sync/ckpt_upload_failures"] < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert syncer.metrics()["sync/ckpt_upload_failures"] == 2 and "sync/final_ckpts_ok" not in syncer.metrics()
    (fake_checkpoint(run_dir, 3) / COMPLETE).unlink()  # incomplete: not kept, not uploaded
    (run_dir / "checkpoints" / "abandoned_x" / "step_000009").mkdir(parents=True)  # set aside on a resume
    blocker.unlink()
    m = syncer.drain(run_dir)
    syncer.finish(run_dir)
    remote = blocker / "run" / "checkpoints"
    assert sorted(p.name for p in remote.iterdir()) == ["step_000001", "step_000002"]
    for ck in cks:
        assert files(remote / ck.name) == files(ck) and (remote / ck.name / COMPLETE).read_text() == "ok\n"
    assert m["sync/final_ckpts_ok"] == 2 and m["sync/last_uploaded_step"] == 2
    assert m["sync/ckpt_upload_failures"] == 2 and m["sync/ckpt_uploads_ok"] == 0  # the per-checkpoint history
    assert "2 failed, 0 skipped; final pass: all 2 kept on the remote; run logs uploaded" in capfd.readouterr().out


def test_final_pass_sends_each_marker_after_all_files(rclone_remote, tmp_path, monkeypatch, capfd):
    """The end-of-run pass is one `rclone copy` of the kept checkpoints: while any file fails, no checkpoint
    gets its marker on the remote; the retry sends them all, markers last."""
    cks = [fake_checkpoint(tmp_path / "run", step) for step in (1, 2)]
    remote = rclone_remote / "run" / "checkpoints"
    (remote / "step_000002" / "optimizer.pt" / "in-the-way").mkdir(parents=True)  # rclone cannot replace it
    seen_during_backoff = []

    def backoff(seconds):  # the state of the remote after the failed attempt; then it recovers
        seen_during_backoff.append(sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()))
        shutil.rmtree(remote / "step_000002" / "optimizer.pt")

    monkeypatch.setattr(ckpt_sync.time, "sleep", backoff)
    job = {"name": ckpt_sync.FINAL, "src": str(cks[0].parent), "dst": f"testremote:{remote}"}
    r = upload({**job, "final": ["step_000001", "step_000002"]}, retries=1, backoff_s=0.0)
    assert seen_during_backoff == [["step_000001/optimizer.pt"]]  # step 1's file landed, no marker anywhere
    assert "is a directory" in capfd.readouterr().err
    assert r["ok"] and r["attempts"] == 2
    assert files(remote) == files(cks[0].parent)
