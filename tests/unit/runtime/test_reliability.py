"""Reliability guards one by one: duplicate YAML keys, the run-directory lock, checkpoint integrity, whole-line
metrics.jsonl, and non-finite steps that never reach the adapter (1 and 2 ranks)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.metrics.logger import MetricsLogger, MetricsWriteError
from rl_training.runtime import lock as run_lock
from rl_training.runtime.lock import RunLock, RunLockError
from rl_training.train.step_guard import nonfinite_agreed
from tests.helpers import REPO, TESTCFG, G, fake_rollouts, lora_policy


# ------------------------------------------------------------------------------------------- YAML keys
@pytest.mark.parametrize(
    "text, where",
    [
        (
            "train:\n  total_steps: 3\n  seed: 1\n  total_steps: 4\n",
            ":4: duplicate key 'train.total_steps' (first at line 2)",
        ),
        ("run:\n  name: a\ntrain:\n  seed: 1\nrun:\n  name: b\n", ":5: duplicate key 'run' (first at line 1)"),
        ("lora:\n  target_modules: [q_proj]\n  target_modules: [v_proj]\n", ":3: duplicate key 'lora.target_modules'"),
    ],
)
def test_duplicate_yaml_keys_are_errors_naming_file_line_and_key(tmp_path, text, where):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f}{where}")
    assert "\n" not in str(e.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("base: &b {seed: 1, total_steps: 3}\n")  # an unknown top-level key: parsed first, refused after
    with pytest.raises(ConfigError, match="unknown config key 'base'"):
        load_config(f)
    f.write_text("train:\n  <<: {seed: 1, total_steps: 3}\n  total_steps: 4\n")
    cfg = load_config(f)
    assert (cfg.train.seed, cfg.train.total_steps) == (1, 4)


# -------------------------------------------------------------------------------------------- run lock
def test_second_writer_fails_at_once_naming_the_holder(tmp_path):
    with RunLock(tmp_path, "training run"):
        out: dict = {}

        def second():
            try:
                with RunLock(tmp_path, "training run"):
                    out["entered"] = True
            except RunLockError as e:
                out["error"] = e

        th = threading.Thread(target=second, daemon=True)
        th.start()
        th.join(30)  # at once, no waiting for the holder: a waiting lock would wait here until the holder lets go
        assert not th.is_alive() and list(out) == ["error"], out
        msg = str(out["error"])
        assert f"{tmp_path} is in use by another training run: host=" in msg and f"pid={os.getpid()}" in msg
        assert "started=" in msg and "\n" not in msg
    with RunLock(tmp_path, "training run"):  # released on exit: the next run takes it
        pass


def test_lock_goes_with_a_killed_process(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "from rl_training.runtime.lock import RunLock; "
         f"RunLock({str(tmp_path)!r}, 'x').acquire(); print('held', flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunLockError, match=f"pid={holder.pid} "):
        RunLock(tmp_path, "x").acquire()
    holder.kill()
    holder.wait()
    with RunLock(tmp_path, "x"):  # the kernel dropped the kill -9'd holder's lock
        pass


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_file_system_without_locks_is_a_clear_error(tmp_path, monkeypatch, code):
    def no_locks(fd, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(RunLockError, match="this file system cannot lock .*set run.lock=false"):
        RunLock(tmp_path, "training run").acquire()


def test_lock_disabled_warns(tmp_path, capsys):
    with RunLock(tmp_path, "training run", enabled=False):
        with RunLock(tmp_path, "training run", enabled=False):  # nothing excludes the second one
            pass
    assert "warning: run.lock=false" in capsys.readouterr().out


def test_mounts_with_host_local_locks_are_named(tmp_path, monkeypatch):
    mounts = f"srv:/x {tmp_path} nfs4 rw,relatime,local_lock=all 0 0\n/dev/sda1 / ext4 rw 0 0\n"
    real_read = Path.read_text
    monkeypatch.setattr(
        Path, "read_text", lambda p, *a, **k: mounts if str(p) == "/proc/mounts" else real_read(p, *a, **k)
    )
    assert run_lock.mount_warning(tmp_path / "runs") == f"{tmp_path} is nfs4 mounted with local_lock=all"
    assert run_lock.mount_warning(Path("/usr")) is None


def test_runner_refuses_a_locked_run_directory(run_overrides, tmp_path, capsys):
    from rl_training.runners import rl_runner

    run_dir = tmp_path / "runs" / "testconfig"
    with RunLock(run_dir, "training run"):
        assert rl_runner.main(["--cfg", TESTCFG, *run_overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run_dir} is in use by another training run: host=") and "\n" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["LOCK"]  # nothing else was written


def test_a_refused_run_leaves_nothing_behind(tmp_path, capsys):
    """A run refused after taking its lock (a task file that does not exist) left runs/<name>/LOCK behind. The
    directories and the file the lock made go again; a directory that was already there, or holds anything else,
    stays as it was."""
    from rl_training.runners import rl_runner

    out = tmp_path / "runs"
    bad = ["--cfg", TESTCFG, f"run.output_dir={out}", "task.name=/nonexistent.py:X"]
    assert rl_runner.main(bad) == 2
    assert "no such file /nonexistent.py" in capsys.readouterr().err and not out.exists()
    (out / "testconfig").mkdir(parents=True)
    (out / "testconfig" / "notes.txt").write_text("mine")
    assert rl_runner.main(bad) == 2
    assert sorted(p.name for p in (out / "testconfig").iterdir()) == ["notes.txt"]


def test_a_lock_on_a_file_system_that_cannot_lock_leaves_nothing(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(RunLockError):
        RunLock(tmp_path / "runs" / "x", "training run").acquire()
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ metrics.jsonl
def test_torn_last_line_is_dropped_with_a_note_on_resume(tmp_path, capsys):
    lines = [json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 4, "x"')  # killed mid-line
    log = MetricsLogger(tmp_path, True, tensorboard=False, resume_step=2)
    log.log(3, {"x": 30.0})
    log.close()
    assert "dropped 1 torn line" in capsys.readouterr().out
    got = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == [{"step": 1, "x": 1}, {"step": 2, "x": 2}, {"step": 3, "x": 30.0}]


def test_a_failed_append_leaves_no_partial_line(tmp_path, monkeypatch):
    log = MetricsLogger(tmp_path, True, tensorboard=False)
    log.log(1, {"x": 1.0})
    real_write = os.write

    def disk_full(fd, data):  # half the line reaches the disk, then ENOSPC
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(MetricsWriteError, match="No space left on device"):
        log.log(2, {"x": 2.0})
    monkeypatch.setattr(os, "write", real_write)
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1, "x": 1.0}) + "\n"


# ------------------------------------------------------------------------------------ non-finite steps
def _update(model, poison: bool, max_grad_norm: float = 1.0):
    """One AdamW update of the tiny LoRA policy on fake rollouts; `poison` turns this rank's gradient to NaN."""
    from rl_training.algs.objectives import StepNorm
    from rl_training.policy.models import trainable_parameters
    from rl_training.train.batches import make_micro_batches
    from rl_training.train.learner import UpdateHParams, train_on_rollouts

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ro = fake_rollouts(4, seed=1)
    adv = torch.tensor([1.0, -1.0] * 4, dtype=torch.float64)
    mbs = make_micro_batches(ro, adv, G, 2, 0, torch.device("cpu"))
    hp, norm = UpdateHParams(max_grad_norm=max_grad_norm), StepNorm(seqs=len(ro), tokens=20.0, max_new_tokens=8)
    train_on_rollouts(model, opt, sched, params, mbs, hp, norm)  # one good step: AdamW state exists
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    hook = params[0].register_hook(lambda g: g * float("nan")) if poison else None
    skipped = train_on_rollouts(model, opt, sched, params, mbs, hp, norm)
    if hook is not None:
        hook.remove()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, params)) and all(
        torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, params)
    )
    steps = {int(opt.state[p]["step"]) for p in params}
    return skipped, unchanged, steps, sched.last_epoch, torch.cat([p.detach().reshape(-1) for p in params])


