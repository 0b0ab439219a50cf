"""rollout.max_async_level (rl_training/rollout/async_queue.py): the schedule for K in {0, 1, 3} (exact
version per batch, queue bound), a failing producer surfacing on the main thread, close() ending the thread;
then the real runner with a fake versioned backend: versions and staleness per step, the stop signal, the
checkpointed past versions, and the config refusals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback

import pytest

from rl_training.base.exit_codes import STOPPED_EXIT_CODE
from rl_training.config.load import load_config
from rl_training.config.schema import ConfigError
from rl_training.rollout.async_queue import (
    behavior_version,
    make_rollouts,
    past_versions,
    version_metrics,
    versions_to_keep,
)
from rl_training.rollout.base import Rollouts
from rl_training.rollout.kinds import check_backend
from rl_training.runners import rl_runner
from tests.helpers import TESTCFG, wait_until


class Recorder:
    """A fake producer: batch t is (t, the pinned version); records what was queued when each batch started."""

    def __init__(self, sleep_s: float = 0.0, fail_at: int | None = None):
        self.pinned = threading.local()
        self.sleep_s, self.fail_at = sleep_s, fail_at
        self.started: list[tuple[int, int]] = []  # (batch, batches produced but not yet taken at its start)
        self.taken = 0

    @contextlib.contextmanager
    def pin(self, version):
        self.pinned.v = version
        yield
        self.pinned.v = None

    def produce(self, t):
        self.started.append((t, len(self.started) - self.taken))
        if t == self.fail_at:
            raise ValueError(f"boom at {t}")
        time.sleep(self.sleep_s)
        return t, getattr(self.pinned, "v", None)


def drive(k: int, n: int, rec: Recorder) -> tuple[list, list[float]]:
    """The main loop's use: take batch t, 'train' on it, publish version t + 1. Train-bound: each update ends
    once the producer is as far ahead as the versions allow (waiting at the gate for version t + 1, or done)."""
    src = make_rollouts(rec.produce, k, 0, n, rec.pin)
    got, depths = [], []
    try:
        for t in range(n):
            got.append(src.get(t))
            rec.taken += 1
            depths.append(src.metrics().get("rollout/queue_depth", 0.0))
            if k:
                wait_until(
                    lambda: src.waiting_for == t + 1 or not src.thread.is_alive(),  # noqa: B023 -- called here
                    f"the producer waits for version {t + 1} after batch {t}",
                )
            src.published(t + 1)
    finally:
        src.close()
    return got, depths


@pytest.mark.parametrize("k", [0, 1, 3])
def test_schedule_exact_versions_and_queue_bound(k):
    n = 8
    # train-bound (instant generation, updates that end with the producer at its gate): the producer runs as far
    # ahead as the versions allow
    rec = Recorder()
    got, depths = drive(k, n, rec)
    if k == 0:  # the synchronous loop: produced on the main thread with the newest version (pin unused: None)
        assert got == [(t, None) for t in range(n)]
        return
    # batch t from version max(0, t - K): K=1 -> 0,0,1,2,...; K=3 -> 0,0,0,0,1,2,...
    assert got == [(t, max(0, t - k)) for t in range(n)]
    assert [v for _, v in got] == ([0, 0, 1, 2, 3, 4, 5, 6] if k == 1 else [0, 0, 0, 0, 1, 2, 3, 4])
    # never more than K batches generated ahead of the trainer, and (train-bound) the queue fills to K
    assert max(ahead for _, ahead in rec.started) <= k
    assert max(depths) == k and all(d <= k for d in depths)


def test_generation_bound_trainer_waits():
    # 50 ms per batch, instant training: the trainer waits for each batch, the producer never waits long
    rec = Recorder(sleep_s=0.05)
    src = make_rollouts(rec.produce, 1, 0, 4, rec.pin)
    try:
        for t in range(4):
            src.get(t)
            src.published(t + 1)
        m = src.metrics()
    finally:
        src.close()
    # The 4 batches take >= 4 x 50 ms back to back; the trainer waits for all of it but the microseconds it spends
    # outside get(), so >= 0.2 s less what a loaded machine preempts there: > 0.1 s. The producer waits only while
    # the trainer is late to take a batch or publish, a lateness the trainer's own wait also holds (plus the 0.2 s).
    assert m["perf/trainer_wait_s"] > 0.1 and m["perf/producer_wait_s"] < m["perf/trainer_wait_s"]


def test_failing_producer_surfaces_on_main_thread_with_its_traceback():
    rec = Recorder(fail_at=2)
    src = make_rollouts(rec.produce, 1, 0, 5, rec.pin)
    try:
        assert src.get(0) == (0, 0)
        src.published(1)
        assert src.get(1) == (1, 0)
        src.published(2)
        with pytest.raises(ValueError, match="boom at 2") as e:
            src.get(2)
    finally:
        src.close()
    text = "".join(traceback.format_exception(e.value))
    assert "in produce" in text and "generating batch 2" in text  # the producer's frame and the note
    assert not src.thread.is_alive()  # a failed producer stops


def test_close_ends_a_producer_waiting_for_a_version():
    rec = Recorder()
    src = make_rollouts(rec.produce, 2, 0, 100, rec.pin)
    src.get(0)  # batches 1, 2 follow from version 0; batch 3 waits for version 1, which never comes
    wait_until(lambda: src.waiting_for == 1, "the producer waits for version 1")  # past batch 2, not starting 3
    t0 = time.monotonic()
    src.close()
    # close() wakes the gate at once (at worst its next 0.1 s poll); one that did not stop it returns after its
    # 30 s join timeout: halfway, 15 s
    assert not src.thread.is_alive() and time.monotonic() - t0 < 15.0
    assert [t for t, _ in rec.started] == [0, 1, 2]


def test_version_rules():
    # batch 5 with K=2 samples version 3; a run resumed at step 5 first serves versions 3 and 4 again
    assert behavior_version(5, 2) == 3 and behavior_version(1, 3) == 0
    assert list(past_versions(5, 2)) == [3, 4] and list(past_versions(1, 3)) == [0] and not past_versions(5, 0)
    assert versions_to_keep(2, 0) == 2 and versions_to_keep(2, 3) == 4  # newest + K older ones
    # batch 4 sampled by versions [2, 2, 3]: staleness 4 - 7/3 = 5/3 on average, at most 2
    m = version_metrics(4, [2, 2, 3])
    assert m["rollout/staleness_mean"] == pytest.approx(5 / 3) and m["rollout/staleness_max"] == 2.0
    assert version_metrics(4, None) == {}


# --------------------------------------------------------------------------------- the runner, fake backend
class FakeServer:
    """A versioned backend like ServerBackend, without a server: fixed completions labelled with the version
    that would have sampled them; published versions are adapter directories (the checkpoint copies them)."""

    name = "server"

    def __init__(self, cfg, model, tokenizer, dist_info, start_step=0):
        from rl_training.config.schema import derive

        self._pin = threading.local()
        self.tokenizer, self.root = tokenizer, derive(cfg, 1).run_dir / "published"
        self.version, self.dirs = start_step - 1, {}
        self.republished: list[int] = []
        self.generated: list[tuple[int, str]] = []  # (version, thread name)
        self.sync_weights(model)

    @contextlib.contextmanager
    def pinned(self, version):
        self._pin.version = version
        yield
        self._pin.version = None

    def generate(self, prompts, spec, examples=None):
        v = getattr(self._pin, "version", None)
        v = self.version if v is None else v
        self.generated.append((v, threading.current_thread().name))
        ids = [self.tokenizer.encode("abc", add_special_tokens=False)] * (len(prompts) * spec.n)
        return Rollouts(
            [p for p in prompts for _ in range(spec.n)],
            ids,
            [[-1.0] * len(c) for c in ids],
            [True] * len(ids),
            self.tokenizer.batch_decode(ids),
            [v] * len(ids),
        )

    def sync_weights(self, model):
        self.version += 1
        self.dirs[self.version] = self.root / f"v{self.version}"
        model.save_pretrained(self.dirs[self.version])

    def republish(self, version, adapter_dir):
        assert (adapter_dir / "adapter_config.json").exists()
        self.republished.append(version)
        self.dirs[version] = adapter_dir

    def version_dirs(self, versions):
        return {v: self.dirs[v] for v in versions}

    def sleep(self):
        pass

    wake = sleep

    def metrics(self):
        return {"rollout/weight_version": float(self.version)}

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch, run_overrides):
    made: list = []

    def build(cfg, model, tokenizer, info, task, start_step=0):
        made.append(FakeServer(cfg, model, tokenizer, info, start_step))
        return made[-1]

    monkeypatch.setattr(rl_runner, "build_rollout", build)
    base = [*run_overrides, "rollout.backend=server", "server.urls=[http://127.0.0.1:9]", "loss.tis_cap=2.0"]
    # The fake's log-probs are not the policy's: the weight-state guard would rightly stop these runs.
    return made, [*base, "rollout.canary_stop_steps=0"]


def metrics_of(tmp_path, name="testconfig"):
    return [json.loads(x) for x in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a few real runner steps on the tiny model (~30-60 s under load)
@pytest.mark.parametrize("k", [0, 1, 3])
def test_runner_versions_per_step(fake, tmp_path, k):
    made, base = fake
    args = ["--cfg", TESTCFG, *base, f"rollout.max_async_level={k}", "train.total_steps=5", "ckpt.every=0"]
    assert rl_runner.main(args) == 0
    m = metrics_of(tmp_path)
    assert [x["rollout/policy_version_max"] for x in m] == [max(0, t - k) for t in range(5)]
    assert [x["rollout/staleness_max"] for x in m] == [min(t, k) for t in range(5)]
    threads = {name for _, name in made[0].generated}
    assert threads == ({"MainThread"} if k == 0 else {"rollout-producer"})
    if k:
        assert all(x["rollout/queue_depth"] <= k for x in m) and "perf/trainer_wait_s" in m[-1]


@pytest.mark.slow  # a few real runner steps on the tiny model (~30-60 s under load)
def test_stop_signal_checkpoints_past_versions_and_resume_republishes_them(fake, tmp_path, monkeypatch):
    made, base = fake
    args = ["--cfg", TESTCFG, *base, "rollout.max_async_level=2", "train.total_steps=6", "ckpt.every=0"]
    real_step = rl_runner.rl_step

    def signal_at_step_3(run, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's time-limit warning would
        return real_step(run, step)

    monkeypatch.setattr(rl_runner, "rl_step", signal_at_step_3)
    before = set(threading.enumerate())
    assert rl_runner.main(args) == STOPPED_EXIT_CODE
    assert not [t for t in set(threading.enumerate()) - before if t.name == "rollout-producer"]  # it exited
    ckpt = tmp_path / "runs" / "testconfig" / "checkpoints" / "step_000004"
    # stopped at the top of step 4: batches 4, 5 would sample versions 2, 3, which the checkpoint keeps
    assert sorted(p.name for p in (ckpt / "policy_versions").iterdir()) == ["v2", "v3"]
    monkeypatch.setattr(rl_runner, "rl_step", real_step)
    assert rl_runner.main([*args, "ckpt.resume=latest"]) == 0
    resumed = made[-1]
    assert resumed.republished == [2, 3]
    # versions continue from the checkpoint's step (4), not from 0
    assert sorted({v for v, _ in resumed.generated}) == [2, 3] and resumed.version == 6
    assert [x["rollout/policy_version_max"] for x in metrics_of(tmp_path)] == [0, 0, 0, 1, 2, 3]


@pytest.mark.slow  # a few real runner steps on the tiny model (~30-60 s under load)
def test_resume_with_a_larger_level_than_saved_is_refused(fake, tmp_path, capsys):
    _, base = fake
    args = ["--cfg", TESTCFG, *base, "train.total_steps=2", "ckpt.every=2"]
    assert rl_runner.main(args) == 0
    capsys.readouterr()
    rc = rl_runner.main([*args, "train.total_steps=3", "rollout.max_async_level=1", "ckpt.resume=latest"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert rc == 2 and len(err) == 1 and "has no policy_versions/v1" in err[0]


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        (["rollout.backend=hf"], "needs rollout.backend=server"),
        (["server.weight_sync=full"], "needs server.weight_sync=lora"),
        (["loss.tis_cap=0"], "with loss.correction=none"),
    ],
)
def test_async_config_refusals(override, reason):
    """Refused before any model loads: the config's own rule at load, the backend's (rollout/kinds.py) right after."""

    def checked(overrides):
        check_backend(load_config(TESTCFG, overrides))

    ok = ["rollout.backend=server", "server.urls=[http://h:1]", "loss.tis_cap=2", "rollout.max_async_level=1"]
    checked(ok)  # the valid combination loads and passes the server's rules
    with pytest.raises(ConfigError, match=reason) as e:
        checked([*ok, *override])
    assert "\n" not in str(e.value)
