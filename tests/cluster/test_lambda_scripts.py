"""The shipped shell scripts: shellcheck-clean, and the Lambda setup / TensorBoard / chain-submission scripts
in dry-run mode (they print every command and change nothing; credentials are never printed)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import REPO, require_debian_packages

SCRIPTS = sorted(
    [
        *REPO.glob("lambda/*.sh"),
        *REPO.glob("scripts/*.sh"),
        *REPO.glob("scripts/slurm/*.sh"),
        *REPO.glob("scripts/slurm/*.sbatch"),
        REPO / ".ci" / "run",
    ]
)
SECRET = "SENTINEL-aws-secret-81c3"


def bash(script: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / script), *args], capture_output=True, text=True, timeout=60, env=env or dict(os.environ)
    )


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    require_debian_packages({"shellcheck": "shellcheck"})
    r = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_lambda_setup_dry_run_prints_everything_and_changes_nothing(tmp_path):
    fs, code = tmp_path / "lambda" / "nfs" / "myfs", tmp_path / "code" / "rl_training"
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "RCLONE_CONFIG_S3_TYPE": "s3",
        "RCLONE_CONFIG_S3_SECRET_ACCESS_KEY": SECRET,
    }
    args = ["--dry-run", "--fs", str(fs), "--dir", str(code), "--repo-url", "https://git.example/rl.git"]
    r = bash("lambda/setup.sh", *args, "--ref", "v1", env=env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "apt-get install -y -q --no-install-recommends git python3-venv python3-dev rclone tmux" in out
    assert f"+ git clone --branch v1 https://git.example/rl.git {code}" in out
    assert f"+ mkdir -p {fs}/rl/runs {fs}/rl/models {fs}/rl/data {fs}/rl/hf_cache" in out
    for name in ("runs", "models", "data"):
        assert f"+ ln -sfn {fs}/rl/{name} {code}/{name}" in out
    assert f"+ {code}/scripts/setup.sh gpu" in out
    assert f"export HF_HOME={fs}/rl/hf_cache" in out
    assert "credential AWS_SECRET_ACCESS_KEY: set" in out and "credential HF_TOKEN: not set" in out
    assert "rclone remotes from RCLONE_CONFIG_*_TYPE: S3" in out
    assert SECRET not in out + r.stderr  # names only, never values
    assert list(tmp_path.iterdir()) == []  # nothing created: no fs, no checkout, no env file in HOME


def test_lambda_setup_updates_an_existing_checkout_by_git(tmp_path):
    code = tmp_path / "rl_training"
    (code / ".git").mkdir(parents=True)
    r = bash("lambda/setup.sh", "--dry-run", "--fs", str(tmp_path / "fs"), "--dir", str(code), "--repo-url", "x")
    assert r.returncode == 0, r.stderr
    assert (
        f"+ git -C {code} fetch --tags origin" in r.stdout and f"+ git -C {code} pull --ff-only origin main" in r.stdout
    )
    assert "git clone" not in r.stdout


def test_lambda_setup_refuses_to_hide_real_output_directories(tmp_path):
    code = tmp_path / "rl_training"
    (code / ".git").mkdir(parents=True)
    (code / "runs").mkdir()  # results that are not on the persistent filesystem yet
    r = bash("lambda/setup.sh", "--dry-run", "--fs", str(tmp_path / "fs"), "--dir", str(code), "--repo-url", "x")
    assert r.returncode == 2 and f"{code}/runs exists and is not a link" in r.stderr


def test_lambda_setup_bad_arguments():
    r = bash("lambda/setup.sh", "--dry-run", "--fs", "/tmp/x", "--bogus")
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr
    r = bash("lambda/setup.sh", "--dry-run", "--fs", "/tmp/x", "--platform", "tpu")
    assert r.returncode == 2 and "--platform must be gpu or cpu" in r.stderr


def test_tensorboard_dry_run_listens_on_localhost_only():
    r = bash("lambda/tensorboard.sh", "--dry-run", "--port", "6123", "--logdir", "/data/runs")
    assert r.returncode == 0, r.stderr
    assert "ssh -N -L 6123:localhost:6123 ubuntu@" in r.stdout
    assert f"+ {REPO}/.venv/bin/tensorboard --logdir /data/runs --host 127.0.0.1 --port 6123" in r.stdout


def test_submit_chain_dry_run_chains_with_afterany():
    r = bash(
        "scripts/slurm/submit_chain.sh", "--dry-run", "3", "--time=04:00:00", "--", "--cfg", "c.yaml", "run.name=e1"
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    sbatch = str(REPO / "scripts" / "slurm" / "rl_train.sbatch")
    assert lines == [
        f"sbatch --parsable --time=04:00:00 {sbatch} --cfg c.yaml run.name=e1 ",
        f"sbatch --parsable --dependency=afterany:JOB1 --time=04:00:00 {sbatch} --cfg c.yaml run.name=e1 ",
        f"sbatch --parsable --dependency=afterany:JOB2 --time=04:00:00 {sbatch} --cfg c.yaml run.name=e1 ",
    ]
    assert bash("scripts/slurm/submit_chain.sh", "zero").returncode == 2