def test_poisoned_gradient_skips_the_step_and_leaves_adapter_and_adamw_alone(tiny_model):
    skipped, unchanged, steps, last_epoch, _ = _update(lora_policy(tiny_model), poison=True)
    assert skipped == ("grad_norm",)
    assert unchanged and steps == {1} and last_epoch == 1  # the good step only: AdamW step 1, scheduler 1
    skipped, unchanged, steps, last_epoch, _ = _update(lora_policy(tiny_model), poison=False)
    assert skipped == () and not unchanged and steps == {2} and last_epoch == 2  # the control moves


def _two_rank_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        reward = nonfinite_agreed({"reward": float("nan") if rank == 1 else 0.5}, torch.device("cpu"))
        skipped, unchanged, steps, last_epoch, flat = _update(lora_policy(Path(model_dir)), poison=rank == 1)
        torch.save(
            {"reward": reward, "skipped": skipped, "unchanged": unchanged, "steps": steps, "epoch": last_epoch,
             "flat": flat},
            Path(out) / f"rank{rank}.pt",
        )  # fmt: skip
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_skip_together_when_one_rank_is_non_finite(tiny_model, tmp_path):
    from tests.helpers import free_port

    mp.spawn(_two_rank_worker, args=(2, free_port(), str(tiny_model), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for r in (r0, r1):  # rank 1's NaN reward and gradient skip rank 0 too
        assert r["reward"] == ("reward",) and r["skipped"] == ("grad_norm",)
        assert r["unchanged"] and r["steps"] == {1} and r["epoch"] == 1
    assert torch.equal(r0["flat"], r1["flat"])


def test_evals_run_holds_the_eval_folder(tmp_path, capsys):
    from evals import run as evals_run

    with RunLock(tmp_path / "eval", "evals.run"):
        assert evals_run.main(["--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'eval'} is in use by another evals.run: host=") and "\n" not in err


def test_sft_skips_a_non_finite_step(tiny_model, reverse_data, tmp_path, monkeypatch, capsys):
    """A NaN loss at SFT step 2 (the model's forward poisoned once): weights of that step unchanged, counted,
    and the run finishes."""
    from rl_training.runners import sft_runner
    from tests.helpers import data_overrides

    real_step, seen = torch.optim.AdamW.step, []

    def counting_step(self, *a, **k):
        seen.append(1)
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    real_clip = torch.nn.utils.clip_grad_norm_
    calls = [0]

    def nan_on_second(params, *a, **k):
        calls[0] += 1
        norm = real_clip(params, *a, **k)
        return norm * float("nan") if calls[0] == 2 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_on_second)
    args = [f"model.name_or_path={tiny_model}", *data_overrides(reverse_data), f"run.output_dir={tmp_path}"]
    cfg = str(REPO / "cfg" / "tiny_sft.yaml")
    assert sft_runner.main(["--cfg", cfg, *args, "run.name=s", "sft.steps=3", "sft.full_finetune=false"]) == 0
    assert len(seen) == 2  # 3 steps, one skipped: two optimizer steps
    m = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [x["train/skipped_steps"] for x in m] == [0, 1, 1]
    assert [x["train/nonfinite_grad_norm"] for x in m] == [0, 1, 0]
    assert "warning: step 2: non-finite grad_norm" in capsys.readouterr().out


def test_a_native_crash_in_a_runner_prints_every_threads_python_stack():
    """A rank that dies in native code (SIGSEGV, SIGABRT: "terminate called ...") leaves only the signal in the
    launcher's log unless the runner enabled faulthandler (rl_training/runtime/cli.py): then its stderr holds the
    Python stack of every thread at the crash, here the body that called abort()."""
    code = (
        "import os, sys\nfrom rl_training.runtime.cli import run_cli\n"
        "def body_that_aborts(cfg, info):\n    os.abort()\n"
        "sys.exit(run_cli('doc', body_that_aborts, ['--cfg', 'cfg/testconfig.yaml']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONFAULTHANDLER", None)  # the runner's own doing, not the environment's
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -6, r.stderr[-2000:]  # SIGABRT
    assert "Fatal Python error: Aborted" in r.stderr
    assert "in body_that_aborts" in r.stderr, r.stderr[-2000:]
